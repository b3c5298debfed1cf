"""What ``MemoryMonitor`` measures and shows, without Lightning: its argument checks, which steps are deep,
the cheap per-step figures, the figures of every rank, and the fit-end summary table."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.memory.measure import state_bytes
from lightning_lowmem.memory.report import CATEGORIES, MemoryReport
from lightning_lowmem.memory.units import format_bytes

__all__ = [
    "PER_RANK_KEYS",
    "check_intervals",
    "cheap_figures",
    "compiled_optimizer_steps",
    "compiled_step_warning",
    "is_deep_step",
    "report_figures",
    "summary_table",
    "with_all_ranks",
]

#: the figures logged for each rank (``rank<r>/<key>``) besides their maximum over ranks
PER_RANK_KEYS = ("peak", "max_allocated", "rss")


def check_intervals(log_every_n_steps: int | None, deep_every_n_steps: int | None) -> None:
    """Raise ``ValueError`` unless ``log_every_n_steps`` is an int > 0 or ``None`` and ``deep_every_n_steps``
    an int >= 0 or ``None``.

    Example::

        >>> check_intervals(None, 0)
        >>> check_intervals(0, None)
        Traceback (most recent call last):
        ...
        ValueError: `log_every_n_steps` must be a positive int (or None for the Trainer's), got 0
    """
    if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps <= 0):
        raise ValueError(
            f"`log_every_n_steps` must be a positive int (or None for the Trainer's), got {log_every_n_steps!r}"
        )
    if deep_every_n_steps is not None and (not isinstance(deep_every_n_steps, int) or deep_every_n_steps < 0):
        raise ValueError(
            f"`deep_every_n_steps` must be an int >= 0 (0 disables deep steps) or None, got {deep_every_n_steps!r}"
        )


def is_deep_step(step: int, deep_every_n_steps: int | None) -> bool:
    """Whether ``step`` is tracked in depth: the second step (the first with optimizer state), then every
    ``deep_every_n_steps`` (``None``: only the second; ``0``: never).

    Example::

        >>> [step for step in range(7) if is_deep_step(step, 3)]
        [1, 3, 6]
    """
    if deep_every_n_steps == 0:
        return False
    if step == 1:
        return True
    return bool(deep_every_n_steps) and step > 0 and step % deep_every_n_steps == 0


#: modules whose optimizers run a ``torch.compile``-d step: torchao's AdamW family (plain, 8-bit, 4-bit, fp8)
#: compiles its per-parameter update in every ``step``
COMPILED_STEP_MODULES = ("torchao.optim.adam",)


def compiled_optimizer_steps(optimizers: Sequence[Any]) -> list[str]:
    """Class names of the optimizers whose step runs ``torch.compile``-d code, looking through the package's
    wrappers (``inner`` of the stochastic-rounding one, ``inner_optimizers`` of the in-backward one) and
    Lightning's ``LightningOptimizer`` (``optimizer``). Duck-typed: nothing here imports what builds them.

    Example::

        >>> compiled_optimizer_steps([torch.optim.AdamW([nn.Parameter(torch.zeros(2))])])
        []
    """
    found: list[str] = []
    stack, seen = list(optimizers), set()
    while stack:
        optimizer = stack.pop(0)
        if optimizer is None or id(optimizer) in seen:
            continue
        seen.add(id(optimizer))
        name = type(optimizer).__name__.lstrip("_")  # adamw_bf16_sr is torchao's private _AdamW
        if type(optimizer).__module__ in COMPILED_STEP_MODULES and name not in found:
            found.append(name)
        stack.append(getattr(optimizer, "inner", None))
        stack.extend(list(getattr(optimizer, "inner_optimizers", {}).values())[:1])  # one per parameter, one kind
        if not isinstance(optimizer, torch.optim.Optimizer):  # LightningOptimizer wraps the real one
            stack.append(getattr(optimizer, "optimizer", None))
    return found


def compiled_step_warning(names: Sequence[str], step: int) -> str:
    """The one-line warning of a deep step that runs a compiled optimizer step eagerly (issue #26 item 5).

    Example::

        >>> print(compiled_step_warning(["AdamW8bit"], 1).split(":")[0])
        MemoryMonitor measures step 1 with AdamW8bit's compiled (torch.compile) optimizer step run eagerly
    """
    return (
        f"MemoryMonitor measures step {step} with {' / '.join(names)}'s compiled (torch.compile) optimizer step run "
        "eagerly: its tracker cannot see inside a compiled graph. The eager step can hold more temporaries than the "
        "compiled one, so read that step's optimizer-step peak as an upper bound; steps not measured in depth run "
        "compiled (docs/composition.md, 'What the MemoryMonitor measures')."
    )


def report_figures(report: MemoryReport) -> dict[str, float]:
    """The figures a deep step logs: ``peak`` and the bytes of every category of ``report``'s breakdown.

    Example::

        >>> report_figures(MemoryReport(peak_bytes=10, breakdown=dict.fromkeys(CATEGORIES, 2)))
        {'peak': 10, 'parameters': 2, 'gradients': 2, 'optimizer_state': 2, 'activations': 2, 'other': 2}
    """
    figures: dict[str, float] = {"peak": report.peak_bytes}
    figures.update({category: report.breakdown[category] for category in CATEGORIES})
    return figures


def cheap_figures(device: str, module: nn.Module, optimizers: Sequence[Any] = ()) -> dict[str, float]:
    """The figures of a cheap step: on CUDA the allocator's (``allocated``, ``max_allocated``, ``reserved``,
    ``fragmentation`` = reserved - allocated); elsewhere the process ``rss`` and ``model_state`` (the bytes of
    ``module``'s parameters, gradients and ``optimizers``' state)."""
    if device == "cuda":
        allocated = torch.cuda.memory_allocated()
        reserved = torch.cuda.memory_reserved()
        return {
            "allocated": allocated,
            "max_allocated": torch.cuda.max_memory_allocated(),
            "reserved": reserved,
            "fragmentation": max(0, reserved - allocated),
        }
    import psutil

    figures: dict[str, float] = {"rss": psutil.Process(os.getpid()).memory_info().rss}
    figures["model_state"] = sum(state_bytes(module, list(optimizers)).values())
    return figures


def with_all_ranks(
    record: dict[str, float], all_gather: Callable[[torch.Tensor], torch.Tensor], world_size: int, device: Any = "cpu"
) -> dict[str, float]:
    """``record`` (this rank's) plus, over all ranks, ``<key>_max`` of every figure and ``rank<r>/<key>`` of
    :data:`PER_RANK_KEYS`. ``all_gather`` takes this rank's figures (a float64 tensor on ``device``) and
    returns every rank's (e.g. ``trainer.strategy.all_gather``); it is a collective, so every rank calls
    this at the same steps (an empty ``record`` is returned as it is).

    Example::

        >>> fake_gather = lambda mine: torch.stack([mine, 2 * mine])  # two ranks, the other uses twice as much
        >>> with_all_ranks({"peak": 100.0}, fake_gather, world_size=2)
        {'peak': 100.0, 'peak_max': 200.0, 'rank0/peak': 100.0, 'rank1/peak': 200.0}
    """
    if not record:
        return record
    keys = sorted(record)
    mine = torch.tensor([float(record[key]) for key in keys], dtype=torch.float64, device=device)
    everyone = all_gather(mine).reshape(world_size, len(keys)).cpu()
    combined = dict(record)
    for column, key in enumerate(keys):
        values = everyone[:, column].tolist()
        combined[f"{key}_max"] = max(values)
        if key in PER_RANK_KEYS:
            combined.update({f"rank{rank}/{key}": value for rank, value in enumerate(values)})
    return combined


def summary_table(history: Sequence[dict[str, float]], last_report: MemoryReport | None, device: str) -> Any:
    """A Rich table of ``last_report``'s breakdown (the last deep step) and the largest per-step figures of
    ``history`` (also the largest rank's, ``<key>_max``), or ``None`` when nothing was measured.

    Example::

        >>> table = summary_table([{"rss": 2048, "step": 0}, {"rss": 4096, "step": 1}], None, "cpu")
        >>> table.title, list(table.columns[1].cells)
        ('Training memory (cpu)', ['4.00 KiB'])
    """
    if last_report is None and not history:
        return None
    if last_report is not None:
        table = last_report.to_table(title=f"Training step memory ({device})")
    else:
        from rich.table import Table

        table = Table(title=f"Training memory ({device})")
        table.add_column("what", style="bold")
        table.add_column("bytes", justify="right")
        table.add_column("share", justify="right")
    for key in ("rss", "model_state", "max_allocated", "reserved", "fragmentation"):
        values = [record[key] for record in history if key in record]
        if values:
            table.add_row(f"max {key} (per-step)", format_bytes(max(values)), "")
    for key in ("peak", "max_allocated", "rss"):  # several ranks: the largest rank's
        values = [record[f"{key}_max"] for record in history if f"{key}_max" in record]
        if values:
            table.add_row(f"max {key} over ranks", format_bytes(max(values)), "")
    return table

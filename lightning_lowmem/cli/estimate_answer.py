"""``lowmem estimate --budget``'s answer, headed by what the user asked: the chosen plan, its peak against the budget,
and the callbacks that train it, as command-line options and as YAML to paste (our callback classes and their
``init_args``, not the planner's labels); the table of every candidate only with ``--verbose``."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_settings", "print_answer"]

_DEFAULTS = {
    "LowRankAdapters": {"r": 8, "alpha": 16.0, "dropout": 0.0, "target": "all-linear", "quantize_base": None},
    "ActivationCheckpointing": {"policy": "auto", "nested": False},
    "ActivationCompression": {"mode": "int8"},
    "ChunkedCrossEntropy": {"chunk_size": None, "head": None, "kernel": "auto"},
}
_STRATEGIES = {
    "ddp": ("lowmem_ddp", {}),
    "zero1": ("lowmem_ddp", {"zero_optimizer": True}),
    "fsdp": ("lowmem_fsdp", {}),
}


def plan_settings(config: Any, baseline_optimizer: str | None = None) -> tuple[dict[str, Any], list[tuple[str, dict]]]:
    """The Trainer options and the callbacks (``(class name, init_args)``, defaults left out) that train ``config``
    (a :class:`~lightning_lowmem.functional.config.TrainingConfig`). The optimizer is a callback only where it is
    not ``baseline_optimizer`` (the one the model configures).

    Example::

        >>> from lightning_lowmem.functional.config import TrainingConfig
        >>> plan_settings(TrainingConfig(precision="bf16-true", lora={"r": 8}, activation_checkpointing="auto"), "adamw")
        ({'precision': 'bf16-true'}, [('LowRankAdapters', {}), ('ActivationCheckpointing', {})])
    """
    trainer: dict[str, Any] = {}
    callbacks: list[tuple[str, dict]] = []
    if config.precision is not None:
        trainer["precision"] = config.precision.preset
    if config.lora is not None:
        lora = config.lora
        given = {
            "r": lora.r,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target": lora.target,
            "quantize_base": lora.quantize_base,
        }
        if lora.quantize_frozen:
            given["quantize_frozen"] = True
        callbacks.append(("LowRankAdapters", given))
    if config.checkpointing is not None:
        callbacks.append(
            ("ActivationCheckpointing", {"policy": config.checkpointing.policy, "nested": config.checkpointing.nested})
        )
    if config.compression is not None:
        callbacks.append(("ActivationCompression", {"mode": config.compression.mode}))
    if config.cross_entropy is not None:
        ce = config.cross_entropy
        callbacks.append(("ChunkedCrossEntropy", {"chunk_size": ce.chunk_size, "head": ce.head, "kernel": ce.kernel}))
    optimizer = config.optimizer
    if optimizer is not None and optimizer.name != baseline_optimizer:
        callbacks.append(("MemoryEfficientOptimizer", {"optimizer": optimizer.name, **dict(optimizer.kwargs)}))
    if config.microbatch is not None:
        callbacks.append(("AutoMicrobatch", {"micro_batch_size": config.microbatch.size}))
    if config.sharding is not None and config.sharding.world_size > 1:
        name, options = _STRATEGIES[config.sharding.kind]
        trainer["devices"] = config.sharding.world_size
        trainer["strategy"] = {"class_path": name, **({"init_args": options} if options else {})} if options else name
    trimmed = [
        (name, {key: value for key, value in args.items() if _DEFAULTS.get(name, {}).get(key, object()) != value})
        for name, args in callbacks
    ]
    return trainer, trimmed


_MAIN_ARGUMENT = {
    "LowRankAdapters": ("r", 8),
    "ActivationCheckpointing": ("policy", "auto"),
    "ActivationCompression": ("mode", "int8"),
}


def _headline(name: str, args: dict[str, Any]) -> str:
    """``LowRankAdapters(r=8)``: a callback with the arguments that differ from its defaults, and its main one."""
    shown = dict(args)
    if name in _MAIN_ARGUMENT:
        key, default = _MAIN_ARGUMENT[name]
        shown = {key: shown.get(key, default), **shown}
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def _flags(trainer: dict[str, Any], callbacks: list[tuple[str, dict]]) -> str:
    parts = []
    for key, value in trainer.items():
        if isinstance(value, dict):  # a strategy with options: the YAML says it
            value = value["class_path"]
        parts.append(f"--trainer.{key} {value}")
    for name, args in callbacks:
        parts.append(f"--trainer.callbacks+={name}")
        parts.extend(f"--trainer.callbacks.{key} {_value(value)}" for key, value in args.items())
    return " ".join(parts)


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _yaml(trainer: dict[str, Any], callbacks: list[tuple[str, dict]]) -> str:
    lines = ["trainer:"]
    for key, value in trainer.items():
        if isinstance(value, dict):
            lines.append(f"  {key}:")
            lines.append(f"    class_path: {value['class_path']}")
            if "init_args" in value:
                args = ", ".join(f"{k}: {_value(v)}" for k, v in value["init_args"].items())
                lines.append(f"    init_args: {{{args}}}")
        else:
            lines.append(f"  {key}: {value}")
    if callbacks:
        lines.append("  callbacks:")
        for name, args in callbacks:
            lines.append(f"    - class_path: lightning_lowmem.{name}")
            if args:
                lines.append("      init_args: {" + ", ".join(f"{k}: {_value(v)}" for k, v in args.items()) + "}")
    return "\n".join(lines)


def print_answer(console: Any, plan: Any, where: str, verbose: bool) -> None:
    """The plan's answer (see the module docstring); ``verbose``: the candidate table first."""
    from lightning_lowmem.memory import format_bytes

    if verbose:
        console.print(plan.to_table())
    chosen = plan.chosen
    baseline = plan.baseline
    base_optimizer = baseline.config.optimizer.name if baseline is not None else None
    trainer, callbacks = plan_settings(plan.config, base_optimizer)
    share = plan.predicted_peak_bytes / plan.budget_bytes if plan.budget_bytes else 0.0
    recipe = " + ".join([str(trainer.get("precision", ""))] + [_headline(name, args) for name, args in callbacks])
    optimizer = "" if any(name == "MemoryEfficientOptimizer" for name, _ in callbacks) else f" ({base_optimizer})"
    console.print(
        f"[bold green]fits[/bold green]: [bold]{recipe}[/bold]{optimizer} -> peak "
        f"[bold]{format_bytes(plan.predicted_peak_bytes)}[/bold] of the {format_bytes(plan.budget_bytes)} budget "
        f"({share:.0%}; {format_bytes(plan.usable_bytes)} usable) on {where}",
        highlight=False,
        soft_wrap=True,
    )
    if baseline is not None and baseline is not chosen and baseline.report is not None:
        console.print(
            f"as configured ({baseline.config.describe()}): {format_bytes(baseline.report.peak_bytes)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if plan.optimizer_kwargs:
        for index, (name, args) in enumerate(callbacks):
            if name == "MemoryEfficientOptimizer":
                callbacks[index] = (name, {**args, **plan.optimizer_kwargs})
    console.print(f"options: {_flags(trainer, callbacks)}", markup=False, highlight=False, soft_wrap=True)
    console.print(_yaml(trainer, callbacks), markup=False, highlight=False, soft_wrap=True)
    for note in plan.notes:
        if note.startswith("numerics:"):
            console.print(note, style="yellow", markup=False, soft_wrap=True)
    tried = len(plan.candidates)
    console.print(
        f"planned in {plan.seconds:.1f} s ({tried} candidates{'' if verbose else '; --verbose lists them'})",
        markup=False,
        highlight=False,
    )

"""`estimate_memory`: a training step's peak memory, predicted without allocating.

The real step (forward, loss, backward, optimizer step) runs on a copy of the model whose parameters are
*fake* tensors (torch's ``FakeTensorMode``): every op computes shapes and dtypes but no data, so a
7B-parameter model "runs" on a laptop. The memory core's tracker counts the fake storages exactly as it
counts real ones, so the estimate shares its categories with :func:`measure_memory`.

Techniques are applied with :func:`lightning_lowmem.functional.apply`, as the callbacks and the
strategies apply them (checkpointing, compression, optimizers, LoRA, micro-batches), so the estimate cannot
drift from what training does. ``TrainingConfig`` lives in :mod:`lightning_lowmem.functional.config` (it is
re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_lowmem._compat.compiler import force_eager
from lightning_lowmem._compat.fake_mode import data_dependent_errors, fake_tensor_mode
from lightning_lowmem._versions import require
from lightning_lowmem.functional.lora.quantized_base import elide_repeated_slabs
from lightning_lowmem.functional.config import PRECISIONS, OptimizerConfig, ShardingConfig, TrainingConfig
from lightning_lowmem.planning._batch_values import BatchValues
from lightning_lowmem.planning._fake_step import (
    EstimationError,
    accumulation_steps,
    apply_model_techniques,
    build_lookup_tables,
    build_optimizer,
    create_state,
    device_optimizer_kwargs,
    fake_batch,
    fake_module,
    refuse_accumulation_in_backward,
    resolve_loop,
    train_step,
)
from lightning_lowmem.memory._tracker import StorageTracker
from lightning_lowmem.memory.cuda_allocator import cuda_block_bytes
from lightning_lowmem.memory.report import MemoryReport
from lightning_lowmem.planning.attention_kernels import fake_attention, validate_attention_kernel
from lightning_lowmem.planning.cuda_autocast import cuda_autocast_rules
from lightning_lowmem.planning.gpus import CUDA_CONTEXT_BYTES, card_simulation, on_card, resolve_card
from lightning_lowmem.planning.axes import check_estimable
from lightning_lowmem.planning.optimizer_argument import configured_optimizer_config, optimizer_config
from lightning_lowmem.planning.sharding import ShardedStep
from lightning_lowmem.model_io import forward_batch, output_logits, output_loss

__all__ = ["CUDA_CONTEXT_BYTES", "PRECISIONS", "EstimationError", "TrainingConfig", "estimate_memory"]


CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""The default card's cuBLAS workspace (Hopper's; :class:`~lightning_lowmem.planning.gpus.GpuCard` has each card's),
allocated through the caching allocator on the first matmul. ``CUDA_CONTEXT_BYTES`` (500 MiB) comes from
:mod:`lightning_lowmem.planning.gpus`."""


# the step machinery lives in _fake_step (shared with the planner); tests and benchmarks run these for real
_apply_model_techniques = apply_model_techniques
_train_step = train_step


def default_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss used when none is given: a LightningModule's ``training_step``, else the model's own.

    A plain module is called the package's way (:func:`lightning_lowmem.model_io.forward_batch`: its
    ``forward_batch(batch)`` if it defines one, a dict batch as keywords, a tuple's first element):
    a Hugging Face output's ``.loss`` is used when the batch has labels, otherwise the output (its
    ``.logits``) is reduced with a float ``sum``. Give ``loss_fn`` to estimate a specific loss (e.g.
    cross-entropy saves softmax).
    """
    if hasattr(module, "training_step") and callable(module.training_step):
        out = module.training_step(batch, 0)
        if isinstance(out, dict):
            out = out["loss"]
        return out
    out = forward_batch(module, batch)
    loss = output_loss(out)
    return loss if loss is not None else output_logits(out).float().sum()


# ----------------------------------------------------------------------------- the estimate
def estimate_memory(
    module: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    optimizer: str | OptimizerConfig | None = None,
    precision: str = "32-true",
    device: str = "cuda",
    steps: int = 2,
    activation_checkpointing: str | int | None = None,
    activation_compression: str | None = None,
    micro_batch_size: int | None = None,
    lora: dict[str, Any] | None = None,
    cross_entropy: str | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    config: TrainingConfig | None = None,
    loop: str = "auto",
    world_size: int = 1,
    sharding: str | None = None,
    attention_kernel: str = "auto",
    accumulate_grad_batches: int = 1,
    gpu: str | None = None,
    autocast_cache: bool = False,
) -> MemoryReport:
    """Predict the peak memory of one training step without allocating any tensor data.

    Args:
        module: the model (real, on ``meta``, or on any device; it is not modified or moved).
        batch: one batch as the model's ``training_step`` (or ``loss_fn``) takes it; tensors may live on
            ``meta``. Only shapes and dtypes are used.
        loss_fn: ``loss_fn(module, batch) -> loss``. Default: :func:`default_loss` (a LightningModule's
            own ``training_step`` under automatic optimization).
        optimizer: an :class:`~lightning_lowmem.functional.config.OptimizerConfig` (a name from
            ``functional.optimizers.available_optimizers()`` and its hyperparameters, e.g.
            ``OptimizerConfig("sgd", momentum=0.9)``), a name, or ``None``: the one the module's
            ``configure_optimizers`` returns, with its arguments (built on a fake copy), else ``"adamw"``.
            Default: ``None``.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
            Mixed precision runs CPU autocast; for ``device="cuda"`` with CUDA autocast's op rules (softmax,
            layer_norm, the losses, ``sum`` ... in float32: :mod:`~lightning_lowmem.planning.cuda_autocast`).
            Default: ``"32-true"``.
        device: ``"cuda"`` applies the caching allocator's 512-byte block rounding and lists the CUDA
            context and cuBLAS workspace in ``report.overheads``; ``"cpu"`` counts exact bytes.
            Default: ``"cuda"``.
        steps: optimizer steps to run; the last one is reported (the second step is the first with
            optimizer state). Only the last step runs forward and backward: the first creates the
            optimizer state with one optimizer step on fake gradients, which is all it leaves behind.
            Default: 2.
        activation_checkpointing, activation_compression, micro_batch_size, lora, cross_entropy: techniques,
            see :class:`TrainingConfig` (``cross_entropy="chunked"``: the output head's loss in chunks, the
            logits never whole). Default: off.
        optimizer_kwargs: a shorthand (:mod:`~lightning_lowmem.planning.optimizer_argument`). Beside
            ``optimizer=None``: arguments that replace the configured optimizer's own (``{"lr": 0.1}``). Beside a
            name (or ``config``'s optimizer): its hyperparameters, deprecated (a ``DeprecationWarning``) -- give
            ``OptimizerConfig(name, **hyperparameters)``. Default: none.
        config: a :class:`~lightning_lowmem.functional.config.TrainingConfig` (or a dict of its shorthands)
            that replaces the technique arguments above; its ``precision=None`` takes ``precision``, its
            ``optimizer=None`` the module's configured one, its ``sharding`` replaces ``sharding`` /
            ``world_size``. Default: ``None``.
        loop: the order of a step. ``"lightning"``: Lightning's automatic optimization, which zeroes
            gradients between ``training_step`` and backward, so the previous step's gradients live
            through the forward (with micro-batches, ``AutoMicrobatch`` zeroes them first).
            ``"torch"``: forward, backward, step, ``zero_grad``. ``"auto"``: ``"lightning"`` for a
            LightningModule under automatic optimization estimated through its own ``training_step``
            (no ``loss_fn``), else ``"torch"``. Default: ``"auto"``.
        world_size: processes the step runs on; ``batch`` is one process's batch. Default: 1.
        sharding: ``"ddp"``, ``"zero1"`` or ``"fsdp"`` (``lowmem_ddp``, ``lowmem_ddp`` with
            ``zero_optimizer=True``, ``lowmem_fsdp``), or ``None`` (one process; ``"ddp"`` if
            ``world_size > 1``). See :mod:`lightning_lowmem.planning.sharding`. Default: ``None``.
        attention_kernel: for ``device="cuda"``, the kernel each ``F.scaled_dot_product_attention`` runs:
            ``"auto"`` (torch's choice on an sm80+ GPU by dtype, mask, head dim), or ``"flash"``,
            ``"efficient"``, ``"math"`` forced as ``torch.nn.attention.sdpa_kernel`` forces it. The fake
            step allocates what that kernel keeps (:mod:`lightning_lowmem.planning.attention_kernels`); on
            ``device="cpu"`` torch's own CPU choice runs. ``report.meta["attention_kernels"]`` counts the
            kernels run. Default: ``"auto"``.
        accumulate_grad_batches: batches whose gradients are summed before each optimizer step, as
            ``Trainer(accumulate_grad_batches=N)``: ``batch`` is one of them; each runs forward and backward (the
            gradients of the first alive through the later ones), the optimizer steps after the last. Refused
            with an optimizer-in-backward. Default: 1.
        gpu: the card, e.g. ``"A100-40GB"`` (:data:`~lightning_lowmem.planning.gpus.GPUS`; implies
            ``device="cuda"``): its CUDA context and cuBLAS workspace in ``report.overheads``, the caching
            allocator's reserved peak in ``report.device_stats["max_reserved"]``, and ``report.meta["gpu"]``:
            ``allocated_bytes``, ``reserved_bytes``, ``nvidia_smi_bytes`` (reserved + context + workspace),
            ``capacity_bytes`` and ``fits``. Default: ``None`` (500 MiB context, 32 MiB workspace, no reserved).
        autocast_cache: mixed precision only: whether autocast keeps the lower-precision copy of each weight it casts
            until the forward ends (``torch.autocast(cache_enabled=...)``). ``False`` as Lightning's
            ``MixedPrecision`` plugin runs it (``cache_enabled=False``), so a Lightning fit (this package's
            strategies too) holds each copy only while an op saves it for backward; ``True`` as torch's default,
            which Hugging Face's ``Trainer`` (through accelerate), Fabric (LitGPT) and a plain ``torch.autocast``
            loop keep: with activation checkpointing the cached copies of every weight live through the forward.
            Default: ``False``.

    Returns:
        A :class:`MemoryReport` with ``source="estimated"``; ``report.meta["config"]`` is the config.
        With ``sharding``: the largest rank's peak and breakdown, ``meta["per_rank"]`` every rank's.

    Raises:
        EstimationError: the step cannot run on fake tensors (data-dependent control flow or output
            shapes); the message says what was tried.
        ValueError: an unknown precision / technique / device / sharding / attention kernel / ``gpu``,
            ``world_size < 1``, ``accumulate_grad_batches`` < 1 or beside an optimizer-in-backward;
            from ``OptimizerConfig``: an optimizer argument it does not take or a value it refuses.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model = CharLM(n_layer=2, n_embd=64, block_size=32)
        >>> batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))
        >>> report = estimate_memory(model, batch, device="cpu")
        >>> report.breakdown["optimizer_state"] > 2 * 4 * 64 * 64
        True
    """
    config, sharding, world_size = resolved_config(
        module,
        config,
        dict(
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            activation_compression=activation_compression,
            micro_batch_size=micro_batch_size,
            lora=lora,
            cross_entropy=cross_entropy,
        ),
        sharding,
        world_size,
    )
    card = resolve_card(gpu, device)  # validates `gpu`; a card implies device="cuda"
    device = card.device if card is not None else device
    accumulate = accumulation_steps(accumulate_grad_batches)
    refuse_accumulation_in_backward(accumulate, config)
    check_estimable(config, "estimate_memory")  # a technique fake tensors cannot run: one line, before any work
    _check_arguments(module, device, steps, attention_kernel)
    loop = resolve_loop(module, loss_fn, loop)
    loss_fn = loss_fn or default_loss
    sharded = ShardedStep(sharding, world_size, device=device)  # validates world_size / sharding
    if config.sharding is None and sharded.sharding is not None:  # the label and meta name the sharding once
        config = config.replace(sharding=ShardingConfig(sharded.sharding, world_size))
    precision_ = config.precision
    true_dtype = precision_.true_dtype
    autocast_dtype = sharded.autocast_dtype(precision_.preset, precision_.autocast_dtype)
    in_backward = config.optimizer.in_backward
    tracker = StorageTracker(device="cpu", round_bytes=cuda_block_bytes if device == "cuda" else None, by_module=False)

    build_lookup_tables(config.optimizer.name)
    fake_mode = fake_tensor_mode()
    with data_dependent_errors_explained(module, config, steps):
        model = fake_module(module, true_dtype, fake_mode)
        # small buffers' real values ride beside their fake twins, as the batch's do: a causal mask registered as a
        # buffer answers nn.Transformer's value check (_detect_is_causal_mask) as in a real step
        buffers = [
            (real, fake)
            for real, fake in zip(module.buffers(), model.buffers(), strict=True)
            if real.device.type != "meta"
        ]
        attention = fake_attention(batch, device, attention_kernel)  # reads the real batch's masks
        cuda_rules = cuda_autocast_rules(device, autocast_dtype)  # CUDA autocast's op rules for CPU autocast
        with sharded, attention as cuda_attention, cuda_rules, fake_mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch, batch_values, params, opt = _prepared_fake_model(model, batch, buffers, config, sharded, device)
            tracker.modules = [model]
            tracker.optimizers = [opt]
            # compiled kernels (torchao's low-bit optimizer steps) must not see fake tensors
            with force_eager():
                if steps > 1:  # the first step's lasting effect, without its forward / backward
                    create_state(opt, params)
                    if loop == "torch" or in_backward:
                        opt.zero_grad(set_to_none=True)
                with batch_values:
                    step = functools.partial(
                        train_step, model, batch, loss_fn, opt, config, autocast_dtype, True, loop, cache=autocast_cache
                    )
                    for _ in range(steps - 2):
                        step(accumulate)
                    with tracker, card_simulation(card if world_size == 1 else None, model, opt, batch) as simulation:
                        with elide_repeated_slabs(functools.partial(_memory_state, tracker, simulation)):
                            step(accumulate)

    report = _labelled_report(tracker, device, config, steps, loop, accumulate, cuda_attention)
    if autocast_dtype is not None:
        report.meta["autocast_cache"] = autocast_cache
    return on_card(sharded.finish(report, opt), device, card, simulation)


def _memory_state(tracker: StorageTracker, simulation: Any) -> tuple:
    """What the tracked step's figures still depend on (:func:`elide_repeated_slabs`): the tracker's live bytes per
    category and the card's caching allocator's bookkeeping. (The "other" bytes' kinds need no reading: a slab loop
    allocates and frees storages of one kind, its module's in its phase.)"""
    live = tracker.current_bytes, tuple(tracker.current_breakdown.values())
    return live, None if simulation is None else simulation.allocator.state()


def _check_arguments(module: nn.Module, device: str, steps: int, attention_kernel: str) -> None:
    """Refuse an unknown ``device``, a ``module`` that is no module, bad ``steps``, an unknown attention kernel; a
    Hugging Face model needs a tested transformers."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"`device`={device!r} is not supported; use 'cuda' (default) or 'cpu'")
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an int >= 1, got {steps!r}")
    validate_attention_kernel(attention_kernel)
    if any(type(layer).__module__.startswith("transformers.") for layer in module.modules()):
        require("transformers", "estimate_memory on a Hugging Face model")  # older: untested mask code paths


def _prepared_fake_model(
    model: nn.Module, batch: Any, buffers: list, config: TrainingConfig, sharded: ShardedStep, device: str
) -> tuple[Any, BatchValues, list[torch.Tensor], Any]:
    """Inside the fake mode: ``model`` with its techniques applied and sharded, the fake batch, the batch's (and
    buffers') real values beside it, the trained parameters and the optimizer over them."""
    model.train()
    apply_model_techniques(model, config)
    sharded.shard(model, config.precision.preset)
    batch, real_batch = fake_batch(batch, config.precision.true_dtype), batch
    # a real step's answers to value questions on the batch (and the model's buffers)
    batch_values = BatchValues((real_batch, [r for r, _ in buffers]), (batch, [f for _, f in buffers]))
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = device_optimizer_kwargs(config.optimizer.name, device, config.optimizer.kwargs)
    return batch, batch_values, params, build_optimizer(config.optimizer.name, params, kwargs)


def _labelled_report(
    tracker: StorageTracker, device: str, config: TrainingConfig, steps: int, loop: str, accumulate: int, attention: Any
) -> MemoryReport:
    """The tracked step's report, marked estimated on ``device``, with the config, steps, loop and kernels run."""
    report = tracker.report
    assert report is not None
    report.source = "estimated"
    report.device = device
    report.meta = {"config": config.to_dict(), "steps": steps, "label": config.describe(), "loop": loop}
    if accumulate > 1:
        report.meta["accumulate_grad_batches"] = accumulate
    if attention is not None:
        report.meta["attention_kernels"] = dict(attention.chosen)
    return report


def resolved_config(
    module: nn.Module, config: Any, arguments: dict[str, Any], sharding: str | None, world_size: int
) -> tuple[TrainingConfig, str | None, int]:
    """``estimate_memory``'s :class:`TrainingConfig` from its ``config`` or technique ``arguments``, with the
    sharding and world size it implies (see the ``config`` argument of :func:`estimate_memory`)."""
    optimizer, optimizer_kwargs, precision = (arguments.pop(k) for k in ("optimizer", "optimizer_kwargs", "precision"))
    config_given = config is not None
    if config is None:
        config = TrainingConfig(
            precision=precision,
            optimizer=optimizer_config(optimizer, optimizer_kwargs, stacklevel=4),
            **{**arguments, "lora": arguments["lora"] or None},
        )
    elif isinstance(config, dict):
        config = TrainingConfig(**config)
    elif not isinstance(config, TrainingConfig):
        raise TypeError(
            f"`config` must be a TrainingConfig or a dict of its arguments, got {type(config).__name__}: {config!r}"
        )
    if config.precision is None:  # "as configured": the `precision` argument
        config = config.replace(precision=precision)
    if config.optimizer is None:  # the module's configure_optimizers' own, its arguments replaced by optimizer_kwargs
        config = config.replace(optimizer=configured_optimizer_config(module, optimizer_kwargs)[0])
    elif optimizer_kwargs and config_given:  # config's optimizer with more hyperparameters: the old shorthand
        merged = {**config.optimizer.kwargs, **optimizer_kwargs}
        config = config.replace(optimizer=optimizer_config(config.optimizer.name, merged, stacklevel=4))
    if config.sharding is not None:
        if sharding is not None and sharding != config.sharding.kind:
            raise ValueError(
                f"`sharding`={sharding!r} disagrees with `config.sharding`={config.sharding!r}; give it once"
            )
        sharding, world_size = config.sharding.kind, config.sharding.world_size
    return config, sharding, world_size


@contextlib.contextmanager
def data_dependent_errors_explained(module: nn.Module, config: TrainingConfig, steps: int) -> Iterator[None]:
    """Turn fake-tensor errors about data-dependent control flow into an :class:`EstimationError`."""
    try:
        yield
    except data_dependent_errors() as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise EstimationError(
            f"estimate_memory could not run {type(module).__name__}'s training step on fake tensors: the step "
            f"depends on tensor *values* (data-dependent control flow or output shape: {first_line}). "
            f"Tried: FakeTensorMode on CPU, config [{config.describe()}], {steps} step(s). Make the control "
            f"flow depend on shapes only, pass a `loss_fn` that avoids it, or measure a real small step "
            f"with `measure_memory`."
        ) from err

"""Fully sharded data parallel on a plain ``nn.Module``: ``fully_shard_`` applies torch's FSDP2.

Every block the policy picks becomes one FSDP unit (its parameters are sharded over the mesh and
all-gathered only while it computes), then the root takes the rest (embeddings, head, final norm).
The policy speaks the vocabulary of activation checkpointing (:func:`~.checkpointing.checkpoint_`):
``"auto"`` (the repeated blocks of the model's ``nn.ModuleList`` s / ``nn.Sequential`` s), class names, module-name patterns,
every-k ints, module classes, or a list of these. No Lightning import here; the strategy
``LowMemoryFSDPStrategy`` calls this in ``setup``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from lightning_lowmem.functional.checkpointing import describe_policy, no_match_message, resolve_policy

__all__ = [
    "DTENSOR_OPTIMIZERS",
    "ShardReport",
    "check_dtensor_optimizer",
    "fully_shard_",
    "mixed_precision_policy",
]

DTENSOR_OPTIMIZERS = (
    "adam",
    "adamw",
    "adamw8bit",
    "sgd",
    "adamw_in_backward",
    "adamw8bit_in_backward",
    "sgd_in_backward",
)
"""Optimizer names (``functional.optimizers``) that step on FSDP2's DTensor parameters (checked on CPU,
gloo, torch 2.13 / torchao 0.18). Not these: ``adamw4bit`` (torchao's 4-bit state has no DTensor
dimension rule), ``adafactor`` / ``adafactor_bf16_sr`` (in-place ``pow_`` on a partial-norm DTensor;
the latter crashes the process), ``adamw_bf16_sr``."""

_DTENSOR_UNSUPPORTED_CLASSES = {
    "AdamW4bit": "adamw4bit",
    "Adafactor": "adafactor",
    "_AdamW": "adamw_bf16_sr",
}


@dataclass
class ShardReport:
    """What :func:`fully_shard_` did.

    Attributes:
        policy: the wrap policy as given.
        units: names of the submodules made FSDP units, in the order sharded (deepest first, later siblings
            first); ``""`` (the root) last.
        world_size: processes the parameters are sharded over.
        reshard_after_forward: whether non-root units free their gathered parameters after forward.
        mixed_precision: ``(param_dtype, reduce_dtype)`` names, or ``None``.
        cpu_offload: whether sharded parameters, gradients and optimizer state live on the CPU.
    """

    policy: str
    units: list[str] = field(default_factory=list)
    world_size: int = 1
    reshard_after_forward: bool = True
    mixed_precision: tuple[str, str] | None = None
    cpu_offload: bool = False


def mixed_precision_policy(preset: str | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a Lightning precision preset, or ``None`` (no casting).

    ``"bf16-mixed"``: parameters all-gathered and computed in bf16, gradients reduced in fp32, the
    sharded master weights and optimizer state stay fp32. ``"bf16-true"`` / ``"16-true"``: parameters
    are already half (Lightning converts the module), gradients reduced in fp32. ``"32-true"`` / ``None``:
    none.

    Raises:
        ValueError: ``"16-mixed"`` (fp16 compute needs a sharded gradient scaler, which FSDP2 lacks
            here) or an unknown preset.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if preset in (None, "32-true"):
        return None
    if preset == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if preset in ("bf16-true", "16-true"):
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    allowed = ["32-true", "bf16-mixed", "bf16-true", "16-true"]
    hint = " fp16 compute needs a gradient scaler over shards: use 'bf16-mixed'." if preset == "16-mixed" else ""
    raise ValueError(f"`precision`={preset!r} is not supported with FSDP; choose one of {allowed}.{hint}")


def _unshardable_parameters(module: nn.Module) -> list[str]:
    """Parameters held as tensor subclasses that FSDP2 cannot split (e.g. a QLoRA int8 base)."""
    from lightning_lowmem._compat import FakeTensor
    from torch.distributed.tensor import DTensor

    bad = []
    for name, param in module.named_parameters():
        data = param.data if isinstance(param, nn.Parameter) else param
        if type(data) not in (torch.Tensor, nn.Parameter, FakeTensor) and not isinstance(data, DTensor):
            if not hasattr(data, "fsdp_pre_all_gather"):  # the FSDP2 extension point (torchao NF4, float8)
                bad.append(f"{name} ({type(data).__name__})")
    return bad


def fully_shard_(
    module: nn.Module,
    policy: Any = "auto",
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mixed_precision: Any = None,
    cpu_offload: bool = False,
    forward_methods: Iterable[str] = (),
) -> ShardReport:
    """Shard ``module`` with FSDP2 in place: each block ``policy`` picks, then the root.

    Needs an initialised process group (any backend; ``gloo`` on CPU). With one process nothing is
    actually split, but the module runs the same code path.

    Args:
        module: the model; its parameters become ``DTensor`` shards, its class an ``FSDPModule``.
        policy: which submodules become FSDP units, as :func:`~.checkpointing.checkpoint_`'s policy
            (``"auto"``, a class name, a name pattern, an every-k int, a class, or a list). Default: ``"auto"``.
        mesh: a 1-D ``DeviceMesh``; ``None``: every process of the default group. Default: ``None``.
        reshard_after_forward: free the gathered parameters of a unit after its forward (all-gather
            again in backward); ``False`` keeps them until backward (more memory, fewer all-gathers).
            The root never reshards after forward (FSDP2's rule). Default: ``True``.
        mixed_precision: a precision preset (see :func:`mixed_precision_policy`) or a
            ``MixedPrecisionPolicy``, or ``None``. Default: ``None``.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU
            (``CPUOffloadPolicy``; the optimizer steps on the CPU). Default: ``False``.
        forward_methods: other methods of ``module`` that run its forward (e.g. a LightningModule's
            ``"training_step"``): FSDP's hooks run around them as around ``forward``. Default: none.

    Returns:
        A :class:`ShardReport`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; bad policy type.
        ValueError: the policy matches no submodule (the message lists the model's module classes);
            the model holds quantized parameters FSDP2 cannot split (a QLoRA int8 / int4 base), or NF4 ones on one
            process (torch's FSDP2 skips its all-gather extension for a single process).
        RuntimeError: no process group is initialised.

    Example::

        >>> import torch.distributed as dist
        >>> from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        >>> model = CharGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> fully_shard_(model, "Block").units
        ['h.1', 'h.0', '']
        >>> dist.destroy_process_group()
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"`reshard_after_forward` must be True or False, got {reshard_after_forward!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard_ needs an initialised process group: call torch.distributed.init_process_group first "
            "(or train with strategy='lowmem_fsdp', which does)."
        )
    names = resolve_policy(module, policy)
    names = [n for n in names if n]  # the root is sharded last anyway
    if not names:
        raise ValueError(
            no_match_message(module, policy).replace("activation checkpointing policy", "FSDP wrap policy", 1)
        )
    unshardable = _unshardable_parameters(module)
    if unshardable:
        raise ValueError(
            f"FSDP cannot shard {len(unshardable)} quantized parameter(s) of {type(module).__name__}, e.g. "
            f"{', '.join(unshardable[:3])}: FSDP2 splits only plain tensors and tensor subclasses that implement "
            "`fsdp_pre_all_gather` (torchao's NF4 / float8). Train the LoRA adapters on an unquantized base "
            "(LowRankAdapters(quantize_base=None)), on an NF4 base without quantize_frozen "
            "(LowRankAdapters(quantize_base='nf4'): NF4 shards), or keep QLoRA with strategy='lowmem_ddp'."
        )
    extended = [name for name, param in module.named_parameters() if hasattr(param, "fsdp_pre_all_gather")]
    world_size = mesh.size() if mesh is not None else dist.get_world_size()
    if extended and world_size == 1:
        raise ValueError(
            f"FSDP on one process cannot run {len(extended)} parameter(s) held as tensor subclasses with FSDP2's "
            f"all-gather extension, e.g. {extended[0]} ({type(module.get_parameter(extended[0])).__name__}): torch "
            f"{torch.__version__}'s FSDP2 skips the all-gather (and so `fsdp_pre_all_gather` / `fsdp_post_all_gather`) "
            "for a single process. Shard over 2 or more processes, or train one process without lowmem_fsdp."
        )
    if isinstance(mixed_precision, str) or mixed_precision is None:
        mixed_precision = mixed_precision_policy(mixed_precision)
    elif not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"`mixed_precision` must be a preset name, a MixedPrecisionPolicy or None, got {mixed_precision!r}"
        )
    if mesh is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # children before parents: FSDP2 assigns a parameter to the innermost unit that holds it
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    units = sorted(names, key=lambda n: (-n.count("."), -order[n]))
    for name in units:
        fully_shard(module.get_submodule(name), reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(module, **kwargs)
    for method in forward_methods:
        if callable(getattr(module, method, None)):
            register_fsdp_forward_method(module, method)
    precision = None
    if mixed_precision is not None:
        precision = tuple(
            str(d).replace("torch.", "") for d in (mixed_precision.param_dtype, mixed_precision.reduce_dtype)
        )
    return ShardReport(
        policy=describe_policy(policy),
        units=[*units, ""],
        world_size=mesh.size(),
        reshard_after_forward=reshard_after_forward,
        mixed_precision=precision,  # type: ignore[arg-type]
        cpu_offload=cpu_offload,
    )


def check_dtensor_optimizer(optimizer: Any) -> None:
    """Raise if ``optimizer`` (a name or an optimizer) cannot step on FSDP2's DTensor parameters.

    Raises:
        ValueError: a name outside :data:`DTENSOR_OPTIMIZERS`, or an optimizer of a class known to fail
            on DTensors (torchao ``AdamW4bit``, torch ``Adafactor``, an in-backward optimizer stepping with one),
            e.g. ``adafactor_in_backward``; the message lists the alternatives.
    """
    if isinstance(optimizer, str):
        name = optimizer.lower()
        if name in DTENSOR_OPTIMIZERS:
            return
        shown = f"optimizer={optimizer!r}"
    else:
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer / wrappers
        cls = type(inner).__name__
        if hasattr(inner, "inner_optimizers"):  # an in-backward optimizer: its per-parameter optimizers step DTensors
            name = f"{inner.inner_name}_in_backward"
            if name in DTENSOR_OPTIMIZERS:
                return
            shown = f"the configured optimizer {name!r}"
        elif cls not in _DTENSOR_UNSUPPORTED_CLASSES:
            return
        else:
            shown = f"the configured optimizer {cls} (like {_DTENSOR_UNSUPPORTED_CLASSES[cls]!r})"
    raise ValueError(
        f"{shown} cannot step on FSDP's sharded (DTensor) parameters. Choose one of {list(DTENSOR_OPTIMIZERS)} "
        "(e.g. optimizer='adamw8bit' for 8-bit state), or keep this optimizer with strategy='lowmem_ddp' "
        "(zero_optimizer=True shards its state)."
    )

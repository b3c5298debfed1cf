"""The training step the estimator runs: a fake copy of the model, its techniques, and the step itself.

Shared by :func:`~lightning_lowmem.planning.estimate.estimate_memory` (the whole step) and the planner's
per-axis measurements (:mod:`lightning_lowmem.planning._components`), so both run exactly the same code.

Two orders of a step exist (``loop``):

* ``"torch"``: forward, backward, ``optimizer.step()``, ``zero_grad()`` -- gradients are freed before
  the next forward.
* ``"lightning"``: Lightning's automatic optimization calls ``optimizer.zero_grad()`` *between*
  ``training_step`` and backward, so the previous step's gradients are alive during the whole forward.
  With micro-batches (``AutoMicrobatch``) the zeroing moves before the first micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable

import torch
from torch import nn

from lightning_lowmem._compat import TorchDispatchMode, tree_leaves, tree_map
from lightning_lowmem.functional.applied import step_context
from lightning_lowmem.functional.microbatch import split_batch

LOOPS = ("torch", "lightning")


class EstimationError(RuntimeError):
    """The step could not be run on fake tensors (e.g. data-dependent control flow)."""


def resolve_loop(module: nn.Module, loss_fn: Any, loop: str) -> str:
    """``"auto"``: Lightning's order for a LightningModule stepped through its own ``training_step`` under
    automatic optimization (no ``loss_fn``), else torch's."""
    if loop not in ("auto", *LOOPS):
        raise ValueError(f"`loop`={loop!r} is unknown; choose 'auto', 'lightning' or 'torch'")
    if loop != "auto":
        return loop
    lightning = (
        loss_fn is None
        and callable(getattr(module, "training_step", None))
        and getattr(module, "automatic_optimization", False) is True
    )
    return "lightning" if lightning else "torch"


# ----------------------------------------------------------------------------- fake copies
def fake_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inside a FakeTensorMode: an uninitialised fake CPU tensor shaped like ``tensor``."""
    dtype = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
    if tensor.is_contiguous():
        return torch.empty(tensor.shape, dtype=dtype, device="cpu")
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device="cpu")


def fake_module(module: nn.Module, dtype: torch.dtype | None, fake_mode: Any) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are fake; nothing real is copied."""
    memo: dict[int, Any] = {}
    with fake_mode:
        for param in module.parameters():
            memo[id(param)] = nn.Parameter(fake_like(param, dtype), requires_grad=param.requires_grad)
        for buffer in module.buffers():
            memo[id(buffer)] = fake_like(buffer, dtype)
    for value in vars(module).values():  # never copy (or log into) a Trainer the module is attached to
        if type(value).__name__ == "Trainer":
            memo[id(value)] = None
    return copy.deepcopy(module, memo)


def fake_batch(batch: Any, dtype: torch.dtype | None) -> Any:
    """Inside a FakeTensorMode: the batch with every tensor fake (floating ones cast to ``dtype``)."""
    return tree_map(lambda t: fake_like(t, dtype) if isinstance(t, torch.Tensor) else t, batch)


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]


# ----------------------------------------------------------------------------- techniques
def apply_model_techniques(model: nn.Module, config: Any) -> Any:
    """``config``'s model side on ``model`` (a throwaway copy) with :func:`lightning_lowmem.functional.apply`,
    as the callbacks and strategies apply it; returns the :class:`~lightning_lowmem.functional.Applied`."""
    from lightning_lowmem.functional.applied import apply

    return apply(model, config)


def device_optimizer_kwargs(name: str, device: str, user_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """On CUDA, torch's Adam/AdamW/SGD default to the ``foreach`` kernels (with their temporaries);
    on CPU, and for fake CPU tensors, to the per-tensor loop. Mirror the target device's default."""
    kwargs = dict(user_kwargs or {})
    if device == "cuda" and name in ("adamw", "adam", "sgd"):
        kwargs.setdefault("foreach", True)
    return kwargs


def build_lookup_tables(name: str) -> None:
    """torchao's low-bit optimizers build their quantization maps lazily (``lru_cache``) with ``.tolist()``,
    which has no value on fake tensors: build them here, for real, before entering the fake mode."""
    if "8bit" in name or "4bit" in name:
        from torchao.optim import subclass_4bit, subclass_8bit

        for table in (subclass_8bit, subclass_4bit):
            table.get_qmap_signed()
            table.get_qmap_unsigned()


def build_optimizer(name: str, params: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer as build

    return build(name, params, **kwargs)


class OptimizerScalars(TorchDispatchMode):
    """Answer ``.item()`` with 1 inside an optimizer step on fake tensors.

    Optimizers read scalars for their *values* only (Adafactor's step count and update norms; torch's
    ``capturable=False`` paths): the result never decides a tensor's shape, so the memory of the step
    does not depend on it. The model's forward and loss are not wrapped: a data-dependent ``.item()``
    there can change shapes and must stay an :class:`EstimationError`.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            if tensor.dtype == torch.bool:
                return True
            return 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def configured_optimizer(module: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """The package's name and the arguments of the optimizer ``module.configure_optimizers()`` returns
    (a LightningModule's), built on a fake copy of the module; ``None`` when there is none, several, or
    one of a type the estimator does not know (it is then estimated as AdamW)."""
    if not callable(getattr(module, "configure_optimizers", None)):
        return None
    fake_mode = _fake_tensor_mode()
    copied = fake_module(module, None, fake_mode)
    try:
        with fake_mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = copied.configure_optimizers()
    except Exception:  # noqa: BLE001 - one that needs a running Trainer (schedulers...): we cannot tell
        return None
    optimizers: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            optimizers.append(value)
        elif isinstance(value, dict):
            walk(value.get("optimizer"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(config)
    for optimizer in optimizers:  # an optimizer-in-backward registered gradient hooks: take them off again
        if callable(getattr(optimizer, "remove_hooks", None)):
            optimizer.remove_hooks()
    if len(optimizers) != 1:
        return None
    optimizer = optimizers[0]
    name = getattr(optimizer, "_lowmem_state_hooks", None)  # built by functional.optimizers.build_optimizer
    if not isinstance(name, str):
        name = (
            _TORCH_NAMES.get(type(optimizer).__name__) if type(optimizer).__module__.startswith("torch.optim") else None
        )
    if name is None:
        return None
    from lightning_lowmem.functional.optimizers.catalog import optimizer_arguments

    allowed = set(optimizer_arguments(name))
    group = optimizer.param_groups[0]
    kwargs = {
        key: (float(value) if isinstance(value, torch.Tensor) else value)
        for key, value in group.items()
        if key in allowed and value is not None
    }
    return name, kwargs


_TORCH_NAMES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Adafactor": "adafactor"}


def _fake_tensor_mode() -> Any:
    from lightning_lowmem._compat.fake_mode import fake_tensor_mode

    return fake_tensor_mode()


# ----------------------------------------------------------------------------- steps
def fake_gradients(params: list[torch.Tensor]) -> None:
    """Inside a FakeTensorMode: give every parameter a gradient shaped as backward would (``empty_like``)."""
    for param in params:
        param.grad = torch.empty_like(param)


def create_state(optimizer: Any, params: list[torch.Tensor]) -> None:
    """One optimizer step on fake gradients: the state a first real step leaves, without forward/backward.

    An optimizer-in-backward steps each parameter's inner optimizer, as its gradient hook would. A
    torch / torchao optimizer keeps state per parameter, shaped by the parameter alone: it steps one
    parameter of each shape, and the others get copies of that state (:func:`_copy_state`). The
    gradients stay set (``zero_grad`` is the caller's, as the loop order decides).
    """
    inner = getattr(optimizer, "inner_optimizers", None)
    with OptimizerScalars():
        if isinstance(inner, dict):
            fake_gradients(params)
            for param, inner_optimizer in inner.items():
                inner_optimizer.step()
                param.grad = None  # the hook frees each gradient right after its step
            return
        if not _state_per_parameter(optimizer) or not _step_by_shape(optimizer, params):
            fake_gradients(params)
            optimizer.step()
    fake_gradients(params)


def _state_per_parameter(optimizer: Any) -> bool:
    """torch's and torchao's own optimizers: state keyed by parameter, nothing wrapped inside."""
    module = type(optimizer).__module__
    plain = module.startswith("torch.optim") or module.startswith("torchao.optim")
    return plain and not hasattr(optimizer, "inner") and not hasattr(optimizer, "inner_optimizers")


def _step_by_shape(optimizer: Any, params: list[torch.Tensor]) -> bool:
    """Step one parameter per (group, shape, stride, dtype); copy its state to the others. ``False`` (and
    nothing stepped) when there is nothing to save."""
    twins: dict[tuple, list[torch.Tensor]] = {}
    wanted = {id(p) for p in params}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in wanted:
                twins.setdefault((index, tuple(param.shape), param.stride(), param.dtype), []).append(param)
    if len(twins) == len(params):
        return False
    for param in params:
        param.grad = None  # a parameter without a gradient is skipped by the step
    fake_gradients([same[0] for same in twins.values()])
    optimizer.step()
    shared = _shared_storages(optimizer.state.get(same[0], {}) for same in twins.values())
    for same in twins.values():
        state = optimizer.state.get(same[0])
        for param in same[1:]:
            copied = _copy_state(state, shared) if state else None
            if copied is None:  # nothing to copy from, or a layout we cannot copy: step it for real
                for other in params:
                    other.grad = None
                fake_gradients([param])
                optimizer.step()
            else:
                optimizer.state[param] = copied
    return True


def _shared_storages(states: Any) -> set[int]:
    """Storages that appear in more than one parameter's state (e.g. torchao's quantization maps)."""
    seen: dict[int, int] = {}
    for state in states:
        for key in {
            id(t.untyped_storage())
            for value in state.values()
            if isinstance(value, torch.Tensor)
            for t in _plain(value)
        }:
            seen[key] = seen.get(key, 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _copy_state(state: dict[str, Any], shared: set[int]) -> dict[str, Any] | None:
    """New tensors laid out as ``state``'s: each plain tensor cloned (the ones every state shares kept),
    tensor subclasses (torchao's low-bit state) rebuilt from their cloned inner tensors. ``None`` if a
    value cannot be rebuilt so."""
    copied: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            clone = _copy_tensor(value, shared)
            if clone is None:
                return None
            copied[key] = clone
        else:
            copied[key] = copy.deepcopy(value)
    return copied


def _copy_tensor(tensor: Any, shared: set[int]) -> torch.Tensor | None:
    if not isinstance(tensor, torch.Tensor) or _is_dtensor(tensor):  # e.g. FSDP2's sharded state: stepped instead
        return None
    if id(tensor.untyped_storage()) in shared:
        return tensor
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or _plain_type(tensor):
        return tensor.clone()
    names, context = flatten()
    inner = {}
    for name in names:
        part = _copy_tensor(getattr(tensor, name), shared)
        if part is None:
            return None
        inner[name] = part
    try:
        return type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())
    except Exception:  # noqa: BLE001 - a subclass that cannot be rebuilt this way: the caller steps it
        return None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    from lightning_lowmem.memory._tensors import plain_tensors as _plain_tensors

    return list(_plain_tensors(tensor))


def _plain_type(tensor: torch.Tensor) -> bool:
    from lightning_lowmem.memory._tensors import is_plain as _is_plain

    return _is_plain(tensor)


def accumulation_steps(accumulate_grad_batches: Any) -> int:
    """``accumulate_grad_batches`` itself (an int >= 1), or a ``ValueError`` saying what is allowed."""
    value = accumulate_grad_batches
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`accumulate_grad_batches`={value!r} must be an int >= 1 (the batches whose gradients are summed "
            "before each optimizer step, as `Trainer(accumulate_grad_batches=...)`); use 1 for none"
        )
    return value


def refuse_accumulation_in_backward(accumulate_grad_batches: int, config: Any) -> None:
    """An optimizer-in-backward steps inside every backward: nothing would be accumulated (composition.py's rule)."""
    if accumulate_grad_batches > 1 and config.optimizer.in_backward:
        raise ValueError(
            f"`accumulate_grad_batches`={accumulate_grad_batches} cannot be estimated with optimizer "
            f"{config.optimizer.name!r}: it steps the optimizer inside every backward, so gradients would never be "
            "accumulated (Lightning refuses the same run); use accumulate_grad_batches=1 or an optimizer that "
            "steps after backward"
        )


def train_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: Any,
    config: Any,
    autocast_dtype: torch.dtype | None,
    fake: bool = False,
    loop: str = "torch",
    accumulate: int = 1,
    cache: bool = False,
) -> None:
    """One optimizer step in the order ``loop`` (see the module docstring) over ``accumulate`` batches.

    With ``accumulate > 1`` (``Trainer(accumulate_grad_batches=...)``) each of the ``accumulate`` batches runs
    forward and backward (its loss divided by ``accumulate``, as Lightning's closure divides it), the gradients
    of the first backward stay alive through the later forwards and backwards, and the optimizer steps once,
    after the last. Mixed precision runs CPU autocast (for a CUDA estimate with CUDA's op rules installed,
    :mod:`lightning_lowmem.planning.cuda_autocast`), its weight cache on with ``cache`` (``False``: as Lightning's
    ``MixedPrecision`` plugin runs it).
    """
    # the same split as AutoMicrobatch / the strategies' planned micro-batches (functional.microbatch)
    micro_batches = split_batch(batch, config.micro_batch_size) if config.micro_batch_size else [batch]
    count = len(micro_batches)
    # every forward + backward of the step: (first of its batch's window?, micro-batch)
    passes = [(index == 0, micro_batch) for index in range(accumulate) for micro_batch in micro_batches]
    if fake and len(passes) > 2:
        # from the second pass on, each one starts from the same state (gradients accumulated, the previous loss
        # freed) and allocates what its micro-batch's shapes decide: one pass per shape shows them all
        later = {_shapes(micro_batch): (first, micro_batch) for first, micro_batch in reversed(passes[1:])}
        passes = [passes[0], *reversed(later.values())]
    lightning = loop == "lightning"
    in_backward = config.optimizer.in_backward  # its steps run inside backward
    divisor = count * accumulate
    held: list[torch.Tensor] = []
    if lightning and count > 1:
        optimizer.zero_grad(set_to_none=True)  # AutoMicrobatch zeroes before its first micro-batch
    for first_batch, micro_batch in passes:
        with contextlib.ExitStack() as stack:
            stack.enter_context(step_context(config))  # activation compression, as training runs it
            autocast = torch.autocast("cpu", dtype=autocast_dtype, cache_enabled=cache) if autocast_dtype else None
            with autocast or contextlib.nullcontext():
                loss = loss_fn(model, micro_batch)
            if lightning and count == 1:
                # Lightning's closure: `loss / normalize` and a detached copy for logging, then zero_grad on the
                # first batch of an accumulation window
                loss, divisor = loss / accumulate, 1
                held[:] = [loss.detach().clone()]
                if first_batch:
                    optimizer.zero_grad(set_to_none=True)  # between training_step and backward
            with OptimizerScalars() if in_backward and fake else contextlib.nullcontext():
                (loss / divisor if divisor > 1 else loss).backward()  # as Lightning does
        del loss
    with OptimizerScalars() if fake else contextlib.nullcontext():
        optimizer.step()
    if not lightning:
        optimizer.zero_grad(set_to_none=True)
    held.clear()


def _shapes(batch: Any) -> tuple:
    return tuple(tuple(leaf.shape) for leaf in tensor_leaves(batch))

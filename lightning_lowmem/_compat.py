"""The one place where lightning_lowmem touches private torch / Lightning attributes.

Each function says which private name it uses and why no public API does the job. When torch grows a
public equivalent, only this file changes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from typing import Any, Iterator

import torch

# Private torch names the package uses in several places, re-exported here: import them from ``_compat``.
# ``import torch`` loads all three modules already, so re-exporting them costs nothing.
# - FakeTensor: the class behind :func:`fake_tensor_mode` (``torch._subclasses``; see there).
# - TorchDispatchMode: the documented ``__torch_dispatch__`` extension point (the memory tracker, the
#   estimator's value questions) is importable only from ``torch.utils._python_dispatch``.
# - pytree: torch's nested-container utilities (``torch.utils._pytree``) have no public module; torch.compile,
#   torch.export and FSDP use the same functions on the same containers.
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = [
    "FakeTensor",
    "TorchDispatchMode",
    "around_fsdp_collectives",
    "cuda_dump_snapshot",
    "cuda_record_memory_history",
    "data_dependent_errors",
    "fake_process_group_store",
    "fake_tensor_mode",
    "force_eager",
    "fsdp_collective_names",
    "hf_masks_as_unpadded",
    "in_backward",
    "inductor_freezing",
    "is_fake",
    "keep_vmap_nesting",
    "lightning_model_parallel_setup_steps",
    "lightning_multiprocessing_launcher",
    "lightning_sharded_checkpoint_reader",
    "move_post_accumulate_grad_hook_first",
    "no_dispatch_modes",
    "below_cpu_autocast",
    "drop_library",
    "on_fsdp_storage_resize",
    "op_mutates",
    "requantize_low_bit_state",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "view_base",
]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    Why private: torch exposes no public "am I inside backward?" query; ``_current_graph_task_id`` is
    what ``torch.utils.checkpoint`` itself uses for the same question. Returns -1 outside backward.
    """
    return torch._C._current_graph_task_id() != -1


def current_autograd_node_name() -> str:
    """The class name of the autograd node backward is running on this thread (e.g. ``"MmBackward0"``), or ``""``.

    Why private: torch exposes the node being run only as ``torch._C._current_autograd_node`` (used by
    ``torch.autograd.graph`` itself); the memory tracker names backward's temporaries by it.
    """
    node = torch._C._current_autograd_node()
    return type(node).__name__ if node is not None else ""


def move_post_accumulate_grad_hook_first(param: torch.Tensor, handle: Any) -> None:
    """Make the hook behind ``handle`` run before every other post-accumulate-grad hook of ``param``.

    Why private: ``register_post_accumulate_grad_hook`` has no ``prepend=`` flag, and the memory
    tracker must see ``param.grad`` before an optimizer-in-backward hook steps and frees it. The hooks
    live in the ``OrderedDict`` ``param._post_accumulate_grad_hooks`` keyed by ``handle.id``; autograd
    walks it with ``PyDict_Next`` (plain-dict insertion order, blind to ``move_to_end``), so the dict is
    rebuilt in place with the hook inserted first.
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if isinstance(hooks, collections.OrderedDict) and handle.id in hooks:
        items = list(hooks.items())
        hooks.clear()
        hooks[handle.id] = dict(items)[handle.id]
        for key, hook in items:
            if key != handle.id:
                hooks[key] = hook


def fake_tensor_mode(**kwargs: Any) -> Any:
    """Return a new ``FakeTensorMode``.

    Why private: FakeTensorMode lives in ``torch._subclasses``; it is the supported way (used by
    ``torch.export`` and torch's own memory tools) to run real ops on tensors that hold no data.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a FakeTensor (see :func:`fake_tensor_mode`)."""
    return isinstance(tensor, FakeTensor)


class inductor_freezing:  # noqa: N801 - used like a function: ``with inductor_freezing(): ...``
    """A context in which ``torch.compile`` treats parameters as constants (Inductor "freezing").

    Freezing lets Inductor pre-pack weights and fuse pt2e int8 patterns into oneDNN ``qlinear`` kernels
    on x86 CPUs; without it a quantized graph runs its reference dequantize/quantize ops.

    Why private: freezing is only switchable through ``torch._inductor.config.freezing``, and dynamo reads
    it while tracing (to inline parameters as constants), so ``torch.compile(options={"freezing": True})``,
    which reaches Inductor only, fails on pt2e int8 graphs (``onednn.qlinear_prepack`` has no fake kernel).
    Setting and restoring the attribute costs about 10 us a call; ``config.patch`` about 85 us.
    """

    def __enter__(self) -> None:
        import torch._inductor.config as inductor_config

        self._previous = inductor_config.freezing
        inductor_config.freezing = True

    def __exit__(self, *exc_info: Any) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = self._previous


def below_cpu_autocast() -> Any:
    """Ops skip CPU autocast's dispatch key, as autocast's own kernels run their op (planning/cuda_autocast.py).

    Why private: ``torch._C._ExcludeDispatchKeyGuard`` is the Python form of C++'s ``ExcludeDispatchKeyGuard``.
    """
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def drop_library(library: Any) -> None:
    """Remove the kernels a ``torch.library.Library`` registered, now. Why private: ``_destroy`` is what its
    finalizer calls; garbage collection would leave them installed for an unknown time."""
    library._destroy()


def no_dispatch_modes() -> Any:
    """A context with no ``TorchDispatchMode`` active (no fake mode, no tracker): ops run for real, unseen.

    Why private: ``torch.utils._python_dispatch._disable_current_modes`` is the one way to step out of every
    active mode from inside a mode's ``__torch_dispatch__``; the estimator runs the batch's mask arithmetic on
    the real batch there (``planning/_batch_values.py``).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def op_mutates(func: Any) -> bool:
    """True when the aten overload ``func`` writes to one of its arguments (in-place or ``out=``).

    Why private: an ``OpOverload`` tells it only through its ``_schema`` (``FunctionSchema.is_mutable``).
    """
    schema = getattr(func, "_schema", None)
    return bool(getattr(schema, "is_mutable", False))


def keep_vmap_nesting() -> None:
    """Make FX dead-code elimination keep functorch's vmap level markers, from now on (idempotent).

    Why private: transformers 4.x builds attention masks under ``torch.vmap``; ``torch.export`` records that as
    ``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` calls whose results nothing reads. They change
    functorch's nesting level (a side effect), but FX does not know it: torchao's ``convert_pt2e``, and the
    ``.eval()`` / ``.train()`` of an exported model, delete them as dead code, leaving ``_add_batch_dim`` calls
    that fail at run time ("tensor may have escaped from inside a function being vmapped").
    ``torch.fx.node._side_effectful_functions`` is the set ``Node.is_impure`` consults; adding the two markers
    for good (not only while converting: Lightning calls ``.eval()`` on the installed graph later) is the fix.
    """
    try:
        import torch.fx.node as fx_node
        from torch._functorch import predispatch
    except ImportError:  # pragma: no cover - a torch without pre-dispatch vmap
        return
    fx_node._side_effectful_functions.update({predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting})


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """Exception types fake tensors raise on data-dependent control flow or output shapes.

    Why private: these exception classes are only importable from ``torch._subclasses`` and
    ``torch.fx.experimental``; the estimator turns them into a clear user-facing error.
    """
    errors: list[type[BaseException]] = []
    try:
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        errors += [DataDependentOutputException, DynamicOutputShapeException]
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors.append(GuardOnDataDependentSymNode)
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch._subclasses.fake_tensor import UnsupportedFakeTensorException

        errors.append(UnsupportedFakeTensorException)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(errors)


def cuda_record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start / stop the CUDA caching allocator's history recording (for OOM snapshots).

    Why private: ``torch.cuda.memory._record_memory_history`` is the documented entry point of the
    memory-snapshot tool (pytorch.org "Understanding CUDA Memory Usage") but keeps its underscore.
    """
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_dump_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history to ``path`` (see :func:`cuda_record_memory_history`)."""
    torch.cuda.memory._dump_snapshot(path)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (the root of a chain of views), or ``None``.

    Why private: ``Tensor._base`` is the only way to learn that a saved tensor such as ``weight.t()``
    (what ``addmm`` saves for a Linear) is a view of a parameter; activation compression must leave
    parameters exact and must not copy them.
    """
    return tensor._base


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The ``(pack, unpack)`` pair on top of autograd's saved-tensors hooks stack, or ``None``.

    Why private: ``torch.autograd.graph.saved_tensors_hooks`` *replace* the hooks below them (only the top
    pair runs), and torch has no public getter for that pair; ``_top_saved_tensors_default_hooks`` is what
    AOT autograd itself uses to read it. A hook that only observes (the memory tracker) reads it to pass
    each saved tensor on to the hooks below, so observing a step never changes how it is stored.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - torch without the getter: observe without passing on
        return None
    return top(True)  # True: ignore whether dynamo is tracing


def force_eager() -> Any:
    """A context in which ``torch.compile``-d functions run their Python code eagerly.

    Needed wherever tensors are fake or a dispatch mode is tracking: a compiled kernel called with fake
    tensors reads memory that does not exist (torchao's low-bit optimizers compile their per-parameter
    step), and compiled frames hide their allocations from a ``TorchDispatchMode``.
    """
    import contextlib

    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")


_FSDP_RESIZE_LISTENERS: list[Any] = []


def on_fsdp_storage_resize(listener: Any) -> None:
    """Call ``listener(tensor)`` after FSDP2 allocates or frees the storage behind ``tensor`` in place.

    Why private: FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each unsharded parameter and
    all-gather output as a tensor whose *storage* it resizes (``untyped_storage().resize_(n)`` / ``(0)``
    in ``_fsdp_param.alloc_storage`` / ``free_storage``). A storage resize is no tensor op, so a
    ``TorchDispatchMode`` never sees it; the memory core would count every unsharded parameter as
    alive for good. Wrapping the two module-level helpers (also imported by name into
    ``_fsdp_param_group``) is the only hook there is. Idempotent per listener.
    """
    if listener in _FSDP_RESIZE_LISTENERS:
        return
    _FSDP_RESIZE_LISTENERS.append(listener)
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    if getattr(_fsdp_param.alloc_storage, "_lowmem_wrapped", False):
        return

    def notify(original: Any) -> Any:
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            for callback in _FSDP_RESIZE_LISTENERS:
                callback(tensor)

        resize._lowmem_wrapped = True  # type: ignore[attr-defined]
        return resize

    alloc, free = notify(_fsdp_param.alloc_storage), notify(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
    if getattr(_fsdp_param_group, "alloc_storage", None) is not None:
        _fsdp_param_group.alloc_storage = alloc


_COLLECTIVE_CONTEXTS: list[Any] = []


def around_fsdp_collectives(context: Any) -> None:
    """Run every ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (torch 2.11:
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, :func:`fsdp_collective_names`) inside ``context(kind,
    output, input)`` (a context-manager factory; ``kind`` is ``"all_gather"`` or ``"reduce_scatter"``).

    Why private: these two are what FSDP2's default communication (``_fsdp_collectives.DefaultAllGather``
    / ``DefaultReduceScatter``) calls, looked up on ``torch.distributed`` at each call; wrapping them is
    how the memory core learns that a backend may allocate in its own thread during the call (gloo's
    reduce-scatter reduces a copy of its input). Idempotent per context.
    """
    if context in _COLLECTIVE_CONTEXTS:
        return
    _COLLECTIVE_CONTEXTS.append(context)
    import contextlib
    import inspect

    import torch.distributed as dist

    def wrap(kind: str, original: Any) -> Any:
        if getattr(original, "_lowmem_wrapped", False):
            return original

        signature = inspect.signature(original)

        def collective(*args: Any, **kwargs: Any) -> Any:
            output, input = list(signature.bind(*args, **kwargs).arguments.values())[:2]
            with contextlib.ExitStack() as stack:
                for factory in _COLLECTIVE_CONTEXTS:
                    stack.enter_context(factory(kind, output, input))
                return original(*args, **kwargs)

        collective._lowmem_wrapped = True  # type: ignore[attr-defined]
        collective.__wrapped__ = original  # type: ignore[attr-defined]
        return collective

    for kind, name in fsdp_collective_names().items():
        setattr(dist, name, wrap(kind, getattr(dist, name)))


def fsdp_collective_names() -> dict[str, str]:
    """``{"all_gather": name, "reduce_scatter": name}``: the ``torch.distributed`` functions FSDP2 calls.

    torch 2.13 has ``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 neither, and FSDP2 calls
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (the same leading ``(output, input)`` arguments).
    """
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    return {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


def lightning_model_parallel_setup_steps() -> tuple[Any, Any]:
    """Lightning's ``_materialize_distributed_module`` and ``_optimizers_to_device``.

    Why private: ``LowMemoryFSDPStrategy.setup`` repeats ``ModelParallelStrategy.setup`` with the sharding
    done by the strategy instead of the user's ``configure_model`` (the parent's ``setup`` rejects a
    module without that hook); these are the two helpers the parent's ``setup`` calls.
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    return _materialize_distributed_module, _optimizers_to_device


def fake_process_group_store() -> Any:
    """A store for ``torch.distributed.init_process_group("fake", store=..., rank=0, world_size=N)``; registers
    torch's "fake" backend first (once): one process plays a rank of N, its collectives communicate nothing.

    Why private: the fake process group (``torch._C._distributed_c10d.FakeProcessGroup``) is registered as a
    backend only by ``torch.testing._internal.distributed.fake_pg``, test code a library must not import; this
    does what that module does (the estimator simulates FSDP ranks with it, ``planning/sharding.py``).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common_opts: Any, backend_opts: Any) -> Any:
        try:
            return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)
        except TypeError:  # a torch whose fake group takes no backend options
            return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size)

    if "FAKE" not in dist.Backend._plugins:
        dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda", "hpu", "xpu"])
    return dist.HashStore()


def lightning_sharded_checkpoint_reader() -> tuple[str, Any]:
    """Lightning's name for the Trainer metadata file of a sharded checkpoint folder (``"meta.pt"``) and its
    reader of the folder's tensors (``_load_distributed_checkpoint``).

    Why private: ``lightning.fabric.utilities.load`` keeps both private; ``consolidate_checkpoint`` reads a
    folder Lightning's ``ModelParallelStrategy`` layout wrote, so it must use Lightning's names for it.
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint

    return _METADATA_FILENAME, _load_distributed_checkpoint


def lightning_multiprocessing_launcher() -> Any:
    """Lightning's multiprocessing launcher class (``spawn`` / ``fork`` / ``forkserver``).

    Why private: ``_MultiProcessingLauncher`` is how ``DDPStrategy(start_method="spawn")`` starts processes;
    ``ModelParallelStrategy`` offers only the script launcher (re-running the command), which cannot
    work from a notebook or a test. ``LowMemoryFSDPStrategy`` subclasses it to hand the full state dict
    back to the main process (see ``strategies/fsdp.py``).
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return _MultiProcessingLauncher


def requantize_low_bit_state(optimizer: Any) -> int:
    """Turn plain (dequantized) moments of a torchao low-bit AdamW back into its quantized buffers.

    Why private: torchao's ``_AdamBase._new_buffer(p, signed)`` is the one place that knows which buffer a
    parameter gets (quantized when its *local* shard has >= 4096 values divisible by the block size,
    wrapped in a DTensor like the parameter). A full FSDP checkpoint stores the moments dequantized, so
    they load on any number of processes; each rank re-quantizes its own shard here. Returns how many
    buffers were converted (0 for any other optimizer).
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    new_buffer = getattr(inner, "_new_buffer", None)
    if new_buffer is None or not hasattr(inner, "_subclass_zeros"):
        return 0
    converted = 0
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state.get(param, {})
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
                value = state.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                local = value.to_local() if hasattr(value, "to_local") else value
                if type(local) is not torch.Tensor:
                    continue  # already quantized
                buffer = new_buffer(param, signed)
                buffer_local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
                if type(buffer_local) is torch.Tensor:
                    continue  # too small to quantize: plain either way
                buffer_local.copy_(local)
                state[key] = buffer
                converted += 1
    return converted


# the decisions ``transformers.masking_utils`` takes from a padding mask's *values* (torch.nn's SDPA then
# runs ``is_causal=True`` / no mask instead of a materialised (B, 1, T, T) mask)
_HF_MASK_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def hf_masks_as_unpadded() -> Iterator[None]:
    """While active, ``transformers`` decides on a *fake* padding mask as on an all-ones one.

    Why private: ``transformers.masking_utils._ignore_causal_mask_sdpa`` /
    ``_ignore_bidirectional_mask_sdpa`` skip building the (B, 1, T, T) attention mask when no token is
    padded, so SDPA runs its flash kernel with ``is_causal``; on a FakeTensor they cannot read the
    values (``is_tracing`` is true for fake tensors) and always build the mask, which the real step with
    an unpadded batch never does. No public switch exists. Each is wrapped so that a fake
    ``padding_mask`` is passed on as ``None`` (no padding: what the caller checked on the real batch);
    real masks and every other argument pass through. Only a ``transformers`` already imported is
    patched, and only the names it has (older versions lack some); all are restored on exit.
    """
    masking = sys.modules.get("transformers.masking_utils")
    originals = {name: getattr(masking, name) for name in _HF_MASK_DECISIONS if hasattr(masking, name)}

    def unpadded(original: Any) -> Any:
        @functools.wraps(original)
        def decide(padding_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
            return original(
                None if padding_mask is not None and is_fake(padding_mask) else padding_mask, *args, **kwargs
            )

        return decide

    for name, original in originals.items():
        setattr(masking, name, unpadded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)

"""Autograd internals: which backward runs, its hook order, saved tensors and views.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

__all__ = [
    "current_autograd_node_name",
    "dispatched_by_autograd_engine",
    "in_backward",
    "move_post_accumulate_grad_hook_first",
    "observing_saved_tensors",
    "top_saved_tensors_hooks",
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


_DISPATCH_WRAPPERS = ("torch._dynamo.eval_frame", "torch._compile", "torch.utils._python_dispatch")
"""Modules whose frames sit between a ``__torch_dispatch__`` and the code that called the op (dynamo's guards)."""


def dispatched_by_autograd_engine(frame: Any) -> bool:
    """True when the op dispatched to a mode from ``frame`` (the frame calling ``__torch_dispatch__``) was called by
    autograd's C++ engine itself, not by Python code the engine runs (an autograd Function's backward, a hook).

    The first frame outside dispatch's own wrappers is then the one that started the backward pass, or none at all
    (the engine's device threads run no Python). Why private: torch tells no one who called an op; the engine is
    entered only through ``torch.autograd.graph._engine_run_backward`` (``backward()`` and ``autograd.grad`` both).
    Any other caller, or a torch without that function, answers False.
    """
    while frame is not None and frame.f_globals.get("__name__") in _DISPATCH_WRAPPERS:
        frame = frame.f_back
    if frame is None:
        return True
    engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
    return frame.f_code is getattr(engine, "__code__", None)


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


def observing_saved_tensors(observe: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``saved_tensors_hooks`` that show each saved tensor to ``observe``, then hand it to the hooks below, if any.

    Saved-tensors hooks replace the pair below them (:func:`top_saved_tensors_hooks`); these pass every tensor on
    (e.g. to activation compression entered first), so an observed step stores activations as an unobserved one.
    """
    below = top_saved_tensors_hooks()
    if below is None:
        return torch.autograd.graph.saved_tensors_hooks(observe, _identity)
    return torch.autograd.graph.saved_tensors_hooks(_PassOn(observe, below[0]), below[1])


def _identity(value: Any) -> Any:
    return value


class _PassOn:
    """A pack hook that observes a saved tensor, then hands it to the pack hook it sits on."""

    def __init__(self, observe: Callable[[torch.Tensor], Any], pack_below: Callable[[torch.Tensor], Any]) -> None:
        self.observe = observe
        self.pack_below = pack_below

    def __call__(self, tensor: torch.Tensor) -> Any:
        return self.pack_below(self.observe(tensor))

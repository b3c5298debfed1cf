"""Activation checkpointing on a plain ``nn.Module``: ``checkpoint_`` wraps chosen submodules in place.

A wrapped submodule keeps no activations for backward: its forward runs under non-reentrant
``torch.utils.checkpoint.checkpoint`` and is recomputed during backward. Only the submodule's inputs
are kept. Gradients are bit-identical to an unwrapped run (same ops, same order, RNG state replayed), and
so are BatchNorm's running statistics (the recompute's update is undone: they move once per step).

The wrap replaces the submodule's ``forward`` by an instance attribute, so parameter names,
``state_dict`` keys and module hooks stay exactly as they were; ``uncheckpoint_`` removes it.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_lowmem.model_io import disable_kv_cache_, restore_kv_cache_
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "CheckpointPolicy",
    "CheckpointReport",
    "checkpoint_",
    "checkpointed_modules",
    "describe_blocks",
    "no_match_message",
    "resolve_policy",
    "uncheckpoint_",
]

log = logging.getLogger(__name__)

CheckpointPolicy = Union[str, int, type, tuple, list]
"""``"auto"``, a class name (``"Block"``), an fnmatch / regex pattern on module names (``"h.*"``,
``r"h\\.[0-2]"``), an int ``k`` (every k-th repeated block), a module class, or a tuple / list of these."""


@dataclass
class CheckpointReport:
    """What :func:`checkpoint_` did.

    Attributes:
        policy: the policy as given (``repr`` for classes).
        wrapped: fully qualified names of the submodules now checkpointed (``""`` is the root).
        kv_cache_disabled: Hugging Face models inside whose ``config.use_cache`` was switched off until
            :func:`uncheckpoint_` (a training-time KV cache would keep what checkpointing frees).
    """

    policy: str
    wrapped: list[str] = field(default_factory=list)
    kv_cache_disabled: list[str] = field(default_factory=list)

    @property
    def num_wrapped(self) -> int:
        return len(self.wrapped)


class _CheckpointedForward:
    """The ``forward`` a wrapped module gets: run the original forward under ``checkpoint``.

    A small class rather than a closure so that ``copy.deepcopy`` and ``pickle`` of the model work
    (the reference to ``module`` follows the copy).
    """

    def __init__(self, module: nn.Module, original: Callable[..., Any] | None) -> None:
        self.module = module
        self.original = original  # an instance-level forward that existed before, else None

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / inference: nothing is saved, nothing to recompute
            return self._run(*args, **kwargs)
        norms = _updating_norms(self.module)
        if not norms:
            return checkpoint(self._run, *args, use_reentrant=False, **kwargs)
        runs = []

        def run_once(*args: Any, **kwargs: Any) -> Any:
            """The recompute in backward must not move BatchNorm's running statistics a second time."""
            runs.append(None)
            if len(runs) == 1:
                return self._run(*args, **kwargs)
            saved = [(buffer, buffer.clone()) for norm in norms for buffer in _running_buffers(norm)]
            try:
                return self._run(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        buffer.copy_(value)

        return checkpoint(run_once, *args, use_reentrant=False, **kwargs)


def _updating_norms(module: nn.Module) -> list[nn.Module]:
    """Normalisation layers in ``module`` whose forward updates running statistics (BatchNorm in training)."""
    return [
        sub
        for sub in module.modules()
        if sub.training
        and getattr(sub, "track_running_stats", False)
        and getattr(sub, "running_mean", None) is not None
    ]


def _running_buffers(norm: nn.Module) -> list[torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    return [buffer for buffer in (getattr(norm, name, None) for name in names) if isinstance(buffer, torch.Tensor)]


def _is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def checkpointed_modules(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` currently wrapped by :func:`checkpoint_`."""
    return [name for name, sub in module.named_modules() if _is_checkpointed(sub)]


_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``module``, in model order.

    A block is a child of an ``nn.ModuleList`` or ``nn.Sequential`` (wherever it sits: the root, an attribute,
    a stage inside a stage) that holds parameters and submodules of its own (a lone ``Linear`` or ``ReLU`` is
    no block: wrapping it keeps its input anyway). Blocks of a class that occurs at least twice are repeated.
    The outermost are kept -- ``nn.Transformer``'s encoder *and* decoder layers, a GPT's ``Block`` s -- except
    that a stage (a repeated block with a container of two or more blocks of one class inside, like a ResNet
    stage) gives way to the blocks inside it: the peak while recomputing one block is lower than one stage's.
    Plain containers (a ``Sequential`` stage) count as blocks only when no other class repeats. A model with no
    repeated block whose ``nn.ModuleList`` holds one block (a 1-layer GPT) gets that block: checkpointing it keeps
    only its input, as for a deeper stack.
    """
    found: list[tuple[str, str, nn.Module]] = []  # (container name, block name, block)
    for container_name, container in module.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        for child_name, child in container.named_children():
            if next(child.children(), None) is None or next(child.parameters(), None) is None:
                continue
            found.append((container_name, f"{container_name}.{child_name}" if container_name else child_name, child))
    counts = Counter(type(child) for _, _, child in found)
    repeated = [item for item in found if counts[type(item[2])] >= 2]
    if not repeated:  # a stack of one block (a 1-layer GPT's ModuleList): that block is the one to recompute
        repeated = [
            item
            for item in found
            if isinstance(module.get_submodule(item[0]) if item[0] else module, nn.ModuleList)
            and not isinstance(item[2], _CONTAINERS)
        ]
    blocks = [item for item in repeated if not isinstance(item[2], _CONTAINERS)] or repeated
    by_container: dict[str, Counter] = {}
    for container_name, _, child in blocks:
        by_container.setdefault(container_name, Counter())[type(child)] += 1
    stacked = {name for name, classes in by_container.items() if max(classes.values()) >= 2}

    def inside(name: str, outer: str) -> bool:
        return name.startswith(f"{outer}.")

    def outermost(names: list[str]) -> list[str]:
        chosen = []
        for name in names:
            if any(inside(name, other) for other in names):
                continue
            inner = [other for other in names if inside(other, name)]
            is_stage = any(c == name or inside(c, name) for c in stacked)
            chosen.extend(outermost(inner) if is_stage and inner else [name])
        return chosen

    keep = set(outermost([name for _, name, _ in blocks]))
    return [(name, child) for _, name, child in blocks if name in keep]


def describe_blocks(module: nn.Module, names: list[str]) -> str:
    """``"4 x TransformerEncoderLayer (transformer.encoder.layers.0, ...), 4 x ..."``: what a policy chose."""
    by_class: dict[str, list[str]] = {}
    for name in names:
        by_class.setdefault(type(module.get_submodule(name)).__name__, []).append(name or "<root>")
    return ", ".join(
        f"{len(found)} x {cls} ({found[0]}{', ...' if len(found) > 2 else ''}{', ' + found[-1] if len(found) > 1 else ''})"
        for cls, found in by_class.items()
    )


def user_class(module: nn.Module) -> type:
    """The class the user wrote for ``module``: FSDP2's ``fully_shard`` swaps a module's class for a subclass
    ``FSDP<Name>`` of ``(FSDPModule, <Name>)``, so a policy naming ``<Name>`` must look one step up its MRO."""
    cls = type(module)
    for base in cls.__mro__[1:]:
        if cls.__name__ == f"FSDP{base.__name__}":
            return base
    return cls


def _class_matches(sub: nn.Module, name: str) -> bool:
    classes = {type(sub), user_class(sub)}
    return any(name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}") for cls in classes)


def _match_names(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose name matches ``pattern`` as fnmatch; if none does, as a full-match regex."""
    named = list(module.named_modules())
    by_glob = [(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)]
    if by_glob:
        return by_glob
    try:
        regex = re.compile(pattern)
    except re.error:
        return []
    return [(n, m) for n, m in named if regex.fullmatch(n)]


def _select(module: nn.Module, policy: Any) -> list[tuple[str, nn.Module]]:
    """Every (name, submodule) the policy picks, outer modules first."""
    if isinstance(policy, (tuple, list)) and not (policy and all(isinstance(p, type) for p in policy)):
        chosen: dict[int, tuple[str, nn.Module]] = {}
        for item in policy:
            for name, sub in _select(module, item):
                chosen.setdefault(id(sub), (name, sub))
        return list(chosen.values())
    if isinstance(policy, type) or isinstance(policy, (tuple, list)):
        classes = tuple(policy) if isinstance(policy, (tuple, list)) else (policy,)
        return [(n, m) for n, m in module.named_modules() if isinstance(m, classes)]
    if isinstance(policy, int):
        return _repeated_blocks(module)[::policy]
    if policy == "auto":
        return _repeated_blocks(module)
    if policy.isdigit():
        return _repeated_blocks(module)[:: int(policy)]
    by_class = [(n, m) for n, m in module.named_modules() if _class_matches(m, policy)]
    if by_class:
        return by_class
    return _match_names(module, policy)


def resolve_policy(module: nn.Module, policy: CheckpointPolicy, nested: bool = False) -> list[str]:
    """Names of the submodules ``policy`` selects in ``module``, without wrapping.

    Args:
        module: the model.
        policy: see :func:`checkpoint_`.
        nested: keep modules inside other selected ones too. Default: ``False`` (outermost only).

    Raises:
        TypeError: ``policy`` is not a str, int, module class or a tuple / list of these.
        ValueError: an int policy is < 1, or a string policy is empty.
    """
    validate_policy(policy)
    selected = _select(module, policy)
    names = sorted({name for name, _ in selected}, key=lambda n: (n.count("."), n))
    chosen: list[str] = []
    for name in names:  # without nesting, a module inside an already-chosen one is recomputed anyway: skip it
        if nested or not any(name == o or name.startswith(f"{o}.") or o == "" for o in chosen):
            chosen.append(name)
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return sorted(chosen, key=order.__getitem__)


def validate_policy(policy: Any) -> None:
    allowed = "'auto', a class name, a module-name pattern, an int k >= 1, a module class, or a list of these"
    if isinstance(policy, bool):
        raise TypeError(f"`policy`={policy!r} is a bool; use {allowed}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"`policy`={policy} must be >= 1 (checkpoint every k-th repeated block); use {allowed}")
        return
    if isinstance(policy, str):
        if not policy.strip():
            raise ValueError(f"`policy`={policy!r} is empty; use {allowed}")
        return
    if isinstance(policy, type):
        if not issubclass(policy, nn.Module):
            raise TypeError(f"`policy`={policy!r} is not an nn.Module subclass; use {allowed}")
        return
    if isinstance(policy, (tuple, list)) and policy:
        for item in policy:
            if isinstance(item, (tuple, list)):
                raise TypeError(f"`policy`={policy!r} nests lists; use {allowed}")
            validate_policy(item)
        return
    raise TypeError(f"`policy`={policy!r} ({type(policy).__name__}) is not supported; use {allowed}")


def describe_policy(policy: Any) -> str:
    if isinstance(policy, type):
        return policy.__name__
    if isinstance(policy, (tuple, list)):
        return "[" + ", ".join(describe_policy(p) for p in policy) + "]"
    return repr(policy)


def no_match_message(module: nn.Module, policy: Any) -> str:
    """Why ``policy`` matched nothing in ``module``, for an error: the repeated block to name instead (what
    ``"auto"`` picks: never a module holding every block, like ``LlamaModel``, which would recompute the whole
    model), or the nearest module name for a name pattern."""
    import difflib

    blocks = _repeated_blocks(module)
    block_classes = list(dict.fromkeys(user_class(block).__name__ for _, block in blocks))
    words = [p for p in (policy if isinstance(policy, (tuple, list)) else [policy]) if isinstance(p, str)]
    names = [name for name, _ in module.named_modules() if name]
    close = [
        match
        for word in words
        for match in difflib.get_close_matches(word, block_classes if "." not in word else names, n=1, cutoff=0.5)
    ]
    if blocks:
        counts = Counter(user_class(block).__name__ for _, block in blocks)
        found = ", ".join(f"{counts[name]} x {name}" for name in block_classes)
        suggestion = close[0] if close else block_classes[0]
        hint = f"Did you mean {suggestion!r}? Its repeated blocks are {found} ({blocks[0][0]}, ...), what 'auto' picks"
    else:
        classes = sorted({user_class(sub).__name__ for sub in module.modules()})
        hint = f"It has no repeated block; its module classes: [{', '.join(classes[:16])}]"
        if close:
            hint = f"Did you mean {close[0]!r}? " + hint
    return (
        f"activation checkpointing policy {describe_policy(policy)} matched no submodule of "
        f"{user_class(module).__name__}. {hint}. Use a class name, a module-name pattern (e.g. 'model.h.*') or 'auto'"
    )


def checkpoint_(
    module: nn.Module, policy: CheckpointPolicy = "auto", nested: bool = False, strict: bool = True
) -> CheckpointReport:
    """Wrap the submodules of ``module`` chosen by ``policy`` with activation checkpointing, in place.

    Each chosen submodule runs under non-reentrant ``torch.utils.checkpoint.checkpoint`` while
    gradients are enabled (under ``torch.no_grad`` it runs as usual). When the policy picks both a
    module and one inside it, only the outer one is wrapped, unless ``nested``. Modules already
    wrapped are left alone.

    Nesting (``policy=["Block", "*.attn"], nested=True``): backward recomputes a whole block keeping
    only what its inner checkpointed modules need as inputs, then recomputes each inner module when
    its own backward comes. The working set of backward shrinks from one block's activations to one
    inner module's, for one more forward of the inner modules.

    Args:
        module: the model; changed in place.
        policy: which submodules to wrap. Default: ``"auto"``.

            * ``"auto"``: the outermost repeated blocks -- children of an ``nn.ModuleList`` or
              ``nn.Sequential`` anywhere in the model, holding parameters and submodules, of a class
              that occurs at least twice (a GPT's blocks; ``nn.Transformer``'s encoder and decoder
              layers; the blocks of a ResNet's stages); where none repeats, the block of an
              ``nn.ModuleList`` holding one (a 1-layer GPT). What it chose is logged at INFO.
            * an int ``k`` (or a digit string): every k-th of those blocks, starting with the first
              (``1`` = all of them; ``2`` = blocks 0, 2, 4, ...).
            * a class name (``"Block"``; also the qualified name): every submodule of that class.
            * otherwise a pattern on module names, as ``fnmatch`` (``"h.*"``, ``"*.mlp"``); when no
              name matches that way, as a full-match regex (``r"h\\.[0-2]"``).
            * a module class, a tuple of classes, or a list mixing any of the above (union).
        nested: also wrap chosen modules that sit inside other chosen ones. Default: ``False``.
        strict: a policy that matches no submodule is an error; ``False`` makes it a warning.
            Default: ``True``.

    Hugging Face models inside ``module`` get ``config.use_cache = False`` while any submodule is
    wrapped (restored by :func:`uncheckpoint_`): their training-time KV cache would keep every layer's
    keys and values alive, undoing the checkpointing.

    Returns:
        A :class:`CheckpointReport` listing the newly wrapped names.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``policy`` has an unsupported type.
        ValueError: ``policy`` is an int < 1 or an empty string, or (``strict``) matches no submodule: the
            message lists the model's module classes and the nearest names.

    Warns:
        NoEffectWarning: ``strict=False`` and the policy matched no submodule.

    Example::

        >>> from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
        >>> model = CharGPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16))
        >>> checkpoint_(model, 2).wrapped
        ['h.0', 'h.2']
        >>> uncheckpoint_(model)
        ['h.0', 'h.2']
        >>> checkpoint_(model, ["Block", "*.attn"], nested=True).wrapped[:3]
        ['h.0', 'h.0.attn', 'h.1']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}")
    if not isinstance(nested, bool):
        raise TypeError(f"`nested` must be a bool, got {type(nested).__name__}: {nested!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"`strict` must be a bool, got {type(strict).__name__}: {strict!r}")
    report = CheckpointReport(policy=describe_policy(policy))
    names = resolve_policy(module, policy, nested=nested)
    if not names:
        message = no_match_message(module, policy)
        if strict:
            raise ValueError(message + "; strict=False allows a policy that matches nothing.")
        warnings.warn(message + "; nothing is checkpointed.", NoEffectWarning, stacklevel=2)
        return report
    for name in names:
        sub = module.get_submodule(name)
        if _is_checkpointed(sub):
            continue
        sub.forward = _CheckpointedForward(sub, sub.__dict__.get("forward"))
        report.wrapped.append(name)
    if report.wrapped:
        report.kv_cache_disabled = disable_kv_cache_(module, "activation checkpointing")
        log.info("activation checkpointing %s: wrapped %s", report.policy, describe_blocks(module, report.wrapped))
    return report


def uncheckpoint_(module: nn.Module, names: list[str] | None = None) -> list[str]:
    """Undo :func:`checkpoint_` in place; returns the names of the submodules unwrapped.

    The original ``forward`` (class method, or an instance attribute that existed before) is restored.

    Args:
        module: the model.
        names: only these submodules (e.g. ``report.wrapped`` of one ``checkpoint_`` call).
            Default: ``None`` = every wrapped submodule.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be an nn.Module, got {type(module).__name__}")
    only = None if names is None else set(names)
    undone = []
    for name, sub in module.named_modules():
        if only is not None and name not in only:
            continue
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            if wrapper.original is not None:
                sub.forward = wrapper.original
            else:
                del sub.forward
            undone.append(name)
    if undone and not checkpointed_modules(module):
        restore_kv_cache_(module, "activation checkpointing")
    return undone

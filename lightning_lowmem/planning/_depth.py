"""A deep model's step from shallow copies of it: the planner's cheap "cannot fit", and its full-depth figures.

Most candidates the planner meets cannot fit; it only has to prove that. For a model built of ``L`` alike blocks (a
transformer's layers), the bytes alive at any moment of a step are a sum of terms each affine in the depth: every
block's parameters and gradients, what the blocks already run saved for backward, the running block's temporaries
(the same in every block), what the embeddings, the head and the loss hold. A step's peak, the largest such sum, is
then the maximum of affine functions of ``L``: convex and piecewise affine for ``L >= 2`` (from 2 blocks on, every
kind of moment a deeper model has exists: a block after a block, a block before the head). A convex function lies
above each of its secants outside the two points, so with the peaks ``f(2)`` and ``f(3)`` of copies holding the
first 2 and 3 blocks::

    f(L) >= f(3) + (L - 3) * (f(3) - f(2))

with equality where the peak is affine (the usual case: the peak where backward starts, or in the forward's last
block). Two copies of 2 and 3 blocks cost a fraction of the full model's run (5 of an 8B Llama's 32 blocks).

The bound only rejects: a candidate whose bound passes the budget cannot fit. (The secant is not the figure: where
another phase overtakes at depth, it is below the peak, a bound still.) The forward's ``f(2)`` is not run but read
off the 3-block copy's forward cut where its second and last blocks start (:func:`one_block_fewer`).

A candidate the bound does not reject gets its exact full-depth figures from the segments of the 3-block copy's
whole step (:func:`deeper_step`): cut at its blocks' forward and backward starts, it shows every kind of moment of
the deep step, each shifted in the deep one by what the extra middle blocks hold then. The figures are taken only
where the 4-block copy's step is what the same arithmetic says (the planner's check), else the full depth runs.

The argument holds for blocks that behave alike under techniques that treat every block alike. :func:`depth_stack`
finds none (``None``) in a model with fewer than :data:`MIN_BLOCKS` blocks, blocks of different classes, shapes
or settings (alternating sliding-window layers), or hooks on a block; :func:`depth_free` refuses a configuration
with a technique outside :data:`DEPTH_FREE_FIELDS` (pruning, freezing the first K blocks, quantization, sharding
...), checkpointing of every k-th block, or LoRA targets that name layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_lowmem.memory.report import CATEGORIES

__all__ = [
    "DEPTHS",
    "DEPTH_FREE_FIELDS",
    "MIN_BLOCKS",
    "DepthStack",
    "depth_free",
    "depth_stack",
    "deeper_step",
    "one_block_fewer",
    "secant_bound",
    "step_cuts",
]

DEPTHS = (2, 3)
"""The shallow copies' depths: two consecutive depths from 2 on (see the module docstring)."""

MIN_BLOCKS = 5
"""Fewer blocks than this: the full model is about as cheap to run as the two shallow copies."""

DEPTH_FREE_FIELDS = frozenset(
    {"precision", "lora", "checkpointing", "compression", "cross_entropy", "optimizer", "microbatch"}
)
"""Techniques that treat every block alike (with the conditions of :func:`depth_free`)."""

_INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "block_idx", "idx", "index")
"""Block attributes that number the blocks (the KV cache's slot): the only setting blocks may differ in."""


@dataclass(frozen=True)
class DepthStack:
    """A model's stack of alike blocks: the ``nn.ModuleList`` at ``path`` holding ``depth`` of them."""

    path: str
    depth: int

    def shallow(self, module: nn.Module, depth: int) -> nn.Module:
        """``module`` with only the first ``depth`` blocks: the modules on the way to the stack are shallow copies,
        everything else is shared with ``module`` (which is not changed)."""
        parts = self.path.split(".")
        root = _copy_node(module)
        parent = root
        for part in parts[:-1]:
            child = _copy_node(parent._modules[part])
            parent._modules[part] = child
            parent = child
        blocks = parent._modules[parts[-1]]
        parent._modules[parts[-1]] = nn.ModuleList(list(blocks)[:depth])
        return root


def depth_stack(module: nn.Module) -> DepthStack | None:
    """The one stack of alike blocks holding most of ``module``'s parameters, or ``None`` (module docstring).

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> depth_stack(CharLM(n_layer=6, n_embd=32, block_size=16))
        DepthStack(path='model.h', depth=6)
        >>> depth_stack(CharLM(n_layer=2, n_embd=32, block_size=16)) is None  # too shallow to gain from it
        True
    """
    stacks = [
        (name, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, nn.ModuleList) and len(sub) >= 2 and name and len({type(block) for block in sub}) == 1
    ]
    if not stacks:
        return None
    total = sum(p.numel() for p in module.parameters())
    name, blocks = max(stacks, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    if len(blocks) < MIN_BLOCKS or 2 * sum(p.numel() for p in blocks.parameters()) < total:
        return None  # a small part of the model repeats: its other parts may not be depth-free
    if not all(_alike(blocks[0], block) for block in blocks):
        return None
    return DepthStack(name, len(blocks))


def depth_free(config: Any) -> bool:
    """Whether ``config``'s techniques treat every block alike (module docstring), so the secant bound holds."""
    from lightning_lowmem.functional.lora.targets import BROAD_TARGETS

    for field, value in config.configs().items():
        if value is None:
            continue
        if field not in DEPTH_FREE_FIELDS:
            return False
        if field == "checkpointing" and (value.policy != "auto" or value.nested):
            return False  # a class name may match a part of some blocks only; every k-th block repeats by k
        if field == "lora" and not (
            isinstance(value.target, str) and value.target in BROAD_TARGETS and value.train_modules == "auto"
        ):
            return False
    return True


def secant_bound(
    low: tuple[int, dict[str, int]], high: tuple[int, dict[str, int]], depth: int
) -> tuple[int, dict[str, int]]:
    """The secant through the peaks of the copies of :data:`DEPTHS` blocks (``low``, ``high``: peak bytes and
    breakdown), extended to ``depth`` blocks: a lower bound of that depth's peak. The breakdown is extended alike
    (it sums to the bound; a category that would fall below zero is left at the shallow copy's and the difference
    goes to ``other``)."""
    steps = depth - DEPTHS[1]
    bound = high[0] + steps * (high[0] - low[0])
    breakdown = {c: high[1][c] + steps * (high[1][c] - low[1][c]) for c in CATEGORIES}
    if any(value < 0 for value in breakdown.values()):
        breakdown = dict(high[1])
    breakdown["other"] += bound - sum(breakdown.values())
    return bound, breakdown


def one_block_fewer(segments: Any) -> tuple[int, dict[str, int]]:
    """The forward's peak of the copy with one block fewer (and its breakdown), read off a forward of the copy of
    :data:`DEPTHS` ``[1]`` blocks cut where its second and last blocks start (``probe_model``'s ``cut_at``, with the
    last block's tensors read): no run of the shallower copy.

    Both copies run the same ops up to the second block; the deeper one's second block (a middle one) has no
    counterpart, and from its last block on it runs what the shallower one runs from its own last block. So the
    shallower copy's moments are the deeper one's before its second block, less the bytes its last block holds
    from the start (``held``: its weights, their gradients), and the deeper one's from its last block on, less that
    and what the middle block left alive (the live state at the last block's start less that at the middle
    one's). The peak is the larger (the earlier on a tie, as a tracker keeps the first)."""
    (first, _, rest), (middle_start, last_start) = segments.peaks, segments.starts
    held = (sum(segments.held.values()), segments.held)
    before = _minus(first, held)
    after = _minus(rest, _plus(held, [_minus(last_start, middle_start)], 1))
    return after if after[0] > before[0] else before


def step_cuts(path: str) -> Any:
    """Where :func:`deeper_step` needs the copy of :data:`DEPTHS` ``[1]`` blocks (its stack at ``path``) cut: as its
    second and last blocks' forwards start, as its second and first blocks' backwards start; the last block read."""
    from lightning_lowmem.planning._components import Cuts

    last = DEPTHS[1] - 1
    return Cuts((f"{path}.1", f"{path}.{last}"), f"{path}.{last}", (f"{path}.1", f"{path}.0"))


def deeper_step(probe: Any, depth: int) -> Any:
    """The model-side figures (a ``ModelProbe``) of the model with ``depth`` blocks, from a whole step of its copy
    of :data:`DEPTHS` ``[1]`` blocks cut at :func:`step_cuts`: no run of the deep model. ``None`` where this does
    not apply (a cut was not reached; gradients alive before the step, as Lightning's loop keeps them).

    The deep model runs the copy's step with ``n = depth - 3`` more middle blocks. Each extra block holds its
    weights (``held``) throughout; its forward leaves what the copy's middle forward left (``forward``: the live
    state as the last block starts less as the middle one starts), and its backward changes that by what the
    middle backward did (``backward``: as the first block's backward starts less as the middle one's starts). So
    every moment of a segment of the copy's step (before the middle block, the middle forward, the last block's
    forward and backward with the head between, the middle backward, the rest) happens in the deep model with
    ``n`` such contributions more, those of a repeated segment growing by one ``forward`` (``backward``) per
    repetition: its highest repetition is the last if that grows the total, else the first. The peak is the
    highest (the first on a tie, as a tracker keeps it); the bytes at ``step()`` follow the last segment's.
    """
    from lightning_lowmem.planning._components import ModelProbe

    segments = probe.segments
    if segments is None or segments.held["gradients"] or probe.stopped_at is not None or probe.forward_only:
        return None
    n = depth - DEPTHS[1]
    held = (sum(segments.held.values()), segments.held)
    middle_start, last_start, back_start, first_back = segments.starts
    forward, backward = _minus(last_start, middle_start), _minus(first_back, back_start)
    grows = [forward if forward[0] > 0 else _ZERO, backward if backward[0] > 0 else _ZERO]
    offsets = [
        [held],
        [held, grows[0]],
        [held, forward],
        [held, forward, grows[1]],
        [held, forward, backward],
    ]
    peak = None
    for (total, breakdown), parts in zip(segments.peaks, offsets, strict=True):
        moment = _plus((total, breakdown), parts, n)
        if peak is None or moment[0] > peak[0]:
            peak = moment
    assert peak is not None
    step = _plus((probe.step_bytes, probe.step_breakdown), offsets[-1], n)
    first, count = segments.held_trainable
    block = probe.trainable[first : first + count]
    trainable = probe.trainable[:first] + block * n + probe.trainable[first:]
    return ModelProbe(peak[0], peak[1], step[0], step[1], trainable)


_ZERO = (0, dict.fromkeys(CATEGORIES, 0))


def _minus(a: tuple[int, dict[str, int]], b: tuple[int, dict[str, int]]) -> tuple[int, dict[str, int]]:
    return a[0] - b[0], {c: a[1][c] - b[1][c] for c in CATEGORIES}


def _plus(
    base: tuple[int, dict[str, int]], parts: list[tuple[int, dict[str, int]]], times: int
) -> tuple[int, dict[str, int]]:
    total, breakdown = base[0], dict(base[1])
    for part_total, part in parts:
        total += times * part_total
        for c in CATEGORIES:
            breakdown[c] += times * part[c]
    return total, breakdown


# ----------------------------------------------------------------------------- helpers
def _copy_node(module: nn.Module) -> nn.Module:
    node = copy.copy(module)
    node._modules = dict(module._modules)  # its own child table: replacing a child leaves ``module``'s
    return node


def _alike(first: nn.Module, other: nn.Module) -> bool:
    """Same classes, parameter and buffer shapes / dtypes / trainability, settings (all but the block's number) and
    no hooks, module by module."""
    mine, theirs = list(first.named_modules()), list(other.named_modules())
    if len(mine) != len(theirs):
        return False
    for (name, a), (other_name, b) in zip(mine, theirs, strict=True):
        if name != other_name or type(a) is not type(b) or _hooked(a) or _hooked(b):
            return False
        if _tensors(a) != _tensors(b) or _settings(a) != _settings(b):
            return False
    return True


def _hooked(module: nn.Module) -> bool:
    return any(
        getattr(module, name, None)
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


def _tensors(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    found = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters(recurse=False)]
    found += [(n, tuple(b.shape), b.dtype, False) for n, b in module.named_buffers(recurse=False)]
    return found


def _settings(module: nn.Module) -> dict[str, Any]:
    """A module's own plain settings (numbers, strings, flags, tuples of them), less the block's number."""
    settings = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name in _INDEX_NAMES:
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            settings[name] = value
        elif isinstance(value, (tuple, list)) and all(
            isinstance(v, (bool, int, float, str, type(None))) for v in value
        ):
            settings[name] = tuple(value)
    return settings

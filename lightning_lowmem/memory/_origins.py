"""Where an ``other`` storage was made: the kinds of ``other`` bytes and the tagging that tells them apart.

``other`` (neither model / optimizer state nor saved for backward) is split by where each storage was made
(:data:`OTHER_KINDS`): the loss and logits (after the output head ran), attention, activation packing
(``tagged_allocations``, e.g. compression's pack / unpack), forward / backward temporaries, the optimizer step's
temporaries, inputs (alive before tracking), communication buffers. ``report.other_breakdown`` is that split at the
peak, ``report.phases[phase]["other"]`` at each phase's peak. :class:`Origins` follows the module forwards and the
autograd node running to name the kind of each allocation; the tracker keeps the bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from lightning_lowmem._compat.autograd import current_autograd_node_name

OTHER_KINDS: tuple[str, ...] = (
    "loss / logits",
    "attention",
    "activation packing",
    "forward temporaries",
    "backward temporaries",
    "optimizer step",
    "inputs",
    "communication buffers",
)
"""What ``other`` bytes are, by where they were made (module docstring)."""

_HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "classifier", "score", "embed_out")
"""Last name segments of an output head: what a forward allocates after one ran is the loss and its logits."""

_LOSS_NODES = ("NllLoss", "LogSoftmax", "CrossEntropy", "ChunkedCrossEntropy")
"""Autograd nodes of a loss (by name): what their backward makes is the logits' gradient."""


def nonzero_kinds(kinds: dict[str, int]) -> dict[str, int]:
    """The kinds of ``kinds`` that hold bytes (what a report shows)."""
    return {kind: nbytes for kind, nbytes in kinds.items() if nbytes}


class Origins:
    """Names the kind (:data:`OTHER_KINDS`) of what is allocated now, from the module forwards running.

    Args:
        module_names: ``{id(module): qualified name}`` of the tracked modules (a head is known by its name).
    """

    def __init__(self, module_names: dict[int, str]) -> None:
        self.module_names = module_names
        self._tag: str | None = None  # set by tagged
        self._stack: list[tuple[int, str]] = []  # (module id, kind) of the module forwards running
        self._module_kinds: dict[int, str] = {}
        self._after_head = False  # an output head ran in this forward: what follows is the loss

    def new_forward(self) -> None:
        """A forward phase starts: no output head has run in it yet."""
        self._after_head = False

    def kind_now(self, phase: str) -> str:
        """Where an allocation made now, in ``phase``, is made."""
        if self._tag is not None:
            return self._tag
        if phase == "optimizer":
            return "optimizer step"
        if phase == "backward":
            node = current_autograd_node_name()
            if any(loss in node for loss in _LOSS_NODES):
                return "loss / logits"  # the gradient of the logits
            return "attention" if "ttention" in node else "backward temporaries"
        if self._after_head:
            return "loss / logits"
        return self._stack[-1][1] if self._stack else "forward temporaries"

    @contextlib.contextmanager
    def tagged(self, kind: str) -> Iterator[None]:
        """Inside: what is allocated counts as ``kind`` (see ``tagged_allocations``)."""
        outer, self._tag = self._tag, kind
        try:
            yield
        finally:
            self._tag = outer

    def enter(self, module: nn.Module) -> None:
        """A forward of ``module`` starts (not a checkpoint recomputation)."""
        kind = self._module_kind(module)
        if kind == "loss / logits":
            self._after_head = True
        inner = self._stack[-1][1] if self._stack else "forward temporaries"
        self._stack.append((id(module), inner if kind == "forward temporaries" else kind))

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward of ``module`` ended (a module forward hook)."""
        if self._stack and self._stack[-1][0] == id(module):
            self._stack.pop()

    def _module_kind(self, module: nn.Module) -> str:
        kind = self._module_kinds.get(id(module))
        if kind is None:
            name = self.module_names.get(id(module), "")
            last = name.rpartition(".")[2]
            attention = "attention" in type(module).__name__.lower() or any(
                "attn" in part or "attention" in part for part in name.lower().split(".")
            )
            kind = "loss / logits" if last in _HEAD_NAMES else "attention" if attention else "forward temporaries"
            self._module_kinds[id(module)] = kind
        return kind

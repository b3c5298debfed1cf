"""The rules for resuming optimizer state written by ``MemoryEfficientOptimizer``: which optimizer may continue
which state, and the messages that say so. The callback only calls them (no Lightning import here).

A checkpoint's record (:mod:`~lightning_lowmem.checkpoints.records`) names the optimizer that wrote the state;
two optimizers with the same :func:`~lightning_lowmem.functional.optimizers.catalog.state_layout` continue each
other (``"adamw8bit"`` and ``"adamw8bit_in_backward"``), others are refused before any weight is loaded.
"""

from __future__ import annotations

from typing import Any

from lightning_lowmem.functional.optimizers.catalog import available_optimizers, state_layout

__all__ = ["FORMAT_VERSION", "WRITER", "describe_state", "refuse_resume", "resume_message"]

WRITER = "MemoryEfficientOptimizer"
"""The writer name the callback records in a checkpoint."""

FORMAT_VERSION = 1
"""The version of that record; a newer one is refused with "upgrade lightning_lowmem"."""


def describe_state(name: str) -> str:
    """What optimizer ``name`` keeps, in words.

    Example::

        >>> describe_state("adamw8bit"), describe_state("adafactor"), describe_state("sgd")
        ('AdamW state in 8-bit', 'Adafactor state', 'SGD state')
    """
    family, precision = state_layout(name)
    label = {"adam": "AdamW", "sgd": "SGD"}.get(family, family.capitalize())
    return f"{label} state" + (f" in {precision.replace('bit', '-bit')}" if precision != "float" else "")


def refuse_resume(entry: dict[str, Any], optimizer: str) -> str | None:
    """Why a ``MemoryEfficientOptimizer(optimizer)`` cannot continue the state recorded in ``entry`` (``None``: it can).

    Example::

        >>> refuse_resume({"format": "adamw8bit_in_backward", "version": 1}, "adamw8bit") is None
        True
        >>> print(refuse_resume({"format": "adamw", "version": 1}, "adafactor")[:48])
        its AdamW state cannot be continued by this Trai
    """
    written = entry.get("format")
    if entry.get("version", 1) > FORMAT_VERSION:
        return f"a newer lightning_lowmem wrote it (version {entry.get('version')}); upgrade lightning_lowmem."
    if written not in available_optimizers():
        return f"optimizer {written!r} is unknown to this lightning_lowmem."
    if state_layout(written) != state_layout(optimizer):
        return (
            f"its {describe_state(written)} cannot be continued by this Trainer's "
            f"MemoryEfficientOptimizer({optimizer!r}) ({describe_state(optimizer)}). Resume with "
            f"MemoryEfficientOptimizer({written!r}), or start a new run from the weights only "
            f"(e.g. `YourModule.load_from_checkpoint(path)`)."
        )
    return None


def resume_message(optimizer: str, needs: str) -> str:
    """The message a plain optimizer shows when it is handed state marked by ``MemoryEfficientOptimizer(optimizer)``."""
    return (
        f"lightning_lowmem: this optimizer state was written by MemoryEfficientOptimizer({optimizer!r}) "
        f"({describe_state(optimizer)}); add {needs} to the Trainer that resumes it, or load the weights only"
    )

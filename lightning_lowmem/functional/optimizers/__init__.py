"""Lean optimizers by name: the name table (``catalog``: ``build_optimizer``, ``available_optimizers``), torchao
8/4-bit AdamW, Adafactor, bf16 stochastic rounding (``stochastic_rounding``), optimizer-in-backward
(``in_backward``) and the portable layout of their state in checkpoints (``state``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "OptimizerInBackward": "lightning_lowmem.functional.optimizers.in_backward",
    "StochasticRounding": "lightning_lowmem.functional.optimizers.stochastic_rounding",
    "available_optimizers": "lightning_lowmem.functional.optimizers.catalog",
    "build_optimizer": "lightning_lowmem.functional.optimizers.catalog",
    "check_optimizer_kwargs": "lightning_lowmem.functional.optimizers.catalog",
    "drop_frozen_": "lightning_lowmem.functional.optimizers.convert",
    "optimizer_arguments": "lightning_lowmem.functional.optimizers.catalog",
    "state_layout": "lightning_lowmem.functional.optimizers.catalog",
    "stochastic_round_": "lightning_lowmem.functional.optimizers.stochastic_rounding",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.optimizers.convert import drop_frozen_
    from lightning_lowmem.functional.optimizers.in_backward import OptimizerInBackward
    from lightning_lowmem.functional.optimizers.catalog import (
        available_optimizers,
        build_optimizer,
        check_optimizer_kwargs,
        optimizer_arguments,
        state_layout,
    )
    from lightning_lowmem.functional.optimizers.stochastic_rounding import StochasticRounding, stochastic_round_

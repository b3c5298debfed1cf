"""Lean optimizers by name: the registry (``registry``: ``build_optimizer``, ``available_optimizers``), torchao
8/4-bit AdamW, Adafactor, bf16 stochastic rounding (``stochastic_rounding``), optimizer-in-backward
(``in_backward``) and the portable layout of their state in checkpoints (``state``).
"""

from lightning_lowmem.functional.optimizers.in_backward import OptimizerInBackward
from lightning_lowmem.functional.optimizers.registry import (
    available_optimizers,
    build_optimizer,
    check_optimizer_kwargs,
    optimizer_arguments,
    state_layout,
)
from lightning_lowmem.functional.optimizers.stochastic_rounding import StochasticRounding, stochastic_round_

__all__ = [
    "OptimizerInBackward",
    "StochasticRounding",
    "available_optimizers",
    "build_optimizer",
    "check_optimizer_kwargs",
    "optimizer_arguments",
    "state_layout",
    "stochastic_round_",
]

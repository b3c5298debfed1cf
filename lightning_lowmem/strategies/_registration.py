"""Make ``import lightning_lowmem`` register the strategy names without importing Lightning itself.

Importing ``lightning.pytorch`` takes seconds; ``import lightning_lowmem`` takes milliseconds. The
names must be in Lightning's ``StrategyRegistry`` before ``Trainer(strategy="lowmem")`` looks them
up, which can only happen once ``lightning.pytorch`` is imported. So: if it already is, register now;
otherwise a one-shot import hook registers right after ``lightning.pytorch`` finishes importing.
"""

from __future__ import annotations

from lightning_lowmem._after_import import call_after_import


def _register() -> None:
    import lightning_lowmem.strategies.fsdp  # noqa: F401  (registers "lowmem_fsdp" on import)
    import lightning_lowmem.strategies.low_memory  # noqa: F401  (registers on import)


def register_on_lightning_import() -> None:
    """Register ``"lowmem"`` / ``"lowmem_ddp"`` / ``"lowmem_ddp_spawn"`` / ``"lowmem_fsdp"`` now or when Lightning loads."""
    call_after_import("lightning.pytorch", _register, "strategies")

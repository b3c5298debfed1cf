"""`MemoryEfficientOptimizer`: swap the optimizers a LightningModule configures for a memory-lean one."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.functional.optimizers import available_optimizers, build_optimizer

_GROUP_KEYS_KEPT = ("lr", "weight_decay")


class MemoryEfficientOptimizer(L.Callback):
    """Replace every optimizer returned by ``configure_optimizers`` with ``optimizer`` over the same
    param groups (same ``lr`` / ``weight_decay``), for users who cannot edit ``configure_optimizers``.

    The swap happens when Lightning calls ``configure_optimizers`` (the callback wraps it in
    ``setup``), so LR schedulers are re-bound to the new optimizer and a checkpoint resume loads the
    saved state straight into the lean optimizer.

    Args:
        optimizer: a name from :func:`~lightning_lowmem.functional.optimizers.available_optimizers`
            (e.g. ``"adamw8bit"``, ``"adafactor"``, ``"adamw_in_backward"``). Default: ``"adamw8bit"``.
        lr: learning rate for the new optimizer, replacing the configured one (LR schedulers then start
            from it). Needed when the new optimizer reads ``lr`` differently, e.g. Adafactor's step size
            relative to each weight's RMS. Default: ``None`` (keep the configured ``lr``).
        weight_decay: likewise for weight decay. Default: ``None`` (keep the configured value).
        **optimizer_kwargs: further arguments for the new optimizer (Python only; LightningCLI reads the
            named arguments).

    Raises:
        ValueError: unknown ``optimizer``, or a negative ``lr`` / ``weight_decay``.

    Example::

        >>> cb = MemoryEfficientOptimizer("adafactor_in_backward", lr=0.05)
        >>> cb.optimizer, cb.optimizer_kwargs
        ('adafactor_in_backward', {'lr': 0.05})
    """

    def __init__(
        self,
        optimizer: str = "adamw8bit",
        lr: float | None = None,
        weight_decay: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not isinstance(optimizer, str) or optimizer.lower() not in available_optimizers():
            raise ValueError(f"`optimizer`={optimizer!r} is unknown; choose one of {available_optimizers()}")
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if value is not None:
                if value < 0:
                    raise ValueError(f"`{name}` must be >= 0, got {value}")
                optimizer_kwargs[name] = value
        self.optimizer = optimizer.lower()
        self.optimizer_kwargs = optimizer_kwargs
        self._module: L.LightningModule | None = None
        self._replaced: list[torch.optim.Optimizer] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._module is not None:
            return
        original = pl_module.configure_optimizers

        def configure_optimizers() -> Any:
            return self._convert(original())

        pl_module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        self._module = pl_module

    def _convert(self, config: Any) -> Any:
        mapping: dict[int, torch.optim.Optimizer] = {}

        def swap(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
            if id(opt) not in mapping:
                kept = [k for k in _GROUP_KEYS_KEPT if k not in self.optimizer_kwargs]  # explicit arguments win
                groups = [{"params": g["params"], **{k: g[k] for k in kept if k in g}} for g in opt.param_groups]
                new = build_optimizer(self.optimizer, groups, **self.optimizer_kwargs)
                for old_group, new_group in zip(opt.param_groups, new.param_groups):
                    if "initial_lr" in old_group:  # set by schedulers created on the old optimizer
                        new_group["initial_lr"] = new_group["lr"] if "lr" in self.optimizer_kwargs else old_group["initial_lr"]
                mapping[id(opt)] = new
                self._replaced.append(new)
                rank_zero_info(f"MemoryEfficientOptimizer: {type(opt).__name__} -> {type(new).__name__}")
            return mapping[id(opt)]

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.optim.Optimizer):
                return swap(obj)
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(walk(v) for v in obj)
            if isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):  # LR scheduler
                obj.optimizer = swap(obj.optimizer)
                if "lr" in self.optimizer_kwargs and hasattr(obj, "base_lrs"):  # schedule from the new lr
                    obj.base_lrs = [group["initial_lr"] for group in obj.optimizer.param_groups]
            return obj

        return walk(config)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._module is not None:
            self._module.__dict__.pop("configure_optimizers", None)
            self._module = None
        for opt in self._replaced:
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()
        self._replaced.clear()

"""`MemoryEfficientOptimizer`: swap the optimizers a LightningModule configures for a memory-lean one."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.checkpoints import guard_module_loading, record, unguard_module_loading
from lightning_lowmem.checkpoints.optimizer_state import FORMAT_VERSION, WRITER, refuse_resume, resume_message
from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.functional.optimizers.convert import convert_optimizers
from lightning_lowmem.functional.optimizers.catalog import check_loaded_state
from lightning_lowmem.functional.optimizers.savings import lean_optimizer_warning
from lightning_lowmem.functional.optimizers.state import mark_state_dict
from lightning_lowmem.composition import optimizer_tags
from lightning_lowmem.warnings import LowMemWarning


class MemoryEfficientOptimizer(TechniqueCallback):
    """Replace every optimizer returned by ``configure_optimizers`` with ``optimizer`` over the same
    param groups (same ``lr`` / ``weight_decay``), for users who cannot edit ``configure_optimizers``.

    The swap happens when Lightning calls ``configure_optimizers`` (the callback wraps it in
    ``setup``), so LR schedulers are re-bound to the new optimizer and a checkpoint resume loads the
    saved state straight into the lean optimizer.

    Args:
        optimizer: a name from :func:`~lightning_lowmem.functional.optimizers.available_optimizers`
            (e.g. ``"adamw8bit"``, ``"adafactor"``, ``"adamw_in_backward"``), or a whole
            :class:`~lightning_lowmem.functional.config.OptimizerConfig` (then no other argument). Default:
            ``"adamw8bit"``.
        lr: learning rate for the new optimizer, replacing the configured one (LR schedulers then start
            from it). Needed when the new optimizer reads ``lr`` differently, e.g. Adafactor's step size
            relative to each weight's RMS. Default: ``None`` (keep the configured ``lr``).
        weight_decay: likewise for weight decay. Default: ``None`` (keep the configured value).
        betas: Adam-family ``(beta1, beta2)``. Default: ``None`` (the optimizer's default).
        eps: the optimizer's ``eps`` (a float; Adafactor takes ``(eps1, eps2)``). Default: ``None``.
        momentum: SGD momentum. Default: ``None`` (0.9 for ``"sgd"``).
        optimizer_kwargs: any other argument of the chosen optimizer, e.g. ``{"amsgrad": True}``,
            ``{"block_size": 128}`` (YAML: a mapping). Default: ``None``.
        **kwargs: the same as ``optimizer_kwargs``, as Python keywords.

    The arguments build an :class:`~lightning_lowmem.functional.config.OptimizerConfig` (``self.config``),
    which checks each against the chosen optimizer's signature and values, at construction: a typo raises
    with the accepted names and a did-you-mean, instead of failing in ``configure_optimizers``. The swap
    itself is :func:`lightning_lowmem.functional.optimizers.convert.convert_optimizers`, as the low-memory
    strategies' ``optimizer=`` option does it.

    Checkpoints record the optimizer (``lightning_lowmem.checkpoints``) and mark its saved state so that a
    ``Trainer`` without this callback refuses it with a message naming the callback to add; a ``Trainer``
    whose ``MemoryEfficientOptimizer`` keeps a different kind of state (8-bit vs float AdamW, AdamW vs
    Adafactor...) refuses it before the model weights are loaded. Names with the same state layout resume
    each other (``"adamw8bit"`` and ``"adamw8bit_in_backward"``).

    Raises:
        ValueError: unknown ``optimizer``; an argument the optimizer does not take; a value it refuses
            (negative ``lr`` / ``weight_decay``, ``betas`` outside [0, 1)...); one argument given twice.

    Example::

        >>> cb = MemoryEfficientOptimizer("adafactor_in_backward", lr=0.05)
        >>> cb.optimizer, cb.optimizer_kwargs
        ('adafactor_in_backward', {'lr': 0.05})
        >>> MemoryEfficientOptimizer("adamw8bit", betas=(0.9, 0.99), optimizer_kwargs={"amsgrad": True}).optimizer_kwargs
        {'amsgrad': True, 'betas': (0.9, 0.99)}
    """

    def __init__(
        self,
        optimizer: str | OptimizerConfig = "adamw8bit",
        lr: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | tuple[float | None, float] | None = None,
        momentum: float | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        named = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps, "momentum": momentum}
        named = {key: value for key, value in named.items() if value is not None}
        if isinstance(optimizer, OptimizerConfig):
            given = {**named, **kwargs, **(optimizer_kwargs or {})}
            if given:
                raise ValueError(
                    f"MemoryEfficientOptimizer({optimizer!r}) also got {given}: give the arguments inside the "
                    f"OptimizerConfig, e.g. OptimizerConfig({optimizer.name!r}, lr=1e-3)"
                )
            self.config = optimizer
        else:
            self.config = OptimizerConfig(optimizer, optimizer_kwargs, **kwargs, **named)  # validates
        self._module: L.LightningModule | None = None
        self._replaced: list[torch.optim.Optimizer] = []

    @property
    def optimizer(self) -> str:
        """The optimizer's name."""
        return self.config.name

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        """Its arguments (the config's hyperparameters)."""
        return self.config.kwargs

    technique = "optimizer"
    changes_step = True  # the optimizer step

    @override
    def composition_label(self) -> str:
        return f"MemoryEfficientOptimizer({self.optimizer!r})"

    @override
    def composition_tags(self) -> frozenset[str]:
        return optimizer_tags(self.optimizer)

    @override
    def composition_optimizer(self) -> str | None:
        return self.optimizer

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        guard_module_loading(trainer, pl_module)  # check what wrote a checkpoint before Lightning loads it
        if stage != "fit" or self._module is not None:
            return
        original = pl_module.configure_optimizers

        def configure_optimizers() -> Any:
            return self._convert(original())

        pl_module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        self._module = pl_module
        reason = lean_optimizer_warning(self.optimizer, pl_module.parameters())
        if reason is not None:  # once per fit: setup runs once
            rank_zero_warn(f"MemoryEfficientOptimizer: {reason}", category=LowMemWarning)

    def _convert(self, configured: Any) -> Any:
        converted = convert_optimizers(
            configured, self.config, info=lambda m: rank_zero_info(f"MemoryEfficientOptimizer: {m}")
        )
        self._replaced.extend(converted.replaced)
        return converted.configured

    def checkpoint_reader(self) -> tuple[str, Any]:
        """(writer, accept) for :func:`lightning_lowmem.checkpoints.check`: state of the same layout only
        (the rules: :func:`lightning_lowmem.checkpoints.optimizer_state.refuse_resume`)."""
        return WRITER, lambda entry: refuse_resume(entry, self.optimizer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        needs = f"callbacks=[MemoryEfficientOptimizer({self.optimizer!r})]"
        record(
            checkpoint, writer=WRITER, format=self.optimizer, version=FORMAT_VERSION, needs=needs, needed_for=["fit"]
        )
        message = resume_message(self.optimizer, needs)
        states = checkpoint.get("optimizer_states") or []
        for index, optimizer in enumerate(trainer.optimizers[: len(states)]):
            if any(optimizer is replaced for replaced in self._replaced):
                states[index] = mark_state_dict(states[index], message)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Checkpoints written without this callback carry no record: check their optimizer state's layout
        # here, before Lightning loads it (and after the weights; the recorded case was checked before).
        if trainer.state.fn == "fit":
            for state in checkpoint.get("optimizer_states") or []:
                check_loaded_state(self.optimizer, state)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer}

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        unguard_module_loading(pl_module)
        if self._module is not None:
            self._module.__dict__.pop("configure_optimizers", None)
            self._module = None
        for opt in self._replaced:
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()
        self._replaced.clear()

"""``ScheduledPruning``: a drop-in for Lightning's ``ModelPruning`` with step schedules, bool masks and resume."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.functional.config.pruning import DEFAULT_PARAMETER_NAMES, PruningConfig
from lightning_lowmem.functional.pruning.bookkeeping import restore_masks_, sparsity_lines, sync_masks_, target_masks
from lightning_lowmem.functional.pruning.masks import apply_masks_, layer_sparsity, remove_pruning_
from lightning_lowmem.functional.pruning.schedule import Amount, PruningSchedule
from lightning_lowmem.functional.pruning.structural import example_row, shrink_to_state_dict_
from lightning_lowmem.functional.pruning.targets import Target, describe_targets, resolve_targets, rewind_, snapshot
from lightning_lowmem.functional.pruning.unstructured import PruningReport, prune_
from lightning_lowmem.model_io import has_forward_batch

__all__ = ["ScheduledPruning"]


class ScheduledPruning(TechniqueCallback):
    """Prune during training with ``bool`` masks, on a step schedule or ``ModelPruning``'s per-epoch rule.

    Every ``ModelPruning`` argument keeps its meaning, so migrating is renaming the class. Without
    ``schedule`` / ``target_sparsity`` it behaves like ``ModelPruning``: at each epoch end where
    ``apply_pruning(epoch)`` holds, ``amount`` of the still-unpruned weights is pruned. With them, the
    sparsity follows ``schedule(global_step)`` from ``start_step`` to ``end_step``. Masks are applied
    after every optimizer step; there is no ``weight_orig`` copy (1 byte of mask per pruned weight).

    Args:
        pruning_fn: ``"l1_unstructured"``, ``"random_unstructured"``, ``"ln_structured"``,
            ``"random_structured"``, ``"nm"``, a ``torch.nn.utils.prune`` function of those names, or a
            ``BasePruningMethod`` subclass (local only). Strings keep the saved config reloadable.
            Default: ``"l1_unstructured"``.
        parameters_to_prune: ``(module, "weight")`` pairs, or ``"module.fqn.param"`` strings (YAML);
            empty = every module's ``parameter_names`` except embeddings (see ``prune_embeddings``).
            Pairs are found again by their parameter when a callback (e.g. ``QuantizationAwareTraining``)
            swaps their module for one holding the same parameter. Default: ``()``.
        parameter_names: names pruned in each module. Default: ``["weight", "bias"]`` (as ModelPruning).
        use_global_unstructured: rank across all tensors (structured methods too). Default: ``True``.
        amount: float fraction, int count, or ``callable(epoch)``; per event in epoch mode, the final
            sparsity in step mode when ``target_sparsity`` is not given. Default: 0.5.
        apply_pruning: bool or ``callable(epoch) -> bool``. Default: ``True``.
        make_pruning_permanent: drop the masks at the end of training (zeros stay). Default: ``True``.
        use_lottery_ticket_hypothesis: rewind unpruned weights to their values at fit start (keeps a
            copy of them: off unless asked, unlike ModelPruning). bool or ``callable(epoch)``. Default: ``False``.
        resample_parameters: rewind to freshly initialised values instead. Default: ``False``.
        pruning_dim: dim whose slices structured methods prune. Default: ``None`` = output dim per module.
        pruning_norm: ``p`` for ``ln_structured``. Default: ``None`` = 1.
        verbose: 0 silent, 1 total sparsity, 2 per layer (``rank_zero_info``). Default: 0.
        prune_on_train_epoch_end: epoch mode prunes at train (else validation) epoch end. Default: ``True``.
        schedule: ``"constant"``, ``"linear"``, ``"cubic"``, ``"exponential"`` or ``callable(step)``;
            enables step mode. Default: ``None`` (``"cubic"`` when only ``target_sparsity`` is given).
        target_sparsity: final sparsity in step mode. Default: ``None``.
        start_step, end_step, frequency: schedule window and period (optimizer steps). ``end_step=None``
            = the run's last step. Defaults: 0, ``None``, 1.
        initial_sparsity: sparsity at ``start_step`` (Zhu & Gupta ``s_i``). Default: 0.0.
        method: alias of ``pruning_fn`` (e.g. ``"nm"``). Default: ``None``.
        n, m: N:M pattern for ``"nm"``: keep ``n`` of every ``m`` along the input dim. Default: 2, 4.
        structural: at the end of the schedule, physically remove the pruned channels / FFN units
            (Torch-Pruning) and rebind the optimizer. Without ``parameters_to_prune`` only the layers it can
            cut are masked (every Conv/Linear but the output head, no attention projection). Default: ``False``.
        structural_ratio: fraction of channels removed per layer; ``None`` = the final sparsity.
            Default: ``None``.
        seed: seed of the random methods' generator (same on every rank). Default: 0.
        prune_embeddings: with no ``parameters_to_prune``, also prune embedding tables and the parameters
            tied to them (GPT-2's ``lm_head``, BERT's MLM decoder), as ``ModelPruning`` does. Off by default
            (Torch-Pruning's and most users' expectation: token tables are lookups, not matmuls, and a tied
            head would be pruned through its embedding). A tied weight is always one target, pruned once,
            its mask shared by the modules that hold it. Default: ``False``.
        prune_heads: with no ``parameters_to_prune``, also prune the task heads: poolers, classifiers, LM heads
            and the output layer (:func:`~lightning_lowmem.functional.pruning.masks.head_modules`). Off by
            default: global magnitude pruning strips a head first (at 50% it zeroed 86% of a BERT classifier).
            What is pruned is logged once at setup; naming a head in ``parameters_to_prune`` warns. Default: ``False``.

    Override points (subclass and override, as with ``ModelPruning``):

    - :meth:`resolve_targets` — which ``(fqn, module, parameter name)`` triples are pruned (called at
      ``setup``, fit start and every pruning event, so a swapped module is found again).
    - :meth:`apply_pruning` — how masks are computed at a pruning event (default:
      :func:`~lightning_lowmem.functional.pruning.prune_`); returns a ``PruningReport``.
    - :meth:`apply_lottery_ticket_hypothesis` — the rewind after a pruning event.
    - :meth:`remove_structurally` — the physical removal at the end of the schedule (``structural=True``).
    - :meth:`make_pruning_permanent` — what happens to the masks at the end of training.

    The *what* lives in :mod:`lightning_lowmem.functional.pruning` (``schedule``: when and how much;
    ``targets``: which parameters, rewind; ``structural``: removal); this class decides *when*, logs, and
    saves what a resumed run needs (masks, last pruned step/epoch, structural shapes, LTH originals).

    The arguments are validated once, by the :class:`~lightning_lowmem.functional.config.PruningConfig` this
    builds (kept as :attr:`config`).

    Raises:
        ValueError / TypeError: bad ``amount``, unknown method or schedule, ``end_step <= start_step``,
            ``n >= m``, unknown ``parameter_names`` (the config's checks); a parameter name no module has (at
            ``setup``).

    Example::

        >>> ScheduledPruning("l1_unstructured", schedule="cubic", target_sparsity=0.8, end_step=100).final_sparsity
        0.8
    """

    PARAMETER_NAMES = DEFAULT_PARAMETER_NAMES
    technique = "pruning"

    @override
    def composition_label(self) -> str:
        return "ScheduledPruning(structural=True)" if self.structural else f"ScheduledPruning({self.method!r})"

    @override
    def composition_tags(self) -> frozenset[str]:
        return frozenset({"pruning"} | ({"structural_pruning"} if self.structural else set()))

    def __init__(
        self,
        pruning_fn: Any = "l1_unstructured",
        parameters_to_prune: Sequence[Any] = (),
        parameter_names: list[str] | None = None,
        use_global_unstructured: bool = True,
        amount: Amount = 0.5,
        apply_pruning: bool | Callable[[int], bool] = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: bool | Callable[[int], bool] = False,
        resample_parameters: bool = False,
        pruning_dim: int | None = None,
        pruning_norm: float | None = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
        *,
        schedule: str | Callable[[int], float] | None = None,
        target_sparsity: float | None = None,
        start_step: int = 0,
        end_step: int | None = None,
        frequency: int = 1,
        initial_sparsity: float = 0.0,
        method: str | None = None,
        n: int = 2,
        m: int = 4,
        structural: bool = False,
        structural_ratio: float | None = None,
        seed: int = 0,
        prune_embeddings: bool = False,
        prune_heads: bool = False,
    ) -> None:
        self.config = config = PruningConfig(  # every check is the config's (#27)
            pruning_fn=pruning_fn,
            parameters_to_prune=parameters_to_prune,
            parameter_names=parameter_names,
            use_global_unstructured=use_global_unstructured,
            amount=amount,
            apply_pruning=apply_pruning,
            make_pruning_permanent=make_pruning_permanent,
            use_lottery_ticket_hypothesis=use_lottery_ticket_hypothesis,
            resample_parameters=resample_parameters,
            pruning_dim=pruning_dim,
            pruning_norm=pruning_norm,
            verbose=verbose,
            prune_on_train_epoch_end=prune_on_train_epoch_end,
            schedule=schedule,
            target_sparsity=target_sparsity,
            start_step=start_step,
            end_step=end_step,
            frequency=frequency,
            initial_sparsity=initial_sparsity,
            method=method,
            n=n,
            m=m,
            structural=structural,
            structural_ratio=structural_ratio,
            seed=seed,
            prune_embeddings=prune_embeddings,
            prune_heads=prune_heads,
        )
        self.method, self._names_given = config.pruning_fn, parameter_names is not None
        self.parameter_names = list(config.parameter_names or self.PARAMETER_NAMES)
        self.step_mode, self.final_sparsity = config.step_mode, config.final_sparsity
        self.sparsity_schedule: PruningSchedule | None = config.sparsity_schedule()
        self.start_step = start_step
        self.parameters_to_prune, self.use_global_unstructured, self.amount = (
            parameters_to_prune,
            use_global_unstructured,
            amount,
        )
        self._apply_pruning, self._make_pruning_permanent = apply_pruning, make_pruning_permanent
        self.use_lottery_ticket_hypothesis, self.resample_parameters = (
            use_lottery_ticket_hypothesis,
            resample_parameters,
        )
        self.pruning_dim, self.pruning_norm = pruning_dim, config.norm
        self.verbose, self.prune_on_train_epoch_end = verbose, prune_on_train_epoch_end
        self.n, self.m, self.structural, self.structural_ratio, self.seed = n, m, structural, structural_ratio, seed
        self.prune_embeddings, self.prune_heads = prune_embeddings, prune_heads
        # state (saved in state_dict)
        self.last_pruned_step = -1
        self.last_pruned_epoch = -1
        self.structural_done = False
        self.structural_shapes: dict[str, list[int]] | None = None
        self._pending_masks: dict[str, torch.Tensor] | None = None
        self._targets: list[Target] = []
        self._module: nn.Module | None = None  # the LightningModule of the current fit (targets are re-found in it)
        self._original: dict[str, torch.Tensor] = {}
        self._example_input: Any = None
        self._load_hook: Any = None  # structural: resizes a fresh model to a pruned checkpoint's shapes

    @property
    def end_step(self) -> int | None:
        """The schedule's last step (``None`` until a step-mode run resolved it)."""
        return self.sparsity_schedule.end_step if self.sparsity_schedule is not None else None

    # --- override points: *what* is done -----------------------------------------------------------------

    def resolve_targets(self, pl_module: nn.Module) -> list[Target]:
        """The ``(fqn, module, parameter name)`` triples to prune in the model as it is *now*.

        Another callback may have swapped modules since the last call (``QuantizationAwareTraining`` replaces
        ``nn.Linear`` by ``FakeQuantizedLinear`` in its ``setup``, keeping the same parameters): targets are
        found again by name, and explicit pairs by their parameter, never by a stale module reference.
        """
        return resolve_targets(
            pl_module,
            self.parameters_to_prune,
            self.parameter_names,
            names_given=self._names_given,
            structural=self.structural,
            embeddings=self.prune_embeddings,
            heads=self.prune_heads,
        )

    def _left_out(self) -> dict[str, bool]:  # what the targets' description calls left out by the defaults
        given = bool(self.parameters_to_prune) or self.structural
        return {"embeddings": self.prune_embeddings or given, "heads": self.prune_heads or given}

    def apply_pruning(
        self, pl_module: nn.Module, amount: float | int, *, relative: bool, generator: torch.Generator
    ) -> PruningReport:
        """Compute and apply the masks of ``self._targets`` for ``amount`` (of the remaining weights when
        ``relative``, else the total sparsity)."""
        use_global = self.use_global_unstructured and isinstance(self.method, str) and self.method != "nm"
        return prune_(
            pl_module,
            amount,
            self.method,
            global_=use_global,
            parameters_to_prune=[(sub, p) for _, sub, p in self._targets],
            n=self.n,
            m=self.m,
            dim=self.pruning_dim,
            norm=self.pruning_norm,
            relative=relative,
            generator=generator,
        )

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Rewind the unpruned weights to their fit-start values (or fresh ones with ``resample_parameters``)."""
        rewind_(self._targets, self._original, self.resample_parameters)

    def remove_structurally(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Physically remove the pruned channels and rebind the optimizer (``structural=True``)."""
        from lightning_lowmem.functional.pruning.structural import call_forward_batch, prune_structural_, pruned_shapes

        ratio = self.structural_ratio if self.structural_ratio is not None else float(self.final_sparsity)
        example = self._example_input if self._example_input is not None else pl_module.example_input_array
        # a module defining forward_batch(batch) is traced through it, on a one-row batch (example_row)
        forward_fn = call_forward_batch if self._example_input is not None and has_forward_batch(pl_module) else None
        remove_pruning_(pl_module)
        report = prune_structural_(pl_module, ratio, example, optimizer=trainer.optimizers, forward_fn=forward_fn)
        self.structural_done, self.structural_shapes = True, pruned_shapes(pl_module)
        self._targets, self._original = [], {}
        rank_zero_info(f"ScheduledPruning: structural pruning kept {report.param_ratio:.1%} of the parameters")

    def make_pruning_permanent(self, pl_module: nn.Module) -> None:
        """Drop the masks (the pruned weights stay zero); called at train end with ``make_pruning_permanent``."""
        remove_pruning_(pl_module)
        self._targets, self._original = [], {}

    # --- when ----------------------------------------------------------------------------------------------

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.structural and self._load_hook is None:  # before Lightning loads a `ckpt_path`'s weights
            self._load_hook = pl_module.register_load_state_dict_pre_hook(self._shrink_before_load)
        if stage != "fit":
            return
        self._module = pl_module
        self._targets = self.resolve_targets(pl_module)  # bad names fail here, before any training
        rank_zero_info(f"ScheduledPruning {describe_targets(pl_module, self._targets, **self._left_out())}")
        if self.sparsity_schedule is not None and self.sparsity_schedule.function is None:
            last = int(trainer.estimated_stepping_batches) if trainer.max_steps != -1 or trainer.max_epochs else 0
            self.sparsity_schedule.resolve_last_step(last)
        if self.structural and trainer.world_size > 1:
            raise ValueError(
                "`structural=True` is not supported with more than one process (DDP holds the old parameters)"
            )

    def _prune(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        amount: float | int,
        relative: bool,
        tag: int,
        on_step: bool,
    ) -> None:
        generator = torch.Generator().manual_seed(self.seed + tag)  # same on every rank
        self._targets = self.resolve_targets(pl_module)
        report = self.apply_pruning(pl_module, amount, relative=relative, generator=generator)
        if trainer.world_size > 1:  # every rank keeps rank 0's masks (random methods, float ties)
            sync_masks_(pl_module, self._targets, lambda mask: trainer.strategy.broadcast(mask, src=0))
        layers = layer_sparsity(pl_module)
        pl_module.log("lowmem/sparsity/total", report.sparsity, on_step=on_step, on_epoch=not on_step)
        for name, value in layers.items():
            pl_module.log(f"lowmem/sparsity/{name}", value, on_step=on_step, on_epoch=not on_step)
        for line in sparsity_lines(report.sparsity, layers, self.method, self.verbose):
            rank_zero_info(line)

    def _after_prune(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int, end_of_schedule: bool) -> None:
        lth = self.use_lottery_ticket_hypothesis
        if lth(epoch) if callable(lth) else lth:
            self.apply_lottery_ticket_hypothesis()
        if self.structural and end_of_schedule:
            self.remove_structurally(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._targets = [] if self.structural_done else self.resolve_targets(pl_module)  # after every setup
        if self._pending_masks is not None:  # resumed: put the saved masks back (shared again by tied owners)
            restore_masks_(pl_module, self._pending_masks)
            self._pending_masks = None
        if self.use_lottery_ticket_hypothesis and not self._original:
            self._original = snapshot(self._targets)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.structural and self._example_input is None:  # one row of the model inputs, to trace the graph
            self._example_input = example_row(batch, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        apply_masks_(pl_module)  # after the optimizer step: pruned weights stay exactly zero
        schedule, step = self.sparsity_schedule, trainer.global_step
        if schedule is None or self.structural_done or step == self.last_pruned_step or step < schedule.start_step:
            return
        if not schedule.is_pruning_step(step):
            return
        self._prune(trainer, pl_module, schedule.sparsity_at(step), relative=False, tag=step, on_step=True)
        self.last_pruned_step = step
        self._after_prune(trainer, pl_module, trainer.current_epoch, end_of_schedule=step >= schedule.end_step)

    def _epoch_prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if self.step_mode or trainer.sanity_checking or epoch == self.last_pruned_epoch or self.structural_done:
            return
        if not (self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning):
            return
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        self._prune(trainer, pl_module, amount, relative=True, tag=epoch, on_step=False)
        self.last_pruned_epoch = epoch
        self._after_prune(trainer, pl_module, epoch, end_of_schedule=True)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.prune_on_train_epoch_end:
            self._epoch_prune(trainer, pl_module)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.prune_on_train_epoch_end and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._epoch_prune(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(pl_module)

    # --- resumable state -----------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._module is not None and self._targets:
            self._targets = self.resolve_targets(self._module)  # modules may have been swapped since
        return {
            "masks": target_masks(self._targets),  # a tied weight's mask is saved once
            "last_pruned_step": self.last_pruned_step,
            "last_pruned_epoch": self.last_pruned_epoch,
            "structural_done": self.structural_done,
            "structural_shapes": self.structural_shapes,
            "original": {k: v.cpu() for k, v in self._original.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_masks = dict(state_dict.get("masks", {})) or None
        self.last_pruned_step = state_dict.get("last_pruned_step", -1)
        self.last_pruned_epoch = state_dict.get("last_pruned_epoch", -1)
        self.structural_done = state_dict.get("structural_done", False)
        self.structural_shapes = state_dict.get("structural_shapes")
        self._original = dict(state_dict.get("original", {}))

    @staticmethod
    def _shrink_before_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Resuming after the structural removal: the fresh model takes the checkpoint's smaller shapes, so its
        weights load (and the optimizer, configured after, holds the pruned parameters)."""
        shrink_to_state_dict_(module, state_dict, prefix)

    @override
    def release(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._example_input = None
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None

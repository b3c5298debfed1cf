"""``ScheduledPruning``: a drop-in for Lightning's ``ModelPruning`` with step schedules, bool masks and resume."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any, Callable, Sequence, Union

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.utils import prune as torch_prune
from typing_extensions import override

from lightning_lowmem.functional.pruning.unstructured import (
    METHODS,
    apply_masks_,
    collect_prunable,
    get_mask,
    layer_sparsity,
    load_masks_,
    prune_,
    remove_pruning_,
)
from lightning_lowmem.schedules import SCHEDULES, build_schedule

__all__ = ["ScheduledPruning"]

_TORCH_FUNCTION_NAMES = ("l1_unstructured", "random_unstructured", "ln_structured", "random_structured")
Amount = Union[int, float, Callable[[int], Union[int, float]]]


def _method_name(pruning_fn: Any) -> Any:
    """Map ``torch.nn.utils.prune.l1_unstructured`` (the function) to its name; keep strings/classes."""
    if isinstance(pruning_fn, str):
        name = pruning_fn.lower()
        if name not in METHODS:
            raise ValueError(f"`pruning_fn`={pruning_fn!r} is unknown; choose one of {list(METHODS)}")
        return name
    if isinstance(pruning_fn, type) and issubclass(pruning_fn, torch_prune.BasePruningMethod):
        return pruning_fn
    if callable(pruning_fn) and getattr(pruning_fn, "__name__", None) in _TORCH_FUNCTION_NAMES:
        return pruning_fn.__name__
    raise TypeError(
        f"`pruning_fn`={pruning_fn!r} must be one of {list(METHODS)}, a torch.nn.utils.prune function of those"
        " names, or a torch.nn.utils.prune.BasePruningMethod subclass"
    )


class ScheduledPruning(Callback):
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
            cut are masked (every Conv/Linear but the last, no attention projection). Default: ``False``.
        structural_ratio: fraction of channels removed per layer; ``None`` = the final sparsity.
            Default: ``None``.
        seed: seed of the random methods' generator (same on every rank). Default: 0.
        prune_embeddings: with no ``parameters_to_prune``, also prune embedding tables and the parameters
            tied to them (GPT-2's ``lm_head``, BERT's MLM decoder), as ``ModelPruning`` does. Off by default
            (Torch-Pruning's and most users' expectation: token tables are lookups, not matmuls, and a tied
            head would be pruned through its embedding). A tied weight is always one target, pruned once,
            its mask shared by the modules that hold it. Default: ``False``.

    Raises:
        ValueError / TypeError: bad ``amount``, unknown method or schedule, ``end_step <= start_step``,
            ``n >= m``, unknown ``parameter_names``; a parameter name no module has (at ``setup``).

    Example::

        >>> ScheduledPruning("l1_unstructured", schedule="cubic", target_sparsity=0.8, end_step=100).final_sparsity
        0.8
    """

    PARAMETER_NAMES = ("weight", "bias")

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
    ) -> None:
        if method is not None:
            if pruning_fn not in ("l1_unstructured", method):
                raise ValueError(f"`method`={method!r} and `pruning_fn`={pruning_fn!r} disagree; pass only one")
            pruning_fn = method
        self.method = _method_name(pruning_fn)
        self.parameter_names = list(parameter_names or self.PARAMETER_NAMES)
        self._names_given = parameter_names is not None
        for name in self.parameter_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"`parameter_names` entries must be parameter names like 'weight', got {name!r}")
        if not callable(amount):
            if isinstance(amount, bool) or not isinstance(amount, (int, float)):
                raise TypeError(f"`amount`={amount!r} must be a float in [0, 1], an int >= 0 or a callable(epoch)")
            if isinstance(amount, int) and amount < 0:
                raise ValueError(
                    f"`amount`={amount} must be >= 0 when an int (a number of weights); allowed: int >= 0 or float in [0, 1]"
                )
            if isinstance(amount, float) and not 0.0 <= amount <= 1.0:
                raise ValueError(f"`amount`={amount} must be in [0, 1] when a float; allowed: int >= 0 or float in [0, 1]")
        if self.method == "nm" and (not isinstance(n, int) or not isinstance(m, int) or not 1 <= n < m):
            raise ValueError(f"`n`={n!r}, `m`={m!r}: N:M pruning needs ints with 1 <= n < m (e.g. n=2, m=4)")
        if verbose not in (0, 1, 2):
            raise ValueError(f"`verbose`={verbose!r} must be 0, 1 or 2")
        if schedule is not None and isinstance(schedule, str) and schedule not in SCHEDULES:
            raise ValueError(
                f"`schedule`={schedule!r} is unknown; choose one of {list(SCHEDULES)} or pass a callable(step)"
            )
        self.step_mode = schedule is not None or target_sparsity is not None
        final = target_sparsity if target_sparsity is not None else amount
        custom_schedule = callable(schedule) and not isinstance(schedule, str)
        valid_final = isinstance(final, float) and 0.0 <= final <= 1.0
        if self.step_mode and not custom_schedule and not valid_final:
            raise ValueError(f"`target_sparsity`={final!r} must be a float in [0, 1] for a step schedule")
        self.final_sparsity = final
        self._schedule_args = dict(
            schedule=schedule or "cubic",
            start_step=start_step,
            end_step=end_step,
            frequency=frequency,
            initial_sparsity=initial_sparsity,
        )
        self.schedule: Callable[[int], float] | None = None
        self.end_step: int | None = end_step
        if self.step_mode and end_step is not None:
            self.schedule = self._build_schedule(end_step)  # validates start/end/frequency now
        elif not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"`start_step`={start_step!r} must be an int >= 0")
        if structural_ratio is not None and not 0.0 <= structural_ratio < 1.0:
            raise ValueError(f"`structural_ratio`={structural_ratio!r} must be in [0, 1)")
        self.parameters_to_prune = parameters_to_prune
        self.use_global_unstructured = use_global_unstructured
        self.amount = amount
        self.apply_pruning = apply_pruning
        self.make_pruning_permanent = make_pruning_permanent
        self.use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self.resample_parameters = resample_parameters
        self.pruning_dim, self.pruning_norm = pruning_dim, pruning_norm if pruning_norm is not None else 1
        self.verbose, self.prune_on_train_epoch_end = verbose, prune_on_train_epoch_end
        self.n, self.m, self.structural, self.structural_ratio, self.seed = n, m, structural, structural_ratio, seed
        self.prune_embeddings = prune_embeddings
        # state (saved in state_dict)
        self.last_pruned_step = -1
        self.last_pruned_epoch = -1
        self.structural_done = False
        self.structural_shapes: dict[str, list[int]] | None = None
        self._pending_masks: dict[str, torch.Tensor] | None = None
        self._targets: list[tuple[str, nn.Module, str]] = []
        self._module: nn.Module | None = None  # the LightningModule of the current fit (targets are re-found in it)
        self._original: dict[str, torch.Tensor] = {}
        self._example_input: Any = None
        self._load_hook: Any = None  # structural: resizes a fresh model to a pruned checkpoint's shapes

    def _build_schedule(self, end_step: int) -> Callable[[int], float]:
        args = self._schedule_args
        self.end_step = end_step
        final = self.final_sparsity if not callable(self.final_sparsity) else 0.0
        return build_schedule(
            args["schedule"], final, args["start_step"], end_step, args["frequency"], args["initial_sparsity"]
        )

    def _is_pruning_step(self, step: int) -> bool:
        start, frequency = self._schedule_args["start_step"], self._schedule_args["frequency"]
        if not start <= step <= self.end_step:
            return False
        return (step - start) % frequency == 0 or step == self.end_step

    def _resolve_targets(self, pl_module: L.LightningModule) -> list[tuple[str, nn.Module, str]]:
        """The targets in the model as it is *now*: called at setup, at fit start, at each pruning event.

        Another callback may have swapped modules since the last call (``QuantizationAwareTraining`` replaces
        ``nn.Linear`` by ``FakeQuantizedLinear`` in its ``setup``, keeping the same parameters): targets are
        found again by name, and explicit pairs by their parameter, never by a stale module reference.
        """
        pairs = []
        for item in self.parameters_to_prune:
            if isinstance(item, str):  # "fqn.param" from YAML
                fqn, _, pname = item.rpartition(".")
                try:
                    pairs.append((pl_module.get_submodule(fqn), pname))
                except AttributeError:
                    names = [n for n, _ in pl_module.named_parameters()]
                    close = difflib.get_close_matches(item, names, n=5, cutoff=0.5) or names[:5]
                    raise ValueError(
                        f"`parameters_to_prune` entry {item!r} names no submodule of {type(pl_module).__name__}; "
                        f"entries are 'module.path.param' strings such as {close}"
                    ) from None
            else:
                pairs.append(tuple(item))
        names = self.parameter_names
        if not pairs and self.structural:  # mask only the channels structural removal can cut
            from lightning_lowmem.functional.pruning.structural import _default_candidates

            pairs = [(layer, "weight") for _, layer in _default_candidates(pl_module)]
        if not pairs:  # ModelPruning prunes only the names each module has; error if a name exists nowhere
            present = {n.rsplit(".", 1)[-1] for n, _ in pl_module.named_parameters()}
            missing = [n for n in names if n not in present]
            if missing and self._names_given:  # the default ["weight", "bias"] fits bias-free models (Llama)
                raise ValueError(
                    f"`parameter_names` contains {missing}, which no module has;"
                    f" parameter names present: {sorted(present)}"
                )
            names = [n for n in names if n in present]
        return collect_prunable(pl_module, names, None, pairs or None, embeddings=self.prune_embeddings)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.structural and self._load_hook is None:  # before Lightning loads a `ckpt_path`'s weights
            self._load_hook = pl_module.register_load_state_dict_pre_hook(self._shrink_before_load)
        if stage != "fit":
            return
        self._module = pl_module
        self._targets = self._resolve_targets(pl_module)  # bad names fail here, before any training
        if self.step_mode and self.schedule is None:
            last = int(trainer.estimated_stepping_batches) if trainer.max_steps != -1 or trainer.max_epochs else 0
            if last <= self._schedule_args["start_step"]:
                raise ValueError(
                    f"`end_step`=None resolves to the run's last step {last}, which is not > `start_step`; set `end_step`"
                )
            self.schedule = self._build_schedule(last)
        if self.structural and trainer.world_size > 1:
            raise ValueError(
                "`structural=True` is not supported with more than one process (DDP holds the old parameters)"
            )

    def _prune(
        self, trainer: L.Trainer, pl_module: L.LightningModule, amount: float | int, relative: bool, tag: int, on_step: bool
    ) -> None:
        generator = torch.Generator().manual_seed(self.seed + tag)  # same on every rank
        self._targets = self._resolve_targets(pl_module)
        use_global = self.use_global_unstructured and isinstance(self.method, str) and self.method != "nm"
        report = prune_(
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
        if trainer.world_size > 1:  # every rank keeps rank 0's masks (random methods, float ties)
            for _, sub, pname in self._targets:
                mask = get_mask(sub, pname)
                mask.copy_(trainer.strategy.broadcast(mask.cpu(), src=0).to(mask.device))
            apply_masks_(pl_module)
        self._log(pl_module, report.sparsity, on_step)

    def _log(self, pl_module: L.LightningModule, total: float, on_step: bool) -> None:
        layers = layer_sparsity(pl_module)
        pl_module.log("lowmem/sparsity/total", total, on_step=on_step, on_epoch=not on_step)
        for name, value in layers.items():
            pl_module.log(f"lowmem/sparsity/{name}", value, on_step=on_step, on_epoch=not on_step)
        if self.verbose:
            rank_zero_info(f"ScheduledPruning: total sparsity {total:.2%} ({self.method})")
        if self.verbose == 2:
            for name, value in layers.items():
                rank_zero_info(f"  {name}: {value:.2%}")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._targets = [] if self.structural_done else self._resolve_targets(pl_module)  # after every setup
        if self._pending_masks is not None:  # resumed: put the saved masks back (shared again by tied owners)
            missing = load_masks_(pl_module, self._pending_masks)
            if missing:
                raise ValueError(
                    f"the checkpoint holds ScheduledPruning masks for {missing[:5]}, which are not parameters of "
                    f"{type(pl_module).__name__}: resume with the model (and callbacks) the checkpoint was written with"
                )
            self._pending_masks = None
        if self.use_lottery_ticket_hypothesis and not self._original:
            self._original = {f"{f}.{p}": getattr(s, p).detach().clone() for f, s, p in self._targets}

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.structural and self._example_input is None:  # one row of the model inputs, to trace the graph
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            if isinstance(x, Mapping):  # Hugging Face dict batch / BatchEncoding: the model is called with keywords
                self._example_input = {k: v[:1].detach().clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
            else:
                self._example_input = x[:1].detach().clone()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        apply_masks_(pl_module)  # after the optimizer step: pruned weights stay exactly zero
        if not self.step_mode or self.structural_done:
            return
        step = trainer.global_step
        if step == self.last_pruned_step or step < self._schedule_args["start_step"]:
            return
        if not self._is_pruning_step(step):
            return
        target = float(self.schedule(step))
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"`schedule`({step}) returned {target!r}; a sparsity must be in [0, 1]")
        self._prune(trainer, pl_module, target, relative=False, tag=step, on_step=True)
        self.last_pruned_step = step
        self._rewind(trainer.current_epoch)
        if self.structural and step >= self.end_step:
            self._remove_structurally(trainer, pl_module)

    def _epoch_prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        if self.step_mode or trainer.sanity_checking or epoch == self.last_pruned_epoch or self.structural_done:
            return
        apply = self.apply_pruning(epoch) if callable(self.apply_pruning) else self.apply_pruning
        if not apply:
            return
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        self._prune(trainer, pl_module, amount, relative=True, tag=epoch, on_step=False)
        self.last_pruned_epoch = epoch
        self._rewind(epoch)
        if self.structural:
            self._remove_structurally(trainer, pl_module)

    @torch.no_grad()
    def _rewind(self, epoch: int) -> None:
        lth = self.use_lottery_ticket_hypothesis
        if not (lth(epoch) if callable(lth) else lth):
            return
        for fqn, sub, pname in self._targets:
            weight = getattr(sub, pname)
            if self.resample_parameters and hasattr(sub, "reset_parameters"):
                fresh = copy.deepcopy(sub)
                fresh.reset_parameters()
                weight.copy_(getattr(fresh, pname))
            else:
                weight.copy_(self._original[f"{fqn}.{pname}"])
            mask = get_mask(sub, pname)
            if mask is not None:
                weight.mul_(mask)

    def _remove_structurally(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_lowmem.functional.pruning.structural import prune_structural_, pruned_shapes

        ratio = self.structural_ratio if self.structural_ratio is not None else float(self.final_sparsity)
        example = self._example_input if self._example_input is not None else pl_module.example_input_array
        remove_pruning_(pl_module)
        report = prune_structural_(pl_module, ratio, example, optimizer=trainer.optimizers)
        self.structural_done, self.structural_shapes = True, pruned_shapes(pl_module)
        self._targets, self._original = [], {}
        rank_zero_info(f"ScheduledPruning: structural pruning kept {report.param_ratio:.1%} of the parameters")

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
        if self.make_pruning_permanent:
            remove_pruning_(pl_module)
            self._targets, self._original = [], {}

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._module is not None and self._targets:
            self._targets = self._resolve_targets(self._module)  # modules may have been swapped since
        masks = {}
        for fqn, sub, pname in self._targets:  # one entry per parameter: a tied weight's mask is saved once
            mask = get_mask(sub, pname)
            if mask is not None:
                masks[f"{fqn}.{pname}" if fqn else pname] = mask.detach().cpu().clone()
        return {
            "masks": masks,
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
        """Resuming after the structural removal: give the fresh (unpruned) model the checkpoint's smaller
        shapes, so its weights load (and the optimizer, configured after, holds the pruned parameters)."""
        from lightning_lowmem.functional.pruning.structural import restore_shapes_

        current = {name: list(t.shape) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        shapes = {key[len(prefix):]: list(value.shape) for key, value in state_dict.items()
                  if key.startswith(prefix) and isinstance(value, torch.Tensor)}  # fmt: skip
        changed = {name: shape for name, shape in shapes.items() if name in current and current[name] != shape}
        shrunk = all(len(shape) == len(current[name]) and all(a <= b for a, b in zip(shape, current[name]))
                     for name, shape in changed.items())  # fmt: skip
        if changed and shrunk:  # anything else is another model: Lightning's size-mismatch error says so
            restore_shapes_(module, changed)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._example_input = None
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None

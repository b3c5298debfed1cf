"""The memory options the low-memory strategies share: turned into one
:class:`~lightning_lowmem.functional.config.TrainingConfig` (validated there, once), planned by
``memory_budget`` into another, and applied with :func:`lightning_lowmem.functional.apply` plus the
strategy's own hooks (``setup_optimizers`` converts the optimizer, ``training_step`` runs compression and
the micro-batch loop). No callback is created, set up or added to the Trainer."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_lowmem.functional.compression import CompressionStats
from lightning_lowmem.functional.config import PRECISIONS, OptimizerConfig, TrainingConfig
from lightning_lowmem.memory.units import describe_bytes, format_bytes, parse_bytes
from lightning_lowmem.warnings import LowMemWarning

PRECISION_PRESETS = PRECISIONS


def validate_precision(precision: str | None) -> None:
    """Raise for an unknown preset (:class:`~lightning_lowmem.functional.config.PrecisionConfig` decides)."""
    if precision is not None:
        from lightning_lowmem.functional.config import PrecisionConfig

        PrecisionConfig(precision)


def precision_plugin(preset: str | None, device_type: str | None = None) -> Any:
    """Lightning's precision plugin for a preset (``None`` -> let the Trainer's ``precision`` decide)."""
    if preset is None:
        return None
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if preset == "32-true":
        return Precision()
    if preset.endswith("-true"):
        return HalfPrecision(preset)  # type: ignore[arg-type]
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return MixedPrecision(preset, device_type)  # type: ignore[arg-type]


def set_expandable_segments(enabled: bool = True) -> bool:
    """Ask the CUDA caching allocator for expandable segments (less fragmentation when batch shapes vary).

    Writes ``expandable_segments:True|False`` into ``PYTORCH_ALLOC_CONF`` when that is set, else into
    ``PYTORCH_CUDA_ALLOC_CONF``, keeping the other settings there. The allocator reads it when CUDA
    initialises, so this must run first; child processes started later inherit it.

    Returns:
        ``True`` if the setting was written, ``False`` (with a :class:`LowMemWarning`) if CUDA was
        already initialised in this process.
    """
    setting = f"expandable_segments:{enabled}"
    if torch.cuda.is_initialized():
        warnings.warn(
            f"`expandable_segments`={enabled}: CUDA is already initialised in this process, so the allocator "
            f"setting cannot change any more. Set PYTORCH_CUDA_ALLOC_CONF={setting} before the first CUDA "
            "call (or create the strategy before touching CUDA).",
            LowMemWarning,
            stacklevel=3,
        )
        return False
    variable = "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in os.environ else "PYTORCH_CUDA_ALLOC_CONF"
    entries = [e.strip() for e in os.environ.get(variable, "").split(",") if e.strip()]
    entries = [e for e in entries if not e.startswith("expandable_segments")] + [setting]
    os.environ[variable] = ",".join(entries)
    return True


class LowMemoryOptions:
    """The options both strategies share, as one :class:`TrainingConfig` (``self.config``).

    A mixin placed before a Lightning strategy class: its hook overrides run the options, then
    ``super()`` (the Lightning strategy).
    """

    @override
    def setup_environment(self) -> None:
        self._setup_environment_options()
        super().setup_environment()  # type: ignore[misc]

    @override
    def setup(self, trainer: Any) -> None:
        self._setup_options(trainer)
        super().setup(trainer)  # type: ignore[misc]

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # type: ignore[misc]
        self._convert_optimizers(trainer)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self._wrap_dataloader(super().process_dataloader(dataloader))  # type: ignore[misc]

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        module = self.lightning_module  # type: ignore[attr-defined]
        if not self._loader_checked and module is not None and module.trainer.training:
            self._check_loader_memory(batch)
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._microbatch is not None:
            trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
            self._microbatch.begin_batch(batch_idx, trainer.accumulate_grad_batches)
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._compression_context():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def on_train_start(self) -> None:
        if self._transaction is not None:
            self._transaction.commit()  # training starts: the setup's changes stay
        super().on_train_start()  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._transaction is not None and self._transaction.open:
            self._transaction.rollback()  # failed before training: every change of this fit undone, last first
        super().on_exception(exception)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        self._release_options()
        super().teardown()  # type: ignore[misc]

    def _init_options(
        self,
        *,
        precision: str | None,
        optimizer: str | OptimizerConfig | None,
        optimizer_kwargs: dict[str, Any] | None,
        activation_checkpointing: str | int | list[str] | None,
        nested_checkpointing: bool,
        activation_compression: str | None,
        compression_min_bytes: int,
        memory_budget: int | str | None,
        zero_optimizer: bool,
        expandable_segments: bool | None,
        prefetch: bool,
    ) -> None:
        if optimizer is not None and optimizer_kwargs is not None:
            warnings.warn(
                f"`optimizer_kwargs`={optimizer_kwargs!r} is deprecated: give the optimizer and its arguments as one "
                f"OptimizerConfig, e.g. optimizer=OptimizerConfig({getattr(optimizer, 'name', optimizer)!r}, lr=1e-3) "
                "(YAML: optimizer: {name: adamw8bit, hyperparameters: {lr: 0.001}})",
                DeprecationWarning,
                stacklevel=3,
            )
        # the settings a planned checkpointing / compression gets (validated even when those are off)
        self._technique_settings = TrainingConfig(
            precision=None,
            optimizer=None,
            activation_checkpointing="auto",
            nested_checkpointing=nested_checkpointing,
            activation_compression="int8",
            compression_min_bytes=compression_min_bytes,
        )
        self.config = TrainingConfig(
            precision=precision,  # None: the Trainer's
            activation_checkpointing=activation_checkpointing,
            nested_checkpointing=nested_checkpointing if activation_checkpointing is not None else None,
            activation_compression=activation_compression,
            compression_min_bytes=compression_min_bytes if activation_compression is not None else None,
            optimizer=optimizer,  # None: configure_optimizers' own
            optimizer_kwargs=optimizer_kwargs if optimizer is not None else None,
        )
        """What the strategy applies: the options set explicitly (``None`` fields: not set), then the plan."""
        self.explicit = self.config  # the options as given: what `memory_budget` keeps fixed
        if zero_optimizer is True and self.config.optimizer is not None and self.config.optimizer.in_backward:
            raise ValueError(
                f"`optimizer`={self.config.optimizer.name!r} steps inside backward and cannot be sharded: use "
                "zero_optimizer=False or an optimizer that steps after backward (e.g. 'adamw', 'adamw8bit')."
            )
        for name, value in (("zero_optimizer", zero_optimizer), ("prefetch", prefetch)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False, got {type(value).__name__}: {value!r}")
        if expandable_segments is not None and not isinstance(expandable_segments, bool):
            raise TypeError(f"`expandable_segments` must be True, False or None, got {expandable_segments!r}")
        self.memory_budget = memory_budget
        self.memory_budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, name="memory_budget")
        if isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool) and memory_budget < 4096:
            raise ValueError(  # `memory_budget: 24` in a YAML is an int: bytes, never what was meant
                f"`memory_budget`={memory_budget!r} is {memory_budget} bytes: did you mean '{memory_budget}GiB'? Give a "
                "size with its unit ('24GiB', '512MB') or a byte count (e.g. 24 * 2**30)."
            )
        # with optimizer=None: arguments replacing the configured optimizer's, for the planner (a named optimizer's are
        # in config.optimizer); no OptimizerConfig can say "configure_optimizers' optimizer with lr=0.1"
        self._optimizer_kwargs = dict(optimizer_kwargs or {}) if optimizer is None else {}
        self.compression_stats = CompressionStats()  # cumulative over the run
        self.zero_optimizer = zero_optimizer
        self.expandable_segments = expandable_segments
        self.prefetch = prefetch
        self.plan: Any = None  # the memory plan chosen for `memory_budget` (a planning.plan.Plan)
        self.applied: Any = None  # the functional.Applied handle of the model-side techniques
        self._microbatch: Any = None  # functional.microbatch.MicrobatchLoop for a plan with micro-batches
        self._converted: list[Any] = []  # optimizers built from `config.optimizer`
        self._guarded = False
        self._loader_checked = False
        self._transaction: Any = None  # this fit's setup (lightning_lowmem.transaction), until training starts

    # ------------------------------------------------------------------ the config, in the flat vocabulary
    @property
    def precision_preset(self) -> str | None:
        return self.config.precision_preset

    @property
    def optimizer_name(self) -> str | None:
        return self.config.optimizer_name

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        return self.config.optimizer.kwargs if self.config.optimizer is not None else dict(self._optimizer_kwargs)

    @property
    def activation_checkpointing(self) -> Any:
        return self.config.activation_checkpointing

    @property
    def activation_compression(self) -> str | None:
        return self.config.activation_compression

    @property
    def checkpointed(self) -> list[str]:
        """Names of the submodules wrapped with activation checkpointing."""
        return list(self.applied.checkpointed) if self.applied is not None else []

    # ------------------------------------------------------------------ setup / teardown
    def _setup_environment_options(self) -> None:
        """Before the accelerator touches the device: allocator settings must precede CUDA init."""
        if self.expandable_segments is not None:
            set_expandable_segments(self.expandable_segments)

    def _setup_options(self, trainer: Any) -> None:
        """Before the model moves / is wrapped: plan, then apply the config (precision plugin, model side,
        micro-batches); the optimizer is converted in ``setup_optimizers``."""
        from lightning_lowmem.composition import check_composition
        from lightning_lowmem.functional.applied import apply

        module = self.lightning_module  # type: ignore[attr-defined]
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # every pair of switches composes (callbacks' setup checked too), or none is applied
            check_composition(trainer)
        device_type = self.root_device.type  # type: ignore[attr-defined]
        if fitting and self.memory_budget is not None and self.plan is None:
            self._plan(trainer, module, device_type)
        if self.precision_preset is not None and self.precision_preset.endswith("-mixed"):
            self.precision_plugin = precision_plugin(self.precision_preset, device_type)  # autocast on this device
        if fitting:  # a failure before training undoes this with the callbacks' changes, last first
            from lightning_lowmem.transaction import join

            self._transaction = join(trainer)
            self._transaction.on_undo(self._release_options)
        if self.applied is None:
            # compression (its KV-cache hold) only while fitting; checkpointing for every stage, as before
            model_side = self.config if fitting else self.config.replace(compression=None)
            self.applied = apply(module, model_side.replace(optimizer=None, microbatch=None))
        if fitting and self.config.microbatch is not None and self._microbatch is None:
            from lightning_lowmem.functional.microbatch import MicrobatchLoop

            self._microbatch = MicrobatchLoop(
                self.config.microbatch.size, info=rank_zero_info, owner=type(self).__name__
            )
            self._microbatch.wrap(module)
            rank_zero_info(f"{type(self).__name__}: micro-batches of {self.config.microbatch.size} samples")
        if fitting and self.config.optimizer is not None:
            from lightning_lowmem.checkpoints import guard_module_loading

            guard_module_loading(trainer, module)  # check what wrote a checkpoint before Lightning loads it
            self._guarded = True
        elif fitting and self.precision_preset == "bf16-true":
            rank_zero_info(
                "LowMemoryStrategy: precision='bf16-true' keeps the optimizer configure_optimizers returns; "
                "optimizer='adamw_bf16_sr' (stochastic rounding) keeps small updates that bf16 weights would lose."
            )
        if self.prefetch and device_type != "cuda":
            rank_zero_info(
                f"LowMemoryStrategy: prefetch=True is a no-op on {device_type} (it overlaps host-to-GPU copies)."
            )

    def _convert_optimizers(self, trainer: Any) -> None:
        """Replace the optimizers ``configure_optimizers`` returned by ``config.optimizer`` (same param groups,
        ``lr`` / ``weight_decay`` kept unless set), re-binding their LR schedulers."""
        if self.config.optimizer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        from lightning_lowmem.functional.optimizers.convert import convert_optimizers

        schedulers = [config.scheduler for config in self.lr_scheduler_configs]  # type: ignore[attr-defined]
        converted = convert_optimizers(
            {"optimizers": list(self.optimizers), "schedulers": schedulers},  # type: ignore[attr-defined]
            self.config.optimizer,
            info=lambda message: rank_zero_info(f"{type(self).__name__}: {message}"),
        )
        self.optimizers = converted.configured["optimizers"]
        self._converted = converted.replaced
        if self._microbatch is not None:
            self._microbatch.check_optimizers(self.optimizers)

    def _plan(self, trainer: Any, module: Any, device_type: str) -> None:
        import time

        from lightning_lowmem.strategies.budget import applied_plan, plan_for_budget

        batch = self._first_training_batch(trainer)
        if batch is None:
            rank_zero_info("LowMemoryStrategy: no training batches, so `memory_budget` is not planned.")
            return
        configured = self.precision_plugin.precision  # type: ignore[attr-defined]
        rank_zero_info(
            f"LowMemoryStrategy: planning memory_budget={describe_bytes(self.memory_budget)} on the first "  # type: ignore[arg-type]
            "training batch..."
        )

        def progress(candidate: Any, index: int, total: int) -> None:
            peak = candidate.predicted_peak_bytes
            outcome = (
                candidate.error
                if peak is None
                else (
                    f"{'>= ' if candidate.method == 'lower bound' else ''}{format_bytes(peak)}, "
                    f"{'fits' if candidate.fits else 'over'}"
                )
            )
            rank_zero_info(f"LowMemoryStrategy: [{index}/{total}] {candidate.config.describe()}: {outcome}")

        started = time.perf_counter()
        plan = plan_for_budget(
            module,
            batch,
            self.memory_budget,  # type: ignore[arg-type]
            device="cuda" if device_type == "cuda" else "cpu",
            precision=configured,
            config=self.explicit,
            settings=self._technique_settings,
            optimizer_kwargs=self._optimizer_kwargs,
            progress=progress,
            accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
        )
        self.config = applied_plan(
            plan, self.explicit, configured, self._optimizer_kwargs
        )  # what is planned is what runs
        if self.config.precision is not None and self.config.precision_preset != configured:
            self.precision_plugin = precision_plugin(self.config.precision_preset, device_type)
        self.plan = plan
        baseline = plan.baseline.predicted_peak_bytes if plan.baseline is not None else None
        rank_zero_info(
            f"LowMemoryStrategy: memory_budget={format_bytes(plan.budget_bytes)} -> [{plan.config.describe()}], "
            f"predicted peak {format_bytes(plan.predicted_peak_bytes)}"
            + (f" (as configured: {format_bytes(baseline)})" if baseline is not None else "")
            + (f", optimizer arguments {plan.optimizer_kwargs}" if plan.optimizer_kwargs else "")
            + f"; planned in {time.perf_counter() - started:.1f} s"
            + "".join(f" {note}" for note in plan.notes if note.startswith("configure_optimizers"))
        )

    @staticmethod
    def _first_training_batch(trainer: Any) -> Any:
        trainer.fit_loop.setup_data()  # the fit loop's own dataloader (samplers included); reused by fit
        loader = trainer.train_dataloader
        if loader is None:
            return None
        if isinstance(loader, (list, tuple, dict)):
            raise ValueError(
                f"`memory_budget` plans for one train dataloader; got a {type(loader).__name__} of {len(loader)}. "
                "Plan each configuration with `lowmem estimate --budget` instead."
            )
        return next(iter(loader), None)

    def _release_options(self) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        if self.applied is not None:
            self.applied.undo()  # checkpointing unwrapped, the KV cache restored
            self.applied = None
        if self._microbatch is not None:
            self._microbatch.unwrap()  # restores training_step / optimizer_zero_grad
            self._microbatch = None
        if self._guarded and module is not None:
            from lightning_lowmem.checkpoints import unguard_module_loading

            unguard_module_loading(module)
            self._guarded = False
        for optimizer in self._converted:
            if hasattr(optimizer, "remove_hooks"):  # an optimizer-in-backward's gradient hooks
                optimizer.remove_hooks()
        self._converted = []

    # ------------------------------------------------------------------ per step
    def _compression_context(self) -> Any:
        if self.applied is None or self.config.compression is None:
            return contextlib.nullcontext()
        return self.applied.step_context(self.compression_stats)

    def _check_loader_memory(self, batch: Any) -> None:
        """On the first training batch: warn when the DataLoader's queue holds a lot of memory."""
        self._loader_checked = True
        from lightning_lowmem.strategies.prefetch import DATALOADER_WARN_BYTES, batch_bytes, prefetched_bytes

        loader = self.lightning_module.trainer.train_dataloader  # type: ignore[attr-defined]
        one_batch = batch_bytes(batch)
        held = prefetched_bytes(loader, one_batch)
        limit, reason = DATALOADER_WARN_BYTES, "the DataLoader threshold"
        if self.memory_budget_bytes is not None and self.memory_budget_bytes // 10 < limit:
            limit, reason = self.memory_budget_bytes // 10, "10% of memory_budget"
        if held > limit:
            warnings.warn(
                f"The train DataLoader keeps about {format_bytes(held)} of batches in flight (prefetch_factor="
                f"{getattr(loader, 'prefetch_factor', None)} x num_workers={getattr(loader, 'num_workers', 0)} x "
                f"{format_bytes(one_batch)} per batch), above {format_bytes(limit)} ({reason}). "
                "Lower prefetch_factor or num_workers, or the batch size.",
                LowMemWarning,
                stacklevel=2,
            )

    def _wrap_dataloader(self, dataloader: Any) -> Any:
        if not self.prefetch or self.root_device.type != "cuda":  # type: ignore[attr-defined]
            return dataloader
        module = self.lightning_module  # type: ignore[attr-defined]
        hooks = ("transfer_batch_to_device", "on_before_batch_transfer")
        if module is not None and any(is_overridden(hook, module) for hook in hooks):
            rank_zero_info(f"LowMemoryStrategy: prefetch=True skipped: the LightningModule overrides one of {hooks}.")
            return dataloader
        from lightning_lowmem.strategies.prefetch import CUDAPrefetchLoader

        return CUDAPrefetchLoader(dataloader, self.root_device)  # type: ignore[attr-defined]

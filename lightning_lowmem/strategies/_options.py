"""The memory options ``LowMemoryStrategy`` and ``LowMemoryDDPStrategy`` share: validated once, applied
through the package's functional transforms and callbacks (no second implementation here)."""

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

from lightning_lowmem.functional.compression import COMPRESSION_MODES, DEFAULT_MIN_BYTES, CompressionStats
from lightning_lowmem.memory.units import format_bytes, parse_bytes
from lightning_lowmem.warnings import LowMemWarning

PRECISION_PRESETS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def validate_precision(precision: str | None) -> None:
    if precision is not None and precision not in PRECISION_PRESETS:
        raise ValueError(f"`precision`={precision!r} is not a known preset; choose one of {list(PRECISION_PRESETS)}")


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


class _LowMemoryOptions:
    """Validation and application of the options both strategies share.

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
    def process_dataloader(self, dataloader: Any) -> Any:
        return self._wrap_dataloader(super().process_dataloader(dataloader))  # type: ignore[misc]

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        module = self.lightning_module  # type: ignore[attr-defined]
        if not self._loader_checked and module is not None and module.trainer.training:
            self._check_loader_memory(batch)
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._compression_context():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        self._release_options()
        super().teardown()  # type: ignore[misc]

    def _init_options(
        self,
        *,
        precision: str | None,
        optimizer: str | None,
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
        validate_precision(precision)
        if activation_compression is not None and activation_compression not in COMPRESSION_MODES:
            raise ValueError(
                f"`activation_compression`={activation_compression!r} is unknown; choose None, 'bf16', 'int8' or 'cpu'"
            )
        if isinstance(compression_min_bytes, bool) or not isinstance(compression_min_bytes, int) or compression_min_bytes < 0:
            raise ValueError(f"`compression_min_bytes` must be an int >= 0 (bytes), got {compression_min_bytes!r}")
        if activation_checkpointing is not None:
            from lightning_lowmem.functional.checkpointing import _validate_policy

            _validate_policy(activation_checkpointing)
        if optimizer is not None:  # validates the name; kept for the swap in setup
            from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer

            MemoryEfficientOptimizer(optimizer, **(optimizer_kwargs or {}))
            if zero_optimizer and optimizer.lower().endswith("_in_backward"):
                raise ValueError(
                    f"`optimizer`={optimizer!r} steps inside backward and cannot be sharded: use zero_optimizer=False "
                    "or an optimizer that steps after backward (e.g. 'adamw', 'adamw8bit')."
                )
        for name, value in (
            ("zero_optimizer", zero_optimizer), ("prefetch", prefetch), ("nested_checkpointing", nested_checkpointing)
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False, got {type(value).__name__}: {value!r}")
        if expandable_segments is not None and not isinstance(expandable_segments, bool):
            raise TypeError(f"`expandable_segments` must be True, False or None, got {expandable_segments!r}")
        self.memory_budget = memory_budget
        self.memory_budget_bytes = None if memory_budget is None else parse_bytes(memory_budget, name="memory_budget")
        self.precision_preset = precision
        self.optimizer_name = optimizer.lower() if optimizer is not None else None
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.activation_checkpointing = activation_checkpointing
        self.nested_checkpointing = nested_checkpointing
        self.activation_compression = activation_compression
        self.compression_min_bytes = compression_min_bytes
        self.compression_stats = CompressionStats()  # cumulative over the run
        self.zero_optimizer = zero_optimizer
        self.expandable_segments = expandable_segments
        self.prefetch = prefetch
        self.plan: Any = None  # the memory plan chosen for `memory_budget` (a memory.plan.Plan)
        self.checkpointed: list[str] = []
        self._explicit = {
            key: value
            for key, value in (
                ("precision", precision),
                ("optimizer", self.optimizer_name),
                ("activation_checkpointing", activation_checkpointing),
                ("activation_compression", activation_compression),
            )
            if value is not None
        }
        self._optimizer_swap: Any = None
        self._microbatch: Any = None  # AutoMicrobatch run for a plan with micro-batches
        self._microbatch_owner: list[Any] = []  # the trainer's callback list it was added to
        self._loader_checked = False
        self._kv_cache_held = False

    # ------------------------------------------------------------------ setup / teardown
    def _setup_environment_options(self) -> None:
        """Before the accelerator touches the device: allocator settings must precede CUDA init."""
        if self.expandable_segments is not None:
            set_expandable_segments(self.expandable_segments)

    def _setup_options(self, trainer: Any) -> None:
        """Before the model moves / is wrapped: plan, then apply precision, checkpointing, optimizer."""
        module = self.lightning_module  # type: ignore[attr-defined]
        fitting = trainer.state.fn == TrainerFn.FITTING
        device_type = self.root_device.type  # type: ignore[attr-defined]
        if fitting and self.memory_budget is not None and self.plan is None:
            self._plan(trainer, module, device_type)
        if self.precision_preset is not None and self.precision_preset.endswith("-mixed"):
            self.precision_plugin = precision_plugin(self.precision_preset, device_type)  # autocast on this device
        if self.activation_checkpointing is not None and not self.checkpointed:
            from lightning_lowmem.functional.checkpointing import checkpoint_

            self.checkpointed = checkpoint_(
                module, self.activation_checkpointing, nested=self.nested_checkpointing
            ).wrapped
        if fitting and self.activation_compression is not None and not self._kv_cache_held:
            from lightning_lowmem.model_io import disable_kv_cache_

            disable_kv_cache_(module, "activation compression")  # a training-time KV cache keeps keys/values whole
            self._kv_cache_held = True
        if fitting and self.optimizer_name is not None and self._optimizer_swap is None:
            from lightning_lowmem.callbacks.memory_efficient_optimizer import MemoryEfficientOptimizer

            self._optimizer_swap = MemoryEfficientOptimizer(self.optimizer_name, **self.optimizer_kwargs)
            self._optimizer_swap.setup(trainer, module, "fit")  # wraps configure_optimizers
        elif fitting and self.precision_preset == "bf16-true" and self.optimizer_name is None:
            rank_zero_info(
                "LowMemoryStrategy: precision='bf16-true' keeps the optimizer configure_optimizers returns; "
                "optimizer='adamw_bf16_sr' (stochastic rounding) keeps small updates that bf16 weights would lose."
            )
        if self.prefetch and device_type != "cuda":
            rank_zero_info(f"LowMemoryStrategy: prefetch=True is a no-op on {device_type} (it overlaps host-to-GPU copies).")

    def _plan(self, trainer: Any, module: Any, device_type: str) -> None:
        import time

        from lightning_lowmem.strategies.budget import plan_for_budget

        batch = self._first_training_batch(trainer)
        if batch is None:
            rank_zero_info("LowMemoryStrategy: no training batches, so `memory_budget` is not planned.")
            return
        configured = self.precision_plugin.precision  # type: ignore[attr-defined]
        rank_zero_info(
            f"LowMemoryStrategy: planning memory_budget={format_bytes(self.memory_budget_bytes or 0)} on the first "
            "training batch..."
        )

        def progress(candidate: Any, index: int, total: int) -> None:
            peak = candidate.predicted_peak_bytes
            outcome = candidate.error if peak is None else (
                f"{'>= ' if candidate.method == 'lower bound' else ''}{format_bytes(peak)}, "
                f"{'fits' if candidate.fits else 'over'}"
            )  # fmt: skip
            rank_zero_info(f"LowMemoryStrategy: [{index}/{total}] {candidate.config.describe()}: {outcome}")

        started = time.perf_counter()
        plan = plan_for_budget(
            module,
            batch,
            self.memory_budget,  # type: ignore[arg-type]
            device="cuda" if device_type == "cuda" else "cpu",
            precision=configured,
            optimizer=self.optimizer_name,  # None: configure_optimizers' own
            fixed=self._explicit,
            optimizer_kwargs=self.optimizer_kwargs,
            progress=progress,
        )
        config = plan.config
        baseline_optimizer = plan.baseline.config.optimizer if plan.baseline is not None else config.optimizer
        if config.precision != configured:
            self.precision_preset = config.precision
            self.precision_plugin = precision_plugin(config.precision, device_type)
        self.activation_checkpointing = config.activation_checkpointing
        self.activation_compression = config.activation_compression
        if config.optimizer != baseline_optimizer:
            self.optimizer_name = config.optimizer
            self.optimizer_kwargs = {**plan.optimizer_kwargs, **self.optimizer_kwargs}  # a new family's lr
        if config.micro_batch_size is not None:  # whole batches cannot fit: run them in micro-batches
            from lightning_lowmem.callbacks.auto_microbatch import AutoMicrobatch

            self._microbatch = AutoMicrobatch(micro_batch_size=config.micro_batch_size)
            self._microbatch.setup(trainer, module, "fit")  # Lightning's setup hooks ran already
            trainer.callbacks.append(self._microbatch)  # its batch hooks and on_fit_start run from here on
            self._microbatch_owner = trainer.callbacks
        self.plan = plan
        baseline = plan.baseline.predicted_peak_bytes if plan.baseline is not None else None
        rank_zero_info(
            f"LowMemoryStrategy: memory_budget={format_bytes(plan.budget_bytes)} -> [{config.describe()}], predicted "
            f"peak {format_bytes(plan.predicted_peak_bytes)}"
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
        if self.checkpointed and module is not None:
            from lightning_lowmem.functional.checkpointing import uncheckpoint_

            uncheckpoint_(module, self.checkpointed)
        self.checkpointed = []
        if self._kv_cache_held and module is not None:
            from lightning_lowmem.model_io import restore_kv_cache_

            restore_kv_cache_(module, "activation compression")
        self._kv_cache_held = False
        if self._optimizer_swap is not None:
            self._optimizer_swap.teardown(None, module, "fit")  # restores configure_optimizers
            self._optimizer_swap = None
        if self._microbatch is not None:
            self._microbatch.teardown(None, module, "fit")  # restores training_step (idempotent)
            if self._microbatch in self._microbatch_owner:
                self._microbatch_owner.remove(self._microbatch)
            self._microbatch = None

    # ------------------------------------------------------------------ per step
    def _compression_context(self) -> Any:
        if self.activation_compression is None:
            return contextlib.nullcontext()
        from lightning_lowmem.functional.compression import compress_activations

        return compress_activations(self.activation_compression, self.compression_min_bytes, self.compression_stats)

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

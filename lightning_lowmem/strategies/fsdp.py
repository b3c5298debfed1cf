"""`LowMemoryFSDPStrategy`: fully sharded data parallel (FSDP2) with the package's memory settings.

Registered as ``"lowmem_fsdp"``. Built on Lightning's ``ModelParallelStrategy`` (FSDP2 on DTensor):
launch, device mesh, checkpoint saving and loading are Lightning's; what this class adds is the
sharding itself (no ``configure_model`` needed) and the options of ``LowMemoryDDPStrategy``:

* the LightningModule's blocks are made FSDP units by ``wrap_policy`` (the ``ActivationCheckpointing``
  vocabulary; ``"auto"`` = the repeated blocks of its ``nn.ModuleList`` s / ``nn.Sequential`` s), then the module itself is
  the root unit, so a block's parameters are all-gathered only while it computes;
* ``precision`` chooses FSDP's ``MixedPrecisionPolicy``: ``"bf16-mixed"`` all-gathers and computes in
  bf16 and reduces gradients in fp32 (the fp32 shards stay the master weights);
* ``cpu_offload=True`` keeps shards, gradients and optimizer state on the CPU (``CPUOffloadPolicy``);
* checkpoints hold the consolidated full state dict by default (one file, loads on one process with
  any strategy); ``save_distributed_checkpoint=True`` writes per-rank shards
  (``torch.distributed.checkpoint``). Either resumes on a different number of processes.

Composes with ``ActivationCheckpointing`` (nested too), ``ActivationCompression``, ``LowRankAdapters``
(a frozen base is sharded like any weight; a quantized QLoRA base is an error), the optimizers in
:data:`~lightning_lowmem.functional.fsdp.DTENSOR_OPTIMIZERS` (8-bit AdamW and the in-backward variants
included), ``MemoryMonitor`` and ``memory_budget``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem._compat.lightning_internals import (
    lightning_model_parallel_setup_steps,
    lightning_multiprocessing_launcher,
)
from lightning_lowmem._compat.torchao_optim import requantize_low_bit_state
from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.functional.config.constants import COMPRESSION_MIN_BYTES
from lightning_lowmem.strategies._options import LowMemoryOptions, precision_plugin, validate_precision

__all__ = ["LowMemoryFSDPStrategy"]

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class LowMemoryFSDPStrategy(LowMemoryOptions, ModelParallelStrategy):
    """FSDP2 (fully sharded parameters, gradients and optimizer state) with memory settings.

    Each process holds ``1 / world_size`` of every parameter, gradient and optimizer state; a unit's
    full parameters exist only while it runs (plus the next one, prefetched in backward). Activations
    are not sharded. Arguments as :class:`~lightning_lowmem.strategies.low_memory.LowMemoryDDPStrategy`
    (``precision``, ``activation_checkpointing``, ``nested_checkpointing``, ``activation_compression``,
    ``memory_budget``, ``optimizer``, ``optimizer_kwargs``, ``compression_min_bytes``,
    ``expandable_segments``, ``prefetch``), plus:

    Args:
        wrap_policy: which submodules become FSDP units, as ``ActivationCheckpointing``'s policy: ``"auto"``,
            a class name (``"GPT2Block"``), a module-name pattern (``"model.h.*"``), an every-k int, or a
            list. The LightningModule is always the root unit. Default: ``"auto"``.
        reshard_after_forward: free a unit's gathered parameters after its forward and all-gather them
            again for backward (``False``: keep them, more memory, fewer all-gathers). Default: ``True``.
        cpu_offload: ``CPUOffloadPolicy``: shards, gradients and optimizer state on the CPU. Default: ``False``.
        save_distributed_checkpoint: ``False`` saves one consolidated file (full state dict gathered on
            rank 0); ``True`` a folder of per-rank shards (``torch.distributed.checkpoint``). Default: ``False``.
        start_method: ``"popen"`` (Lightning re-runs the command per process; torchrun and SLURM start
            them themselves) or ``"spawn"`` / ``"fork"`` / ``"forkserver"`` (start from this process: notebooks,
            tests; ``strategy="lowmem_fsdp_spawn"``). Default: ``"popen"``.
        process_group_backend, timeout: as Lightning's ``ModelParallelStrategy``.

    Raises:
        ValueError: as ``LowMemoryDDPStrategy``; ``precision="16-mixed"``; an optimizer name that cannot
            step on DTensor parameters; ``zero_optimizer`` (FSDP shards optimizer state already). At
            ``fit``: a ``wrap_policy`` matching no submodule (lists the module's classes), a quantized
            (QLoRA) base, a configured optimizer class that fails on DTensors.

    Example::

        >>> strategy = LowMemoryFSDPStrategy(precision="bf16-mixed", optimizer="adamw8bit")
        >>> strategy.mixed_precision
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True)
    """

    strategy_name = "lowmem_fsdp"
    #: its parameters are DTensor shards (what lightning_lowmem.composition refuses some techniques for)
    shards_parameters = True

    def __init__(
        self,
        precision: str | None = None,
        wrap_policy: Any = "auto",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = False,
        activation_checkpointing: str | int | list[str] | None = None,
        nested_checkpointing: bool = False,
        activation_compression: str | None = None,
        memory_budget: int | str | None = None,
        optimizer: str | OptimizerConfig | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        compression_min_bytes: int = COMPRESSION_MIN_BYTES,
        expandable_segments: bool | None = None,
        prefetch: bool = False,
        zero_optimizer: bool = False,
        start_method: str = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        from lightning_lowmem.functional.checkpointing import validate_policy
        from lightning_lowmem.functional.fsdp import check_dtensor_optimizer, mixed_precision_policy

        validate_precision(precision)
        self.mixed_precision = mixed_precision_policy(precision)  # raises for 16-mixed
        validate_policy(wrap_policy)
        for name, value in (
            ("reshard_after_forward", reshard_after_forward),
            ("cpu_offload", cpu_offload),
            ("save_distributed_checkpoint", save_distributed_checkpoint),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be True or False, got {type(value).__name__}: {value!r}")
        if zero_optimizer:
            raise ValueError(
                "`zero_optimizer`=True is for strategy='lowmem_ddp' (ZeRO-1); FSDP already shards optimizer "
                "state, gradients and parameters: drop zero_optimizer."
            )
        if optimizer is not None:
            check_dtensor_optimizer(optimizer)
        if start_method not in _START_METHODS:
            raise ValueError(f"`start_method`={start_method!r} is unknown; choose one of {list(_START_METHODS)}")
        self.start_method = start_method
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # bf16-mixed is FSDP's MixedPrecisionPolicy (cast at all-gather), not autocast: keep fp32 plugin
        plugin_preset = "32-true" if precision == "bf16-mixed" else precision
        plugin = precision_plugin(plugin_preset)
        if plugin is not None:
            self.precision_plugin = plugin
        self._init_options(
            precision=precision,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            activation_checkpointing=activation_checkpointing,
            nested_checkpointing=nested_checkpointing,
            activation_compression=activation_compression,
            compression_min_bytes=compression_min_bytes,
            memory_budget=memory_budget,
            zero_optimizer=False,
            expandable_segments=expandable_segments,
            prefetch=prefetch,
        )
        self.wrap_policy = wrap_policy
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.shard_report: Any = None  # a functional.fsdp.ShardReport once the model is sharded

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # FSDP over every process, no TP
        self._tensor_parallel_size = 1
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, with the sharding done here instead of requiring `configure_model`
        from torch.distributed.fsdp import FSDPModule

        if self.cpu_offload and self.root_device.type == "cpu":
            raise ValueError(
                "`cpu_offload`=True keeps FSDP's shards in CPU memory between uses on a GPU (CPUOffloadPolicy), but "
                "this run is on the CPU (accelerator='cpu'), where they live already: drop cpu_offload, or train "
                "on GPUs (accelerator='gpu')."
            )
        self._setup_options(trainer)  # plan, checkpointing, optimizer swap (before the shards exist)
        if self.precision_preset == "bf16-mixed":  # the planner / _setup_options may reset the plugin
            self.precision_plugin = precision_plugin("32-true")
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)  # "-true" presets: half before sharding
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            self._shard(self.model)
        else:
            rank_zero_info("LowMemoryFSDPStrategy: the model is already sharded (configure_model): not sharding again.")
        materialize, optimizers_to_device = lightning_model_parallel_setup_steps()
        materialize(self.model, self.root_device)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, module: Any) -> None:
        from lightning_lowmem.functional.fsdp import fully_shard_
        from lightning_lowmem.planning.sharding import count_fsdp_resizes

        count_fsdp_resizes()  # the memory core (MemoryMonitor) then sees FSDP free gathered parameters
        if self.mixed_precision is not None and self.precision_preset != "bf16-mixed":
            from lightning_lowmem.functional.fsdp import mixed_precision_policy

            self.mixed_precision = mixed_precision_policy(self.precision_preset)
        self.shard_report = fully_shard_(
            module,
            self.wrap_policy,
            mesh=self.device_mesh["data_parallel"],
            reshard_after_forward=self.reshard_after_forward,
            mixed_precision=self.mixed_precision,
            cpu_offload=self.cpu_offload,
            forward_methods=_FORWARD_METHODS,
        )
        note = " (one process: nothing is sharded, each unit holds its full parameters)" if self.world_size == 1 else ""
        rank_zero_info(
            f"LowMemoryFSDPStrategy: {len(self.shard_report.units) - 1} FSDP units ({self.shard_report.policy}) + root, "
            f"sharded over {self.world_size} process(es){note}"
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.start_method == "popen" or self.cluster_environment.creates_processes_externally:
            super()._configure_launcher()
        else:
            self._launcher = _FullStateLauncher(self, start_method=self.start_method)

    @override
    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards stay on the CPU; FSDP moves what computes
            super().model_to_device()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        from lightning_lowmem.functional.fsdp import check_dtensor_optimizer

        for optimizer in self.optimizers:
            try:
                check_dtensor_optimizer(optimizer)
            except ValueError:
                for refused in self.optimizers:  # an in-backward optimizer's hooks would step on the next backward
                    remove_hooks = getattr(getattr(refused, "optimizer", refused), "remove_hooks", None)
                    if remove_hooks is not None:
                        remove_hooks()
                raise
            # frozen parameters (a LoRA base) leave the optimizer now, as LowRankAdapters does at fit start:
            # a saved full optimizer state is keyed by trainable parameters only, and torch matches the
            # param groups of a resumed run against it before that callback would run
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p.requires_grad]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _waited(super().lightning_module_state_dict())

    def full_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) weights on rank 0, empty elsewhere; a collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _waited(get_model_state_dict(self.model, options=options))

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # low-bit states (torchao AdamW8bit) are saved dequantized: a full state loads anywhere, and is
        # quantized again for the shards of the loading run (see load_checkpoint)
        return _waited(super().optimizer_state(optimizer), dequantize=True)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from pathlib import Path

        from lightning_lowmem.checkpoints.sharded import is_sharded_checkpoint, load_sharded_checkpoint

        path = Path(self.broadcast(checkpoint_path))  # every rank reads the folder rank 0 names
        if is_sharded_checkpoint(path):  # Lightning's loader: no strict=False, no low-bit state
            assert self.lightning_module is not None
            checkpoint = load_sharded_checkpoint(
                path,
                self.model,
                self.optimizers,
                strict=self.lightning_module.strict_loading,
                weights_only=weights_only,
            )
        else:
            checkpoint = super().load_checkpoint(path, weights_only)
        for optimizer in self.optimizers:
            requantize_low_bit_state(optimizer)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lowmem_fsdp", cls, description="LowMemoryFSDPStrategy (FSDP2)", override=True)
        strategy_registry.register(
            "lowmem_fsdp_spawn", cls, description="LowMemoryFSDPStrategy (spawn)", start_method="spawn", override=True
        )


def _waited(state: Any, dequantize: bool = False) -> Any:
    """Plain tensors for torch's ``AsyncCollectiveTensor`` s (a gathered full state dict can hold them; they
    do not load with ``torch.load(weights_only=True)``) and, with ``dequantize``, for low-bit states."""
    import torch
    from torch.distributed.tensor import DTensor
    from lightning_lowmem._compat import tree_map

    def plain(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if hasattr(value, "trigger_wait"):
            value = value.trigger_wait()
        if not dequantize:
            return value
        local = value.to_local() if isinstance(value, DTensor) else value
        if hasattr(local, "codes") and hasattr(local, "qmap"):  # torchao's low-bit optimizer state
            plain_local = local.dequantize()
            if not isinstance(value, DTensor):
                return plain_local
            return DTensor.from_local(
                plain_local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return value

    return tree_map(plain, state)


class _FullStateLauncher(lightning_multiprocessing_launcher()):  # type: ignore[misc]
    """Lightning's spawn launcher, handing the *full* weights back to the main process.

    The base class returns rank 0's ``lightning_module.state_dict()``, which under FSDP holds DTensor
    shards; here every rank gathers the strategy's full state dict (a collective) and rank 0 hands it on.
    """

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        full = trainer.strategy.full_state_dict()  # also with save_distributed_checkpoint=True
        module = trainer.lightning_module
        module.state_dict = lambda *args, **kwargs: full  # the base class asks the module
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


LowMemoryFSDPStrategy.register_strategies(StrategyRegistry)

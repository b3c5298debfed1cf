"""LowMemoryFSDPStrategy on CPU (gloo): sharded training with checkpointing + LoRA + 8-bit AdamW, consolidated
checkpoints resumed on another number of processes, and the bad inputs."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_lowmem  # noqa: F401  (registers "lowmem_fsdp")
from lightning_lowmem.callbacks import ActivationCheckpointing, LowRankAdapters
from lightning_lowmem.demo.charlm import CharLM
from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy
from lightning_lowmem.checkpoints.sharded import consolidate_checkpoint, is_sharded_checkpoint

GLOBAL_BATCH = 8


class _TinyLM(CharLM):
    """A CharLM whose global batches are the same on any world size (rank r takes every r-th sample)."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, n_head=2, n_embd=128, block_size=8, lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (16, 9), generator=generator)  # 2 steps an epoch
        data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        world_size, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


class _Record(L.Callback):
    """Each rank saves the full weights, its local share of the parameters and what trained."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.start: dict = {}

    def on_train_start(self, trainer, pl_module):  # after a resumed checkpoint was loaded
        self.start = {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()}
        state = trainer.strategy.optimizer_state(trainer.optimizers[0])  # full, dequantized, on rank 0
        self.start_optimizer = torch.utils._pytree.tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state
        )

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        full = trainer.strategy.full_state_dict()  # collective; rank 0 receives the full tensors
        params = list(pl_module.parameters())
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        optimizer = trainer.optimizers[0]
        states = [s for s in optimizer.state.values() if "exp_avg" in s]
        torch.save(
            {
                "weights": {k: v.clone() for k, v in full.items()},
                "start_weights": self.start,
                "start_optimizer": self.start_optimizer,
                "local_fraction": local / sum(p.numel() for p in params),
                "optimizer": type(optimizer).__name__,
                "quantized_state": [
                    type(getattr(s["exp_avg"], "_local_tensor", s["exp_avg"])).__name__ for s in states
                ],
                "checkpointed": trainer.callbacks
                and [c.wrapped for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)],
                "trainable": sorted(n for n, p in pl_module.named_parameters() if p.requires_grad),
            },
            f"{self.directory}/rank{trainer.global_rank}.pt",
        )


class _SaveSharded(L.Callback):
    """At the end of epoch 0 (step 2), also save a sharded folder (the strategy's save_distributed_checkpoint=True
    format) from the same run, beside ModelCheckpoint's consolidated file."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.strategy._save_distributed_checkpoint = True
            try:
                trainer.save_checkpoint(self.folder)
            finally:
                trainer.strategy._save_distributed_checkpoint = False


def _callbacks(directory, save_base_weights: bool = False) -> list:
    adapters = LowRankAdapters(r=16, target=["c_fc"], save_base_weights=save_base_weights)
    return [ActivationCheckpointing("auto"), adapters, _Record(str(directory))]


def _trainer(tmp_path, devices, strategy, max_steps, callbacks, **kwargs):
    # whole epochs of 2 steps: Lightning resumes a map-style loader at an epoch boundary only
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=max_steps // 2,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def _assert_same_weights(left: dict, right: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert left.keys() == right.keys()
    for key in left:  # the reduction order differs between world sizes: equal up to float rounding
        torch.testing.assert_close(
            left[key], right[key], rtol=rtol, atol=atol, msg=lambda message, key=key: f"{key}: {message}"
        )


def _resume_on_one(tmp_path, ckpt_path, name, save_base_weights: bool = False) -> dict:
    """Resume in this process, 1 rank, through epoch 1 (step 4, the same global batches); the record it ends with."""
    torch.manual_seed(0)  # the same frozen base (LoRA checkpoints hold adapters only); lora_B starts at zero
    directory = tmp_path / name
    directory.mkdir()
    strategy = LowMemoryFSDPStrategy(optimizer="adamw8bit")
    trainer = _trainer(directory, 1, strategy, 4, _callbacks(directory, save_base_weights), enable_checkpointing=False)
    trainer.fit(_TinyLM(), ckpt_path=ckpt_path)
    return torch.load(directory / "rank0.pt")


@pytest.mark.slow
def test_two_processes_train_save_consolidated_and_resume_on_one(tmp_path):
    """2 ranks (spawn): checkpointing + LoRA + adamw8bit; the step-2 checkpoint is one full file that
    resumes on 1 rank to the same weights as the 2-rank run's step 4; the sharded folder saved at the same
    step resumes on 1 rank exactly as the file does."""
    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    strategy = LowMemoryFSDPStrategy(optimizer="adamw8bit", start_method="spawn")
    sharded = tmp_path / "sharded-step2"
    trainer = _trainer(tmp_path / "two", 2, strategy, 4, [*_callbacks(tmp_path), _SaveSharded(sharded), checkpoints])
    trainer.fit(_TinyLM())
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")

    # sharded: each rank holds half of every parameter; LoRA trains only adapters; 8-bit AdamW state
    assert 0.45 < rank0["local_fraction"] < 0.55 and 0.45 < rank1["local_fraction"] < 0.55
    assert rank0["checkpointed"] == [["model.h.0", "model.h.1"]]
    assert rank0["trainable"] and all("lora" in name for name in rank0["trainable"])
    assert rank0["optimizer"] == "AdamW8bit" and "OptimState8bit" in rank0["quantized_state"]
    assert rank0["weights"] and not rank1["weights"]  # the full state dict is gathered on rank 0 only

    step2 = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert step2.is_file()  # one consolidated file: loads on one process without any strategy
    saved = torch.load(step2, weights_only=False)
    assert all(not type(v).__name__ == "DTensor" for v in saved["state_dict"].values())
    assert all(type(v) is torch.Tensor for s in saved["optimizer_states"][0]["state"].values() for v in s.values())
    resumed = _resume_on_one(tmp_path, step2, "one")
    for key, value in saved["state_dict"].items():  # resumed on 1 process with exactly the saved weights
        assert torch.equal(resumed["start_weights"][key], value), key
    # two more steps match the 2-process run up to the 8-bit moments, saved dequantized and re-quantized on
    # load (~1e-3 after two steps at lr=1e-2; a lost optimizer state or a wrong batch differs by ~1e-2)
    _assert_same_weights(resumed["weights"], rank0["weights"], rtol=0.05, atol=2.5e-3)
    assert "OptimState8bit" in resumed["quantized_state"]  # the dequantized moments were quantized again

    # the sharded folder (2 ranks wrote it) resumes on 1 rank: the saved adapters and moments exactly, and the
    # run then continues exactly as the one resumed from the consolidated file (loops, optimizer, data)
    assert is_sharded_checkpoint(sharded)
    folder = consolidate_checkpoint(sharded)
    from_folder = _resume_on_one(tmp_path, sharded, "one-from-folder")
    assert folder["state_dict"].keys() == saved["state_dict"].keys()  # adapters only (LowRankAdapters' format)
    for key, value in folder["state_dict"].items():
        assert torch.equal(from_folder["start_weights"][key], value), key
    start, saved_state = from_folder["start_optimizer"], folder["optimizer_states"][0]

    def in_order(state):  # Lightning keys the moments by model-parameter position, the folder by group position
        return [state["state"][i] for group in state["param_groups"] for i in group["params"]]

    assert len(in_order(start)) == len(in_order(saved_state)) == 4  # lora_A / lora_B of 2 blocks
    for resumed_moments, saved_moments in zip(in_order(start), in_order(saved_state), strict=True):
        assert torch.equal(resumed_moments["step"], saved_moments["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            resumed_value, saved_value = resumed_moments[name], saved_moments[name]
            if saved_value.numel() < 4096:  # lora_A: too small for 8-bit blocks, fp32 moments: exact
                assert torch.equal(resumed_value, saved_value), name
            else:  # 8-bit: saved dequantized, quantized again on load: within one code of the 8-bit map
                tolerance = 0.02 * saved_value.abs().max().item()
                torch.testing.assert_close(resumed_value, saved_value, rtol=0, atol=tolerance)
    for key, value in resumed["weights"].items():
        assert torch.equal(from_folder["weights"][key], value), key


@pytest.mark.slow
def test_four_processes_train_save_consolidated_and_resume_on_one(tmp_path):
    """4 ranks: each holds a quarter of every parameter; the step-2 file resumes on 1 rank to the same weights."""
    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    strategy = LowMemoryFSDPStrategy(optimizer="adamw8bit", start_method="spawn")
    trainer = _trainer(tmp_path / "four", 4, strategy, 4, [*_callbacks(tmp_path), checkpoints])
    trainer.fit(_TinyLM())
    rank0 = torch.load(tmp_path / "rank0.pt")
    assert 0.2 < rank0["local_fraction"] < 0.3
    step2 = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert step2.is_file() and not is_sharded_checkpoint(step2)
    saved = torch.load(step2, weights_only=False)
    resumed = _resume_on_one(tmp_path, step2, "one")
    for key, value in saved["state_dict"].items():
        assert torch.equal(resumed["start_weights"][key], value), key
    _assert_same_weights(resumed["weights"], rank0["weights"], rtol=0.05, atol=2.5e-3)


# ----------------------------------------------------------------------------- one process, bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "16-mixed"}, r"`precision`='16-mixed' is not supported with FSDP.*use 'bf16-mixed'"),
        (
            {"optimizer": "adafactor"},
            r"optimizer='adafactor' cannot step on FSDP's sharded \(DTensor\).*'adamw8bit'.*lowmem_ddp",
        ),
        (
            {"optimizer": "adamw4bit"},
            r"optimizer='adamw4bit' cannot step.*Choose one of \['adam', 'adamw', 'adamw8bit'",
        ),
        ({"zero_optimizer": True}, r"`zero_optimizer`=True is for strategy='lowmem_ddp'.*FSDP already shards"),
        ({"wrap_policy": 0}, r"`policy`=0 must be >= 1"),
        ({"cpu_offload": "yes"}, r"`cpu_offload` must be True or False, got str"),
        ({"start_method": "thread"}, r"`start_method`='thread' is unknown; choose one of \['popen', 'spawn'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LowMemoryFSDPStrategy(**kwargs)


def test_registered_names_and_mixed_precision_policy():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["lowmem_fsdp"]["strategy"] is LowMemoryFSDPStrategy
    assert StrategyRegistry["lowmem_fsdp_spawn"]["init_params"] == {"start_method": "spawn"}
    policy = LowMemoryFSDPStrategy(precision="bf16-mixed").mixed_precision
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert LowMemoryFSDPStrategy(precision="bf16-mixed").precision_plugin.precision == "32-true"  # no autocast on top


def test_one_process_trains_with_a_note_and_shards_the_blocks(tmp_path, caplog):
    from torch.distributed.fsdp import FSDPModule

    strategy = LowMemoryFSDPStrategy(wrap_policy="Block")
    model = _TinyLM()
    with caplog.at_level("INFO"):
        _trainer(tmp_path, 1, strategy, 1, [], enable_checkpointing=False).fit(model)
    assert strategy.shard_report.units == ["model.h.1", "model.h.0", ""]
    assert isinstance(model.model.h[0], FSDPModule) and isinstance(model, FSDPModule)
    assert "one process: nothing is sharded" in caplog.text


def test_a_policy_that_matches_nothing_lists_the_module_classes(tmp_path):
    strategy = LowMemoryFSDPStrategy(wrap_policy="GPT2Block")
    with pytest.raises(
        ValueError,
        match=r"FSDP wrap policy 'GPT2Block' matched no submodule of _TinyLM\. Did you mean 'Block'\? Its repeated blocks are \d+ x Block",
    ):
        _trainer(tmp_path, 1, strategy, 1, [], enable_checkpointing=False).fit(_TinyLM())


def test_a_configured_optimizer_that_fails_on_dtensors_is_named(tmp_path):
    class WithAdafactor(_TinyLM):
        def configure_optimizers(self):
            return torch.optim.Adafactor(self.parameters())

    with pytest.raises(ValueError, match=r"the configured optimizer Adafactor \(like 'adafactor'\) cannot step"):
        _trainer(tmp_path, 1, LowMemoryFSDPStrategy(), 1, [], enable_checkpointing=False).fit(WithAdafactor())


def test_a_quantized_lora_base_is_a_clear_error(tmp_path):
    callbacks = [LowRankAdapters(r=4, target=["c_fc"], quantize_base="int8")]
    with pytest.raises(
        ValueError, match=r"FSDP cannot shard \d+ quantized parameter\(s\).*quantize_base=None.*lowmem_ddp"
    ):
        _trainer(tmp_path, 1, LowMemoryFSDPStrategy(), 1, callbacks, enable_checkpointing=False).fit(_TinyLM())


def test_a_sharded_checkpoint_loaded_without_the_strategy_says_how_to_consolidate(tmp_path):
    folder = tmp_path / "step=2.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"is a sharded FSDP checkpoint.*strategy='lowmem' cannot read.*consolidate_checkpoint.*dcp_to_torch_save",
    ):
        _trainer(tmp_path, 1, "lowmem", 1, []).fit(_TinyLM(), ckpt_path=folder)


def test_a_sharded_checkpoint_under_lightnings_own_strategy_says_how_to_consolidate(tmp_path):
    """Lightning's single-device strategy would fail in torch.load on a folder; a lowmem callback checks first."""
    from lightning_lowmem.callbacks import MemoryEfficientOptimizer

    folder = tmp_path / "step=2.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    callbacks = [MemoryEfficientOptimizer("adamw8bit")]
    with pytest.raises(
        ValueError,
        match=r"sharded FSDP checkpoint.*strategy SingleDeviceStrategy cannot read.*consolidate_checkpoint.*dcp_to_torch_save",
    ):
        _trainer(tmp_path, 1, "auto", 1, callbacks).fit(_TinyLM(), ckpt_path=folder)

"""One resumption test over every stateful callback, strategy option and plugin (Composer's pattern, no xfails).

For each configuration: an uninterrupted run of ``STEPS`` optimizer steps; a second run of the same
configuration, in a forked child process that is killed with a real ``SIGKILL`` (its whole process group:
ranks included) one step after a checkpoint was written; a third run that resumes from that checkpoint's
``last.ckpt`` with a model of *other* initial weights (everything must come from the file) and finishes the
``STEPS``. The resumed run must end bit-identical to the uninterrupted one: the trained module's tensors
(after ``on_train_end`` / ``on_fit_end``: pruning made permanent, QAT converted...) and the final checkpoint's
weights, optimizer and LR-scheduler state and every callback's state (``torch.equal``, dtypes and shapes).

A forked child costs no new interpreter (the kill is still a real ``kill -9`` of a real process group);
ZeRO-1 runs its 2 gloo ranks as forked processes too. What cannot be bit-identical by construction is left
out, and said so: a ``MemoryMonitor``'s per-process RSS figures (compared by presence), and with adapters-only
LoRA checkpoints the frozen base, which a resumed run takes from its own pretrained weights (as it does the
teacher of a ``DistillationModule``).

Checkpoints are written at epoch ends (2 steps an epoch, the kill lands in the second epoch): Lightning
resumes a plain ``DataLoader`` from the start of an epoch, so mid-epoch checkpoints would replay batches.
Training draws no random numbers from the global generator (no dropout, no shuffling): Lightning saves no
random state, so those would make any Lightning run resume differently; what the package draws itself
(random pruning, stochastic rounding) comes from seeds it keeps. All runs use one intra-op thread: the same
kernels, the same sums. torchao's optimizers run eagerly (``force_eager``): compiling their step takes tens of
seconds on CPU and saves and loads the same state.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lowmem._compat.compiler import force_eager
from lightning_lowmem.demo.charlm import CharGPT, GPTConfig
from lightning_lowmem.functional.cross_entropy import chunked_cross_entropy

STEPS = 6  # 3 epochs of 2 steps; checkpoints at steps 2, 4, 6
KILL_AFTER_STEP = 3  # the child dies in epoch 2, its last checkpoint is the one of step 2
SAMPLES, BATCH = 8, 4


def _warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.8 ** max(0, step - 2)


class TinyLM(L.LightningModule):
    """A 2-layer CharGPT (n_embd 32) on 8 fixed random sequences, AdamW, per-step LR warmup and decay."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V), or deferred under ChunkedCrossEntropy
        return chunked_cross_entropy(logits, y)  # F.cross_entropy on float32 logits when they are real

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_decay)  # from base_lrs at each step
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return _token_loader(BATCH // self.trainer.world_size)


def _token_loader(batch_size: int) -> torch.utils.data.DataLoader:
    """8 fixed random sequences of 16 bytes (and their next bytes), in order."""
    tokens = torch.randint(0, 256, (SAMPLES, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


# ----------------------------------------------------------------------------- configurations
def _callbacks(*factories: Callable[[], L.Callback]) -> Callable[[Path], dict[str, Any]]:
    return lambda root: {"callbacks": [factory() for factory in factories]}


def _optimizer(name: str) -> Callable[[Path], dict[str, Any]]:
    from lightning_lowmem.callbacks import MemoryEfficientOptimizer

    return _callbacks(lambda: MemoryEfficientOptimizer(name, lr=1e-2))


class _OutOfMemoryOnce(TinyLM):
    """Runs out of memory (raises) on whole batches in its first step only: a transient peak."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 0 and batch[0].shape[0] > BATCH // 2:  # one split: 4 -> 2 samples
            raise torch.OutOfMemoryError("simulated: batch too large")
        return super().training_step(batch, batch_idx)


class _TinyCNN(L.LightningModule):
    """conv-BN-ReLU x 2 (3 x 3), a 1 x 1 conv and a head on 8 fixed 8 x 8 images; the same base weights in every run
    (adapters-only LoRA checkpoints: the base is the model's own pretrained weights)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            nn = torch.nn
            stem = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
            body = [nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1)]
            self.model = nn.Sequential(*stem, *body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))  # head: 9

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(SAMPLES, 3, 8, 8, generator=generator)
        labels = torch.randint(0, 4, (SAMPLES,), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=BATCH)


def _distillation(root: Path, cache: bool = False) -> dict[str, Any]:
    from lightning_lowmem.distillation import DistillationModule

    student = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))  # from the run's seed
    with torch.random.fork_rng():
        torch.manual_seed(2)  # the teacher: the same pretrained model in every run
        teacher = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, block_size=16))
    if cache:  # teacher outputs cached on the first fit; a resumed run reuses the file the killed one wrote
        module = DistillationModule(student, teacher, teacher_cache=str(root / "teacher.cache"), lr=1e-2)
    else:
        module = DistillationModule(student, teacher, hint_layers={"h.1.mlp.c_fc": "h.1.mlp.c_fc"}, lr=1e-2)
    return {"module": module, "train_dataloaders": _token_loader(BATCH)}


def _zero1(root: Path, **options: Any) -> dict[str, Any]:
    from lightning_lowmem.strategies import LowMemoryDDPStrategy

    return {"devices": 2, "strategy": LowMemoryDDPStrategy(zero_optimizer=True, start_method="fork", **options)}


def _strategy(**options: Any) -> Callable[[Path], dict[str, Any]]:
    def build(root: Path) -> dict[str, Any]:
        from lightning_lowmem.strategies import LowMemoryStrategy

        return {"strategy": LowMemoryStrategy(**options)}

    return build


def _compressed_io(root: Path, qat: bool = False) -> dict[str, Any]:
    from lightning_lowmem.callbacks import QuantizationAwareTraining, ScheduledPruning
    from lightning_lowmem.checkpoints import CompressedCheckpointIO

    if qat:  # the final checkpoint holds the converted (torchao) weights, read back by the plugin itself
        return {
            "plugins": [CompressedCheckpointIO()],
            "callbacks": [QuantizationAwareTraining("int8_weight_only", start_step=1)],
        }
    pruning = ScheduledPruning(target_sparsity=0.6, start_step=1, end_step=5, frequency=3, make_pruning_permanent=False)
    return {"plugins": [CompressedCheckpointIO(min_numel=256)], "callbacks": [pruning]}  # sparse tensors on disk


def _lazy(path: str, *args: Any, **kwargs: Any) -> Callable[[], L.Callback]:
    def build() -> L.Callback:
        module, _, name = path.rpartition(".")
        return getattr(__import__(module, fromlist=[name]), name)(*args, **kwargs)

    return build


_CB = "lightning_lowmem.callbacks."
CONFIGS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "plain": lambda root: {},
    # ScheduledPruning: step schedules pruning at steps 1, 4, 5: the resumed run's first step (3) prunes nothing, so
    # only restored masks keep the pruned weights at zero; ModelPruning's per-epoch rule; structural removal
    "pruning-step": _callbacks(
        _lazy(
            _CB + "ScheduledPruning",
            schedule="cubic",
            target_sparsity=0.6,
            start_step=1,
            end_step=5,
            frequency=3,
            make_pruning_permanent=False,
        )
    ),
    "pruning-step-random": _callbacks(
        _lazy(
            _CB + "ScheduledPruning", "random_unstructured", target_sparsity=0.5, start_step=1, end_step=5, frequency=3
        )
    ),
    "pruning-epoch": _callbacks(_lazy(_CB + "ScheduledPruning", amount=0.3, use_lottery_ticket_hypothesis=True)),
    "pruning-structural": _callbacks(
        _lazy(
            _CB + "ScheduledPruning",
            "ln_structured",
            target_sparsity=0.5,
            start_step=0,
            end_step=2,
            structural=True,
            parameter_names=["weight"],
        )
    ),
    # QAT from step 1: the resumed run starts at step 2, past start_step, and must fake-quantize from its first step
    "qat-intx4": _callbacks(_lazy(_CB + "QuantizationAwareTraining", "intx4_weight_only", start_step=1)),
    "qat-int8": _callbacks(_lazy(_CB + "QuantizationAwareTraining", "int8_weight_only", start_step=1)),
    **{
        f"optimizer-{name}": _optimizer(name)
        for name in (
            "adamw8bit",
            "adamw4bit",
            "adamw8bit_in_backward",
            "adamw_in_backward",
            "adafactor",
            "adafactor_in_backward",
            "sgd",
        )
    },
    "optimizer-adamw_bf16_sr": lambda root: {"precision": "bf16-true", **_optimizer("adamw_bf16_sr")(root)},
    "optimizer-adafactor_bf16_sr": lambda root: {"precision": "bf16-true", **_optimizer("adafactor_bf16_sr")(root)},
    "optimizer-adafactor_bf16_sr_in_backward": lambda root: {
        "precision": "bf16-true",
        **_optimizer("adafactor_bf16_sr_in_backward")(root),
    },
    "auto-microbatch": lambda root: {"module": _OutOfMemoryOnce(), **_callbacks(_lazy(_CB + "AutoMicrobatch"))(root)},
    # adapters-only checkpoints: the frozen base comes from the model's own (pretrained) weights, as a teacher does
    "lora": lambda root: {"same_base": True, **_callbacks(_lazy(_CB + "LowRankAdapters", r=4, alpha=8.0))(root)},
    "qlora-int8": lambda root: {
        "same_base": True,
        **_callbacks(_lazy(_CB + "LowRankAdapters", r=4, quantize_base="int8"))(root),
    },
    # LoRA on convolutions; BatchNorm's running statistics travel in the adapters-only checkpoint
    "lora-conv": lambda root: {
        "module": _TinyCNN(),
        **_callbacks(_lazy(_CB + "LowRankAdapters", r=2, target="all-conv", train_modules=["9"]))(root),
    },
    "lora-save-base-weights": _callbacks(_lazy(_CB + "LowRankAdapters", r=4, save_base_weights=True)),
    "activation-compression-int8": _callbacks(_lazy(_CB + "ActivationCompression", "int8", min_bytes=0)),
    "activation-compression-bf16": _callbacks(_lazy(_CB + "ActivationCompression", "bf16", min_bytes=0)),
    "activation-checkpointing": _callbacks(_lazy(_CB + "ActivationCheckpointing", "auto")),
    "chunked-cross-entropy": _callbacks(_lazy(_CB + "ChunkedCrossEntropy", chunk_size=5)),
    # its history holds the process's resident set size: a measurement of each process, compared by presence
    "memory-monitor": lambda root: {
        "measured": {"rss", "rss_before", "rss_after"},
        **_callbacks(_lazy(_CB + "MemoryMonitor", log_every_n_steps=1))(root),
    },
    "distillation-hint-layers": _distillation,
    "distillation-teacher-cache": lambda root: _distillation(root, cache=True),
    "strategy-bf16-mixed": _strategy(precision="bf16-mixed"),
    "strategy-options": _strategy(
        optimizer="adamw4bit", activation_checkpointing="auto", activation_compression="int8", compression_min_bytes=0
    ),
    "strategy-bf16-true-adafactor_bf16_sr": _strategy(precision="bf16-true", optimizer="adafactor_bf16_sr"),
    # memory_budget plans again on resume (the same plan: it is a function of model and batch); two candidates
    "strategy-memory-budget": _strategy(
        memory_budget="1MB",
        precision="32-true",
        optimizer="adamw",
        activation_compression="bf16",
        compression_min_bytes=0,
    ),
    "strategy-zero1-2-processes": _zero1,
    "strategy-zero1-adamw8bit": lambda root: _zero1(root, optimizer="adamw8bit"),
    "strategy-zero1-bf16-true-adafactor_bf16_sr": lambda root: _zero1(
        root, precision="bf16-true", optimizer="adafactor_bf16_sr"
    ),
    "compressed-checkpoint-io": _compressed_io,
    "compressed-checkpoint-io-qat-int8": lambda root: _compressed_io(root, qat=True),
}


# ----------------------------------------------------------------------------- runs
class _KillAfter(L.Callback):
    """``kill -9`` of this process group (launcher and every rank) once training finished ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.killpg(0, signal.SIGKILL)


class _RecordStart(L.Callback):
    """Rank 0 writes the step training starts from (2 when resumed from the step-2 checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(str(trainer.global_step))


def _fit(name: str, root: Path, *, seed: int = 0, ckpt_path: Path | None = None, kill: bool = False):
    torch.manual_seed(seed)
    spec = CONFIGS[name](root)
    measured = frozenset(spec.pop("measured", ()))
    module = spec.pop("module", None) or TinyLM(0 if spec.pop("same_base", False) else seed)
    loaders = spec.pop("train_dataloaders", None)
    saver = ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1, save_last=True)
    extra = [_RecordStart(root / "start_step"), *([_KillAfter(KILL_AFTER_STEP)] if kill else [])]
    callbacks = [*spec.pop("callbacks", []), saver, *extra]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec.pop("devices", 1),
        max_epochs=STEPS // (SAMPLES // BATCH),
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **spec,
    )
    trainer.fit(module, loaders, ckpt_path=ckpt_path)
    return trainer, module, measured


def _killed_child(name: str, root: Path) -> None:
    os.setpgrp()  # a process group of its own: the kill takes the ranks it launches and nothing else
    _fit(name, root, kill=True)
    os._exit(3)  # not killed: the parent reports it


def _run_killed(name: str, root: Path) -> Path:
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(name, root))
    child.start()
    child.join(timeout=300)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == -signal.SIGKILL, f"{name}: the child ended with {child.exitcode}, not SIGKILL"
    return root / "ckpt" / "last.ckpt"


# ----------------------------------------------------------------------------- comparison
def _tensor_parts(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A plain tensor as itself, a tensor subclass (torchao quantized weights) as its inner tensors."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return {"": tensor}
    names, _ = tensor.__tensor_flatten__()
    return {f".{n}{k}": v for n in names for k, v in _tensor_parts(getattr(tensor, n)).items()}


def _differences(a: Any, b: Any, path: str = "", measured: frozenset[str] = frozenset()) -> list[str]:
    """Where ``a`` and ``b`` differ (values of the keys in ``measured``: only their type)."""
    if path.rpartition("/")[2] in measured:
        return [] if type(a) is type(b) else [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or type(a) is not type(b):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        parts_a, parts_b = _tensor_parts(a), _tensor_parts(b)
        if parts_a.keys() != parts_b.keys():
            return [f"{path}: inner tensors {sorted(parts_a)} vs {sorted(parts_b)}"]
        found = []
        for key, x in parts_a.items():
            y = parts_b[key]
            if x.dtype != y.dtype or x.shape != y.shape:
                found.append(f"{path}{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            elif not torch.equal(x, y):
                delta = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else "?"
                found.append(f"{path}{key}: values differ (max abs difference {delta})")
        return found
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}", measured)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]", measured)
        ]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]


_COMPARED = ("state_dict", "optimizer_states", "lr_schedulers", "callbacks", "global_step", "epoch", "lightning_lowmem")


def _final_checkpoint(trainer: L.Trainer, root: Path) -> dict[str, Any]:
    checkpoint = trainer.strategy.checkpoint_io.load_checkpoint(root / "ckpt" / "last.ckpt")
    kept = {key: checkpoint.get(key) for key in _COMPARED}
    # ModelCheckpoint's own state names its run's directory: the one thing that must differ
    kept["callbacks"] = {k: v for k, v in (kept["callbacks"] or {}).items() if not k.startswith("ModelCheckpoint")}
    return kept


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ~10 s each: memory_budget plans in each of the 3 runs, ZeRO-1 forks 2 ranks in each
_SLOW = ("strategy-memory-budget", *(name for name in CONFIGS if "zero1" in name))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in CONFIGS])
def test_kill_9_and_resume_is_bit_identical_to_an_uninterrupted_run(name, tmp_path):
    with _one_thread(), force_eager():
        full_trainer, full, measured = _fit(name, tmp_path / "full")
        last = _run_killed(name, tmp_path / "killed")
        assert sorted(p.name for p in last.parent.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
        resumed_trainer, resumed, _ = _fit(name, tmp_path / "killed", seed=1, ckpt_path=last)
    full_checkpoint = _final_checkpoint(full_trainer, tmp_path / "full")
    assert full_checkpoint["global_step"] == STEPS  # (a multi-process launcher's own Trainer keeps step 0)
    assert (tmp_path / "killed" / "start_step").read_text() == str(KILL_AFTER_STEP - 1)  # it did resume
    differences = _differences(full.state_dict(), resumed.state_dict(), "module")  # after on_train_end/on_fit_end
    resumed_checkpoint = _final_checkpoint(resumed_trainer, tmp_path / "killed")
    differences += _differences(full_checkpoint, resumed_checkpoint, "checkpoint", measured)
    assert not differences, f"{name}: " + "; ".join(differences[:8])

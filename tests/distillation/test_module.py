"""DistillationModule: the teacher stays frozen, in eval, out of optimizers and checkpoints; bad input."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.distillation import DistillationModule
from lightning_lowmem.memory import state_bytes

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Wide(nn.Module):
    """A 16 -> 64 -> 4 teacher (named layers for hints)."""

    def __init__(self, width: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


def loaders(n: int = 64, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=generator)
    y = (x[:, :4].argmax(-1)).long()
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=batch_size, shuffle=True), DataLoader(data, batch_size=batch_size)


def fit(module: DistillationModule, kwargs: dict, steps: int = 4, **trainer_kwargs) -> L.Trainer:
    train, val = loaders()
    trainer = L.Trainer(max_steps=steps, limit_val_batches=1, **{**kwargs, **trainer_kwargs})
    trainer.fit(module, train, val)
    return trainer


def test_teacher_frozen_eval_and_outside_optimizer_during_fit(tiny_mlp, tiny_trainer_kwargs):
    torch.manual_seed(1)
    teacher = Wide()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    module = DistillationModule(tiny_mlp, teacher, hint_layers={"fc1": "fc1"}, alpha=0.7)
    seen_modes = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen_modes.append(pl_module.teacher.training)

    student_before = tiny_mlp.fc1.weight.detach().clone()
    trainer = fit(module, tiny_trainer_kwargs, callbacks=[Spy()])
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())  # bitwise unchanged
    assert not torch.equal(student_before, tiny_mlp.fc1.weight)  # ... while the student learned
    assert seen_modes == [False] * 4 and not teacher.training
    module.train()
    assert not teacher.training and tiny_mlp.training
    assert all(not p.requires_grad for p in teacher.parameters())
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not teacher_ids & {id(p) for p in module.parameters()}
    assert all(not isinstance(m, Wide) for m in module.modules())  # not a child: pruning callbacks skip it
    assert all(k.startswith(("student.", "hint_adapters.")) for k in module.state_dict())
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert optimized and not teacher_ids & {id(p) for p in optimized}
    adapter = module.hint_adapters["fc1"]  # 32 -> 64 projection is trained with the student
    assert {id(p) for p in adapter.parameters()} <= {id(p) for p in optimized}
    assert "teacher_val_acc" in trainer.callback_metrics and "val_agreement" in trainer.callback_metrics


def test_checkpoint_has_no_teacher_keys_and_reloads_a_working_module(tiny_mlp, tiny_trainer_kwargs, tmp_path):
    torch.manual_seed(1)
    teacher = Wide()
    teacher_file = tmp_path / "teacher.pt"
    torch.save(teacher.state_dict(), teacher_file)
    module = DistillationModule(tiny_mlp, Wide(), teacher_checkpoint=str(teacher_file), temperature=3.0)
    trainer = fit(module, tiny_trainer_kwargs, steps=2)
    path = tmp_path / "distilled.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    keys = list(checkpoint["state_dict"])
    assert keys and all(k.startswith("student.") for k in keys), keys
    assert not any("teacher" in k for k in keys)
    assert "student" not in checkpoint["hyper_parameters"] and "teacher" not in checkpoint["hyper_parameters"]

    from tests.conftest import TinyMLP

    restored = DistillationModule.load_from_checkpoint(path, student=TinyMLP(), teacher=Wide)
    assert restored.hparams.temperature == 3.0
    x = torch.randn(5, 16)
    torch.testing.assert_close(restored(x), module(x))
    torch.testing.assert_close(restored.teacher_logits(x), teacher(x))  # teacher rebuilt from its source


def test_lightning_teacher_from_checkpoint(tmp_path, tiny_trainer_kwargs):
    from lightning_lowmem.demo.digits import DigitsClassifier, digits_mlp

    torch.manual_seed(0)
    trained = DigitsClassifier(hidden=32, depth=1)
    trainer = L.Trainer(max_steps=1, **tiny_trainer_kwargs)
    trainer.strategy.connect(trained)
    trainer.save_checkpoint(tmp_path / "teacher.ckpt")
    module = DistillationModule(
        digits_mlp(16, 1), DigitsClassifier(hidden=32, depth=1), teacher_checkpoint=str(tmp_path / "teacher.ckpt")
    )
    x = torch.rand(3, 1, 8, 8)
    torch.testing.assert_close(module.teacher_logits(x), trained(x))


def test_bf16_teacher_halves_parameter_bytes():
    torch.manual_seed(0)
    fp32 = DistillationModule(nn.Linear(16, 4), Wide(256))
    bf16 = DistillationModule(nn.Linear(16, 4), Wide(256), teacher_precision="bf16")
    fp32_bytes = state_bytes(fp32.teacher)["parameters"]
    bf16_bytes = state_bytes(bf16.teacher)["parameters"]
    assert bf16_bytes <= 0.55 * fp32_bytes
    logits = bf16.teacher_logits(torch.randn(2, 16))
    assert logits.dtype == torch.float32 and logits.shape == (2, 4)


def test_int8_teacher_runs_and_stays_close():
    torch.manual_seed(0)
    teacher = Wide(64)
    x = torch.randn(8, 16)
    reference = teacher(x).detach()
    module = DistillationModule(nn.Linear(16, 4), teacher, teacher_precision="int8")
    torch.testing.assert_close(module.teacher_logits(x), reference, atol=0.05, rtol=0.05)


def test_callable_teacher_is_built_lazily():
    calls = []

    def build() -> nn.Module:
        calls.append(1)
        return Wide()

    module = DistillationModule(nn.Linear(16, 4), build)
    assert calls == []
    assert isinstance(module.teacher, Wide) and calls == [1]
    assert module.teacher is module.teacher and calls == [1]


def test_sequence_model_distils_token_logits(tiny_gpt, tiny_trainer_kwargs):
    from lightning_lowmem.demo.charlm import CharGPT, GPTConfig

    torch.manual_seed(1)
    teacher = CharGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16))
    tokens = torch.randint(0, 256, (8, 17))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (B, T) inputs and next-token targets
    module = DistillationModule(tiny_gpt, teacher, alpha=0.8)
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, **tiny_trainer_kwargs)
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert 0.0 <= float(trainer.callback_metrics["val_agreement"]) <= 1.0


def test_missing_teacher():
    with pytest.raises(ValueError, match=r"missing teacher: pass `teacher`"):
        DistillationModule(nn.Linear(16, 4))


def test_unmatchable_output_shapes_name_both(tiny_mlp, tiny_trainer_kwargs):
    module = DistillationModule(tiny_mlp, Wide(classes=6))
    with pytest.raises(
        ValueError, match=r"student output shape \(16, 4\) cannot be matched to teacher output shape \(16, 6\)"
    ):
        fit(module, tiny_trainer_kwargs, steps=1, num_sanity_val_steps=0)


def test_unknown_hint_layer_lists_close_names(tiny_mlp):
    with pytest.raises(ValueError, match=r"hint layer 'fc3' does not exist in the teacher; close names: \[.*'fc1'"):
        DistillationModule(tiny_mlp, Wide(), hint_layers={"fc2": "fc3"})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"teacher_precision": "fp8"},
            ValueError,
            r"`teacher_precision`='fp8' is unknown; choose from \['32', 'bf16', 'int8'\]",
        ),
        ({"temperature": -1.0}, ValueError, r"`temperature` must be > 0, got -1.0"),
        ({"alpha": 2.0}, ValueError, r"`alpha` must be in \[0, 1\].*got 2.0"),
        ({"loss": "unknown"}, ValueError, r"`loss`='unknown' is not registered"),
        ({"teacher": 3}, TypeError, r"`teacher` must be an nn.Module or a callable returning one, got int"),
        ({"hint_layers": {"fc1": "fc1"}, "teacher_cache": "x.npy"}, ValueError, r"`hint_layers` need the live teacher"),
        (
            {"cache_top_k": 0, "teacher_cache": "x.npy"},
            ValueError,
            r"`cache_top_k` must be a positive int or None, got 0",
        ),
    ],
)
def test_bad_arguments(tiny_mlp, kwargs, error, match):
    kwargs = {"teacher": Wide(), **kwargs}
    with pytest.raises(error, match=match):
        DistillationModule(tiny_mlp, **kwargs)


def test_student_must_be_a_module_and_differ_from_teacher(tiny_mlp):
    with pytest.raises(ValueError, match=r"`student` must be an nn.Module.*got NoneType"):
        DistillationModule(None, Wide())
    with pytest.raises(ValueError, match="`teacher` and `student` are the same object"):
        DistillationModule(tiny_mlp, tiny_mlp)


class _SaveStudent(L.Callback):
    """Writes each rank's student weights and teacher presence at the end of fit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        state = {k: v.clone() for k, v in pl_module.student.state_dict().items()}
        torch.save(
            {"student": state, "teacher_held": pl_module.teacher is not None},
            f"{self.directory}/rank{trainer.global_rank}.pt",
        )


def test_ddp_two_cpu_processes_with_cached_teacher(tmp_path):
    """Rank 0 builds the cache, both ranks read it after a barrier and release the teacher."""
    cached = True
    torch.manual_seed(0)
    options = {"teacher_cache": str(tmp_path / "cache.npy")} if cached else {}
    module = DistillationModule(nn.Linear(16, 4), Wide(), **options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_SaveStudent(str(tmp_path))],
    )
    trainer.fit(module, loaders()[0])
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert all(torch.equal(rank0["student"][k], rank1["student"][k]) for k in rank0["student"])  # DDP in sync
    assert rank0["teacher_held"] is (not cached) and rank1["teacher_held"] is (not cached)
    assert (tmp_path / "cache.npy").exists() is cached


def test_pruning_callback_prunes_the_student_only(tiny_mlp, tiny_trainer_kwargs):
    from lightning.pytorch.callbacks import ModelPruning

    teacher = Wide()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    module = DistillationModule(tiny_mlp, teacher)
    fit(module, tiny_trainer_kwargs, steps=2, callbacks=[ModelPruning("l1_unstructured", amount=0.5, verbose=0)])
    weights = list(tiny_mlp.parameters())  # global L1 over weights and biases: 50% of all of them
    zeros = sum(int((w == 0).sum()) for w in weights)
    assert zeros == round(0.5 * sum(w.numel() for w in weights))
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_teacher_from_a_compressed_checkpoint(tmp_path, tiny_trainer_kwargs):
    """A checkpoint our own CompressedCheckpointIO wrote is a teacher (bare torch.load could not read it)."""
    from lightning_lowmem.demo.digits import DigitsClassifier, digits_mlp
    from lightning_lowmem.plugins import CompressedCheckpointIO

    torch.manual_seed(0)
    trained = DigitsClassifier(hidden=32, depth=1)
    trainer = L.Trainer(max_steps=1, plugins=[CompressedCheckpointIO()], **tiny_trainer_kwargs)
    trainer.strategy.connect(trained)
    trainer.save_checkpoint(tmp_path / "teacher.ckpt")
    module = DistillationModule(
        digits_mlp(16, 1), DigitsClassifier(hidden=32, depth=1), teacher_checkpoint=str(tmp_path / "teacher.ckpt")
    )
    x = torch.rand(3, 1, 8, 8)
    torch.testing.assert_close(module.teacher_logits(x), trained(x))

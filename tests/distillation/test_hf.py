"""DistillationModule on Hugging Face models: dict batches, `.logits` / `.loss`, padding out of the KD loss, cache."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

transformers = pytest.importorskip("transformers")

from lightning_lowmem.models.hf import build_hf_model  # noqa: E402
from lightning_lowmem.distillation import DistillationModule, build_teacher_cache, register_loss  # noqa: E402
from lightning_lowmem.distillation.cache import batch_keys  # noqa: E402
from lightning_lowmem.memory import state_bytes  # noqa: E402
from lightning_lowmem.model_io import BatchCallError  # noqa: E402
from tests.hf_zoo import constant_bytes, hf_batch, hf_data  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*self.log.*")

SMALL = {
    "gpt2": dict(n_embd=32, n_layer=1),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1),
    "bert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1),
}
NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": {},
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}  # so calls can be compared


def teacher_and_student(teacher_family: str, student_family: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    teacher = build_hf_model(teacher_family, **NO_DROPOUT[teacher_family]).eval()  # 2 layers of width 64
    torch.manual_seed(1)
    return teacher, build_hf_model(student_family, **SMALL[student_family], **NO_DROPOUT[student_family])


def loaders(family: str, train: int = 12, val: int = 8) -> tuple[DataLoader, DataLoader]:
    data = hf_data(family, seq_len=16, batch_size=4)
    data.setup("fit")
    return (
        DataLoader(Subset(data.train_set, range(train)), batch_size=4, shuffle=True),
        DataLoader(Subset(data.val_set, range(val)), batch_size=4),
    )


@pytest.mark.parametrize("student_family", ["gpt2", "llama"])
def test_gpt2_teacher_to_smaller_students_through_fit(student_family, tiny_trainer_kwargs):
    teacher, student = teacher_and_student("gpt2", student_family)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student_before = copy.deepcopy(student.state_dict())
    train, val = loaders("gpt2")
    module = DistillationModule(student, teacher, temperature=2.0, alpha=0.5)
    trainer = L.Trainer(**{**tiny_trainer_kwargs, "max_epochs": 1, "num_sanity_val_steps": 0})
    trainer.fit(module, train, val)

    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())  # frozen
    assert any(not torch.equal(student_before[k], v) for k, v in student.state_dict().items())  # trained
    with torch.no_grad():  # the logged losses are each model's own HF `.loss` on the dict batches
        teacher_loss = torch.stack([teacher(**batch).loss for batch in val]).mean()
        student_loss = torch.stack([student(**batch).loss for batch in val]).mean()
    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["teacher_val_loss"], teacher_loss)
    torch.testing.assert_close(metrics["val_loss"], student_loss)
    assert 0.0 <= float(metrics["val_agreement"]) <= 1.0 and torch.isfinite(metrics["train_loss"])
    assert "val_acc" not in metrics  # token accuracy of a causal LM needs the shift: the HF loss is logged instead


class NoisyLogits(nn.Module):
    """Wraps a HF model and adds `scale` to its logits where `where(batch)` is True."""

    def __init__(self, model: nn.Module, where, scale: float = 0.0) -> None:
        super().__init__()
        self.model, self.where, self.scale = model, where, scale

    def forward(self, **batch):
        output = self.model(**batch)
        noise = torch.randn(output.logits.shape, generator=torch.Generator().manual_seed(0)) * self.scale
        output.logits = output.logits + noise * self.where(batch).unsqueeze(-1)
        return output


def _not_counted(batch):  # padding, and tokens whose label is ignored (BERT: every unmasked token)
    return ((batch["attention_mask"] == 0) | (batch["labels"] == -100)).float()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_logits_at_padded_or_ignored_positions_do_not_change_the_kd_loss(family):
    batch = hf_batch(family, seq_len=16)
    assert bool((_not_counted(batch) == 1).any()) and bool((_not_counted(batch) == 0).any())
    teacher, student = teacher_and_student(family, family)
    noisy_teacher, noisy_student = NoisyLogits(teacher, _not_counted), NoisyLogits(student, _not_counted)
    module = DistillationModule(noisy_student, noisy_teacher, temperature=2.0, alpha=0.5)
    clean = module.training_step(batch, 0)
    noisy_teacher.scale = noisy_student.scale = 50.0
    assert torch.equal(module.training_step(batch, 0), clean)
    # control: the same noise on the positions that count does change it
    noisy_teacher.where = noisy_student.where = lambda b: 1.0 - _not_counted(b)
    assert not torch.allclose(module.training_step(batch, 0), clean)


def test_student_hard_term_is_its_own_shifted_hf_loss():
    batch = hf_batch("gpt2", seq_len=16)
    teacher, student = teacher_and_student("gpt2", "gpt2")
    module = DistillationModule(student, teacher, alpha=0.0)  # hard labels only
    torch.testing.assert_close(module.training_step(batch, 0), student(**batch).loss)


def test_dict_cache_matches_the_live_teacher_and_releases_it(tmp_path, tiny_trainer_kwargs):
    teacher, student = teacher_and_student("gpt2", "gpt2")
    train, _ = loaders("gpt2", train=12)
    path = tmp_path / "teacher.npy"
    module = DistillationModule(student, copy.deepcopy(teacher), teacher_cache=str(path), cache_dtype="float32")
    L.Trainer(**{**tiny_trainer_kwargs, "max_steps": 2, "limit_val_batches": 0}).fit(module, train)
    assert module.teacher is None and module._cache.meta["output_shape"] == [16, 264]
    batch = next(iter(train))  # shuffled rows of padded dict samples find their cached logits
    cached = module._cache.logits(module._cache.rows(batch_keys(batch)))
    with torch.no_grad():
        torch.testing.assert_close(cached, teacher(**batch).logits)
    live = DistillationModule(copy.deepcopy(student), teacher)
    module.trainer = None  # detached from the finished fit: `self.log` becomes a no-op
    torch.testing.assert_close(module.training_step(batch, 0), live.training_step(batch, 0))


def test_cache_refuses_samples_of_different_lengths(tmp_path):
    samples = [{"input_ids": torch.arange(n), "attention_mask": torch.ones(n, dtype=torch.long)} for n in (8, 8, 6)]
    with pytest.raises(
        ValueError,
        match=r"samples of one shape: sample 0 is dict\(input_ids: \(8,\) int64.*sample 2 is "
        r"dict\(input_ids: \(6,\) int64.*pad every sample to one length",
    ):
        build_teacher_cache(build_hf_model("gpt2"), samples, tmp_path / "c.npy")


def test_call_model_and_batch_targets_map_a_custom_batch(tiny_trainer_kwargs):
    roles = set()

    class CustomBatches(DistillationModule):
        def call_model(self, model, batch, role):
            roles.add(role)
            return model(input_ids=batch["tokens"], attention_mask=batch["keep"])

        def batch_targets(self, batch, logits, output=None):
            return None, batch["keep"].bool()

    data = [
        {"tokens": b["input_ids"][i], "keep": b["attention_mask"][i]}
        for b in [hf_batch("gpt2", 16, 8)]
        for i in range(8)
    ]
    teacher, student = teacher_and_student("gpt2", "llama")
    module = CustomBatches(student, teacher, alpha=1.0)
    trainer = L.Trainer(**{**tiny_trainer_kwargs, "max_steps": 2, "limit_val_batches": 0})
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert roles == {"student", "teacher"} and torch.isfinite(trainer.callback_metrics["train_loss"])


def test_a_batch_the_model_cannot_take_names_call_model():
    module = DistillationModule(nn.Linear(16, 264), build_hf_model("gpt2"))
    with pytest.raises(
        BatchCallError,
        match=r"could not call Linear.forward.*override `call_model\(self, model, batch, "
        r"role\)` to call the student \(Linear\)",
    ):
        module.training_step(hf_batch("gpt2", 16), 0)


def test_hint_layers_on_conv1d_and_close_names():
    teacher, student = teacher_and_student("gpt2", "gpt2")
    module = DistillationModule(student, teacher, hint_layers={"transformer.h.0.mlp.c_fc": "transformer.h.1.mlp.c_fc"})
    adapter = module.hint_adapters["transformer_h_0_mlp_c_fc"]  # Conv1D widths: 4 * 32 -> 4 * 64
    assert (adapter.in_features, adapter.out_features) == (128, 256)
    loss = module.training_step(hf_batch("gpt2", 16), 0)
    assert torch.isfinite(loss)
    with pytest.raises(
        ValueError,
        match=r"hint layer 'transformer.h.0.mlp.fc' does not exist in the student; close "
        r"names: \[.*'transformer.h.0.mlp.c_fc'",
    ):
        DistillationModule(student, teacher, hint_layers={"transformer.h.0.mlp.fc": "transformer.h.0.mlp.c_fc"})


def test_a_registered_loss_without_mask_is_refused_for_dict_batches():
    register_loss("plain_mse", lambda s, t, targets, temperature, alpha, ignore_index: ((s - t) ** 2).mean())
    teacher, student = teacher_and_student("gpt2", "gpt2")
    module = DistillationModule(student, teacher, loss="plain_mse")
    with pytest.raises(TypeError, match=r"does not accept \['mask', 'hard_loss'\], which dict batches need"):
        module.training_step(hf_batch("gpt2", 16), 0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_and_int8_hf_teachers_hold_fewer_bytes_and_stay_close(family):
    torch.manual_seed(0)
    reference = build_hf_model(family, **NO_DROPOUT[family]).eval()
    batch = hf_batch(family, 16)
    with torch.no_grad():
        expected = reference(**batch).logits
    constant = constant_bytes(reference)  # e.g. transformers 4.x GPT-2's causal-mask buffers: never cast
    fp32_bytes = state_bytes(reference)["parameters"] - constant
    for precision, ratio in (("bf16", 0.55), ("int8", 0.35)):  # int8: embeddings stay fp32
        module = DistillationModule(build_hf_model(family), copy.deepcopy(reference), teacher_precision=precision)
        assert state_bytes(module.teacher)["parameters"] - constant <= ratio * fp32_bytes
        torch.testing.assert_close(module.teacher_logits(batch), expected, atol=0.05, rtol=0.05)


def test_attention_mask_alone_keeps_padding_out_of_an_unlabelled_batch():
    batch = {k: v for k, v in hf_batch("gpt2", seq_len=16).items() if k != "labels"}  # pure distillation
    padded = lambda b: (b["attention_mask"] == 0).float()  # noqa: E731
    assert bool(padded(batch).any())
    teacher, student = teacher_and_student("gpt2", "gpt2")
    noisy_teacher = NoisyLogits(teacher, padded)
    module = DistillationModule(student, noisy_teacher, alpha=1.0)
    clean = module.training_step(batch, 0)
    noisy_teacher.scale = 50.0
    assert torch.equal(module.training_step(batch, 0), clean)
    with pytest.raises(ValueError, match=r"`targets` are required for the hard-label term when `alpha`=0.5 < 1"):
        DistillationModule(student, teacher, alpha=0.5).training_step(batch, 0)


def test_a_student_without_its_own_loss_gets_a_warning_about_the_unshifted_hard_term():
    class LogitsOnly(nn.Module):  # takes no labels: returns logits only
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask=None):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    teacher, student = teacher_and_student("gpt2", "gpt2")
    module = DistillationModule(LogitsOnly(student), teacher, alpha=0.5)
    with pytest.warns(UserWarning, match=r"no `.loss` for a dict batch with `labels`.*no shift"):
        module.training_step(hf_batch("gpt2", 16), 0)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_chunked_cross_entropy_distils_to_the_same_weights_without_the_students_logits(alpha, tiny_trainer_kwargs):
    """ChunkedCrossEntropy on a DistillationModule: the student's head defers its logits, the KD term and the
    student's own loss are computed in chunks; weights after two SGD steps equal the unchunked run's, peak lower."""
    import lightning as L

    from lightning_lowmem import ChunkedCrossEntropy, DistillationModule, MemoryEfficientOptimizer, MemoryMonitor

    hf_zoo = pytest.importorskip("tests.hf_zoo")
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "vocab_size": 4096}
    results = []
    for chunked in (False, True):
        module = DistillationModule(
            student=hf_zoo.hf_module("gpt2", n_embd=32, **no_dropout).model,
            teacher=hf_zoo.hf_module("gpt2", seed=1, **no_dropout).model,
            alpha=alpha,
        )
        monitor = MemoryMonitor(summary=False)
        callbacks = [MemoryEfficientOptimizer("sgd", lr=0.5), monitor, *([ChunkedCrossEntropy()] if chunked else [])]
        trainer = L.Trainer(
            max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks, **tiny_trainer_kwargs
        )
        trainer.fit(module, hf_zoo.hf_data("gpt2", seq_len=64, batch_size=4))
        results.append(
            ({n: p.detach().clone() for n, p in module.student.named_parameters()}, monitor.last_report.peak_bytes)
        )
    (plain, plain_peak), (ours, chunked_peak) = results
    for name, reference in plain.items():
        torch.testing.assert_close(ours[name], reference, rtol=1e-4, atol=1e-6, msg=name)
    logits_bytes = 4 * 64 * 4096 * 4  # one (B, T, V) fp32 logits tensor of the student
    assert plain_peak - chunked_peak >= 0.9 * logits_bytes  # the teacher's logits (no grad) are still made whole

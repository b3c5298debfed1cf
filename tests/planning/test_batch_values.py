"""The estimator answers value questions about the batch as the real step does (transformers 4.x masks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import EstimationError, estimate_memory
from lightning_lowmem.cli import main
from lightning_lowmem.planning._batch_values import BatchValues


class MaskedModel(nn.Module):
    """Builds a (B, T, T) mask only when a token is padded, as transformers 4.x's ``padding_mask.all()`` does;
    without a mask it makes an all-ones one itself (BERT's way), so that question is asked either way."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
        hidden = self.embed(input_ids)  # (B, T, C)
        if not bool(attention_mask.to(torch.bool).all()):  # padded: a (B, T, T) mask, 4 KiB per row at T=32
            mask = attention_mask[:, None, :].expand(-1, input_ids.shape[1], -1).to(hidden.dtype)  # (B, T, T)
            hidden = hidden + (mask @ hidden) * 1e-3
        return self.head(hidden).sum()


def loss(model, batch):
    return model(**batch)


def batch(padded: bool) -> dict[str, torch.Tensor]:
    mask = torch.ones(4, 32, dtype=torch.long)
    if padded:
        mask[:, 24:] = 0
    return {"input_ids": torch.zeros(4, 32, dtype=torch.long), "attention_mask": mask}


MASK_BYTES = 4 * 32 * 32 * 4  # the (B, T, T) float32 mask the padded branch builds


def estimate(batch_: dict[str, torch.Tensor]):
    return estimate_memory(MaskedModel(), batch_, loss_fn=loss, device="cpu")


def test_the_estimate_takes_the_branch_the_real_step_takes():
    unpadded, padded = estimate(batch(False)), estimate(batch(True))
    assert padded.peak_bytes - unpadded.peak_bytes >= MASK_BYTES  # the padded batch built its mask
    no_mask = estimate({"input_ids": torch.zeros(4, 32, dtype=torch.long)})  # the model's own all-ones mask
    assert padded.peak_bytes - no_mask.peak_bytes >= MASK_BYTES
    # no values: the mask counts as all ones (unpadded), as planning.attention.batch_is_padded takes it (before
    # issue #33: zeros, i.e. padded -- the real all-ones mask and the meta one took two branches)
    meta = {key: value.to("meta") for key, value in batch(False).items()}
    assert estimate(meta).peak_bytes == unpadded.peak_bytes


class ActivationBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.layer(x)
        return hidden.sum() if bool((hidden > 0).all()) else hidden.mean()  # a question about an activation


def test_a_question_about_an_activation_is_still_an_estimation_error():
    with pytest.raises(EstimationError, match=r"depends on tensor \*values\*"):
        estimate_memory(ActivationBranch(), torch.ones(2, 8), loss_fn=lambda m, b: m(b), device="cpu")


def test_batch_values_follow_views_literals_and_in_place_writes():
    from lightning_lowmem._compat.fake_mode import fake_tensor_mode

    real = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with fake_tensor_mode():
        fake = torch.empty(2, 3, dtype=torch.long)
        with BatchValues(real, fake):
            assert not bool(fake.bool().all())
            assert int(fake[:, [-1, 0]].sum()) == 3  # indexed with a literal list (a real tensor inside)
            copy = fake.clone()
            copy[0, 2] = 1  # in place, from a known value: still known
            assert bool(copy.bool().all())
            ones = torch.ones(2, 3, dtype=torch.long)  # a factory: known
            assert int(ones.sum()) == 6


def test_lowmem_estimate_reports_an_estimation_error_in_one_line(monkeypatch, capsys):
    import lightning_lowmem.planning.estimate as estimate
    import lightning_lowmem.planning.plan as plan

    def fails(*args, **kwargs):
        raise EstimationError("estimate_memory could not run Model's training step on fake tensors:\nsecond line")

    monkeypatch.setattr(estimate, "estimate_memory", fails)
    monkeypatch.setattr(plan, "plan_memory", fails)
    args = [
        "--model",
        "lightning_lowmem.demo.CharLM",
        "--data",
        "lightning_lowmem.demo.CharLMDataModule",
        "--device",
        "cpu",
    ]
    for extra in ([], ["--budget", "1GiB"]):
        assert main(["estimate", *extra, *args]) == 1
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if not line.startswith("--budget ")]  # what the budget was read as
        assert lines[0] == "error: estimate_memory could not run Model's training step on fake tensors: second line"
        assert "Traceback" not in err


def test_every_hugging_face_family_estimates_with_a_mask_without_one_and_on_meta(hf_family):
    """transformers 4.x asked `padding_mask.all()` (every family with a mask) and BERT `torch.all(mask == 1)`
    (even without one): `aten._local_scalar_dense` on fake tensors. Each form of the batch now estimates."""
    hf_zoo = pytest.importorskip("tests.hf_zoo")
    module, batch_ = hf_zoo.hf_module(hf_family), hf_zoo.hf_batch(hf_family, seq_len=16)
    unmasked = {key: value for key, value in batch_.items() if key != "attention_mask"}
    on_meta = {key: value.to("meta") for key, value in batch_.items()}
    unpadded = {
        key: torch.ones_like(value) if key.endswith("attention_mask") else value for key, value in batch_.items()
    }
    peaks = [estimate_memory(module, b, device="cpu").peak_bytes for b in (batch_, unmasked, on_meta, unpadded)]
    assert all(peak > 0 for peak in peaks)
    # a mask on meta has no values: it is taken as unpadded (planning.attention_kernels.batch_is_padded), as a packed batch
    assert peaks[2] == peaks[3]


class CausalBufferSeq2Seq(nn.Module):
    """``nn.Transformer`` with its causal ``tgt_mask`` registered as a buffer: ``_detect_is_causal_mask`` compares
    the mask's *values* with a fresh causal mask in every forward."""

    def __init__(self, length: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 32)
        self.transformer = nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 10)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        return self.head(self.transformer(x, x, tgt_mask=self.causal_mask).mean(dim=1))


def test_nn_transformer_with_a_causal_mask_buffer_is_estimated_exactly():
    import warnings

    from lightning_lowmem import TrainingConfig, measure_memory
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import _train_step, default_loss

    generator = torch.Generator().manual_seed(0)
    batch_ = (torch.randint(0, 50, (4, 12), generator=generator), torch.randint(0, 10, (4,), generator=generator))
    estimated = estimate_memory(CausalBufferSeq2Seq(), batch_, device="cpu")  # was: EstimationError (values)
    model, config = CausalBufferSeq2Seq(), TrainingConfig(optimizer="adamw")
    optimizer = build_optimizer("adamw", list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch_, default_loss, optimizer, config, None, loop="torch")
        measured = measure_memory(
            _train_step, model, batch_, default_loss, optimizer, config, None, loop="torch", module=model
        )
    assert estimated.peak_bytes == measured.peak_bytes

"""compress_activations / exact_activations: bounded gradient error, charlm loss, memory cut, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.demo.charlm import CharGPT, CharLMDataModule, GPTConfig
from lightning_lowmem.functional.compression import (
    CompressionStats,
    _dequantize_int8,
    _quantize_int8,
    compress_activations,
    exact_activations,
)
from lightning_lowmem.memory import measure_memory


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared CPU run ~20x faster single-threaded (no waiting for a busy second core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gpt(n_layer: int = 2, n_embd: int = 32, block_size: int = 16) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=block_size))


def _loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    targets = idx.roll(-1, 1) if targets is None else targets
    logits = model(idx)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _flat_grad(
    model: nn.Module, idx: torch.Tensor, mode: str | None, min_bytes: int = 0
) -> tuple[torch.Tensor, CompressionStats]:
    model.zero_grad(set_to_none=True)
    stats = CompressionStats()
    if mode is None:
        loss = _loss(model, idx)
    else:
        with compress_activations(mode, min_bytes=min_bytes, stats=stats):
            loss = _loss(model, idx)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


@pytest.mark.parametrize(("mode", "bound", "ratio"), [("bf16", 0.01, 2.0), ("int8", 0.05, 3.0)])
def test_relative_gradient_error_is_bounded(tiny_gpt, mode, bound, ratio):
    idx = torch.randint(0, 256, (8, 16))
    exact, _ = _flat_grad(tiny_gpt, idx, None)
    approx, stats = _flat_grad(tiny_gpt, idx, mode)
    error = ((approx - exact).norm() / exact.norm()).item()
    assert 0 < error < bound
    assert stats.packed > 10
    assert stats.ratio >= ratio


def test_cpu_mode_on_a_cpu_device_is_a_no_op(tiny_gpt):
    idx = torch.randint(0, 256, (4, 16))
    exact, _ = _flat_grad(tiny_gpt, idx, None)
    same, stats = _flat_grad(tiny_gpt, idx, "cpu")
    assert torch.equal(same, exact)
    assert stats.packed == 0 and stats.kept > 0


def test_parameters_and_their_views_are_never_packed():
    layer = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    with compress_activations("int8", min_bytes=0) as stats:
        out = layer(x * 1.0)  # addmm saves its input (packed) and weight.t() (a parameter view: kept)
    out.sum().backward()
    assert (stats.packed, stats.kept) == (1, 1)
    assert stats.bytes_in == x.numel() * 4


def test_small_and_non_float_tensors_are_kept():
    emb = nn.Embedding(256, 64)
    idx = torch.randint(0, 256, (4, 8))  # int64 indices: saved, never packed
    with compress_activations("bf16", min_bytes=1 << 20) as stats:
        out = torch.tanh(emb(idx))  # (4, 8, 64) fp32 = 8 KiB < min_bytes
    out.sum().backward()
    assert stats.packed == 0 and stats.kept >= 2


def test_exact_activations_opts_out(tiny_gpt):
    idx = torch.randint(0, 256, (4, 16))
    exact, _ = _flat_grad(tiny_gpt, idx, None)
    tiny_gpt.zero_grad(set_to_none=True)
    with compress_activations("int8", min_bytes=0) as stats, exact_activations():
        loss = _loss(tiny_gpt, idx)
    loss.backward()
    assert stats.packed == 0
    assert torch.equal(torch.cat([p.grad.flatten() for p in tiny_gpt.parameters()]), exact)


def test_int8_roundtrip_error_is_within_half_a_step_per_row():
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)  # rows of very different scale
    quantized, scale = _quantize_int8(x)
    assert quantized.dtype == torch.int8 and scale.shape == (32, 1)
    assert ((quantized.float() * scale - x).abs() <= scale / 2 + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_packing_allocates_no_full_size_float_temporary(dtype):
    x = torch.randn(64, 32, 256).to(dtype)  # 2048 rows, packed 256 rows (64K elements) at a time
    x_bytes = x.numel() * x.element_size()
    packed = measure_memory(_quantize_int8, x)  # the peak counts x itself
    quantized, scale = _quantize_int8(x)
    temporaries = 2 * 4 * (1 << 16) + (1 << 14)  # one fp32 chunk and its |x|, plus per-row scales
    assert packed.peak_bytes - x_bytes <= quantized.numel() + scale.numel() * 4 + temporaries
    unpacked = measure_memory(_dequantize_int8, quantized, scale, dtype, x.shape)
    restored = _dequantize_int8(quantized, scale, dtype, x.shape)
    assert restored.dtype == dtype and restored.shape == x.shape
    packed_bytes = quantized.numel() + scale.numel() * 4
    assert unpacked.peak_bytes - packed_bytes <= x_bytes + temporaries
    assert ((restored.float() - x.float()).abs() <= scale.reshape(64, 32, 1) * 0.51 + x.float().abs() / 128).all()


def test_int8_cuts_charlm_activation_bytes_2_5x():
    model = _gpt(n_layer=6, n_embd=64, block_size=64)
    idx = torch.randint(0, 256, (16, 64))

    def step(mode: str | None) -> None:
        if mode is None:
            _loss(model, idx).backward()
            return
        with compress_activations(mode, min_bytes=1 << 14):
            loss = _loss(model, idx)
        loss.backward()

    base = measure_memory(step, None, module=model)
    model.zero_grad(set_to_none=True)
    packed = measure_memory(step, "int8", module=model)
    ratio = base.breakdown["activations"] / packed.breakdown["activations"]
    assert ratio >= 2.5, f"activations {base.breakdown['activations']} -> {packed.breakdown['activations']}"


def _train_losses(mode: str | None, steps: int) -> list[float]:
    data = CharLMDataModule(block_size=32, batch_size=16, max_chars=60_000)
    data.setup("fit")
    model = _gpt(n_layer=2, n_embd=64, block_size=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses = []
    for step, (x, y) in enumerate(data.train_dataloader()):
        if step == steps:
            break
        if mode is None:
            loss = _loss(model, x, y)
        else:
            with compress_activations(mode, min_bytes=0):
                loss = _loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_charlm_training_loss_stays_within_2_percent():
    steps = 60
    base = _train_losses(None, steps)
    assert base[-1] < 0.7 * base[0]  # it learns
    tail = sum(base[-10:]) / 10
    for mode in ("bf16", "int8"):
        losses = _train_losses(mode, steps)
        assert abs(sum(losses[-10:]) / 10 - tail) / tail < 0.02, (mode, losses[-10:], base[-10:])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="fp8"), ValueError, r"`mode`='fp8' is unknown; choose one of \['bf16', 'int8', 'cpu'\]"),
        (dict(mode="int8", min_bytes=-1), ValueError, r"`min_bytes`=-1 must be >= 0"),
        (dict(mode="int8", min_bytes=1.5), TypeError, r"`min_bytes` must be an int \(bytes\), got float"),
        (dict(mode="int8", min_bytes=True), TypeError, r"`min_bytes` must be an int \(bytes\), got bool"),
    ],
)
def test_bad_input_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        with compress_activations(**kwargs):
            pass


def test_estimate_memory_uses_the_same_transforms():
    """The estimator runs checkpoint_ / compress_activations on fake tensors: same cuts as measured."""
    from lightning_lowmem.planning.estimate import estimate_memory

    model = _gpt(n_layer=2, n_embd=64, block_size=64)
    idx = torch.randint(0, 256, (16, 64))
    plain = estimate_memory(model, idx, loss_fn=_loss, device="cpu", steps=1)
    int8 = estimate_memory(model, idx, loss_fn=_loss, device="cpu", steps=1, activation_compression="int8")
    both = estimate_memory(
        model, idx, loss_fn=_loss, device="cpu", steps=1, activation_compression="int8", activation_checkpointing="auto"
    )
    assert plain.breakdown["activations"] >= 2.5 * int8.breakdown["activations"]
    assert int8.breakdown["activations"] > both.breakdown["activations"]


def test_compress_activations_takes_its_config_and_validates_only_through_it():
    """#27: the mode name is a shorthand that builds a CompressionConfig; the errors are the config's."""
    from lightning_lowmem.functional.config import COMPRESSION_MIN_BYTES, CompressionConfig

    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    with compress_activations(CompressionConfig("bf16", min_bytes=0)) as stats:
        mlp(torch.randn(128, 256)).square().mean().backward()
    assert (stats.packed, stats.ratio) == (4, 2.0)
    with compress_activations("bf16") as stats:  # default min_bytes: the 16 KiB activations stay exact
        mlp(torch.randn(4, 256)).square().mean().backward()
    assert stats.packed == 0 and COMPRESSION_MIN_BYTES == 65536
    with pytest.raises(ValueError, match=r"`mode`='int4' is unknown; choose one of \['bf16', 'int8', 'cpu'\]"):
        with compress_activations("int4"):
            pass
    with pytest.raises(ValueError, match=r"`min_bytes`=5 is given beside a CompressionConfig; set it in the config"):
        with compress_activations(CompressionConfig("int8"), min_bytes=5):
            pass


def test_checkpointed_blocks_inputs_are_compressed_with_a_bounded_gradient_error(monkeypatch):
    """Stacked on checkpointing, compression stores each checkpointed block's saved input (the boundary, saved by
    torch's non-reentrant checkpoint through the saved-tensor hooks) as int8; the gradient error stays within
    compression's bound (the same 5% as above, against checkpointing alone)."""
    from lightning_lowmem.functional import compression
    from lightning_lowmem.functional.checkpointing import checkpoint_

    model = _gpt(n_layer=4, n_embd=32, block_size=16)
    assert checkpoint_(model, "auto").num_wrapped == 4
    idx = torch.randint(0, 256, (8, 16))
    exact, _ = _flat_grad(model, idx, None)
    quantized_shapes = []

    def recording_quantize(tensor):
        quantized_shapes.append(tuple(tensor.shape))
        return _quantize_int8(tensor)

    monkeypatch.setattr(compression, "_quantize_int8", recording_quantize)
    approx, stats = _flat_grad(model, idx, "int8")
    error = ((approx - exact).norm() / exact.norm()).item()
    assert 0 < error < 0.05
    # (B, T, C) inputs packed: the 4 blocks' (nothing inside a block is saved) and the final norm's
    assert quantized_shapes.count((8, 16, 32)) == 5
    assert stats.ratio > 3

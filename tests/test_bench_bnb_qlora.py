"""benchmarks/_bnb_qlora.py: the memory model of LitGPT's bitsandbytes QLoRA (the published benchmark's LitGPT
QLoRA rows) keeps what bitsandbytes 0.42's ``MatMul4Bit`` keeps, for as long as it keeps it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import bench_published  # noqa: E402
from benchmarks._bnb_qlora import Bnb4bitLinear, bnb_qlora_, saved_inputs  # noqa: E402
from lightning_lowmem.cli.hf_config import hf_config_model  # noqa: E402
from lightning_lowmem.memory import measure_memory  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, BATCH, SEQ = 64, 176, 2, 320, 2, 256


@pytest.fixture
def model(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = hf_config_model(str(tmp_path))
    assert bnb_qlora_(model, r=8, alpha=16, target=["q_proj", "v_proj"], dropout=0.05) == 7 * LAYERS + 1
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(0)
    for name, param in model.named_parameters():  # to_empty left them uninitialised (the 4-bit codes are unread)
        if param.is_floating_point():
            torch.nn.init.normal_(param) if "lora_A" in name or "embed" in name else torch.nn.init.ones_(param)
    for name, buffer in model.named_buffers():  # to_empty left the rotary frequencies uninitialised
        if name.endswith("inv_freq"):
            buffer.copy_(1.0 / 10000 ** (torch.arange(0, buffer.numel()) / buffer.numel()))
    return model


def _held_bytes(*outputs: torch.Tensor) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for o in outputs for t in saved_inputs(o)}
    return sum(storages.values())


# per block the attention input (not in the first block: nothing before it needs a gradient), the attention output,
# the MLP input and silu(gate) * up, bf16; and the head's input
EXPECTED = (LAYERS * (3 * HIDDEN + INTERMEDIATE)) * BATCH * SEQ * 2


def test_each_4bit_linear_keeps_its_input_and_backward_does_not_free_it(model):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    logits = bench_published._litgpt_logits(model, ids)
    assert _held_bytes(logits[0]) == EXPECTED == 753_664
    bench_published._litgpt_cross_entropy(logits, ids).backward()
    assert _held_bytes(logits[0]) == EXPECTED  # a plain ctx attribute: alive as long as the graph
    assert model.model.layers[1].self_attn.q_proj.lora_B.grad is not None


def test_the_previous_iterations_inputs_are_alive_at_the_end_of_the_next_forward(model):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    previous = bench_published._litgpt_logits(model, ids)
    bench_published._litgpt_cross_entropy(previous, ids).backward()
    logits = bench_published._litgpt_logits(model, ids)  # LitGPT's loop: `logits` still names the previous list
    assert _held_bytes(previous[0], logits[0]) == 2 * EXPECTED


def test_forward_decodes_the_weight_to_float16_then_copies_it_to_the_inputs_dtype():
    layer = Bnb4bitLinear(1024, 2048, None, "cpu")
    assert layer.codes.numel() == 1024 * 2048 // 2 and layer.absmax.numel() == 1024 * 2048 // 64 * 4
    x = torch.zeros(4, 1024, dtype=torch.bfloat16)
    report = measure_memory(layer, x, device="cpu")
    weight_bytes = 1024 * 2048 * 2
    # the float16 decode and its bf16 copy, alive together, and the input (the output comes after the decode's end)
    assert report.peak_bytes == 2 * weight_bytes + x.nbytes == 8_396_800
    assert layer(x).dtype == torch.bfloat16 and layer(x.half()).dtype == torch.float16

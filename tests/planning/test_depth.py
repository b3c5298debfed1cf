"""planning/_depth.py: the secant of two shallow copies bounds a deep model's step from below (and equals it where
the peak is affine in the depth); the planner's answer is the same with the bound as without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.demo import CharLM
from lightning_lowmem.planning import _depth
from lightning_lowmem.planning._components import Cuts, probe_model
from lightning_lowmem.planning._depth import (
    DEPTHS,
    deeper_step,
    depth_free,
    depth_stack,
    one_block_fewer,
    secant_bound,
    step_cuts,
)
from lightning_lowmem.planning.estimate import TrainingConfig, default_loss
from lightning_lowmem.planning.plan import plan_memory

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 6) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _batch(tokens: int = 96) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1024, (2, tokens))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _peaks(module: nn.Module, batch, config: TrainingConfig, loss_fn=default_loss, device: str = "cuda"):
    """(whole step's peak, forward's peak) of ``module`` at full depth, and the secant bounds of both."""
    stack = depth_stack(module)
    assert stack is not None

    def run(model, forward_only):
        probe = probe_model(
            model, batch, config, loss_fn=loss_fn, device=device, loop="torch", forward_only=forward_only
        )
        return probe.peak_bytes, probe.peak_breakdown

    found = {}
    for forward_only in (False, True):
        low, high = (run(stack.shallow(module, depth), forward_only) for depth in DEPTHS)
        bound, breakdown = secant_bound(low, high, stack.depth)
        assert sum(breakdown.values()) == bound
        found[forward_only] = (run(module, forward_only)[0], bound)
    return found


MIXES = [
    {"precision": "32-true"},
    {"precision": "bf16-true", "lora": {"r": 4}},
    {"precision": "bf16-mixed", "lora": {"r": 4}, "cross_entropy": "chunked"},
    {"precision": "bf16-true", "lora": {"r": 4}, "checkpointing": "auto", "cross_entropy": "chunked"},
    {"precision": "bf16-true", "lora": {"r": 4}, "checkpointing": "auto"},
    {"precision": "32-true", "activation_compression": "bf16", "compression_min_bytes": 0},
    {"precision": "bf16-true", "micro_batch_size": 1},
]


def test_the_secant_of_two_shallow_copies_bounds_a_llama_step_from_below():
    model, batch = _llama(6), _batch()
    exact = 0
    for mix in MIXES:
        config = TrainingConfig(optimizer="adamw", **mix)
        assert depth_free(config)
        for forward_only, (peak, bound) in _peaks(model, batch, config).items():
            assert 0 < bound <= peak, (config.describe(), forward_only, bound, peak)
            exact += bound == peak  # a peak affine in the depth: the bound is the figure itself
    assert exact >= len(MIXES)  # most of these steps' peaks are affine (on an 8B Llama at 4096 tokens: all checked)


def test_the_secant_bound_on_a_gpt_of_blocks_and_on_cpu():
    torch.manual_seed(0)
    model = CharLM(n_layer=6, n_head=2, n_embd=64, block_size=64)
    x = torch.randint(0, 256, (8, 64))
    for mix in ({"precision": "32-true"}, {"precision": "bf16-mixed", "checkpointing": "auto"}):
        found = _peaks(model, (x, x.roll(-1, 1)), TrainingConfig(optimizer="adamw", **mix), device="cpu")
        for peak, bound in found.values():
            assert 0 < bound <= peak


def test_the_bound_is_below_a_peak_that_bends_with_depth():
    """A model whose forward saves little per block but whose head is large: at 2 and 3 blocks the head's moment is
    the peak, deeper the blocks' saved activations are; the secant then stays below the deep peak (a bound, not
    the figure)."""
    model, batch = _llama(12), _batch(32)
    config = TrainingConfig(optimizer="adamw", precision="32-true")
    for peak, bound in _peaks(model, batch, config).values():
        assert bound <= peak


def test_depth_stack_and_depth_free_refuse_what_the_bound_does_not_cover():
    model = _llama(6)
    assert depth_stack(model) == _depth.DepthStack("model.layers", 6)
    assert depth_stack(_llama(4)) is None  # fewer than MIN_BLOCKS: the full run is about as cheap
    shallow = depth_stack(model).shallow(model, 2)
    assert len(shallow.model.layers) == 2 and len(model.model.layers) == 6  # the model itself is untouched
    assert shallow.lm_head is model.lm_head  # shared, not copied
    model.model.layers[3].self_attn.sliding_window = 16  # one block unlike the others (Gemma-style)
    assert depth_stack(model) is None
    model = _llama(6)
    model.model.layers[1].register_forward_hook(lambda *args: None)
    assert depth_stack(model) is None
    assert depth_free(TrainingConfig(precision="bf16-true", lora={"r": 8, "quantize_base": "int8"}))
    assert not depth_free(TrainingConfig(checkpointing=2))  # every 2nd block: a pattern with a period
    assert not depth_free(TrainingConfig(lora={"r": 8, "target": "model.layers.0.*"}))  # names layers
    assert not depth_free(TrainingConfig(freeze_layers={"blocks": 2}))  # the first K blocks differ


def test_the_plan_is_the_same_with_the_bound_and_fewer_full_depth_runs(monkeypatch):
    model, batch = _llama(8), _batch(128)
    kwargs = {"device": "cuda", "loras": [None, {"r": 4}], "full_check": "always"}
    budget = 9 * 2**20

    def plan():
        return plan_memory(model, batch, budget, **kwargs)

    with_bound = plan()
    monkeypatch.setattr(_depth, "MIN_BLOCKS", 10**6)  # no stack: every candidate runs at full depth
    without = plan()
    assert with_bound.chosen.config == without.chosen.config
    assert with_bound.predicted_peak_bytes == without.predicted_peak_bytes  # the full estimate, to the byte
    verdicts = {c.config: c.fits for c in without.candidates}
    assert {c.config: c.fits for c in with_bound.candidates if c.config in verdicts} == {
        c.config: verdicts[c.config] for c in with_bound.candidates if c.config in verdicts
    }
    assert any("shallow" in note for note in with_bound.notes)


def _figures(probe):
    return probe.peak_bytes, probe.peak_breakdown, probe.step_bytes, probe.step_breakdown, probe.trainable


@pytest.mark.parametrize("loop", ["torch", "lightning"])
def test_the_two_block_forward_is_read_off_the_three_block_one(loop):
    """``one_block_fewer``: the 2-block copy's forward peak and breakdown from the 3-block copy's forward, cut where
    its second and last blocks start, to the byte (no 2-block run in the planner's forward bound)."""
    model, batch = _llama(6), _batch()
    stack = depth_stack(model)
    cut = Cuts(("model.layers.1", "model.layers.2"), "model.layers.2")
    for mix in MIXES:
        config = TrainingConfig(optimizer="adamw", **mix)
        for device in ("cuda", "cpu"):
            kwargs = {"loss_fn": default_loss, "device": device, "loop": loop, "forward_only": True}
            deeper = probe_model(stack.shallow(model, 3), batch, config, cut_at=cut, **kwargs)
            shallow = probe_model(stack.shallow(model, 2), batch, config, **kwargs)
            assert deeper.segments is not None and deeper.segments.held["parameters"] > 0
            assert one_block_fewer(deeper.segments) == (shallow.peak_bytes, shallow.peak_breakdown), mix


STEP_MIXES = [
    {"precision": "32-true"},
    {"precision": "bf16-true", "lora": {"r": 4}, "checkpointing": "auto", "cross_entropy": "chunked"},
    {"precision": "bf16-true", "lora": {"r": 4, "quantize_base": "int8"}, "checkpointing": "auto"},
    {"precision": "bf16-mixed", "checkpointing": "auto"},
    {"precision": "32-true", "activation_compression": "bf16", "compression_min_bytes": 0},
    {"precision": "32-true", "cross_entropy": "chunked"},
]


@pytest.mark.parametrize("layers, tokens", [(6, 96), (12, 32)])
def test_a_deep_step_is_read_off_the_three_block_one(layers, tokens):
    """``deeper_step``: the full depth's model-side figures (peak, bytes at ``step()``, their breakdowns, trained
    parameters) from the 3-block copy's whole step cut at its blocks' forward and backward starts, to the byte,
    wherever the 4-block copy agrees with it (the planner's check; it agrees on each of these)."""
    model, batch = _llama(layers), _batch(tokens)
    stack = depth_stack(model)
    for mix in STEP_MIXES:
        config = TrainingConfig(optimizer="adamw", **mix)
        for device in ("cuda", "cpu"):
            kwargs = {"loss_fn": default_loss, "device": device, "loop": "torch"}
            copy = probe_model(stack.shallow(model, 3), batch, config, cut_at=step_cuts(stack.path), **kwargs)
            check = probe_model(stack.shallow(model, 4), batch, config, **kwargs)
            assert _figures(deeper_step(copy, 4)) == _figures(check), (mix, device)
            deep, full = deeper_step(copy, layers), probe_model(model, batch, config, **kwargs)
            assert _figures(deep) == _figures(full), (mix, device)
            assert sum(deep.peak_breakdown.values()) == deep.peak_bytes
            assert sum(deep.step_breakdown.values()) == deep.step_bytes


def test_a_deep_step_is_not_read_where_it_does_not_apply():
    """Lightning's loop keeps the last step's gradients into the forward: no figures from the segments; bf16-mixed
    with LoRA leaves per block what the segments do not tell: the 4-block check refuses it."""
    model, batch = _llama(6), _batch()
    stack = depth_stack(model)
    lora = TrainingConfig(optimizer="adamw", precision="bf16-true", lora={"r": 4})
    kwargs = {"loss_fn": default_loss, "device": "cuda"}
    kept = probe_model(stack.shallow(model, 3), batch, lora, cut_at=step_cuts(stack.path), loop="lightning", **kwargs)
    assert kept.segments.held["gradients"] > 0 and deeper_step(kept, 6) is None
    mixed = TrainingConfig(optimizer="adamw", precision="bf16-mixed", lora={"r": 4})
    copy = probe_model(stack.shallow(model, 3), batch, mixed, cut_at=step_cuts(stack.path), loop="torch", **kwargs)
    check = probe_model(stack.shallow(model, 4), batch, mixed, loop="torch", **kwargs)
    assert deeper_step(copy, 4) != check


@pytest.mark.parametrize("full_check", ["near-budget", "always"])
def test_every_figure_of_the_plan_is_the_same_without_the_depth_shortcuts(monkeypatch, full_check):
    """The plan with the shallow copies (bounds, the 2-block forward read off the 3-block one, full-depth figures
    read off the 3-block step) and without them (every candidate at full depth): every candidate's figure and
    breakdown, the baseline's, the choice, to the byte."""
    model, batch = _llama(8), _batch(128)
    kwargs = {"device": "cuda", "loras": [None, {"r": 4}], "full_check": full_check}

    def figures(plan):
        rows = {c.config: (c.method, c.report.peak_bytes, c.report.breakdown, c.fits) for c in plan.candidates}
        return plan.chosen.config, plan.predicted_peak_bytes, rows

    with_shortcuts = plan_memory(model, batch, 9 * 2**20, **kwargs)
    assert any("stood in for full-depth runs" in note for note in with_shortcuts.notes)
    monkeypatch.setattr(_depth, "MIN_BLOCKS", 10**6)  # no stack: every candidate runs at full depth
    without = plan_memory(model, batch, 9 * 2**20, **kwargs)
    (chosen, peak, rows), (full_chosen, full_peak, full_rows) = figures(with_shortcuts), figures(without)
    assert (chosen, peak) == (full_chosen, full_peak)
    assert rows[with_shortcuts.baseline.config] == full_rows[without.baseline.config]  # the "as configured" figure
    complete = [config for config, row in rows.items() if row[0] != "lower bound" and config in full_rows]
    assert len(complete) >= 2  # the baseline and the chosen, at least
    assert {config: rows[config] for config in complete} == {config: full_rows[config] for config in complete}
    assert {config: row[3] for config, row in rows.items() if config in full_rows} == {
        config: full_rows[config][3] for config in rows if config in full_rows
    }

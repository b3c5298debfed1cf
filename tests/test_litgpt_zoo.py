"""Every feature on LitGPT's ``GPT`` (Pythia- and Llama-style, tests/litgpt_zoo.py), through ``Trainer.fit``.

Like tests/test_hf_zoo.py: each case adds the callbacks a user would add, trains the family's tiny model for two
steps and checks the feature's *effect* on LitGPT's own modules -- ``Block`` s checkpointed, adapters on exactly
the attention / MLP linears, bytes packed, optimizer state shrunk, sparsity exactly at target, layers fake-quantized
or quantized, logits deferred -- never only that it ran. Then the estimator (byte-exact against the fit) and the
planner at a budget only a lean mix fits. LitGPT is an optional extra (the transformers-4 leg of ``make
test-compat``); elsewhere this file is skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import lightning as L
import pytest
import torch

from lightning_lowmem import (
    ActivationCheckpointing,
    ActivationCompression,
    ChunkedCrossEntropy,
    LowMemoryStrategy,
    LowRankAdapters,
    MemoryEfficientOptimizer,
    MemoryMonitor,
    PostTrainingQuantization,
    QuantizationAwareTraining,
    ScheduledPruning,
)
from lightning_lowmem.functional.checkpointing import checkpoint_, checkpointed_modules
from lightning_lowmem.functional.cross_entropy import DeferredLogits
from lightning_lowmem.functional.optimizers.savings import predicted_state_bytes
from lightning_lowmem.functional.pruning.masks import embedding_parameters, head_parameters
from lightning_lowmem.memory import state_bytes
from lightning_lowmem.planning.estimate import estimate_memory

zoo = pytest.importorskip("tests.litgpt_zoo")
hf_zoo = pytest.importorskip("tests.hf_zoo")  # size_ratio: LitGPT's rope cos / sin are non-persistent buffers

BLOCKS = ["model.transformer.h.0", "model.transformer.h.1"]


@pytest.fixture(params=list(zoo.FAMILIES))
def litgpt_family(request) -> str:
    return request.param


@dataclass
class Run:
    family: str
    module: L.LightningModule
    trainer: L.Trainer
    callbacks: list[L.Callback]
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)

    def callback(self, kind: type) -> Any:
        return next(c for c in self.callbacks if isinstance(c, kind))


class Spy(L.Callback):
    """Records, on the first training batch, what is in force while the step runs."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.seen:
            self.seen["checkpointed"] = checkpointed_modules(pl_module)
            self.seen["linear_types"] = {
                name: type(sub).__name__ for name, sub in pl_module.named_modules() if isinstance(sub, torch.nn.Linear)
            }
            self.seen["logits"] = pl_module(batch[0][:, :-1])


def _linears(family: str) -> list[str]:
    """The adapted / fake-quantized layers: every block's attention and MLP linears (not the head)."""
    return [f"{block}.{linear}" for block in BLOCKS for linear in zoo.LINEARS[family]]


def check_checkpointing(run: Run) -> None:
    assert run.callback(ActivationCheckpointing).wrapped == BLOCKS == run.seen["checkpointed"]
    assert all(type(run.module.get_submodule(name)).__name__ == "Block" for name in BLOCKS)
    assert checkpointed_modules(run.module) == []  # handed back after fit


def check_lora(run: Run) -> None:
    report = run.callback(LowRankAdapters).report
    assert report.wrapped == _linears(run.family)  # 4 (Pythia) / 5 (Llama) per block, the head left out
    assert report.trained == []  # LitGPT's lm_head is a pretrained vocabulary head, not a fresh task head
    trainable = {name: p for name, p in run.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    rank = 4
    linears = [run.module.get_submodule(name) for name in report.wrapped]
    expected = sum(rank * (layer.in_features + layer.out_features) for layer in linears)
    assert sum(p.numel() for p in trainable.values()) == expected
    assert not run.module.model.lm_head.weight.requires_grad
    now = dict(run.module.named_parameters())
    assert torch.equal(now["model.lm_head.weight"], run.before["model.lm_head.weight"])
    moved = [name for name, p in trainable.items() if "lora_B" in name and p.abs().sum() > 0]
    assert len(moved) == len(report.wrapped)  # zero-initialised B: every adapter got a gradient and stepped


def check_compression(run: Run) -> None:
    stats = run.callback(ActivationCompression).stats
    assert stats.packed > 0 and stats.bytes_out < 0.6 * stats.bytes_in  # int8 + a scale per row vs fp32


def check_optimizer(run: Run) -> None:
    optimizer = run.trainer.optimizers[0]
    assert type(optimizer).__name__ == "AdamW8bit"
    lean = state_bytes(run.module, [optimizer])["optimizer_state"]
    predicted, adamw = predicted_state_bytes("adamw8bit", run.module.parameters())
    assert lean == predicted
    # every matrix (>= 4096 weights) in 8 bits plus a scale per 256: about a quarter of AdamW's two fp32 moments
    assert 0.25 < lean / adamw < 0.30, lean / adamw


def check_pruning(run: Run) -> None:
    skip = embedding_parameters(run.module)  # the token table
    assert skip == {id(run.module.model.transformer.wte.weight)}
    heads = head_parameters(run.module)  # the task head, left out by default (#34): LitGPT's untied lm_head
    assert heads == {id(run.module.model.lm_head.weight)}
    targets = [p for p in run.module.parameters() if id(p) not in skip | heads]
    zeros = sum(int((p == 0).sum()) for p in targets)
    total = sum(p.numel() for p in targets)
    assert abs(zeros - 0.5 * total) <= 1, (zeros, total)  # global magnitude pruning: exactly at target
    assert int((run.module.model.lm_head.weight == 0).sum()) == 0
    assert int((run.module.model.transformer.wte.weight == 0).sum()) == 0


def check_structural(run: Run) -> None:
    model = run.module.model
    hidden = model.config.intermediate_size
    for block in model.transformer.h:  # half the FFN units removed, attention and the residual width kept
        fc = [block.mlp.fc] if run.family == "pythia" else [block.mlp.fc_1, block.mlp.fc_2]
        assert all(layer.out_features == hidden // 2 for layer in fc) and block.mlp.proj.in_features == hidden // 2
        assert block.attn.qkv.weight.shape == run.before["model.transformer.h.0.attn.qkv.weight"].shape
    assert model.lm_head.out_features == zoo.VOCAB  # the vocabulary head keeps every token
    assert run.callback(ScheduledPruning).structural_done
    optimized = {id(p) for group in run.trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in run.module.parameters()}  # rebound to the smaller weights
    assert run.module(zoo.litgpt_batch(2)[0]).shape == (2, zoo.SEQ_LEN + 1, zoo.VOCAB)


def check_ptq(run: Run) -> None:
    summary = run.callback(PostTrainingQuantization).summary
    ratio = hf_zoo.size_ratio(summary["before"]["bytes"], summary["after"]["bytes"], run.module)
    assert summary["met"] and ratio > 3.0, ratio  # 3.68x (Pythia), 3.74x (Llama): every matrix and table in int8
    expected = {*_linears(run.family), "model.lm_head", "model.transformer.wte"}
    assert set(summary["report"].converted) == expected
    idx = zoo.litgpt_batch(2)[0][:, :-1]
    for train in (False, True):  # quantized weights run in eval and train mode, under no_grad and without it
        run.module.train(train)
        with torch.no_grad():
            logits = run.module(idx)
        assert logits.shape == (2, zoo.SEQ_LEN, zoo.VOCAB) and torch.isfinite(logits).all()
        assert torch.isfinite(run.module(idx)).all()


def check_qat(run: Run) -> None:
    qat = run.callback(QuantizationAwareTraining)
    fake = sorted(name for name, kind in run.seen["linear_types"].items() if kind == "FakeQuantizedLinear")
    assert fake == sorted(qat.prepared) == sorted([*_linears(run.family), "model.lm_head"])
    # and at fit end converted to real int8 weights
    converted = [
        name
        for name in qat.prepared
        if type(run.module.get_submodule(name).weight).__name__ not in ("Parameter", "Tensor")
    ]
    assert converted == qat.prepared


def check_chunked(run: Run) -> None:
    assert run.callback(ChunkedCrossEntropy).heads == ["model.lm_head"]
    assert isinstance(run.seen["logits"], DeferredLogits)  # no (B, T, V) logits while training
    assert isinstance(run.module(zoo.litgpt_batch(1)[0]), torch.Tensor)  # handed back after fit


@dataclass
class Case:
    callbacks: Callable[[], list[L.Callback]]
    check: Callable[[Run], None]
    steps: int = 2


def _structural() -> list[L.Callback]:
    return [
        ScheduledPruning(
            "ln_structured",
            schedule="linear",
            target_sparsity=0.5,
            end_step=2,
            structural=True,
            parameter_names=["weight"],
            use_global_unstructured=False,
            pruning_norm=2,
        )
    ]


CASES = {
    "checkpointing": Case(lambda: [ActivationCheckpointing("auto")], check_checkpointing),
    "lora": Case(lambda: [LowRankAdapters(r=4)], check_lora),
    "compression": Case(lambda: [ActivationCompression("int8", min_bytes=0)], check_compression),
    "optimizer": Case(lambda: [MemoryEfficientOptimizer("adamw8bit", lr=0.01)], check_optimizer),
    "pruning": Case(lambda: [ScheduledPruning(schedule="constant", target_sparsity=0.5)], check_pruning),
    "structural": Case(_structural, check_structural, steps=3),  # removal at step 2, then a step on the smaller model
    "ptq": Case(lambda: [PostTrainingQuantization("int8_weight_only", latency_batches=0)], check_ptq),
    "qat": Case(lambda: [QuantizationAwareTraining("int8_weight_only")], check_qat),
    "chunked_loss": Case(lambda: [ChunkedCrossEntropy(chunk_size=16)], check_chunked),
}


def _fit(module, callbacks, tiny_trainer_kwargs, steps: int = 2, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **tiny_trainer_kwargs,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few-workers, ... : these tests are about effects
        trainer.fit(module, zoo.litgpt_data(), zoo.litgpt_data(batches=1))
    return trainer


@pytest.mark.parametrize("feature", list(CASES))
def test_every_feature_on_litgpt(feature, litgpt_family, tiny_trainer_kwargs):
    module = zoo.LitGPTModule(litgpt_family)
    spy = Spy()
    callbacks = [*CASES[feature].callbacks(), spy]
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = _fit(module, callbacks, tiny_trainer_kwargs, steps=CASES[feature].steps)
    CASES[feature].check(Run(litgpt_family, module, trainer, callbacks, before, spy.seen))


def test_checkpointed_blocks_give_the_same_gradients(litgpt_family):
    grads = []
    for checkpointing in (False, True):
        module = zoo.LitGPTModule(litgpt_family)
        if checkpointing:
            assert checkpoint_(module, "auto").wrapped == BLOCKS
        module.loss(zoo.litgpt_batch()).backward()
        grads.append({name: p.grad for name, p in module.named_parameters()})
    for name, reference in grads[0].items():
        assert torch.equal(grads[1][name], reference), name


def test_estimate_is_the_peak_the_fit_measures(litgpt_family, tiny_trainer_kwargs):
    estimate = estimate_memory(zoo.LitGPTModule(litgpt_family), zoo.litgpt_batch(), device="cpu")
    monitor = MemoryMonitor(summary=False)
    _fit(zoo.LitGPTModule(litgpt_family), [monitor], tiny_trainer_kwargs)
    assert monitor.last_report.peak_bytes == estimate.peak_bytes  # byte-exact, the memory core on CPU
    assert monitor.last_report.breakdown == estimate.breakdown


def test_a_budget_only_a_lean_mix_fits_trains_under_it(litgpt_family, tiny_trainer_kwargs):
    plain = estimate_memory(zoo.LitGPTModule(litgpt_family), zoo.litgpt_batch(), device="cpu").peak_bytes
    budget = int(0.55 * plain)  # below bf16-true alone: checkpointing, compression or a lean optimizer needed
    strategy = LowMemoryStrategy(memory_budget=budget)
    monitor = MemoryMonitor(summary=False)
    _fit(zoo.LitGPTModule(litgpt_family), [monitor], tiny_trainer_kwargs, strategy=strategy)
    plan = strategy.plan
    assert plan.config.describe() != "32-true + adamw"
    assert plan.predicted_peak_bytes <= 0.9 * budget  # the strategy's 10% margin
    assert monitor.last_report.peak_bytes == plan.predicted_peak_bytes <= budget

"""Every feature on every Hugging Face family of the zoo (GPT-2, Llama, BERT, T5), through ``Trainer.fit``.

One parametrised test: each case builds the callbacks (or strategy, or module) a user would add, trains the
family's tiny model for two steps on dict batches, and checks the feature's *effect* — blocks wrapped, bytes
packed, optimizer state shrunk, micro-batches run, adapters only trained, sparsity exactly at target, layers
converted — never only that it ran. Deeper per-feature tests live beside each feature.
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
    AutoMicrobatch,
    DistillationModule,
    LowMemoryStrategy,
    LowRankAdapters,
    MemoryEfficientOptimizer,
    MemoryMonitor,
    PostTrainingQuantization,
    QuantizationAwareTraining,
    ScheduledPruning,
)
from lightning_lowmem.functional.checkpointing import checkpointed_modules
from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.functional.pruning.masks import embedding_parameters, head_parameters
from lightning_lowmem.memory import state_bytes

hf_zoo = pytest.importorskip("tests.hf_zoo")

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "bert": "BertLayer", "t5": "T5Block"}


@dataclass
class Run:
    """What one case trained: the module, the trainer, its callbacks, the weights before fit."""

    family: str
    module: L.LightningModule
    trainer: L.Trainer
    callbacks: list[L.Callback]
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)  # observed by `Spy` during the first training step

    def callback(self, kind: type) -> Any:
        return next(c for c in self.callbacks if isinstance(c, kind))


class Spy(L.Callback):
    """Records, on the first training batch, what is in force while the step runs."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.seen:
            self.seen["checkpointed"] = checkpointed_modules(pl_module)
            config = getattr(getattr(pl_module, "model", None), "config", None)
            self.seen["use_cache"] = getattr(config, "use_cache", None)


def _blocks(run: Run) -> list[str]:
    return [name for name, sub in run.module.named_modules() if type(sub).__name__ == BLOCKS[run.family]]


def check_monitor(run: Run) -> None:
    report = run.callback(MemoryMonitor).last_report
    assert report.peak_bytes == sum(report.breakdown.values())
    params = sum(p.numel() * p.element_size() for p in run.module.parameters())
    assert report.breakdown["optimizer_state"] >= 2 * params  # AdamW: two moments per weight


def check_checkpointing(run: Run) -> None:
    wrapped = run.callback(ActivationCheckpointing).wrapped
    assert wrapped == _blocks(run) == run.seen["checkpointed"] and len(wrapped) >= 2
    if run.family != "bert":  # BERT has no KV cache while training; the others switch it off, then back on
        assert run.seen["use_cache"] is False and run.module.model.config.use_cache is True


def check_compression(run: Run) -> None:
    stats = run.callback(ActivationCompression).stats
    assert stats.packed > 0 and stats.ratio > 3.0  # int8 + a scale per row vs fp32


def check_optimizer(run: Run) -> None:
    optimizer = run.trainer.optimizers[0]
    assert type(optimizer).__name__ == "Adafactor"
    params = state_bytes(run.module)["parameters"]
    assert 0 < state_bytes(run.module, [optimizer])["optimizer_state"] < 0.1 * params  # factored second moments


def check_microbatch(run: Run) -> None:
    assert run.module.forward_calls == 4  # 2 steps x 2 micro-batches of 2 rows


def check_lora(run: Run) -> None:
    report = run.callback(LowRankAdapters).report
    assert report.wrapped
    trainable = {name: p for name, p in run.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    rank = 4
    expected = sum(
        rank * (layer.in_features + layer.out_features)
        for name, layer in run.module.named_modules()
        if name in report.wrapped
    )
    assert sum(p.numel() for p in trainable.values()) == expected
    now = dict(run.module.named_parameters())
    frozen = [name for name in now if name not in trainable]
    assert len(frozen) >= len(run.before) - 1  # every base weight still there (a tied pair may list once)
    for name in frozen:  # the frozen base did not move (Conv1D weights may now be in nn.Linear's layout)
        weight = run.before.get(name, run.before.get(name.replace(".base_layer", "").replace(".base", "")))
        assert weight is not None, name
        assert torch.equal(now[name], weight) or torch.equal(now[name].t(), weight), name


def check_pruning(run: Run) -> None:
    skip = embedding_parameters(run.module) | head_parameters(run.module)  # tables, tied and task heads: left out
    targets = {id(p): p for p in run.module.parameters() if id(p) not in skip}.values()  # a tied weight once
    zeros = sum(int((p == 0).sum()) for p in targets)
    total = sum(p.numel() for p in targets)
    assert abs(zeros - 0.5 * total) <= 1, (zeros, total)  # global magnitude pruning: exactly at target
    tables = {name: p for name, p in run.module.named_parameters() if id(p) in skip}
    assert tables
    for name, table in tables.items():  # embeddings (and tied heads) left alone by default: only a padding row is 0
        assert int((table == 0).sum()) <= int((run.before[name] == 0).sum()), name


def check_ptq(run: Run) -> None:
    summary = run.callback(PostTrainingQuantization).summary
    assert summary["met"] and hf_zoo.size_ratio(summary["before"]["bytes"], summary["after"]["bytes"], run.module) > 3.0
    model = run.module.model
    head = model.get_output_embeddings()
    if run.family in ("gpt2", "bert", "t5"):  # tied: still one tensor
        assert head.weight is model.get_input_embeddings().weight
    if run.family == "gpt2":
        assert summary["report"].conv1d  # GPT-2's Conv1D layers were converted too


def check_qat(run: Run) -> None:
    quantized = [name for name, p in run.module.named_parameters() if type(p) not in (torch.Tensor, torch.nn.Parameter)]
    quantized += [
        name
        for name, m in run.module.named_modules()
        if isinstance(m, torch.nn.Linear) and type(m.weight).__name__ not in ("Parameter", "Tensor")
    ]
    assert quantized, "QAT converted nothing"


def check_strategy(run: Run) -> None:
    strategy = run.trainer.strategy
    assert run.seen["checkpointed"] == _blocks(run)
    assert strategy.compression_stats.packed > 0
    assert type(run.trainer.optimizers[0]).__name__ == "Adafactor"


def check_distillation(run: Run) -> None:
    module = run.module
    student = dict(module.student.named_parameters())
    assert any(not torch.equal(student[name], weight) for name, weight in run.before.items() if name in student)
    assert all(not p.requires_grad for p in module.teacher.parameters())
    assert torch.isfinite(run.trainer.callback_metrics["train_loss"])


@dataclass
class Case:
    callbacks: Callable[[], list[L.Callback]] = list
    check: Callable[[Run], None] = check_monitor
    strategy: Callable[[], Any] | None = None
    module: Callable[[str], L.LightningModule] | None = None
    batch_size: int = 4


def _distillation(family: str) -> L.LightningModule:
    small = {"gpt2": {"n_embd": 32}, "t5": {"d_model": 32, "d_ff": 64, "d_kv": 8}}.get(
        family, {"hidden_size": 32, "intermediate_size": 64}
    )
    return DistillationModule(
        student=hf_zoo.hf_module(family, **small).model, teacher=hf_zoo.hf_module(family, seed=1).model
    )


CASES = {
    "monitor": Case(lambda: [MemoryMonitor(summary=False)], check_monitor),
    "checkpointing": Case(lambda: [ActivationCheckpointing("auto")], check_checkpointing),
    "compression": Case(lambda: [ActivationCompression("int8", min_bytes=0)], check_compression),
    "optimizer": Case(lambda: [MemoryEfficientOptimizer("adafactor", lr=0.01)], check_optimizer),
    "microbatch": Case(lambda: [AutoMicrobatch(micro_batch_size=2)], check_microbatch),
    "lora": Case(lambda: [LowRankAdapters(r=4)], check_lora),
    "pruning": Case(lambda: [ScheduledPruning(schedule="constant", target_sparsity=0.5)], check_pruning),
    "ptq": Case(lambda: [PostTrainingQuantization("int8_dynamic", latency_batches=0)], check_ptq),
    "qat": Case(lambda: [QuantizationAwareTraining("int8_weight_only")], check_qat),
    "strategy": Case(
        check=check_strategy,
        strategy=lambda: LowMemoryStrategy(
            activation_checkpointing="auto",
            activation_compression="int8",
            compression_min_bytes=0,
            optimizer=OptimizerConfig("adafactor", lr=0.01),
        ),
    ),
    "distillation": Case(check=check_distillation, module=_distillation),
}


@pytest.mark.parametrize("feature", list(CASES))
def test_every_feature_on_every_family(feature, hf_family, tiny_trainer_kwargs):
    case = CASES[feature]
    module = case.module(hf_family) if case.module else hf_zoo.hf_module(hf_family)
    module.forward_calls = 0
    module.register_forward_pre_hook(lambda *_: setattr(module, "forward_calls", module.forward_calls + 1))
    spy = Spy()
    callbacks = [*case.callbacks(), spy]
    kwargs = dict(tiny_trainer_kwargs)
    if case.strategy is not None:
        kwargs["strategy"] = case.strategy()
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks, **kwargs)
    target = module.student if isinstance(module, DistillationModule) else module
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache, few-workers, ... : this test is about effects
        trainer.fit(module, hf_zoo.hf_data(hf_family, seq_len=16, batch_size=case.batch_size))
    case.check(Run(hf_family, module, trainer, callbacks, before, spy.seen))

"""Task heads (poolers, classifiers, LM heads, the output layer) are left out of default pruning (issue #34, item 3).

Global L1 to 50% over every Linear of a BERT classifier zeroed 99.95% of its pooler and 86% of its classifier
(their weights are small next to the encoder's); now the defaults leave them out, say what they prune, and warn
when a head is named explicitly.
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.callbacks.scheduled_pruning import ScheduledPruning
from lightning_lowmem.functional.config.pruning import PruningConfig
from lightning_lowmem.functional.pruning.masks import head_modules
from lightning_lowmem.functional.pruning.targets import resolve_targets
from lightning_lowmem.functional.pruning.unstructured import prune_
from lightning_lowmem.warnings import LowMemWarning

transformers = pytest.importorskip("transformers")

HEADS = ("bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias")


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=5,
    )
    return transformers.BertForSequenceClassification(config)


def _zeros_outside_heads(model: nn.Module, names: tuple[str, ...] = ("weight",)) -> tuple[int, int]:
    """(zeros, total) over every non-embedding parameter named ``names`` outside the heads."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    zeros = total = 0
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in names and id(param) not in tables and not name.endswith(HEADS):
            zeros, total = zeros + int((param == 0).sum()), total + param.numel()
    return zeros, total


def test_heads_are_the_pooler_the_classifier_and_the_output_layer() -> None:
    assert head_modules(_bert()) == ["bert.pooler", "classifier"]
    assert head_modules(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == ["2"]
    assert head_modules(nn.Linear(4, 2)) == []  # the whole model is no head to spare
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    assert head_modules(llama) == ["lm_head"]


@pytest.mark.parametrize("how", ["shorthand", "config"])
def test_one_shot_global_l1_leaves_the_heads_and_prunes_the_rest_exactly(how: str) -> None:
    model = _bert()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith(HEADS)}
    if how == "config":
        report = prune_(model, PruningConfig(target_sparsity=0.5, parameter_names=["weight"]))
    else:
        report = prune_(model, 0.5, global_=True)
    for name, param in model.named_parameters():
        if name in before:
            assert torch.equal(param, before[name]), name  # untouched (was: 99.95% / 86% zeroed)
    zeros, total = _zeros_outside_heads(model)
    assert report.sparsity == 0.5 and report.num_prunable == total and zeros == total // 2
    assert not any(key.startswith(("bert.pooler", "classifier")) for key in report.per_tensor)


def test_prune_heads_true_includes_them_and_naming_a_head_warns_once() -> None:
    model = _bert()
    report = prune_(model, 0.5, global_=True, heads=True)
    assert "classifier.weight" in report.per_tensor and report.per_tensor["bert.pooler.dense.weight"] > 0.5
    model = _bert()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_targets(model, ["classifier.weight", "bert.encoder.layer.0.output.dense.weight"])
        resolve_targets(model, ["classifier.weight"])  # the same head again: already said
    messages = [str(w.message) for w in caught if issubclass(w.category, LowMemWarning)]
    assert len(messages) == 1 and "['classifier.weight']" in messages[0] and "output layer / task head" in messages[0]


class _BertClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _bert()
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randint(0, 64, (32, 12), generator=generator), torch.randint(0, 5, (32,)))

    def training_step(self, batch, batch_idx):
        return self.model(batch[0], labels=batch[1]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)


def test_scheduled_pruning_leaves_the_heads_and_says_what_it_prunes(tmp_path, caplog) -> None:
    module = _BertClassifier()
    pruning = ScheduledPruning(schedule="constant", target_sparsity=0.5, make_pruning_permanent=False)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        callbacks=[pruning],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(module)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ScheduledPruning prunes")]
    assert len(lines) == 1
    assert "left out: 3 embedding tables" in lines[0] and "heads model.bert.pooler, model.classifier" in lines[0]
    for name, param in module.model.named_parameters():
        if name.endswith(HEADS):
            assert int((param == 0).sum()) == 0, name
    zeros, total = _zeros_outside_heads(module.model, ("weight", "bias"))  # ModelPruning's default names
    assert zeros == total // 2  # exactly the target, on the rest


def test_a_named_head_registered_first_is_the_only_head():
    """LitGPT registers ``lm_head`` before its blocks: the named head is the output, the last block's projection
    (the last-registered matrix) is not taken for one."""
    import torch.nn as nn

    from lightning_lowmem.functional.pruning.masks import head_modules

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(8, 16)
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    assert head_modules(HeadFirst()) == ["lm_head"]

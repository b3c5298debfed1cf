"""The maintainer's checklist (issue #35): docs/design.md's "add a technique" recipe, followed from outside the
package. A technique registered here -- its config, its handler, its callback -- appears in ``apply``,
``TrainingConfig``, the estimator, the planner, composition, ``lowmem estimate`` and a YAML fit with no other edit
of the package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import lightning as L
import pytest
import torch

from lightning_lowmem import composition
from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.cli import main
from lightning_lowmem.functional import TrainingConfig, apply
from lightning_lowmem.functional.registry import register_technique, unregister_technique
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory


@dataclass(frozen=True)
class FreezePrefixConfig:  # 1. the config, validated once
    pattern: str = "0."

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"`pattern`={self.pattern!r} must be a parameter-name prefix, e.g. '0.'")


def _freeze_prefix(module, config, applied):  # 2. the handler: change in place, record the undo first
    chosen = [p for name, p in module.named_parameters() if name.startswith(config.pattern)]
    was = [p.requires_grad for p in chosen]
    applied.on_undo(lambda: [p.requires_grad_(w) for p, w in zip(chosen, was, strict=True)])
    for p in chosen:
        p.requires_grad_(False)


class FreezePrefix(TechniqueCallback):  # 3. the callback: says what it is, decides when
    technique = "freeze_prefix"
    tags = frozenset({"freeze_prefix"})

    def __init__(self, pattern: str = "0.") -> None:
        self.config = FreezePrefixConfig(pattern)

    def composition_label(self) -> str:
        return f"FreezePrefix({self.config.pattern!r})"

    def setup_technique(self, trainer, pl_module, stage):
        if stage == "fit" and self._applied is None:
            self.frozen = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            self.apply_config(pl_module)
            self.frozen -= sum(p.numel() for p in pl_module.parameters() if p.requires_grad)


@pytest.fixture
def freeze_prefix():
    register_technique(
        FreezePrefixConfig,
        field="freeze_prefix",
        order=60,
        label=lambda c: c and f"freeze_prefix({c.pattern})",
    )(_freeze_prefix)
    yield
    unregister_technique(FreezePrefixConfig)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def test_apply_and_training_config(freeze_prefix):
    model = _model()
    config = TrainingConfig(freeze_prefix={"pattern": "0."}, micro_batch_size=2)
    assert config.describe() == "32-true + adamw + mb 2 + freeze_prefix(0.)"
    assert config.to_dict()["freeze_prefix"] == {"pattern": "0."} and TrainingConfig(**config.to_dict()) == config
    applied = apply(model, config)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["2.weight", "2.bias"]
    applied.undo()
    assert all(p.requires_grad for p in model.parameters())


def test_the_estimator_and_the_planner(freeze_prefix):
    """Frozen parameters get no gradient and no optimizer state in the estimate; the plan keeps the technique."""
    model, batch = _model(), (torch.randn(8, 64), torch.randint(0, 2, (8,)))
    frozen_bytes = sum(p.numel() * 4 for p in model[0].parameters())
    config = TrainingConfig.of(FreezePrefixConfig("0."))
    plain = estimate_memory(model, batch, device="cpu", optimizer="adamw")
    frozen = estimate_memory(model, batch, device="cpu", optimizer="adamw", config=config)
    # AdamW keeps exp_avg, exp_avg_sq and a 4-byte step count per trained tensor: none for the two frozen ones
    assert plain.breakdown["optimizer_state"] - frozen.breakdown["optimizer_state"] == 2 * frozen_bytes + 2 * 4
    assert frozen.peak_bytes < plain.peak_bytes - frozen_bytes  # and no gradient for them either
    plan = plan_memory(model, batch, "1GiB", device="cpu", config=config, max_estimates=4)
    assert plan.config.freeze_prefix == FreezePrefixConfig("0.")


def test_composition(freeze_prefix, monkeypatch):
    """The callback is named as it says; a rule on its tag refuses it beside another callback's tag."""
    from lightning_lowmem import LowRankAdapters

    rule = composition.Rule("freeze_prefix", "lora", "{a.label} freezes what {b.label} wraps", "drop one")
    monkeypatch.setattr(composition, "RULES", (*composition.RULES, rule))
    trainer = L.Trainer(callbacks=[FreezePrefix("model."), LowRankAdapters(r=2)], logger=False)
    assert [t.label for t in composition.techniques_of(trainer)][:2] == [
        "FreezePrefix('model.')",
        "LowRankAdapters(r=2)",
    ]
    with pytest.raises(ValueError, match=r"^FreezePrefix\('model\.'\) and LowRankAdapters\(r=2\) do not compose"):
        composition.check_composition(trainer)


YAML = """\
model:
  class_path: lightning_lowmem.demo.CharLM
  init_args: {n_layer: 1, n_embd: 32, n_head: 2, block_size: 16}
data:
  class_path: lightning_lowmem.demo.CharLMDataModule
  init_args: {block_size: 16, batch_size: 4, max_chars: 5000}
trainer:
  max_steps: 1
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: {module}.FreezePrefix
      init_args: {pattern: model.wte.}
"""


def test_lowmem_estimate_and_a_yaml_fit(freeze_prefix, tmp_path, capsys):
    config = tmp_path / "freeze.yaml"
    config.write_text(YAML.replace("{module}", __name__) + f"  default_root_dir: {tmp_path}\n")  # this module's classes
    assert main(["estimate", "--device", "cpu", "--json", "--config", str(config), "--batch-shape", "4x16,4x16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["meta"]["config"]["freeze_prefix"] == {"pattern": "model.wte."}
    assert main(["fit", "--config", str(config)]) == 0  # the YAML trains with it

"""The maintainer's checklist (issue #35): docs/design.md's "add a technique" recipe, followed literally.

A copy of the package gets the recipe's two code files -- ``functional/techniques/freeze_prefix.py`` (the config and
its registered handler) and ``callbacks/freeze_prefix.py`` (the callback: what it is, its refusal) -- and nothing
else. A fresh interpreter on that copy then finds the technique in ``apply``, ``TrainingConfig``, the estimator,
the planner, composition, ``lowmem estimate`` and a YAML fit (``class_path: lightning_lowmem.FreezePrefix``). The
recipe's other files (the ``TYPE_CHECKING`` line, the YAML example, the page, README / CHANGELOG lines, the
composition matrix) are docs and static types: nothing at run time needs them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_lowmem

#: 1. functional/techniques/freeze_prefix.py: the config, validated once, and its handler, registered on import
TECHNIQUE = """
from dataclasses import dataclass

from lightning_lowmem.functional.registry import register_technique


@dataclass(frozen=True)
class FreezePrefixConfig:
    pattern: str = "0."

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"`pattern`={self.pattern!r} must be a parameter-name prefix, e.g. '0.'")


@register_technique(
    FreezePrefixConfig, field="freeze_prefix", order=60, label=lambda c: c and f"freeze_prefix({c.pattern})"
)
def _freeze_prefix(module, config, applied):  # change in place, record the undo first
    chosen = [p for name, p in module.named_parameters() if name.startswith(config.pattern)]
    was = [p.requires_grad for p in chosen]
    applied.on_undo(lambda: [p.requires_grad_(w) for p, w in zip(chosen, was, strict=True)])
    for p in chosen:
        p.requires_grad_(False)
"""

#: 2. callbacks/freeze_prefix.py: the callback says what it is (its field, its tags, its refusals) and when it applies
CALLBACK = """
from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.composition import Rule
from lightning_lowmem.functional.techniques.freeze_prefix import FreezePrefixConfig


class FreezePrefix(TechniqueCallback):
    technique = "freeze_prefix"  # lowmem estimate reads self.config as this field
    tags = frozenset({"freeze_prefix"})
    rules = (Rule("freeze_prefix", "lora", "{a.label} freezes what {b.label} wraps", "drop one"),)

    def __init__(self, pattern: str = "0.") -> None:
        self.config = FreezePrefixConfig(pattern)

    def composition_label(self) -> str:
        return f"FreezePrefix({self.config.pattern!r})"

    def setup_technique(self, trainer, pl_module, stage):
        if stage == "fit" and self._applied is None:
            self.apply_config(pl_module)  # undone in teardown, and with the others if the fit fails before training
"""

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
    - class_path: lightning_lowmem.FreezePrefix
      init_args: {pattern: model.wte.}
"""

#: what the fresh interpreter observes, printed as one JSON line
CHECKS = """
import contextlib, io, json, sys
import lightning as L
import torch

import lightning_lowmem
from lightning_lowmem import FreezePrefix, LowRankAdapters, composition
from lightning_lowmem.cli import main
from lightning_lowmem.functional import TrainingConfig, apply
from lightning_lowmem.functional.techniques.freeze_prefix import FreezePrefixConfig
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.plan import plan_memory

seen = {"package": lightning_lowmem.__file__, "exported": "FreezePrefix" in lightning_lowmem.__all__}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
config = TrainingConfig(freeze_prefix={"pattern": "0."}, micro_batch_size=2)
seen["describe"] = config.describe()
seen["round_trip"] = config.to_dict()["freeze_prefix"] == {"pattern": "0."} and TrainingConfig(**config.to_dict()) == config
applied = apply(model, config)
seen["trained_after_apply"] = [n for n, p in model.named_parameters() if p.requires_grad]
applied.undo()
seen["trained_after_undo"] = [n for n, p in model.named_parameters() if p.requires_grad]

batch = (torch.randn(8, 64), torch.randint(0, 2, (8,)))
frozen = TrainingConfig.of(FreezePrefixConfig("0."))
plain = estimate_memory(model, batch, device="cpu", optimizer="adamw")
estimate = estimate_memory(model, batch, device="cpu", optimizer="adamw", config=frozen)
seen["frozen_bytes"] = sum(p.numel() * 4 for p in model[0].parameters())
seen["optimizer_state_saved"] = plain.breakdown["optimizer_state"] - estimate.breakdown["optimizer_state"]
seen["peak_saved"] = plain.peak_bytes - estimate.peak_bytes
plan = plan_memory(model, batch, "1GiB", device="cpu", config=frozen, max_estimates=4)
seen["planned"] = plan.config.freeze_prefix == FreezePrefixConfig("0.")

trainer = L.Trainer(callbacks=[FreezePrefix("model."), LowRankAdapters(r=2)], logger=False)
seen["labels"] = [t.label for t in composition.techniques_of(trainer)][:2]
try:
    composition.check_composition(trainer)
except ValueError as error:
    seen["refusal"] = str(error)

yaml = sys.argv[1]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["estimate", "--device", "cpu", "--json", "--config", yaml, "--batch-shape", "4x16,4x16"])
seen["estimate_exit"], seen["estimate_config"] = code, json.loads(out.getvalue())["meta"]["config"]
with contextlib.redirect_stdout(io.StringIO()):
    seen["fit_exit"] = main(["fit", "--config", yaml])
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    """The recipe's two code files added to a copy of the package, and what a fresh interpreter on it observes."""
    root = tmp_path_factory.mktemp("recipe")
    package = root / "lightning_lowmem"
    shutil.copytree(Path(lightning_lowmem.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "functional" / "techniques" / "freeze_prefix.py").write_text(TECHNIQUE)
    (package / "callbacks" / "freeze_prefix.py").write_text(CALLBACK)
    yaml = root / "freeze_prefix.yaml"
    yaml.write_text(YAML + f"  default_root_dir: {root}\n")
    result = subprocess.run(
        [sys.executable, "-c", CHECKS, str(yaml)], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"root": str(root)}


def test_the_copy_is_the_one_checked(seen):
    assert seen["package"] == str(Path(seen["root"]) / "lightning_lowmem" / "__init__.py")
    assert seen["exported"]  # lightning_lowmem.FreezePrefix, found by its file


def test_apply_and_training_config(seen):
    assert seen["describe"] == "32-true + adamw + mb 2 + freeze_prefix(0.)"
    assert seen["round_trip"]
    assert seen["trained_after_apply"] == ["2.weight", "2.bias"]
    assert seen["trained_after_undo"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_the_estimator_and_the_planner(seen):
    """Frozen parameters get no gradient and no optimizer state in the estimate; the plan keeps the technique."""
    # AdamW keeps exp_avg, exp_avg_sq and a 4-byte step count per trained tensor: none for the two frozen ones
    assert seen["optimizer_state_saved"] == 2 * seen["frozen_bytes"] + 2 * 4
    assert seen["peak_saved"] > seen["frozen_bytes"]  # and no gradient for them either
    assert seen["planned"]


def test_composition(seen):
    """The callback is named as it says; the rule it brings refuses it beside LoRA."""
    assert seen["labels"] == ["FreezePrefix('model.')", "LowRankAdapters(r=2)"]
    assert seen["refusal"] == (
        "FreezePrefix('model.') and LowRankAdapters(r=2) do not compose: FreezePrefix('model.') freezes what "
        "LowRankAdapters(r=2) wraps. Instead, drop one."
    )


def test_lowmem_estimate_and_a_yaml_fit(seen):
    assert seen["estimate_exit"] == 0 and seen["estimate_config"]["freeze_prefix"] == {"pattern": "model.wte."}
    assert seen["fit_exit"] == 0  # the YAML trains with it

"""`lowmem fit` mistakes found when the run starts (a callback's setup, the checkpoint to resume, the first batch): one
`error:` line and a hint on stderr, exit code 2, the model untouched, no `lightning_logs/version_N` left behind."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_lowmem.cli import main
from lightning_lowmem.cli.lowmem_cli import LowMemCLI

FIT = [
    "fit",
    "--model",
    "lightning_lowmem.demo.HFLanguageModel",
    "--model.family",
    "llama",
    "--data",
    "lightning_lowmem.demo.HFTextDataModule",
    "--data.seq_len",
    "16",
    "--data.batch_size",
    "2",
    "--trainer.max_steps",
    "1",
    "--trainer.accelerator",
    "cpu",
    "--trainer.enable_progress_bar",
    "false",
]

MISTAKES = {
    "checkpointing policy matching nothing": (
        ["--trainer.callbacks+=ActivationCheckpointing", "--trainer.callbacks.policy", "LlamaBlock"],
        r"ValueError in ActivationCheckpointing\.\w+: activation checkpointing policy 'LlamaBlock' matched no "
        r"submodule of HFLanguageModel\. Did you mean 'LlamaDecoderLayer'\? Its repeated blocks are 2 x LlamaDecoderLayer",
    ),
    "LoRA target typo": (
        ["--trainer.callbacks+=LowRankAdapters", "--trainer.callbacks.target", "[q_projj]"],
        r"ValueError in LowRankAdapters\.\w+: `target` pattern 'q_projj' matches no .* its layers end in: .*'q_proj'",
    ),
    "int4 QLoRA on CPU": (
        ["--trainer.callbacks+=LowRankAdapters", "--trainer.callbacks.quantize_base", "int4"],
        r"RuntimeError in LowRankAdapters\.\w+: `quantize_base`='int4' runs on CUDA only .*quantize_base='nf4'",
    ),
    "missing --ckpt_path": (
        ["--ckpt_path", "no_such.ckpt"],
        r"--ckpt_path 'no_such\.ckpt': no such file or folder; give a checkpoint a fit wrote",
    ),
    "ChunkedCrossEntropy with QAT": (
        ["--trainer.callbacks+=ChunkedCrossEntropy", "--trainer.callbacks+=QuantizationAwareTraining"],
        r"ValueError in .*: ChunkedCrossEntropy and QuantizationAwareTraining\('intx4_weight_only'\) do not compose",
    ),
    "two LowRankAdapters": (
        ["--trainer.callbacks+=LowRankAdapters", "--trainer.callbacks+=LowRankAdapters"],
        r"trainer\.callbacks: LowRankAdapters is given twice; a fit takes one LowRankAdapters .*merge their options",
    ),
}


class _StderrHandler(logging.StreamHandler):
    """Lightning's own handler, writing to whatever ``sys.stderr`` is at the time (pytest swaps it per test)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _snapshot(model: torch.nn.Module) -> tuple:
    return (
        {name: value.detach().clone() for name, value in model.state_dict().items()},
        {name: p.requires_grad for name, p in model.named_parameters()},
        [type(m).__name__ for m in model.modules()],
    )


def _same(before: tuple, after: tuple) -> bool:
    weights, grads, types = before
    new_weights, new_grads, new_types = after
    return (
        weights.keys() == new_weights.keys()
        and all(torch.equal(weights[k], new_weights[k]) for k in weights)
        and grads == new_grads
        and types == new_types
    )


@pytest.fixture
def run_fit(tmp_path, monkeypatch, capfd):
    """Run `lowmem fit` in-process from ``tmp_path``; returns (exit code, stderr lines, model snapshot before the
    run started, the model after)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOWMEM_DEBUG", raising=False)
    lightning_logger = logging.getLogger("lightning.pytorch")  # as in a terminal: Lightning prints its INFO lines
    monkeypatch.setattr(lightning_logger, "handlers", [_StderrHandler()])
    monkeypatch.setattr(lightning_logger, "propagate", False)
    seen: dict[str, object] = {}
    before_run = LowMemCLI._before_run

    def spy(self, subcommand):
        seen["model"], seen["before"] = self.model, _snapshot(self.model)
        return before_run(self, subcommand)

    monkeypatch.setattr(LowMemCLI, "_before_run", spy)

    def run(extra: list[str]) -> tuple[int, list[str], object, object]:
        capfd.readouterr()
        code = main([*FIT, *extra])
        lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
        model = seen.get("model")
        return code, lines, seen.get("before"), (_snapshot(model) if model is not None else None)

    return run


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_mistake_found_when_the_run_starts_is_one_line_and_changes_nothing(case, run_fit, tmp_path):
    extra, expected = MISTAKES[case]
    code, lines, before, after = run_fit(extra)
    assert code == 2
    assert len(lines) <= 3, "\n".join(lines)
    assert lines[0].startswith("error: ")
    assert any(re.search(expected, line) for line in lines), lines[0]
    assert "Traceback" not in "\n".join(lines)
    if before is not None:  # the model was built: the failed run left it as it was
        assert _same(before, after)
    assert not (tmp_path / "lightning_logs").exists()  # no version_N for a run that never started


def test_a_first_batch_of_float_token_ids_is_one_line(run_fit, monkeypatch, tmp_path):
    from lightning_lowmem.demo import HFTextDataModule

    floats = [{"input_ids": torch.rand(2, 16), "labels": torch.zeros(2, 16, dtype=torch.long)}]
    monkeypatch.setattr(HFTextDataModule, "train_dataloader", lambda self: DataLoader(floats, batch_size=None))
    code, lines, before, after = run_fit([])
    assert code == 2 and len(lines) <= 3, "\n".join(lines)
    assert lines[0].startswith("error: the first training step failed on the batch dict(input_ids: (2, 16) float32")
    assert "token ids are int64" in lines[0]
    assert _same(before, after)
    assert not (tmp_path / "lightning_logs").exists()


def test_an_unexpected_error_keeps_its_traceback_and_a_good_run_prints_lightnings_lines(run_fit, monkeypatch, capfd):
    from lightning_lowmem.demo import HFLanguageModel

    def broken(self, batch, batch_idx):
        raise KeyError("not a check of ours")

    monkeypatch.setattr(HFLanguageModel, "training_step", broken)
    with pytest.raises(KeyError, match="not a check of ours"):
        main(FIT)
    assert "GPU available" in capfd.readouterr().err  # held until the first batch, then printed as usual

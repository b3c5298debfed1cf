"""The `lowmem` console script: estimate, fit through YAML, demo --quick."""

from __future__ import annotations

import json

import pytest

from lightning_lowmem.cli import main

CHARLM_ARGS = [
    "--model", "lightning_lowmem.demo.CharLM",
    "--model.n_layer", "2", "--model.n_embd", "64", "--model.n_head", "2", "--model.block_size", "32",
    "--data", "lightning_lowmem.demo.CharLMDataModule",
    "--data.block_size", "32", "--data.batch_size", "8", "--data.max_chars", "20000",
]


def test_estimate_without_a_model_says_how_to_give_one(capsys):
    assert main(["estimate", "--budget", "8GiB"]) == 2
    assert "lowmem estimate needs a model" in capsys.readouterr().err


def test_estimate_json_plan(capsys):
    assert main(["estimate", "--budget", "4GiB", "--device", "cpu", "--json", *CHARLM_ARGS]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[out.index("{"):])
    assert plan["chosen"]["label"] == "32-true + adamw"
    assert plan["chosen"]["fits"] is True and plan["chosen"]["predicted_peak_bytes"] > 0


def test_estimate_impossible_budget_fails_cleanly(capsys):
    assert main(["estimate", "--budget", "10KiB", "--device", "cpu", *CHARLM_ARGS]) == 1
    assert "no configuration fits" in capsys.readouterr().out


def test_fit_runs_from_command_line_options(tmp_path):
    main(["fit", *CHARLM_ARGS, "--trainer.fast_dev_run=true", f"--trainer.default_root_dir={tmp_path}"])


def test_unknown_callback_argument_gets_jsonargparse_message(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_lowmem.MemoryMonitor\n      init_args:\n        every_step: 3\n"
    )
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), *CHARLM_ARGS, "--trainer.fast_dev_run=true"])
    assert "every_step" in capsys.readouterr().err

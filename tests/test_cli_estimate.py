"""`lowmem estimate`'s question in one line and its answer first: `4k` lengths, `--hf-config` on cuda by default with
the `--trainer.*` options and the short flags (`--lora`, `--qlora`, `--optimizer`, `--checkpointing`), the chosen plan
as the callbacks / YAML to paste, the candidate table and progress only with `--verbose`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_lowmem.cli import main
from lightning_lowmem.cli.estimate_answer import plan_settings
from lightning_lowmem.functional.config import TrainingConfig

pytest.importorskip("transformers")


def _folder(tmp_path: Path) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _peak(args: list[str], capsys) -> int:
    assert main(["estimate", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["peak_bytes"]


def test_token_lengths_take_k_and_a_bad_one_is_one_line(tmp_path, capsys):
    folder = _folder(tmp_path)
    base = ["--hf-config", folder, "--device", "cpu"]
    assert _peak([*base, "--seq-len", "1k"], capsys) == _peak([*base, "--seq-len", "1024"], capsys)
    assert main(["estimate", *base, "--seq-len", "4 thousand"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: --seq-len '4 thousand' is not a number of tokens: give a whole number, or one with k (= 1024), "
        "e.g. --seq-len 4096 or --seq-len 4k",
        "see `lowmem estimate --help`",
    ]


def test_hf_config_plans_for_cuda_by_default_and_says_so(tmp_path, capsys):
    folder = _folder(tmp_path)
    assert main(["estimate", "--hf-config", folder, "--seq-len", "64"]) == 0
    captured = capsys.readouterr()
    assert "--device cuda (the default with --hf-config" in captured.err
    assert "Estimated training step on cuda" in captured.out


def test_trainer_options_and_short_flags_are_what_the_callbacks_give(tmp_path, capsys):
    base = ["--hf-config", _folder(tmp_path), "--seq-len", "128", "--device", "cpu"]
    plain = _peak(base, capsys)
    by_callbacks = _peak(
        [
            *base,
            "--trainer.precision",
            "bf16-true",
            "--trainer.callbacks+=LowRankAdapters",
            "--trainer.callbacks.r",
            "4",
            "--trainer.callbacks+=ActivationCheckpointing",
        ],
        capsys,
    )
    by_flags = _peak([*base, "--precision", "bf16-true", "--lora", "4", "--checkpointing", "auto"], capsys)
    assert by_callbacks == by_flags < plain
    assert main(["estimate", *base, "--trainer.callbacks+=LowRankAdapters", "--trainer.callbacks.rr", "4"]) == 2
    assert "error: trainer.callbacks: lightning_lowmem.LowRankAdapters has no argument 'rr'" in capsys.readouterr().err


def test_the_answer_comes_first_with_the_callbacks_to_paste(tmp_path, capsys):
    args = ["estimate", "--hf-config", _folder(tmp_path), "--seq-len", "256", "--device", "cpu", "--fine-tune"]
    assert main([*args, "--budget", "20MiB", "--lora", "8"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("fits: ") and "LowRankAdapters(" in lines[0] and "of the 20.00 MiB budget" in lines[0]
    assert "plan [" not in err and "configuration" not in out  # no progress lines, no candidate table
    assert any(line.startswith("options: ") and "--trainer.callbacks+=LowRankAdapters" in line for line in lines)
    document = yaml.safe_load(
        "\n".join(lines[lines.index("trainer:") :]).split("\nplanned in")[0].split("\nnumerics")[0]
    )
    classes = [item["class_path"] for item in document["trainer"]["callbacks"]]
    assert "lightning_lowmem.LowRankAdapters" in classes
    assert main([*args, "--budget", "20MiB", "--lora", "8", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert "configuration" in out and "plan [1/" in err


def test_plan_settings_build_our_callbacks():
    import lightning_lowmem

    config = TrainingConfig(
        precision="bf16-true",
        lora={"r": 4, "quantize_base": "int8"},
        activation_checkpointing=2,
        activation_compression="bf16",
        cross_entropy="chunked",
        optimizer="adamw8bit",
        micro_batch_size=2,
    )
    trainer, callbacks = plan_settings(config, "adamw")
    assert trainer == {"precision": "bf16-true"}
    built = [getattr(lightning_lowmem, name)(**args) for name, args in callbacks]  # real classes, real init_args
    assert [type(c).__name__ for c in built] == [
        "LowRankAdapters",
        "ActivationCheckpointing",
        "ActivationCompression",
        "ChunkedCrossEntropy",
        "MemoryEfficientOptimizer",
        "AutoMicrobatch",
    ]
    assert dict(callbacks)["LowRankAdapters"] == {"r": 4, "quantize_base": "int8"}
    assert dict(callbacks)["ActivationCheckpointing"] == {"policy": 2}


def test_the_command_ends_at_once_after_estimate_with_its_output_and_exit_code(tmp_path):
    """``python -m lightning_lowmem.cli estimate`` (and the ``lowmem`` script, ``console``) skips the interpreter's
    teardown: the whole JSON answer still arrives, and a mistake still exits 2 with its one line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]  # this checkout's package, not an installed one
    command = [sys.executable, "-m", "lightning_lowmem.cli", "estimate", "--hf-config", _folder(tmp_path)]
    done = subprocess.run([*command, "--seq-len", "64", "--json"], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["peak_bytes"] > 0
    wrong = subprocess.run([*command, "--budget", "24"], capture_output=True, text=True, cwd=root)
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines()[-2].startswith("error: --budget='24' has no unit")


def test_the_objects_alive_before_the_plan_are_out_of_the_collectors_sight_during_it_only(
    tmp_path, capsys, monkeypatch
):
    import gc

    from lightning_lowmem.planning import plan as plan_module

    seen = []
    original = plan_module.plan_memory

    def plan_memory(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return original(*args, **kwargs)

    monkeypatch.setattr(plan_module, "plan_memory", plan_memory)
    args = ["--hf-config", _folder(tmp_path), "--seq-len", "64", "--budget", "1GiB"]
    assert main(["estimate", *args]) == 0, capsys.readouterr().err
    assert len(seen) == 1 and seen[0] > 10_000  # the libraries and the model, frozen while it plans
    assert gc.get_freeze_count() == 0  # and back in sight after

"""The `lowmem` console script: help, one-line config errors, estimate (device, batch shapes, configured
techniques, dict batches), fit through YAML, and the startup log filters."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lowmem.cli import main, parse_batch_shape, quiet_startup_logs
from lightning_lowmem.demo import CharLM
from lightning_lowmem.planning.estimate import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
CHARLM_ARGS = [
    "--model",
    "lightning_lowmem.demo.CharLM",
    "--model.n_layer",
    "2",
    "--model.n_embd",
    "64",
    "--model.n_head",
    "2",
    "--model.block_size",
    "32",
    "--data",
    "lightning_lowmem.demo.CharLMDataModule",
    "--data.block_size",
    "32",
    "--data.batch_size",
    "8",
    "--data.max_chars",
    "20000",
]
MODEL_DATA_YAML = """\
model:
  class_path: lightning_lowmem.demo.CharLM
  init_args: {n_layer: 1, n_embd: 32, n_head: 2, block_size: 16}
data:
  class_path: lightning_lowmem.demo.CharLMDataModule
  init_args: {block_size: 16, batch_size: 4, max_chars: 5000}
trainer:
  fast_dev_run: true
  logger: false
"""


def _error_lines(capfd) -> list[str]:
    err = capfd.readouterr().err
    return [line for line in err.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- help
def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "estimate", "demo"):
        assert f"\n  {name} " in out
    assert main([]) == 2  # no subcommand: the same overview, as an error


def test_unknown_subcommand_says_did_you_mean(capfd):
    assert main(["estimat", "--budget", "1GiB"]) == 2
    lines = _error_lines(capfd)
    assert (
        lines[0]
        == "error: unknown subcommand 'estimat' (did you mean 'estimate'?); choose one of fit, validate, test, predict, estimate, demo"
    )


# ----------------------------------------------------------------------------- one-line config errors
CALLBACK_CASES = {
    # a ValueError raised by a callback's constructor: the package's own message, on one line
    "value": (
        "lightning_lowmem.ActivationCompression",
        "{mode: int7}",
        "error: lightning_lowmem.ActivationCompression: `mode`='int7' is unknown; choose one of ['bf16', 'int8', 'cpu']",
    ),
    "class_path": (
        "lightning_lowmem.ActivationCheckpointng",
        "{policy: Block}",
        "did you mean lightning_lowmem.ActivationCheckpointing?",
    ),
    "argument": (
        "lightning_lowmem.ActivationCheckpointing",
        "{polcy: Block}",
        "lightning_lowmem.ActivationCheckpointing has no argument 'polcy' (did you mean 'policy'?)",
    ),
    "type": (
        "lightning_lowmem.ActivationCheckpointing",
        "{nested: 3}",
        "lightning_lowmem.ActivationCheckpointing: argument 'nested': expected a bool, got 3",
    ),
}


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_bad_callback_in_yaml_is_one_error_line(case, tmp_path, capfd):
    class_path, init_args, expected = CALLBACK_CASES[case]
    config = tmp_path / "bad.yaml"
    config.write_text(MODEL_DATA_YAML + f"  callbacks:\n    - class_path: {class_path}\n      init_args: {init_args}\n")
    assert main(["fit", "--config", str(config)]) == 2
    lines = _error_lines(capfd)
    assert len(lines) == 2, lines  # the error and a one-line hint: no traceback, no usage dump, no banner
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert lines[1] == "see `lowmem fit --help`; LOWMEM_DEBUG=1 shows the full error"


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--trainer.strategy=lightning_lowmem.LowMemoryStrategy", "--trainer.strategy.memory_budget=banana"],
            "error: lightning_lowmem.LowMemoryStrategy: `memory_budget`='banana' is not a byte size.",
        ),
        (["--model.n_embd=33"], "error: lightning_lowmem.demo.CharLM: `n_embd`=33 must be divisible by `n_head`=2"),
        (
            ["--data.val_fraction=2"],
            "error: lightning_lowmem.demo.CharLMDataModule: `val_fraction` must be in (0, 1), got 2.0",
        ),
        (["--trainer.strategy=lowmen"], "error: trainer.strategy: unknown strategy 'lowmen' (did you mean 'lowmem'?)"),
        (["--trainer.precision=bf17"], "error: trainer.precision: 'bf17' is not accepted (did you mean 'bf16'?)"),
        (
            ["--trainer.max_stepz=3"],
            "error: unrecognized arguments: --trainer.max_stepz=3 (did you mean 'trainer.max_steps'?)",
        ),
        (
            ["--model.n_layr=2"],
            "error: model: lightning_lowmem.demo.CharLM has no argument 'n_layr' (did you mean 'n_layer'?)",
        ),
        (["--model=lightning_lowmem.demo.CharLN"], "(did you mean lightning_lowmem.demo.CharLM?)"),
        (["--config=/no/such.yaml"], "error: config: file does not exist: '/no/such.yaml'"),
    ],
    ids=[
        "strategy-value",
        "model-value",
        "data-value",
        "strategy-name",
        "precision",
        "trainer-option",
        "model-arg",
        "model-class",
        "config-file",
    ],
)
def test_bad_value_on_the_command_line_is_one_error_line(args, expected, tmp_path, capfd):
    config = tmp_path / "ok.yaml"
    config.write_text(MODEL_DATA_YAML)
    assert main(["fit", "--config", str(config), *args]) == 2
    lines = _error_lines(capfd)
    assert len(lines) == 2 and expected in lines[0], lines


def test_fit_without_a_model_says_what_is_missing(capfd):
    assert main(["fit"]) == 2
    assert _error_lines(capfd)[0] == "error: missing model: give --model CLASS_PATH or a config with a `model:` section"


def test_lowmem_debug_shows_the_original_error(tmp_path, monkeypatch):
    config = tmp_path / "ok.yaml"
    config.write_text(MODEL_DATA_YAML)
    monkeypatch.setenv("LOWMEM_DEBUG", "1")
    with pytest.raises(ValueError, match="must be divisible by `n_head`"):
        main(["fit", "--config", str(config), "--model.n_embd=33"])


def test_fit_runs_from_command_line_options(tmp_path):
    assert main(["fit", *CHARLM_ARGS, "--trainer.fast_dev_run=true", f"--trainer.default_root_dir={tmp_path}"]) == 0


# ----------------------------------------------------------------------------- estimate
def test_estimate_without_a_model_says_how_to_give_one(capsys):
    assert main(["estimate", "--budget", "8GiB"]) == 2
    assert "lowmem estimate needs a model" in capsys.readouterr().err


def test_estimate_json_plan(capsys):
    assert main(["estimate", "--budget", "4GiB", "--device", "cpu", "--json", "--verbose", *CHARLM_ARGS]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out[captured.out.index("{") :])
    assert plan["chosen"]["label"] == "32-true + adamw"
    assert plan["chosen"]["fits"] is True and plan["chosen"]["predicted_peak_bytes"] > 0
    assert "plan [1/" in captured.err and "32-true + adamw: " in captured.err  # --verbose: the search on stderr
    assert plan["seconds"] > 0


def test_estimate_impossible_budget_fails_cleanly(capsys):
    assert main(["estimate", "--budget", "10KiB", "--device", "cpu", *CHARLM_ARGS]) == 1
    assert "plan [" not in capsys.readouterr().err  # progress lines only with --verbose
    assert main(["estimate", "--budget", "10KiB", "--device", "cpu", "--verbose", *CHARLM_ARGS]) == 1
    captured = capsys.readouterr()
    assert "no configuration fits" in captured.out
    # --verbose: the search on stderr: one line per candidate, numbered in order (long labels wrapped at 80 columns)
    lines = captured.err.splitlines()
    assert lines[0].startswith("--budget '10KiB' = 10,240 B") and len(lines) > 2
    assert [line.split("/")[0] for line in lines[1:]] == [f"plan [{i}" for i in range(1, len(lines))]
    assert all(re.search(r"\) \d+\.\d s$", line) for line in lines[1:]), captured.err


@pytest.mark.parametrize(
    ("budget", "error"),
    [
        ("-1", "error: --budget must be >= 0 bytes, got '-1'"),
        ("lots", "error: --budget='lots' is not a byte size. Use a number with a unit from B, KB"),
        ("24", "error: --budget='24' has no unit: did you mean '24GiB'? Give a size with its unit"),
    ],
)
def test_estimate_a_bad_budget_is_an_error_line_before_the_model_loads(budget, error, capsys):
    assert main(["estimate", "--budget", budget, "--device", "cpu", *CHARLM_ARGS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(error) and err.splitlines()[1] == "see `lowmem estimate --help`"


def test_estimate_says_what_a_budget_was_read_as(capsys):
    """GB is SI (10^9): "24gb" is 22.35 GiB of GPU memory, and the CLI says so before planning."""
    main(["estimate", "--budget", "10KB", "--device", "cpu", *CHARLM_ARGS])
    assert capsys.readouterr().err.startswith("--budget '10KB' = 10,000 B = 9.77 KiB\n")


@pytest.mark.parametrize("gpu", [False, True], ids=["without-gpu", "with-gpu"])
def test_estimate_defaults_to_this_machines_device_and_says_so(gpu, monkeypatch, capfd):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert main(["estimate", *CHARLM_ARGS]) == 0
    out = capfd.readouterr()
    device = "cuda" if gpu else "cpu"
    assert f"Estimated training step on {device}" in " ".join(out.out.split())
    assert "GPU available" not in out.out + out.err  # no Trainer is built to plan
    assert main(["estimate", "--json", *CHARLM_ARGS]) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["device"] == device and (report["overheads"] != {}) == gpu  # the CUDA context only on cuda


def test_estimate_batch_shape_replaces_the_data(capsys):
    """`--batch-shape 8x32,8x32` estimates the same step as a real (inputs, targets) batch of that shape."""
    model_args = CHARLM_ARGS[:10]  # --model and its options only: no data
    assert main(["estimate", "--device", "cpu", "--json", "--batch-shape", "8x32,8x32", *model_args]) == 0
    report = json.loads(capsys.readouterr().out)
    batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))
    expected = estimate_memory(CharLM(n_layer=2, n_embd=64, n_head=2, block_size=32), batch, device="cpu")
    assert report["peak_bytes"] == expected.peak_bytes
    assert main(["estimate", "--device", "cpu", *model_args]) == 2  # neither data nor a shape
    assert "--batch-shape" in capsys.readouterr().err


def test_estimate_a_batch_the_step_cannot_take_is_one_error_line(capsys, monkeypatch):
    """`--batch-shape 32x64:float32` on a token model printed a 116-line traceback."""
    monkeypatch.delenv("LOWMEM_DEBUG", raising=False)
    model_args = CHARLM_ARGS[:10]
    assert main(["estimate", "--device", "cpu", "--batch-shape", "8x32:float32", *model_args]) == 2
    err = capsys.readouterr().err
    first, hint = err.splitlines()
    assert first.startswith("error: the training step of CharLM failed on the batch (8, 32) float32: ValueError: ")
    assert "(at charlm.py:" in first and "e.g. 32x64,32x64 for an (inputs, targets) tuple" in first
    assert "Traceback" not in err and hint == "see `lowmem estimate --help`"
    monkeypatch.setenv("LOWMEM_DEBUG", "1")
    with pytest.raises(ValueError, match="too many values to unpack"):
        main(["estimate", "--device", "cpu", "--batch-shape", "8x32:float32", *model_args])


def test_estimate_uses_the_configs_precision_and_memory_callbacks(capsys):
    config = str(ROOT / "examples" / "configs" / "full_stack.yaml")
    assert main(["estimate", "--device", "cpu", "--json", "--config", config, "--batch-shape", "4x64,4x64"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["meta"]["config"] == {
        "precision": "bf16-true",
        "activation_checkpointing": "Block",
        "activation_compression": "int8",
        "optimizer": "adafactor_in_backward",
        "micro_batch_size": None,
        "lora": None,
        "optimizer_kwargs": {"lr": 0.05},  # MemoryEfficientOptimizer(lr=0.05): the callback's config, whole
    }


def test_estimate_hugging_face_model_with_a_dict_batch_shape(capsys):
    pytest.importorskip("transformers")
    from lightning_lowmem.demo import HFLanguageModel

    shape = "input_ids=2x16,attention_mask=2x16,labels=2x16"
    assert (
        main(
            [
                "estimate",
                "--device",
                "cpu",
                "--json",
                "--model",
                "lightning_lowmem.demo.HFLanguageModel",
                "--model.family",
                "gpt2",
                "--batch-shape",
                shape,
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    batch = {key: torch.zeros(2, 16, dtype=torch.long) for key in ("input_ids", "labels")}
    batch["attention_mask"] = torch.ones(2, 16, dtype=torch.long)  # a mask on meta is taken as unpadded
    assert report["peak_bytes"] == estimate_memory(HFLanguageModel(family="gpt2"), batch, device="cpu").peak_bytes


def test_estimate_attention_kernel_option(capsys):
    """`--attention-kernel` reaches the estimate: CharLM's attention (with dropout) runs CUDA's
    memory-efficient kernel by default; forced math keeps the (B, H, T, T) scores."""
    peaks = {}
    for kernel in ("auto", "math"):
        args = ["estimate", "--device", "cuda", "--json", "--attention-kernel", kernel, "--batch-shape", "8x32,8x32"]
        assert main([*args, *CHARLM_ARGS[:10]]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["meta"]["attention_kernels"] == {"efficient" if kernel == "auto" else "math": 2}
        peaks[kernel] = report["peak_bytes"]
    assert peaks["math"] > peaks["auto"]


def test_parse_batch_shape_forms_and_errors():
    assert [tuple(t.shape) for t in parse_batch_shape("32x64,32x64")] == [(32, 64), (32, 64)]
    images, labels = parse_batch_shape("16x1x8x8:float32, 16")
    assert (images.dtype, labels.dtype, images.device.type) == (torch.float32, torch.int64, "meta")
    assert set(parse_batch_shape("input_ids=4x128,labels=4x128:int64")) == {"input_ids", "labels"}
    assert tuple(parse_batch_shape("4x128").shape) == (4, 128)
    from lightning_lowmem.cli.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'32xx64' in '32xx64' is not a shape like 32x64"):
        parse_batch_shape("32xx64")
    with pytest.raises(ConfigError, match=r"dtype 'flaot32' in '4x4:flaot32' is unknown \(did you mean 'float32'\?\)"):
        parse_batch_shape("4x4:flaot32")
    with pytest.raises(ConfigError, match="mixes named"):
        parse_batch_shape("input_ids=4x8,4x8")


# ----------------------------------------------------------------------------- startup noise
def test_startup_filters_drop_only_torchaos_import_lines(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    quiet_startup_logs()
    quiet_startup_logs()  # idempotent
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning(
            "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this "
            "library: /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
        )
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
            "opaque value type. Calling register_constant() on Enum subclasses is deprecated"
        )
        logging.getLogger("torchao").warning("Failed to load config.json: permission denied")  # a real problem
        logging.getLogger("torch.utils._pytree").warning("something else")
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to load config.json: permission denied",
        "something else",
    ]


def test_cli_startup_prints_no_torchao_noise():
    """The real import: `lowmem` imports torchao (the strategy and callbacks do) without its log lines."""
    code = "import lightning_lowmem.cli as c, sys; c.quiet_startup_logs(); import torchao.quantization"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stderr
    assert "_C_mxfp8" not in err and "register_constant() on Enum" not in err, err


def test_estimate_per_rank_for_a_strategy_and_devices(capsys):
    """`--devices 2 --strategy fsdp` is estimate_memory(world_size=2, sharding="fsdp"); bad values are errors."""
    import torch.distributed as dist

    if dist.is_initialized():  # left by an in-process Lightning run: the fake ranks need their own group
        dist.destroy_process_group()
    model_args = [*CHARLM_ARGS[:10], "--device", "cpu", "--batch-shape", "4x32,4x32"]
    assert main(["estimate", "--json", "--devices", "2", "--strategy", "fsdp", *model_args]) == 0
    report = json.loads(capsys.readouterr().out)
    batch = (torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))
    expected = estimate_memory(
        CharLM(n_layer=2, n_embd=64, n_head=2, block_size=32), batch, device="cpu", world_size=2, sharding="fsdp"
    )
    assert report["peak_bytes"] == expected.peak_bytes and [r["rank"] for r in report["meta"]["per_rank"]] == [0, 1]
    assert report["meta"]["label"] == "32-true + adamw + fsdp x2"  # the sharding named once (was "... | fsdp x 2")
    # with --budget (per GPU) the plan is per rank; --strategy fixes the sharding, else it is searched
    assert main(["estimate", "--json", "--devices", "2", "--strategy", "fsdp", "--budget", "1GiB", *model_args]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert (chosen["config"]["sharding"], chosen["config"]["world_size"]) == ("fsdp", 2)
    assert chosen["predicted_peak_bytes"] == expected.peak_bytes
    assert main(["estimate", "--json", "--devices", "2", "--budget", "1GiB", *model_args]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["config"]["sharding"] == "ddp"  # least communication
    assert main(["estimate", "--devices", "0", "--strategy", "fsdp", *model_args]) == 2
    assert "--devices=0 must be an int >= 1" in capsys.readouterr().err
    assert main(["estimate", "--devices", "2", "--strategy", "fdsp", *model_args]) == 2
    assert "--strategy='fdsp' is unknown" in capsys.readouterr().err


def test_estimate_per_rank_table_has_one_row_per_distinct_rank_figure(capsys):
    """FSDP's ranks hold the same bytes: one row `0-3`, under a title naming the sharding once (was four identical
    rows titled '... + fsdp x4 | fsdp x 4 | fsdp x 4 processes'); ZeRO-1's ranks may differ: a row per figure."""
    import torch.distributed as dist

    from lightning_lowmem.memory import format_bytes

    if dist.is_initialized():
        dist.destroy_process_group()
    model_args = [*CHARLM_ARGS[:10], "--device", "cpu", "--batch-shape", "4x32,4x32"]
    assert main(["estimate", "--devices", "4", "--strategy", "fsdp", *model_args]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    batch = (torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))
    model = CharLM(n_layer=2, n_embd=64, n_head=2, block_size=32)
    fsdp = estimate_memory(model, batch, device="cpu", world_size=4, sharding="fsdp")
    assert len(rows) == 1 and rows[0].split("│")[1].strip() == "0-3", out
    assert rows[0].split("│")[-2].strip() == format_bytes(fsdp.peak_bytes)
    assert " ".join(out.split()).count("32-true + adamw + fsdp x4") == 1 and "processes" not in out, out
    # ZeRO-1: ranks own different parameters' state; the rows are the distinct figures, every rank in one of them
    assert main(["estimate", "--devices", "4", "--strategy", "zero1", *model_args]) == 0
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    zero = estimate_memory(model, batch, device="cpu", world_size=4, sharding="zero1")
    peaks = {format_bytes(rank["peak_bytes"]) for rank in zero.meta["per_rank"]}
    assert len(rows) == len({(r["peak_bytes"], *r["breakdown"].values()) for r in zero.meta["per_rank"]}) > 1
    assert {row[-2].strip() for row in rows} == peaks
    ranks = [r for row in rows for part in row[1].split(",") for r in _rank_range(part)]
    assert sorted(ranks) == [0, 1, 2, 3]


def _rank_range(text: str) -> list[int]:
    first, _, last = text.strip().partition("-")
    return list(range(int(first), int(last or first) + 1))


def _hf_config_folder(tmp_path: Path, **values) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "max_position_embeddings": 512,
        "torch_dtype": "float16",
        **values,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_estimate_from_a_hugging_face_config_json_equals_the_built_model(tmp_path, capsys):
    """`--hf-config` builds the config.json's model on meta (float32 master weights, whatever `torch_dtype` says)
    and estimates the step of a dict batch: the figure estimate_memory gives for the same model and batch."""
    pytest.importorskip("transformers")
    from lightning_lowmem.cli.hf_config import hf_config_batch, hf_config_model

    folder = _hf_config_folder(tmp_path)
    args = ["estimate", "--hf-config", str(folder), "--batch-size", "2", "--seq-len", "64", "--device", "cpu"]
    assert main([*args, "--json", "--precision", "bf16-true"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = hf_config_model(str(folder / "config.json"))
    assert {p.dtype for p in model.parameters()} == {torch.float32} and model.lm_head.weight.is_meta
    expected = estimate_memory(model, hf_config_batch(2, 64), device="cpu", precision="bf16-true")
    assert report["peak_bytes"] == expected.peak_bytes
    params = sum(p.numel() for p in model.parameters())
    assert 2 * params <= report["breakdown"]["parameters"] <= 2 * params + 1024  # bf16-true (+ rotary buffers)
    assert main([*args, "--budget", "1GiB", "--json"]) == 0  # the planner path
    assert json.loads(capsys.readouterr().out)["chosen"]["config"]["precision"] == "32-true"


def test_estimate_shows_each_phase_and_names_other(tmp_path, capsys):
    """The table has a column per phase (the forward's activations, which the step's single peak in the optimizer
    step no longer holds) and says what `other` is; `--json` has the same figures (#26 item 8)."""
    pytest.importorskip("transformers")
    folder = _hf_config_folder(tmp_path)
    args = ["estimate", "--hf-config", str(folder), "--batch-size", "2", "--seq-len", "64", "--device", "cuda"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    forward, optimizer = report["phases"]["forward"], report["phases"]["optimizer"]
    assert forward["breakdown"]["activations"] > 100 * optimizer["breakdown"]["activations"]
    assert forward["other"]["loss / logits"] >= 2 * 64 * 2048 * 4  # the (B, T, V) float32 logits
    assert optimizer["other"]["optimizer step"] > 0
    assert sum(report["other_breakdown"].values()) == report["breakdown"]["other"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "loss / logits" in out and "optimizer step" in out and "phase's own peak" in out


@pytest.mark.parametrize(
    "extra, config, expected",
    [
        ([], {"model_type": None}, "has no `model_type`"),
        (["--seq-len", "0"], {}, "--seq-len '0' is not a number of tokens: give a whole number, or one with k"),
        (["--precision", "bf16"], {}, "--precision='bf16' is not a known preset"),
        (["--model", "x.Y"], {}, "--hf-config takes no other model / data options"),
    ],
)
def test_hf_config_bad_input_is_one_error_line(extra, config, expected, tmp_path, capfd):
    pytest.importorskip("transformers")
    folder = _hf_config_folder(tmp_path, **config)
    if config.get("model_type", "") is None:
        values = json.loads((folder / "config.json").read_text())
        del values["model_type"]
        (folder / "config.json").write_text(json.dumps(values))
    assert main(["estimate", "--hf-config", str(folder), "--device", "cpu", *extra]) == 2
    err = capfd.readouterr().err
    assert expected in err and err.startswith("error:") and "Traceback" not in err


def test_hf_config_missing_file_is_one_error_line(tmp_path, capfd):
    assert main(["estimate", "--hf-config", str(tmp_path / "nope")]) == 2
    assert "no such file (give a Hugging Face config.json" in capfd.readouterr().err


def test_fit_help_lists_our_callbacks_and_short_names_resolve(capsys):
    """LightningCLI resolves a short class name among the Callback subclasses imported: ours are imported first."""
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    for name in ("ScheduledPruning", "ChunkedCrossEntropy", "MemoryMonitor", "ActivationCheckpointing"):
        assert f"lightning_lowmem.{name}" in out
    model_help = out[out.index("subclasses: lightning.LightningModule") :].split(")", 1)[0]  # was: only that one
    for name in ("DistillationModule", "HFLanguageModel", "CharLM", "DigitsClassifier"):
        assert f".{name}," in " ".join(model_help.split()) + ",", name
    assert "HFTextDataModule" in out and "CharLMDataModule" in out
    with pytest.raises(SystemExit):  # --print_config prints and exits
        main(
            [
                "fit",
                "--model",
                "lightning_lowmem.demo.CharLM",
                "--data",
                "lightning_lowmem.demo.CharLMDataModule",
                "--trainer.callbacks+=ScheduledPruning",
                "--print_config",
            ]
        )
    assert "class_path: lightning_lowmem.ScheduledPruning" in capsys.readouterr().out


# ----------------------------------------------------------------------------- resuming
def test_fit_resuming_adapters_only_checkpoint_without_lora_names_the_callback_with_its_r(tmp_path, capfd):
    """#26 item 10: before, Lightning's strict load listed every missing base weight of the model (a 100-line
    RuntimeError); now one line naming LowRankAdapters with the r the file records, before anything is loaded."""
    common = [
        *CHARLM_ARGS,
        "--trainer.logger=false",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    lora = ["--trainer.callbacks+=LowRankAdapters", "--trainer.callbacks.r=3"]
    assert main(["fit", *common, *lora]) == 0
    ckpt = next(tmp_path.rglob("*.ckpt"))
    capfd.readouterr()
    assert main(["fit", *common, "--trainer.max_steps=2", f"--ckpt_path={ckpt}"]) == 2
    lines = _error_lines(capfd)
    assert len(lines) == 2, lines
    assert re.fullmatch(
        rf"error: --ckpt_path {re.escape(str(ckpt))}: this checkpoint was written with LowRankAdapters \(format "
        r"'adapters-only', version 1\), which the loading side lacks: add callbacks=\[LowRankAdapters\(r=3\)\] "
        r"\(same target layers\)\.",
        lines[0],
    )
    assert main(["fit", *common, *lora, "--trainer.max_steps=2", f"--ckpt_path={ckpt}"]) == 0  # with it: resumes


def test_hf_config_without_a_vocabulary_size_says_which_default_it_used(tmp_path):
    """A config.json without vocab_size gets the family's default (LlamaConfig: 32000), said in a warning: the
    logits' memory follows it (issue #26 item 7: it silently got a byte-level vocabulary)."""
    pytest.importorskip("transformers")
    from lightning_lowmem.cli.hf_config import hf_config_model

    folder = _hf_config_folder(tmp_path)
    values = json.loads((folder / "config.json").read_text())
    del values["vocab_size"]
    (folder / "config.json").write_text(json.dumps(values))
    with pytest.warns(UserWarning, match="has no vocab_size: the LlamaConfig default 32000 is used"):
        model = hf_config_model(str(folder))
    assert model.get_input_embeddings().weight.shape == (32000, 64)
    assert model.get_input_embeddings().weight.device.type == "meta"


def test_estimate_reads_what_each_callback_says_it_trains_with(tmp_path, capsys):
    """No class names: AutoMicrobatch's micro-batches and QAT's fake quantization are estimated (they were left out);
    pruning, which fake tensors cannot run, is left out (#35)."""
    config = tmp_path / "callbacks.yaml"
    config.write_text(
        MODEL_DATA_YAML
        + """  callbacks:
    - class_path: lightning_lowmem.AutoMicrobatch
      init_args: {micro_batch_size: 2}
    - class_path: lightning_lowmem.QuantizationAwareTraining
      init_args: {mode: int8_weight_only}
    - class_path: lightning_lowmem.ScheduledPruning
      init_args: {pruning_fn: l1_unstructured, amount: 0.5}
"""
    )
    assert main(["estimate", "--device", "cpu", "--json", "--config", str(config), "--batch-shape", "4x16,4x16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["meta"]["config"]["micro_batch_size"] == 2
    assert report["meta"]["config"]["qat"] == {"mode": "int8_weight_only"}
    assert "pruning" not in report["meta"]["config"] and "prune" not in report["meta"]["label"]

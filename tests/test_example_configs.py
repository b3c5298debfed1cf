"""Every example config runs `lowmem fit --config X` (a short, real run: 2 steps, 1 validation batch), and the
config Lightning auto-saves for it reloads and runs again (`--trainer.fast_dev_run=true`) — the trap of `ModelPruning`, whose
saved config cannot be reloaded. (Lightning saves no config under `fast_dev_run`, hence the short run.) Text
configs run with batches of 4 sequences: their 16-64 would make the suite's slowest test (bf16 emulated on CPU),
and every class, callback and setting of the config still runs and is saved as written but for that number."""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_lowmem.functional.quantization.search as search
from lightning_lowmem.cli import main

SMALL_BATCH = "--data.init_args.batch_size=4"  # text data modules: sequences per batch
CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))
SHORT_RUN = [
    "--trainer.max_epochs=1",
    "--trainer.max_steps=2",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=1.0",
    "--trainer.enable_progress_bar=false",
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_example_config_runs_and_its_saved_config_reloads(config, tmp_path, monkeypatch):
    # PTQ configs time latency over 10 batches per model; one is enough to run that path (eager int8 is slow on CPU)
    real = search.measure_latency
    monkeypatch.setattr(
        search, "measure_latency", lambda module, inputs, **_: real(module, inputs, repeats=1, warmup=0)
    )
    # `main` returns 2 (one `error:` line) for a config mistake, instead of raising
    short = tmp_path / "short"
    text = any(name in config.read_text() for name in ("CharLMDataModule", "HFTextDataModule"))
    assert (
        main(
            [
                "fit",
                "--config",
                str(config),
                *SHORT_RUN,
                *([SMALL_BATCH] if text else []),
                f"--trainer.default_root_dir={short}",
            ]
        )
        == 0
    )
    saved = sorted(short.rglob("config.yaml"))
    assert saved, f"Lightning saved no config.yaml for {config.name}"
    assert not text or "batch_size: 4" in saved[0].read_text()
    assert (
        main(
            [
                "fit",
                "--config",
                str(saved[0]),
                "--trainer.fast_dev_run=true",
                f"--trainer.default_root_dir={tmp_path / 'again'}",
            ]
        )
        == 0
    )

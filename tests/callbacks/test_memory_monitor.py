"""MemoryMonitor inside a real Trainer.fit: logged keys, deep breakdown, resume, bad input."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_lowmem import MemoryMonitor
from lightning_lowmem.demo import DigitsClassifier, DigitsDataModule


def _fit(tmp_path: Path, monitor: MemoryMonitor, max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=max_steps,
        callbacks=[monitor],
        logger=CSVLogger(str(tmp_path), name="logs"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        limit_val_batches=0,
    )
    trainer.fit(DigitsClassifier(hidden=64), DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
    return trainer


def test_keys_written_to_csv_logger(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=2, deep_every_n_steps=3, summary=False)
    trainer = _fit(tmp_path, monitor, max_steps=6)
    metrics_file = Path(trainer.logger.log_dir) / "metrics.csv"
    rows = list(csv.DictReader(metrics_file.open()))
    columns = set(rows[0])
    cheap_steps = [r["step"] for r in rows if r.get("lowmem/memory/rss")]
    assert cheap_steps == ["0", "1", "2", "3", "4"]  # every 2nd step, plus the deep steps
    assert {"lowmem/memory/rss", "lowmem/memory/model_state", "lowmem/memory/peak"} <= columns
    assert {f"lowmem/memory/{c}" for c in ("parameters", "gradients", "optimizer_state", "activations")} <= columns
    deep_steps = [r["step"] for r in rows if r.get("lowmem/memory/peak")]
    assert deep_steps == ["1", "3"]  # the second step, then every 3rd
    report = monitor.last_report
    params = sum(p.numel() * 4 for p in trainer.lightning_module.parameters())
    assert report.breakdown["parameters"] >= params
    assert report.breakdown["optimizer_state"] >= 2 * params  # AdamW: two moments per weight
    assert sum(report.breakdown.values()) == report.peak_bytes


def test_state_survives_checkpoint_resume(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, summary=False)
    trainer = _fit(tmp_path / "a", monitor, max_steps=3)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = MemoryMonitor(log_every_n_steps=1, summary=False)
    _fit(tmp_path / "b", resumed, max_steps=5, ckpt_path=str(ckpt))
    assert resumed.history[: len(monitor.history)] == monitor.history
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3, 4]


def test_summary_table_lists_categories(tmp_path):
    monitor = MemoryMonitor(summary=False)
    _fit(tmp_path, monitor, max_steps=2)
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(monitor.summary_table())
    text = console.export_text()
    assert "optimizer_state" in text and "activations" in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, "`log_every_n_steps` must be a positive int .* got 0"),
        ({"deep_every_n_steps": -1}, "`deep_every_n_steps` must be an int >= 0 .* got -1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryMonitor(**kwargs)


@pytest.mark.parametrize(
    ("optimizer", "compiled"),
    [("adamw8bit", "AdamW8bit"), ("adamw4bit_in_backward", "AdamW4bit"), ("adamw_bf16_sr", "AdamW"), ("adamw", None)],
)
def test_a_deep_step_over_a_compiled_optimizer_step_warns_once(tmp_path, optimizer, compiled):
    """torchao's AdamW family compiles its step; the deep step runs it eagerly (issue #26 item 5): one
    LowMemWarning at the first deep step, none for the later ones, none for an eager optimizer."""
    import warnings

    from lightning_lowmem import LowMemWarning, MemoryEfficientOptimizer
    from lightning_lowmem._compat.compiler import force_eager

    monitor = MemoryMonitor(deep_every_n_steps=2, summary=False)  # deep steps 1 and 2
    trainer = L.Trainer(
        max_steps=3,
        callbacks=[MemoryEfficientOptimizer(optimizer), monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        limit_val_batches=0,
    )
    # the monitor's deep steps run the step eagerly anyway; the others too here (compiling torchao's step takes
    # tens of seconds on CPU): the warning depends on the optimizer, not on the stance
    with force_eager(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DigitsClassifier(hidden=64), DigitsDataModule(batch_size=32))
    ours = [str(w.message) for w in caught if issubclass(w.category, LowMemWarning) and "compiled" in str(w.message)]
    if compiled is None:
        assert ours == []
    else:
        assert len(ours) == 1 and ours[0].startswith(f"MemoryMonitor measures step 1 with {compiled}'s compiled"), ours
    assert monitor.last_report is not None and monitor.last_report.breakdown["optimizer_state"] > 0

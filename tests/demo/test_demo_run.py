"""`lowmem demo`: rows, headers, partial results, emulated-bf16 short rows, the picture, and stopping on
Ctrl-C / SIGTERM.

The demo's own sizes take minutes on 2 cores; these tests run the same code on a tiny charlm (2 x 64,
batch 8 x 32) and one digits epoch, with the bf16 rows forced short (as on a CPU without bf16)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_lowmem.cli import main
from lightning_lowmem.demo import run as demo
from lightning_lowmem.memory import PHASES

ROOT = Path(__file__).resolve().parents[2]


def tiny_settings(*_: object, **__: object) -> demo.DemoSettings:
    return demo.DemoSettings(
        quick=True,
        charlm_steps=6,
        digits_epochs=1,
        bf16_short=True,
        bf16_reason="forced by the test",
        charlm_model=dict(n_layer=2, n_head=2, n_embd=64, block_size=32),
        charlm_batch_size=8,
        charlm_chars=60_000,
        val_batches=2,
    )


def test_demo_rows_table_json_and_picture(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "settings_for", tiny_settings)
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["complete"] is True and result["interrupted_by"] is None
    assert result["settings"]["threads"] == 1  # every run pinned to one thread (as the benchmarks)
    runs = result["runs"]
    assert [line.split("]")[0] for line in out.splitlines() if line.startswith("[")] == [f"[{i}/8" for i in range(1, 9)]
    assert out.count("      done: ") == 8

    baseline, bf16_true, stack, stack_fp32 = (run for run in runs if run["workload"] == "charlm")
    # rows that train the full length carry the loss; emulated-bf16 rows only their memory
    for run in (baseline, stack_fp32):
        assert run["steps"] == 6 and run["metric"] is not None and run["step_ms"] > 0 and not run["memory_only"]
    for run in (bf16_true, stack):
        assert run["steps"] == 2 and run["metric"] is None and run["memory_only"] and "emulated" in run["notes"]
    assert bf16_true["peak_bytes"] < 0.7 * baseline["peak_bytes"]
    assert stack["peak_bytes"] < 0.7 * bf16_true["peak_bytes"]  # the lowmem stack beats Lightning's bf16-true
    assert stack["breakdown"]["gradients"] < baseline["breakdown"]["gradients"] / 4  # in-backward frees grads
    for run in (baseline, stack):  # the trace within the step: every phase, never above the measured peak
        phases = [phase for phase, _ in run["timeline"]]
        assert phases[0] == "forward" and set(phases) == set(PHASES)
        assert max(live for _, live in run["timeline"]) <= run["peak_bytes"]

    digits = {run["name"].split()[0]: run for run in runs if run["workload"] == "digits"}
    base = digits["float"]["model_bytes"]
    assert digits["ScheduledPruning"]["model_bytes"] < base / 4  # 90% sparse, bitmask + values
    assert digits["PostTrainingQuantization"]["model_bytes"] < base / 3  # int8 weights
    assert digits["DistillationModule"]["model_bytes"] < base / 16  # 4x narrower student, int8
    assert all(run["metric"] is not None for run in digits.values())

    assert "bf16 rows: memory only (forced by the test)" in " ".join(out.split())
    assert (tmp_path / "memory.png").stat().st_size > 30_000


def test_pinned_threads_sets_and_restores_the_count():
    import torch

    from lightning_lowmem.demo.timing import pinned_threads

    before = torch.get_num_threads()
    with pinned_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_bf16_speed_by_flag_probe_and_override(monkeypatch):
    from lightning_lowmem.demo import timing

    def speed(**patches: object) -> timing.Bf16Speed:
        for name, value in patches.items():
            monkeypatch.setattr(timing, name, value)
        timing.bf16_speed.cache_clear()
        return timing.bf16_speed()

    monkeypatch.delenv("LOWMEM_BF16", raising=False)
    try:
        assert speed(_cpu_flags=lambda: {"avx2", "amx_bf16"}).reason == "CPU flag amx_bf16"
        slow = speed(_cpu_flags=lambda: {"avx2"}, matmul_slowdown=lambda *a, **k: 70.0)
        assert slow.emulated and "70x slower than fp32" in slow.reason
        assert not speed(matmul_slowdown=lambda *a, **k: 0.8).emulated
        monkeypatch.setenv("LOWMEM_BF16", "emulated")
        assert speed().emulated
    finally:
        timing.bf16_speed.cache_clear()


def test_step_progress_counts_steps_across_epochs(capsys):
    import lightning as L

    from lightning_lowmem.demo import DigitsClassifier, DigitsDataModule
    from lightning_lowmem.demo.timing import StepProgress

    progress = StepProgress("1/1 digits")
    assert not progress.interactive  # pytest's stderr is not a terminal: plain lines
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=0,
        callbacks=[progress],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsClassifier(arch="mlp", hidden=16), DigitsDataModule(batch_size=64))
    lines = [line.split("(")[0].strip() for line in capsys.readouterr().out.splitlines() if "step " in line]
    assert lines == ["step 2/8", "step 4/8", "step 6/8", "step 8/8"]  # 8 = 2 epochs x 4 batches, not "Epoch 1"


SIGNAL_SCRIPT = """
import sys
from lightning_lowmem.demo import run as demo
sys.path.insert(0, {tests!r})
from test_demo_run import tiny_settings
demo.settings_for = tiny_settings
import time, lightning as L
from lightning_lowmem.demo import digits_runs
made = []
_trainer = digits_runs.demo_trainer


class Pause(L.Callback):  # the second run waits inside its fit, so the signal lands there on any machine
    def on_train_batch_start(self, *args):
        print("PAUSED IN FIT 2", flush=True)
        time.sleep(120)


def trainer(title, *args, callbacks=(), **kwargs):
    made.append(title)
    return _trainer(title, *args, callbacks=[*callbacks, Pause()] if len(made) == 2 else callbacks, **kwargs)


digits_runs.demo_trainer = trainer
from lightning_lowmem.cli import main
raise SystemExit(main(["demo", "--workloads", "digits", "--out", {out!r}]))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_one_signal_stops_the_whole_demo_and_keeps_finished_runs(signum, tmp_path):
    """A subprocess (a signal cannot be sent to pytest itself): ~15 s, most of it importing Lightning."""
    script = SIGNAL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    stderr = (tmp_path / "stderr.txt").open("w")  # a file: an unread pipe could fill up and block the demo
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while not any(line.startswith("PAUSED IN FIT 2") for line in seen):  # run 1 finished, run 2 inside its fit
        try:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            process.kill()
            pytest.fail(f"the demo did not reach its second run in 300 s: {''.join(seen)}")
    process.send_signal(signum)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    reader.join(timeout=10)
    stderr.close()
    err = (tmp_path / "stderr.txt").read_text()
    out = "".join(seen) + "".join(lines.get() for _ in range(lines.qsize()))
    assert process.returncode == 128 + signum, (out, err)
    assert "[3/4]" not in out  # the demo did not go on with the next run
    assert f"interrupted by {signal.Signals(signum).name} after 1/4 runs" in out
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["complete"] is False and result["interrupted_by"] == signal.Signals(signum).name
    assert [run["name"] for run in result["runs"]] == ["float MLP 2x256 (baseline)"]
    assert "Traceback" not in err

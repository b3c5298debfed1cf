"""``LowMemoryStrategy(expandable_segments=...)`` reaches the CUDA caching allocator: a fresh process that
trains with it has expandable segments (or none). GPU only (``cuda`` marker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import lightning as L
import torch
from lightning_lowmem.strategies.low_memory import LowMemoryStrategy

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1024, 1024)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

enabled = sys.argv[1] == "True"
initialised_before = torch.cuda.is_initialized()
data = torch.utils.data.TensorDataset(torch.randn(64, 1024))
trainer = L.Trainer(accelerator="cuda", devices=1, strategy=LowMemoryStrategy(expandable_segments=enabled), max_steps=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
segments = torch.cuda.memory_snapshot()
print("RESULT " + json.dumps({"initialised_before": initialised_before,
                               "expandable": [bool(s.get("is_expandable", False)) for s in segments]}))
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_expandable_segments_setting_reaches_the_allocator(enabled, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # this checkout's package
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(enabled)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    assert not found["initialised_before"]
    assert found["expandable"], "the allocator reported no segment at all"
    assert all(found["expandable"]) if enabled else not any(found["expandable"]), found

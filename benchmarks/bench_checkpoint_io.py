"""Checkpoint size and save / load time: CompressedCheckpointIO vs Lightning's TorchCheckpointIO on charlm."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _charlm_state(sparsity: float) -> dict[str, torch.Tensor]:
    from lightning_lowmem.demo import CharLM

    torch.manual_seed(0)
    model = CharLM()  # reference charlm: 4 layers, n_embd 128
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and sparsity > 0:  # magnitude pruning of every weight matrix
                threshold = param.abs().flatten().kthvalue(int(sparsity * param.numel())).values
                param.mul_(param.abs() > threshold)
    return model.state_dict()


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_lowmem.checkpoints import CompressedCheckpointIO

    repeats = 3 if quick else 15  # best of N, the plugins measured in turn (a shared CPU is noisy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same for every plugin; spares the measurement thread-pool oversubscription
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        for sparsity in (0.0, 0.9):
            checkpoint = {"state_dict": _charlm_state(sparsity), "epoch": 0, "global_step": 0}
            plugins = {
                "TorchCheckpointIO": TorchCheckpointIO(),
                "zstd": CompressedCheckpointIO("zstd"),
                "lz4": CompressedCheckpointIO("lz4"),
            }
            # one file name for all (torch.save writes the name into the file): sizes compare byte for byte
            paths = {name: Path(directory) / f"{name}-{sparsity}" / "last.ckpt" for name in plugins}
            for file in paths.values():
                file.parent.mkdir()
            best = {name: [float("inf"), float("inf")] for name in plugins}
            for _ in range(repeats):
                for name, plugin in plugins.items():
                    start = time.perf_counter()
                    plugin.save_checkpoint(checkpoint, paths[name])
                    middle = time.perf_counter()
                    plugin.load_checkpoint(paths[name], weights_only=True)
                    end = time.perf_counter()
                    best[name] = [min(best[name][0], middle - start), min(best[name][1], end - middle)]
            plain_bytes = paths["TorchCheckpointIO"].stat().st_size
            plain_save, plain_load = best["TorchCheckpointIO"]
            label = f"charlm weights, {sparsity:.0%} sparse"
            for name in plugins:
                size = paths[name].stat().st_size
                save_ratio, load_ratio = best[name][0] / plain_save, best[name][1] / plain_load
                rows.append(
                    {
                        "checkpoint": label,
                        "io": name,
                        "MiB": round(size / 2**20, 3),
                        "x smaller": round(plain_bytes / size, 2),
                        "save s": round(best[name][0], 4),
                        "load s": round(best[name][1], 4),
                        "save x torch": round(save_ratio, 2),
                        "load x torch": round(load_ratio, 2),
                    }
                )
                if name == "TorchCheckpointIO":
                    continue
                if sparsity == 0.0:
                    targets += [
                        {
                            "target": f"dense charlm, {name}: save <= 1.5x TorchCheckpointIO",
                            "measured": f"{save_ratio:.2f}x",
                            "met": save_ratio <= 1.5,
                        },
                        {
                            "target": f"dense charlm, {name}: load <= 1.5x TorchCheckpointIO",
                            "measured": f"{load_ratio:.2f}x",
                            "met": load_ratio <= 1.5,
                        },
                        {
                            "target": f"dense charlm, {name}: file never larger than TorchCheckpointIO's",
                            "measured": f"{size} vs {plain_bytes} bytes",
                            "met": size <= plain_bytes,
                        },
                    ]
                elif name == "zstd":
                    ratio = plain_bytes / size
                    targets.append(
                        {
                            "target": "90%-sparse charlm checkpoint >= 5x smaller than torch.save (zstd)",
                            "measured": f"{ratio:.2f}x",
                            "met": ratio >= 5,
                        }
                    )
    torch.set_num_threads(threads)
    return {
        "title": "Checkpoint size and save/load time (CompressedCheckpointIO vs TorchCheckpointIO)",
        "rows": rows,
        "targets": targets,
        "notes": "Weights-only checkpoints of the reference charlm (every weight matrix magnitude-pruned per tensor). "
        f"Times are the best of {repeats} on the local disk, the three plugins measured in turn, torch on one thread. Dense chunks that "
        "compression shrinks by less than 10% are stored raw; when nothing is gained the plugin writes the plain "
        "torch.save file, byte for byte TorchCheckpointIO's (both serialize in memory). fsync is off by default (the rename is atomic against "
        "a killed process; `fsync=True` also survives power loss, at the disk's flush cost).",
    }

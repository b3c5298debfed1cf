"""Train the digits MLP, then quantize it three ways and print size / accuracy, and time the fast CPU
path (static int8, compiled) against compiled float32.

Run: ``python examples/quantize_digits.py`` (about a minute on 2 CPU cores, most of it compiling).
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import torch

from lightning_lowmem.callbacks.post_training_quantization import PostTrainingQuantization
from lightning_lowmem.demo import DigitsClassifier, DigitsDataModule
from lightning_lowmem.functional.quantization.ptq import measure_latency, quantize_
from lightning_lowmem.functional.quantization.compile import compile_inference

warnings.filterwarnings("ignore", module="torchao")


def accuracy(model: torch.nn.Module, loader) -> float:
    with torch.inference_mode():
        hits = [(model(x).argmax(-1) == y).float() for x, y in loader]
    return float(torch.cat(hits).mean())


def main() -> None:
    L.seed_everything(0)
    model, data = DigitsClassifier(hidden=256), DigitsDataModule()
    # 1. the callback: int8 at fit end, val_acc kept within 1 point (layers fall back to float if needed)
    ptq = PostTrainingQuantization("int8_dynamic", monitor="val_acc", tolerance=0.01)
    trainer = L.Trainer(
        max_epochs=5, callbacks=[ptq], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    float_model = None

    class KeepFloat(L.Callback):
        def on_train_end(self, trainer, pl_module):  # runs before PTQ's on_fit_end
            nonlocal float_model
            float_model = copy.deepcopy(pl_module).eval()

    trainer.callbacks.append(KeepFloat())
    trainer.fit(model, data)
    data.setup("test")
    loader = data.test_dataloader()
    print(f"float   test acc {accuracy(float_model, loader):.4f}")
    print(f"int8 (callback) test acc {accuracy(model.eval(), loader):.4f}, kept float: {ptq.summary['kept_float']}")
    # 2. the functional form on a copy: int4 weight values and static int8
    for mode in ("intx4_weight_only", "int8_static"):
        kwargs = {"calibration_data": [x for x, _ in loader][:4]} if mode == "int8_static" else {}
        report = quantize_(copy.deepcopy(float_model), mode, **kwargs)
        print(f"{mode:18} {report.size_ratio:.2f}x smaller, test acc {accuracy(report.module, loader):.4f}")
    # 3. speed: compile both (Inductor freezing -> oneDNN int8 kernels for the static graph)
    batch = next(iter(loader))[0]
    calibration = [x for x, _ in loader][:4]
    fast_int8 = compile_inference(
        quantize_(copy.deepcopy(float_model), "int8_static", calibration_data=calibration).module, (batch,)
    )
    fast_float = compile_inference(copy.deepcopy(float_model), (batch,))
    ratio = measure_latency(fast_float, (batch,), repeats=50) / measure_latency(fast_int8, (batch,), repeats=50)
    print(f"compiled int8_static vs compiled float32: {ratio:.2f}x faster at batch {len(batch)}")


if __name__ == "__main__":
    main()

"""Quantization on digits: size ratio, CPU latency ratio and accuracy delta per mode, beside torch's
deprecated ``torch.ao.quantization.quantize_dynamic`` (the anchor), and QAT vs PTQ at int4 weights."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch


def _accuracy(model: torch.nn.Module, loader: Any) -> float:
    correct = total = 0
    with torch.inference_mode():
        for x, y in loader:
            correct += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    return correct / total


def _train(epochs: int, callbacks: list[Any], hidden: int) -> Any:
    import lightning as L

    from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule

    L.seed_everything(0, verbose=False)
    model, data = DigitsClassifier(hidden=hidden), DigitsDataModule()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, data)
    data.setup("test")
    return model.eval(), data


def run(device: str = "cpu", quick: bool = False) -> dict:
    warnings.filterwarnings("ignore")
    from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining
    from lightning_lowmem.functional.quantization import measure_latency, quantize_
    from lightning_lowmem.memory.measure import state_bytes

    epochs, hidden = (2, 256) if quick else (8, 512)
    model, data = _train(epochs, [], hidden)
    loader = data.test_dataloader()
    batch = next(iter(loader))[0]
    float_bytes = state_bytes(model)["parameters"]
    float_latency = measure_latency(model, (batch,), repeats=30)
    float_acc = _accuracy(model, loader)
    rows = [{"mode": "float32", "size_ratio": 1.0, "latency_ratio": 1.0, "accuracy": float_acc, "acc_delta_pts": 0.0}]

    def add(name: str, quantized: torch.nn.Module, size: int) -> dict:
        row = {
            "mode": name,
            "size_ratio": float_bytes / size,
            "latency_ratio": float_latency / measure_latency(quantized, (batch,), repeats=30),
            "accuracy": _accuracy(quantized, loader),
        }
        row["acc_delta_pts"] = 100 * (row["accuracy"] - float_acc)
        rows.append(row)
        return row

    anchor = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    import io

    def saved_bytes(module: torch.nn.Module) -> int:
        buffer = io.BytesIO()
        torch.save(module.state_dict(), buffer)
        return len(buffer.getvalue())

    float_saved = saved_bytes(model)
    anchor_row = add("torch.ao quantize_dynamic (anchor)", anchor, 1)
    anchor_row["size_ratio"] = float_saved / saved_bytes(anchor)  # packed params: compare checkpoint sizes
    results = {}
    for mode in ("int8_dynamic", "int8_weight_only", "intx4_weight_only"):
        quantized = copy.deepcopy(model)
        report = quantize_(quantized, mode)
        results[mode] = add(mode, quantized, report.bytes_after)
    batches = [x for x, _ in list(data.val_dataloader())[:8]]
    static = quantize_(copy.deepcopy(model), "int8_static", calibration_data=batches, example_inputs=(batch,))
    results["int8_static"] = add("int8_static (pt2e, eager)", static.module, static.bytes_after)
    qat_model, _ = _train(epochs, [QuantizationAwareTraining("intx4_weight_only", start_step=0)], hidden)
    results["qat"] = add("QAT intx4_weight_only", qat_model, state_bytes(qat_model)["parameters"])

    best_int8 = max(results[m]["latency_ratio"] for m in ("int8_dynamic", "int8_weight_only", "int8_static"))
    ptq4, qat4 = results["intx4_weight_only"]["acc_delta_pts"], results["qat"]["acc_delta_pts"]
    targets = [
        {"target": "int8 >= 3.8x smaller (int8_dynamic)", "measured": f"{results['int8_dynamic']['size_ratio']:.2f}x",
         "met": results["int8_dynamic"]["size_ratio"] >= 3.8},
        {"target": "int8 >= 1.5x faster on CPU (best torchao int8 mode, eager)", "measured": f"{best_int8:.2f}x",
         "met": best_int8 >= 1.5},
        {"target": "int8 <= 1 point accuracy drop", "measured": f"{results['int8_dynamic']['acc_delta_pts']:+.2f} pts",
         "met": results["int8_dynamic"]["acc_delta_pts"] >= -1.0},
        {"target": "QAT int4-weight recovers more than PTQ int4-weight", "measured": f"PTQ {ptq4:+.2f} vs QAT {qat4:+.2f} pts",
         "met": qat4 > ptq4},
    ]  # fmt: skip
    notes = (
        f"DigitsClassifier MLP (hidden={hidden}), {epochs} epochs, test split, batch {len(batch)}; latency = median "
        "eager forward on CPU (no torch.compile). torchao's int8 tensor subclasses run eager dispatch that is slower "
        "than fp32 on tiny matmuls; torch.ao's fbgemm kernels are the anchor. int4_weight_only has no CPU kernel in "
        "torchao 0.18 (intx4 = int4 values in int8 storage). charlm is not benchmarked yet. Size ratios count "
        "parameter+buffer bytes (the anchor's: checkpoint bytes, its packed weights are opaque)."
    )
    return {"title": "Quantization (digits, CPU)", "rows": rows, "targets": targets, "notes": notes}

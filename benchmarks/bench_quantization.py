"""Quantization on digits (MLP classifier) and charlm (character-level GPT): size ratio, CPU latency
ratio (eager and ``torch.compile``-d, each against float32 run the same way) and metric delta per mode,
beside torch's deprecated ``torch.ao.quantization.quantize_dynamic`` (the anchor); QAT vs PTQ at
int4 weight values on charlm, where int4 PTQ loses loss; and whole-model int8 of the Hugging Face models
users bring (GPT-2 with Conv1D and a tied head, Llama, BERT with a tied decoder, T5): size ratio
(embeddings included) and relative output change.

Latency is timed with one intra-op thread (the 2-core machine is shared: two OpenMP threads under load
swing by 5x), in interleaved rounds, median of the rounds' medians.
"""

from __future__ import annotations

import copy
import io
import statistics
import warnings
from typing import Any, Callable

import torch
from torch import nn

ROUNDS = 7


def _saved_bytes(module: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return len(buffer.getvalue())


def _trainer(callbacks: list[Any] = (), **kwargs: Any) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def _latencies(candidates: dict[str, Callable[..., Any]], inputs: tuple[Any, ...], repeats: int) -> dict[str, float]:
    """Median seconds per call of each candidate, timed in ``ROUNDS`` interleaved rounds."""
    from lightning_lowmem.functional.quantization.ptq import measure_latency

    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, fn in candidates.items():
            times[name].append(measure_latency(fn, inputs, repeats=repeats, warmup=1))
    return {name: statistics.median(values) for name, values in times.items()}


def _variants(model: nn.Module, calibration: list[tuple[Any, ...]]) -> tuple[dict[str, tuple[nn.Module, int]], int]:
    """Every (mode, execution) variant of ``model``: name -> (callable module, bytes), and float bytes.
    The torchao modes quantize nn.Linear and nn.Embedding (their default); int8_static and the anchor
    quantize nn.Linear only."""
    from lightning_lowmem.functional.quantization.ptq import quantize_
    from lightning_lowmem.functional.quantization.compile import compile_inference
    from lightning_lowmem.memory.measure import state_bytes

    float_bytes = state_bytes(model)["parameters"]
    variants: dict[str, tuple[nn.Module, int]] = {"float32": (model, float_bytes)}
    anchor = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    # packed fbgemm weights are opaque to state_bytes: scale the float bytes by the checkpoint-size ratio
    variants["torch.ao quantize_dynamic (anchor)"] = (
        anchor,
        round(float_bytes * _saved_bytes(anchor) / _saved_bytes(model)),
    )
    for mode in ("int8_dynamic", "int8_weight_only", "intx4_weight_only"):
        report = quantize_(copy.deepcopy(model), mode)
        variants[mode] = (report.module, report.bytes_after)
    static = quantize_(copy.deepcopy(model), "int8_static", calibration_data=calibration, example_inputs=calibration[0])
    variants["int8_static"] = (static.module, static.bytes_after)
    variants["float32 compiled"] = (compile_inference(copy.deepcopy(model)), float_bytes)
    dynamic = quantize_(copy.deepcopy(model), "int8_dynamic")
    variants["int8_dynamic compiled"] = (compile_inference(dynamic.module), dynamic.bytes_after)
    static_copy = quantize_(
        copy.deepcopy(model), "int8_static", calibration_data=calibration, example_inputs=calibration[0]
    )
    variants["int8_static compiled"] = (compile_inference(static_copy.module), static_copy.bytes_after)
    return variants, float_bytes


def _linear_only_ratio(model: nn.Module) -> float:
    """Size ratio of int8_dynamic with ``embeddings=False`` (what the table showed before embeddings)."""
    from lightning_lowmem.functional.quantization.ptq import quantize_

    return quantize_(copy.deepcopy(model), "int8_dynamic", embeddings=False).size_ratio


def _rows(
    workload: str,
    variants: dict[str, tuple[nn.Module, int]],
    float_bytes: int,
    batch: tuple[Any, ...],
    single: tuple[Any, ...],
    metric: Callable[[nn.Module], float],
    delta: Callable[[float, float], float],
    repeats: int,
) -> list[dict[str, Any]]:
    metrics = {name: metric(module) for name, (module, _) in variants.items()}  # also compiles each shape
    callables = {name: module for name, (module, _) in variants.items()}
    latency = _latencies(callables, batch, repeats)
    latency_1 = _latencies(callables, single, repeats * 4)
    rows = []
    for name, (_, size) in variants.items():
        reference = "float32 compiled" if name.endswith("compiled") else "float32"
        rows.append(
            {
                "workload": workload,
                "mode": name,
                "size_ratio": float_bytes / size,
                "latency_ms": 1e3 * latency[name],
                "speedup": latency[reference] / latency[name],
                "speedup_b1": latency_1[reference] / latency_1[name],
                "speedup_vs_eager_fp32": latency["float32"] / latency[name],
                "metric": metrics[name],
                "delta": delta(metrics[name], metrics["float32"]),
            }
        )
    return rows


# --- digits ----------------------------------------------------------------------------------------------


def _digits(quick: bool) -> list[dict[str, Any]]:
    import lightning as L

    from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule

    epochs, hidden, batch_size = (2, 256, 256) if quick else (8, 512, 256)
    L.seed_everything(0, verbose=False)
    module, data = DigitsClassifier(hidden=hidden), DigitsDataModule(batch_size=batch_size)
    _trainer(max_epochs=epochs).fit(module, data)
    model = module.model.eval()
    test = list(data.test_dataloader())
    calibration = [(x,) for x, _ in data.val_dataloader()]

    def accuracy(net: nn.Module) -> float:
        with torch.inference_mode():
            hits = sum(int((net(x).argmax(-1) == y).sum()) for x, y in test)
        return hits / sum(len(y) for _, y in test)

    variants, float_bytes = _variants(model, calibration)
    batch = test[0][0][:batch_size]
    rows = _rows(
        f"digits MLP h{hidden}, batch {len(batch)}",
        variants,
        float_bytes,
        (batch,),
        (batch[:1],),
        accuracy,
        lambda value, base: 100 * (value - base),
        repeats=20,
    )
    rows[0]["linear_only_ratio"] = _linear_only_ratio(model)
    return rows


# --- charlm ----------------------------------------------------------------------------------------------


def _charlm_setup(quick: bool) -> dict[str, Any]:
    import lightning as L

    from lightning_lowmem.demo.charlm import CharLM, CharLMDataModule

    config = (
        dict(n_layer=1, n_embd=64, steps=60, qat_steps=30)
        if quick
        else dict(n_layer=2, n_embd=128, steps=300, qat_steps=100)
    )
    L.seed_everything(0, verbose=False)
    data = CharLMDataModule(block_size=64, batch_size=32, max_chars=400_000 if quick else 1_000_000)
    data.setup()
    module = CharLM(n_layer=config["n_layer"], n_head=4, n_embd=config["n_embd"], block_size=64, lr=3e-3)
    _trainer(max_steps=config["steps"]).fit(module, data)
    val = [x for x in data.val_dataloader() if len(x[0]) == 32][: 8 if quick else 24]
    return {"module": module.eval(), "data": data, "val": val, **config}


def _val_loss(net: nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.inference_mode():
        losses = [float(torch.nn.functional.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())) for x, y in val]
    return sum(losses) / len(losses)


def _relative_increase(value: float, base: float) -> float:
    return 100 * (value - base) / base


def _charlm(setup: dict[str, Any]) -> list[dict[str, Any]]:
    model, val = setup["module"].model, setup["val"]
    calibration = [(x,) for x, _ in val[:8]]
    variants, float_bytes = _variants(model, calibration)
    rows = _rows(
        f"charlm GPT {setup['n_layer']}x{setup['n_embd']}, batch 32x64",
        variants,
        float_bytes,
        (val[0][0],),
        (val[0][0][:1],),
        lambda net: _val_loss(net, val),
        _relative_increase,
        repeats=3,
    )
    rows[0]["linear_only_ratio"] = _linear_only_ratio(model)
    return rows


def _qat_vs_ptq(setup: dict[str, Any], group_size: int) -> dict[str, float]:
    """Both arms start from the trained float model and get the same extra steps at the same lr: the
    float arm is then quantized (PTQ), the QAT arm trains with int4 fake quantization and is converted.
    QAT covers nn.Linear only, so PTQ keeps the embedding tables float too (the same format)."""
    import lightning as L

    from lightning_lowmem.callbacks.quantization_aware_training import QuantizationAwareTraining
    from lightning_lowmem.functional.quantization.ptq import quantize_

    def fine_tune(callbacks: list[Any]) -> Any:
        module = copy.deepcopy(setup["module"]).train()
        module.hparams.lr = 1e-3
        L.seed_everything(1, verbose=False)
        _trainer(callbacks, max_steps=setup["qat_steps"]).fit(module, setup["data"])
        return module.eval()

    val = setup["val"]
    float_model = fine_tune([]).model
    float_loss = _val_loss(float_model, val)
    ptq = quantize_(copy.deepcopy(float_model), "intx4_weight_only", group_size=group_size, embeddings=False).module
    qat = fine_tune([QuantizationAwareTraining("intx4_weight_only", group_size=group_size)]).model
    return {"float": float_loss, "ptq": _val_loss(ptq, val), "qat": _val_loss(qat, val)}


# --- Hugging Face models ----------------------------------------------------------------------------------

HF_CONFIGS = {
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4),
    "llama": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "bert": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),
    "t5": dict(d_model=128, d_ff=256, d_kv=32, num_layers=2, num_heads=4),
}
HF_TARGET_FAMILIES = ("gpt2", "llama", "bert")


def _hf_outputs(module: nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """Logits of every batch (flattened, concatenated) and the mean loss."""
    with torch.inference_mode():
        outputs = [module(**batch) for batch in batches]
    logits = torch.cat([output.logits.flatten() for output in outputs])
    return logits, sum(float(output.loss) for output in outputs) / len(outputs)


def _relative_change(output: torch.Tensor, reference: torch.Tensor) -> float:
    return 100 * float((output - reference).norm() / reference.norm())


def _hf(quick: bool) -> list[dict[str, Any]]:
    """Each family trained briefly (real users quantize trained weights), then quantized whole (int8_dynamic,
    int8_weight_only): size ratio, saved-file ratio, relative change of the logits and of the loss on held-out
    batches; the logits change of the same quantization of the untrained (random) weights beside it."""
    import itertools

    import lightning as L

    from lightning_lowmem.models.hf import FAMILIES, HFLanguageModel, HFTextDataModule
    from lightning_lowmem.functional.quantization.ptq import quantize_

    steps = 20 if quick else 150
    rows = []
    for family, config in HF_CONFIGS.items():
        L.seed_everything(0, verbose=False)
        module = HFLanguageModel(family, config=config, lr=3e-3)
        untrained = copy.deepcopy(module).eval()
        data = HFTextDataModule(FAMILIES[family], seq_len=64, batch_size=16, max_chars=200_000 if quick else 400_000)
        _trainer(max_steps=steps).fit(module, data)
        module.eval()
        batches = list(itertools.islice(data.val_dataloader(), 2 if quick else 6))
        reference, reference_loss = _hf_outputs(module, batches)
        untrained_reference, _ = _hf_outputs(untrained, batches)
        for mode in ("int8_dynamic", "int8_weight_only"):
            quantized = copy.deepcopy(module)
            report = quantize_(quantized, mode)
            logits, loss = _hf_outputs(quantized, batches)
            random_init = copy.deepcopy(untrained)
            quantize_(random_init, mode)
            rows.append(
                {
                    "workload": f"HF {family} {config_label(config)}, +{steps} steps",
                    "mode": mode,
                    "size_ratio": report.size_ratio,
                    "file_ratio": _saved_bytes(module) / _saved_bytes(quantized),
                    "output_change_pct": _relative_change(logits, reference),
                    "delta": _relative_increase(loss, reference_loss),
                    "output_change_random_init_pct": _relative_change(
                        _hf_outputs(random_init, batches)[0], untrained_reference
                    ),
                    "layers": len(report.converted),
                    "conv1d": len(report.conv1d),
                    "tied": " = ".join(name.rsplit(".", 1)[-1] for group in report.tied for name in group) or "-",
                }
            )
    return rows


def config_label(config: dict[str, Any]) -> str:
    width = next(v for k, v in config.items() if k in ("n_embd", "hidden_size", "d_model"))
    layers = next(v for k, v in config.items() if k in ("n_layer", "num_hidden_layers", "num_layers"))
    return f"{layers}x{width}"


def _hf_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for family in HF_TARGET_FAMILIES:
        row = next(r for r in rows if r["workload"].startswith(f"HF {family} ") and r["mode"] == "int8_dynamic")
        targets += [
            {
                "target": f"HF {family}: whole-model int8 >= 3.5x smaller (int8_dynamic, embeddings and tied head included)",
                "measured": f"{row['size_ratio']:.3f}x (file {row['file_ratio']:.2f}x; {row['layers']} layers, "
                f"{row['conv1d']} Conv1D, tied: {row['tied']})",
                "met": row["size_ratio"] >= 3.5,
            },
            {
                "target": f"HF {family}: int8 output change <= 1% relative (logits, trained weights)",
                "measured": f"{row['output_change_pct']:.3f}% (loss {row['delta']:+.4f}%; untrained random weights: "
                f"{row['output_change_random_init_pct']:.2f}%)",
                "met": row["output_change_pct"] <= 1.0,
            },
        ]
    return targets


def run(device: str = "cpu", quick: bool = False) -> dict:
    from benchmarks.common import smoke

    if device == "cuda" or smoke():  # the CUDA study (int4 on tinygemm): benchmarks/int4_cuda.py; smoke runs it on CPU
        from benchmarks.int4_cuda import quantization_cuda

        return quantization_cuda(device, quick)
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = _digits(quick)
        setup = _charlm_setup(quick)
        rows += _charlm(setup)
        qat = {size: _qat_vs_ptq(setup, size) for size in (32, 128)}
        hf_rows = _hf(quick)
    finally:
        torch.set_num_threads(threads)
    for size, losses in qat.items():
        for arm in ("ptq", "qat"):
            rows.append(
                {
                    "workload": f"charlm, +{setup['qat_steps']} steps from the float model",
                    "mode": f"{arm.upper()} intx4 g{size}",
                    "metric": losses[arm],
                    "delta": _relative_increase(losses[arm], losses["float"]),
                }
            )
    by = {(row["workload"].split()[0], row["mode"]): row for row in rows}
    linear_only = {workload: by[(workload, "float32")].pop("linear_only_ratio") for workload in ("digits", "charlm")}
    targets = []
    for workload, unit, limit in (("digits", "pts", -1.0), ("charlm", "% loss", 1.0)):
        size = by[(workload, "int8_dynamic")]["size_ratio"]
        best = max(
            ("int8_dynamic", "int8_weight_only", "int8_static", "int8_dynamic compiled", "int8_static compiled"),
            key=lambda mode: by[(workload, mode)]["speedup"],
        )
        deltas = {mode: by[(workload, mode)]["delta"] for mode in ("int8_dynamic", best)}
        met_delta = all((d >= limit) if workload == "digits" else (d <= limit) for d in deltas.values())
        targets += [
            {
                "target": f"{workload}: int8 >= 3.8x smaller (int8_dynamic, whole model)",
                "measured": f"{size:.3f}x (nn.Linear only: {linear_only[workload]:.3f}x)",
                "met": size >= 3.8,
            },
            {
                "target": f"{workload}: int8 >= 1.5x faster on CPU than float32 run the same way (best int8 path)",
                "measured": f"{best}: {by[(workload, best)]['speedup']:.2f}x (batch 1: {by[(workload, best)]['speedup_b1']:.2f}x)",
                "met": by[(workload, best)]["speedup"] >= 1.5,
            },
            {
                "target": f"{workload}: int8 metric drop <= {'1 point' if workload == 'digits' else '1% relative val loss'}",
                "measured": ", ".join(f"{mode} {d:+.2f} {unit}" for mode, d in deltas.items()),
                "met": met_delta,
            },
        ]
    for size, losses in qat.items():
        ptq_drop, qat_drop = (_relative_increase(losses[a], losses["float"]) for a in ("ptq", "qat"))
        targets.append(
            {
                "target": f"charlm: QAT intx4 (group {size}) ends with a lower val loss than PTQ intx4 (same format, same steps)",
                "measured": f"PTQ {ptq_drop:+.2f}% vs QAT {qat_drop:+.2f}% (vs the float arm)",
                "met": qat_drop < ptq_drop,
            }
        )
    from lightning_lowmem.functional.quantization.static import cpu_has_vnni

    vnni = cpu_has_vnni()
    ptq_costs = " / ".join(
        f"{_relative_increase(losses['ptq'], losses['float']):+.2f}% (g{size})" for size, losses in qat.items()
    )
    notes = (
        "speedup = float32 latency / mode latency at the listed batch, eager modes against eager float32 and compiled "
        "modes against compiled float32 (`compile_inference`: torch.compile with Inductor freezing, so the pt2e graph "
        "runs oneDNN int8 kernels); speedup_vs_eager_fp32 compares everything with eager float32; speedup_b1 = "
        "batch 1. One intra-op thread, 7 interleaved rounds, median. delta: accuracy points (digits, test split) or "
        "relative val-loss increase in % (charlm; +1% loss = the '1 point' budget there; perplexity = exp(loss)). "
        "Size ratios count parameter+buffer bytes. The torchao modes (int8_dynamic, int8_weight_only, intx4_weight_only) "
        "quantize nn.Linear weights and nn.Embedding tables (charlm's token/position embeddings: weight-only, int8 per "
        "row, or int4 values in groups for intx4); int8_static and the torch.ao anchor quantize nn.Linear only. "
        "LayerNorm weights and all biases stay float, every int8 row carries an fp32 scale (4 bytes beside the 128 "
        "int8 values of a row at n_embd 128, +3%) and the embedding rows also an int8 zero point (torchao's "
        "IntxUnpackedToInt8Tensor requires one; the all-zero zero points torchao stores beside symmetric int8 "
        "nn.Linear weights are dropped, `drop_zero_points_`), so whole-model int8 stays below 4x on charlm; the size "
        "target's 'nn.Linear only' figure is int8_dynamic with embeddings=False. "
        "int4_weight_only has no CPU kernel in torchao 0.18 "
        "(intx4 = int4 values in int8 bytes). QAT arms: both start from the trained float model and get the same "
        "extra steps at lr 1e-3; PTQ quantizes the float arm. QAT covers nn.Linear only, so both arms keep the embedding "
        "tables float (PTQ with embeddings=False); charlm's head is not tied, so QAT converts the same layers as PTQ. "
        f"int4 PTQ of the nn.Linear layers costs charlm {ptq_costs} val loss here (vs the float arm), so there is "
        "little drop for QAT to recover; the QAT target is read as QAT ending below PTQ at the same format. The "
        "intx4_weight_only rows also hold the embedding tables in int4 values (groups of 32): compare their delta with "
        "the PTQ arms' (nn.Linear only)."
        f" This CPU {'has' if vnni else 'has no'} VNNI (AVX512-VNNI / AMX) for oneDNN's int8 kernels and is shared with "
        "other jobs: absolute milliseconds swing between runs, compare ratios measured in the same run (interleaved). "
        "Without VNNI, eager torchao int8 (int8_dynamic above all) is many times slower than float, and the compiled "
        "static path gains far less than on a VNNI CPU."
    )
    rows += hf_rows
    targets += _hf_targets(hf_rows)
    notes += (
        " HF rows: tiny-but-not-trivial transformers configs (layers x width) over the byte vocabulary (264 ids), "
        "trained for the listed steps on the stdlib corpus (seq 64, batch 16, lr 3e-3), then quantized whole with "
        "quantize_ (GPT-2's Conv1D layers become exact nn.Linear; a head tied to the token table is quantized once, "
        "weight-only int8 per row, and stays tied: stored once). size_ratio counts parameter bytes, file_ratio the "
        "torch.save'd state dict (pickle overhead per tensor included). output_change_pct = 100 * ||logits_q - logits|| "
        "/ ||logits|| over 6 held-out batches; delta = relative loss change in %. output_change_random_init_pct: the "
        "same quantization of the untrained (randomly initialised) weights, whose near-zero logits make per-row "
        "int8 rounding (about 0.65% of a Gaussian weight per layer) show up at 1-2%: the figure a user trying random "
        "models sees, not what trained models lose. T5 is reported, not targeted. "
        "Static int8 on a CPU without VNNI (this one: AVX2 only) quantizes activations to 7 bits (reduce_range), "
        "which keeps the compiled oneDNN kernels equal to the reference graph (8-bit activations saturate there)."
    )
    return {
        "title": "Quantization (digits, charlm and Hugging Face models, CPU)",
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }

"""The rows of ``bench_vision`` that put the libraries' own recipes beside ours, measured the same way.

* **checkpointing**: Hugging Face's ``model.gradient_checkpointing_enable()`` beside
  ``checkpoint_(model, "auto")`` (what ``ActivationCheckpointing("auto")`` applies) on tiny HF ViT, ResNet and
  ConvNeXt: activation bytes and peak of a forward + backward, whether the gradients are ``torch.equal`` to those
  without checkpointing, and the fp32 + AdamW step peak, measured and predicted by ``estimate_memory``. ResNet and
  ConvNeXt have ``supports_gradient_checkpointing = False`` in transformers 5: Hugging Face's row says so.
* **int8 conv nets**: torchao's own configs on the trained digits CNNs of :mod:`benchmarks._vision_rows` --
  ``IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))`` with a ``filter_fn`` taking
  ``nn.Conv2d`` and ``nn.Linear`` (its only int8 recipe that reaches convolutions), ``Int8WeightOnlyConfig()``
  as shipped (linear layers only) and with the same ``filter_fn`` -- beside our ``int8_weight_only``: size ratio,
  accuracy change, logit error, inference peak and whether the model runs in train / eval / ``no_grad`` /
  ``inference_mode``.

Memory is the memory core's (exact tensor bytes, CPU).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
from torch import nn

from benchmarks._vision_rows import accuracy, hf_resnet, inference_peak, vit
from benchmarks.common import mib
from lightning_lowmem.functional.checkpointing import checkpoint_
from lightning_lowmem.functional.quantization import quantize_ as lowmem_quantize_
from lightning_lowmem.memory import measure_memory, state_bytes
from lightning_lowmem.planning.estimate import TrainingConfig, _train_step, default_loss, estimate_memory

HF = "HF gradient_checkpointing_enable()"
OURS = "lowmem checkpoint_(model, 'auto')"


def hf_convnext() -> nn.Module:
    """ConvNeXt of ``tests/vision_zoo.py``: hidden sizes 32 / 64, depths 2 / 2, 2 x 2 patches."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(
        num_channels=3, patch_size=2, hidden_sizes=[32, 64], depths=[2, 2], num_stages=2, image_size=32, num_labels=10
    )
    return ConvNextForImageClassification(config)


def _hf_enable(model: nn.Module) -> int:
    """Hugging Face's own recipe; returns how many modules it switched to checkpointing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5: FutureWarning, renamed activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    return sum(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _forward_backward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """Memory report of one forward + backward, and the gradients it left."""

    def step() -> None:
        output = model(batch[0])
        nn.functional.cross_entropy(getattr(output, "logits", output), batch[1]).backward()

    report = measure_memory(step, module=model)
    return report, [p.grad for p in model.parameters()]


def _step_peak(model: nn.Module, batch: Any) -> int:
    """Peak of the second fp32 + AdamW step (optimizer state alive), torch's order, as ``estimate_memory``'s."""
    config = TrainingConfig(optimizer="adamw")
    optimizer = torch.optim.AdamW(model.parameters())
    _train_step(model, batch, default_loss, optimizer, config, None, loop="torch")
    args = (model, batch, default_loss, optimizer, config, None)
    return measure_memory(_train_step, *args, loop="torch", module=model, device="cpu").peak_bytes


def checkpointing_rows(small: bool) -> list[dict[str, Any]]:
    """Per model: no checkpointing, Hugging Face's recipe, ours (see the module docstring)."""
    generator = torch.Generator().manual_seed(0)
    models: list[tuple[str, Callable[[], nn.Module], int]] = [
        ("HF ViT (2 layers, width 64)", vit, 16),
        ("HF ResNet (basic, 16/32)", hf_resnet, 32),
        ("HF ConvNeXt (32/64)", hf_convnext, 32),
    ]
    rows = []
    for name, make, size in models:
        count = 8 if small else 32
        batch = (
            torch.randn(count, 3, size, size, generator=generator),
            torch.randint(0, 10, (count,), generator=generator),
        )
        base = make().train()
        plain_report, plain_grads = _forward_backward(copy.deepcopy(base), batch)
        for setup in ("none", HF, OURS):
            model = copy.deepcopy(base)
            row: dict[str, Any] = {"model": name, "batch": f"{count} x 3 x {size} x {size}", "setup": setup}
            config = TrainingConfig(optimizer="adamw")
            if setup == HF:
                try:
                    row["blocks"] = _hf_enable(model)
                except ValueError as error:  # transformers: "<class> does not support activation checkpointing."
                    rows.append({**row, "blocks": "-", "error": f"ValueError: {error}"})
                    continue
            elif setup == OURS:
                row["blocks"] = len(checkpoint_(model, "auto").wrapped)
                config = TrainingConfig(optimizer="adamw", activation_checkpointing="auto")
            else:
                row["blocks"] = 0
            report, grads = (plain_report, plain_grads) if setup == "none" else _forward_backward(model, batch)
            model.zero_grad(set_to_none=True)
            # ours: the estimator applies checkpointing to the plain model itself (as the planner does); HF's: the
            # estimator is given the model as the user prepared it
            predicted = estimate_memory(
                model if setup == HF else base, batch, config=config, device="cpu", loop="torch"
            ).peak_bytes
            measured = _step_peak(model, batch)
            rows.append(
                {
                    **row,
                    "activations MiB": mib(report.breakdown["activations"]),
                    "fwd+bwd peak MiB": mib(report.peak_bytes),
                    "grads equal": "-" if setup == "none" else all(map(torch.equal, grads, plain_grads)),
                    "step peak MiB": mib(measured),
                    "predicted MiB": mib(predicted),
                    "error %": round(100 * (predicted / measured - 1), 2),
                }
            )
    return rows


def _int8_layers(model: nn.Module) -> tuple[int, int]:
    """(convolutions, linear layers) whose weight is no longer a plain float tensor."""

    def quantized(m: nn.Module) -> bool:
        return type(getattr(m, "weight", None)) not in (nn.Parameter, torch.Tensor, type(None))

    convs = sum(isinstance(m, nn.Conv2d) and quantized(m) for m in model.modules())
    linears = sum(isinstance(m, nn.Linear) and quantized(m) for m in model.modules())
    return convs, linears


def _conv_weight_error(trained: nn.Module, quantized: nn.Module) -> float | str:
    """Mean over the int8 convolutions of ``||dequantized - float|| / ||float||`` of their weights (percent)."""
    errors = []
    float_convs = dict(trained.named_modules())
    for name, module in quantized.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Conv2d) and type(weight) is not nn.Parameter and hasattr(weight, "dequantize"):
            reference = float_convs[name].weight.detach()
            errors.append(float((weight.dequantize() - reference).norm() / reference.norm()))
    return round(100 * sum(errors) / len(errors), 2) if errors else "-"


def _runs_in(model: nn.Module, images: torch.Tensor) -> str:
    """Where a forward of the quantized model runs: train (grad on), eval, ``no_grad``, ``inference_mode``."""
    failed = {}
    for context in ("train", "eval", "no_grad", "inference_mode"):
        copy_ = copy.deepcopy(model).train(context == "train")
        guard = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(context, torch.enable_grad)
        try:
            with guard():
                copy_(images)
        except Exception as error:  # noqa: BLE001 -- the row reports whatever torchao raises
            failed[context] = f"{type(error).__name__}: {str(error).splitlines()[0][:70]}"
    if not failed:
        return "all four"
    if len(set(failed.values())) == 1 and len(failed) == 4:
        return f"none ({next(iter(failed.values()))})"
    return "; ".join(f"{context}: {error}" for context, error in failed.items())


def _torchao_recipes() -> list[tuple[str, str, Callable[[nn.Module], Any]]]:
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization import quantize_ as torchao_quantize_
    from torchao.quantization.granularity import PerAxis

    def conv_and_linear(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, (nn.Conv2d, nn.Linear))

    def intx(model: nn.Module) -> None:
        config = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
        torchao_quantize_(model, config, filter_fn=conv_and_linear)

    return [
        (
            "lowmem quantize_(model, 'int8_weight_only')",
            "output channel",
            lambda m: lowmem_quantize_(m, "int8_weight_only"),
        ),
        (
            "torchao IntxWeightOnlyConfig(int8, PerAxis(0)), filter_fn: Conv2d + Linear",
            "output channel x kernel position",
            intx,
        ),
        (
            "torchao Int8WeightOnlyConfig() (default filter_fn)",
            "output row (linear only)",
            lambda m: torchao_quantize_(m, Int8WeightOnlyConfig()),
        ),
        (
            "torchao Int8WeightOnlyConfig(), filter_fn: Conv2d + Linear",
            "-",
            lambda m: torchao_quantize_(m, Int8WeightOnlyConfig(), filter_fn=conv_and_linear),
        ),
    ]


def torchao_rows(data: dict[str, Any], cnns: list[tuple[str, nn.Module]]) -> list[dict[str, Any]]:
    """Per trained CNN and recipe: int8 layers, size, accuracy and logit change, inference peak, where it runs."""
    images = data["test"][0][:64]
    rows = []
    for name, trained in cnns:
        float_bytes, float_accuracy = state_bytes(trained)["parameters"], accuracy(trained, data)
        with torch.no_grad():
            float_logits = _logits(trained, data["test"][0])
        for recipe, scale, apply in _torchao_recipes():
            model = copy.deepcopy(trained)
            row: dict[str, Any] = {"model": name, "recipe": recipe, "scale per": scale}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    apply(model)
            except Exception as error:  # noqa: BLE001 -- the row reports whatever torchao raises
                rows.append(
                    {
                        **row,
                        "int8 convs / linears": "-",
                        "runs in": f"quantize_ fails: {type(error).__name__}: {str(error)[:70]}",
                    }
                )
                continue
            convs, linears = _int8_layers(model)
            quantized_bytes = state_bytes(model)["parameters"]
            row.update(
                {
                    "int8 convs / linears": f"{convs} / {linears}",
                    "float -> int8 KiB": f"{float_bytes / 1024:.1f} -> {quantized_bytes / 1024:.1f}",
                    "size ratio": round(float_bytes / quantized_bytes, 2),
                    "conv weight error %": _conv_weight_error(trained, model),
                    "runs in": _runs_in(model, images),
                }
            )
            if row["runs in"] == "all four":
                with torch.no_grad():
                    logits = _logits(model.eval(), data["test"][0])
                quantized_accuracy = accuracy(model, data)
                row.update(
                    {
                        "acc % (float -> int8)": f"{100 * float_accuracy:.1f} -> {100 * quantized_accuracy:.1f}",
                        "acc change (points)": round(100 * (quantized_accuracy - float_accuracy), 1),
                        "logit error %": round(100 * float((logits - float_logits).norm() / float_logits.norm()), 2),
                        "inference peak MiB": mib(inference_peak(model, images)),
                    }
                )
            rows.append(row)
    return rows


def _logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    output = model(images)
    return getattr(output, "logits", output)

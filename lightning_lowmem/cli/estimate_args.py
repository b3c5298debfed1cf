"""``lowmem estimate``'s own options, parsed in one place: the parser, token lengths (``4k``), and the short flags
(``--lora 8``, ``--qlora nf4``, ``--optimizer adamw8bit``, ``--checkpointing auto``) as the
:class:`~lightning_lowmem.functional.config.TrainingConfig` arguments the callbacks they stand for would give."""

from __future__ import annotations

import argparse
import re
from typing import Any

from lightning_lowmem.cli.errors import ConfigError

__all__ = ["ESTIMATE_USAGE", "estimate_parser", "parse_length", "short_flag_techniques"]

ESTIMATE_USAGE = """usage: lowmem estimate [--budget SIZE] [--device {cuda,cpu}] [--gpu NAME] [--batch-shape SPEC] [--json] [--verbose]
                       [--attention-kernel {auto,flash,efficient,math}] [--real-weights] [--fine-tune] [--devices N --strategy {ddp,zero1,fsdp}]
                       [--lora R] [--qlora {int8,nf4}] [--optimizer NAME] [--checkpointing POLICY]
                       (--config CONFIG.yaml | --model CLASS_PATH [--data CLASS_PATH]
                        | --hf-config PATH [--batch-size B] [--seq-len T] [--precision P]) [--trainer.* ...]

Predict the peak memory of one training step without allocating it, and (with --budget) plan the
cheapest technique mix that fits. Takes the same model / data / trainer options as `lowmem fit`; the
precision and the memory callbacks of the config (ActivationCheckpointing, ActivationCompression,
MemoryEfficientOptimizer, LowRankAdapters, ChunkedCrossEntropy) are what is estimated. With --budget the
answer comes first: the chosen plan, its peak against the budget, and the callbacks / YAML that train it.

options:
  --budget SIZE       plan for this memory, with its unit: 24GiB, 512MB (a bare number is refused).
                      Default: the config's LowMemoryStrategy memory_budget, if any
  --device DEVICE     cuda or cpu (default: cuda for --hf-config, else cuda when this machine has one)
  --gpu NAME          the card, e.g. A100-40GB, H100-80GB, RTX4090, T4 (implies --device cuda): its
                      CUDA context and cuBLAS workspace, the allocator's reserved memory, what
                      nvidia-smi would show, and whether that fits the card
  --trainer.accumulate_grad_batches N
                      estimate N batches per optimizer step (gradient accumulation; also with --hf-config)
  --verbose           also the table of every candidate the plan tried, and its progress on stderr
  --lora R            LoRA adapters of rank R (LowRankAdapters(r=R)), kept fixed by the plan
  --qlora {int8,nf4}  QLoRA: the frozen base quantized (LowRankAdapters(quantize_base=...); rank --lora or 8)
  --optimizer NAME    the optimizer (MemoryEfficientOptimizer(NAME)), e.g. adamw, adamw8bit, adafactor
  --checkpointing POLICY  activation checkpointing (ActivationCheckpointing(POLICY)): auto, a block class name,
                      a module-name pattern, or k (every k-th block)
  --attention-kernel K  the CUDA attention kernel: auto (default: the one torch picks by dtype,
                      mask and head dim), flash, efficient or math (forced, as sdpa_kernel forces it)
  --batch-shape SPEC  the batch to estimate, instead of taking one from --data. Tensors are
                      comma-separated shapes, integer (int64) unless a dtype is given:
                        32x64,32x64                    a tuple (inputs, targets) of token ids
                        64x1x8x8:float32,64            float images and int labels
                        input_ids=4x128,attention_mask=4x128,labels=4x128
                                                       a dict batch (Hugging Face models)
  --hf-config PATH    a Hugging Face config.json (or a checkpoint folder holding one): the model it
                      describes, built on the meta device (no download, no weights), trained on
                      dict batches of --batch-size (default 1) x --seq-len (default 2048) tokens
                      in --precision (default 32-true; --trainer.precision too). Lengths take k = 1024:
                      --seq-len 4k is 4096. --trainer.callbacks+=... checks a plan in one line:
                        lowmem estimate --hf-config ./Llama-3.1-8B --seq-len 4k --budget 24GiB --fine-tune
  --json              machine-readable output
  --real-weights      build the model for real (default: on the meta device, no weight memory)
  --fine-tune         also plan LoRA / QLoRA candidates
  --devices N         processes (GPUs) the step runs on; the batch is one process's batch
  --strategy NAME     ddp, zero1 (lowmem_ddp + zero_optimizer) or fsdp (lowmem_fsdp): per-rank
                      peaks, without the devices. With --budget (per GPU) and --devices N the
                      plan searches the sharding too, unless --strategy fixes it"""

_LENGTH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*$")


def parse_length(text: str, name: str) -> int:
    """A count of tokens or sequences from the command line: ``4096``, or ``4k`` / ``8K`` (k = 1024, as token
    lengths are counted).

    Raises:
        ConfigError: not a positive whole number of that form.

    Example::

        >>> parse_length("4k", "--seq-len"), parse_length("8K", "--seq-len"), parse_length("4096", "--seq-len")
        (4096, 8192, 4096)
    """
    match = _LENGTH.match(str(text))
    value = float(match.group(1)) * (1024 if match.group(2) else 1) if match else 0
    if not match or value < 1 or value != int(value):
        what = "sequences" if "batch" in name else "tokens"
        raise ConfigError(
            f"{name} {text!r} is not a number of {what}: give a whole number, or one with k (= 1024), e.g. "
            f"{name} 4096 or {name} 4k"
        )
    return int(value)


def estimate_parser() -> argparse.ArgumentParser:
    """The parser of ``lowmem estimate``'s own options (the rest go to LightningCLI's parser)."""
    parser = argparse.ArgumentParser(prog="lowmem estimate", usage=ESTIMATE_USAGE, add_help=False)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--gpu", default=None)
    parser.add_argument("--attention-kernel", default="auto")
    parser.add_argument("--batch-shape", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.add_argument("--real-weights", action="store_true")
    parser.add_argument("--fine-tune", action="store_true")
    parser.add_argument("--devices", default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--hf-config", default=None)
    parser.add_argument("--batch-size", default="1")
    parser.add_argument("--seq-len", default="2048")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--lora", default=None)
    parser.add_argument("--qlora", default=None)
    parser.add_argument("--optimizer", default=None)
    parser.add_argument("--checkpointing", default=None)
    parser.add_argument("-h", "--help", action="store_true")
    return parser


_CHOICES = {"device": ("cuda", "cpu"), "attention_kernel": ("auto", "flash", "efficient", "math")}


def check_choices(own: argparse.Namespace) -> None:
    """The options with a fixed set of values, one line each (argparse's own ``choices`` print the usage)."""
    from lightning_lowmem.cli.errors import did_you_mean

    for field, choices in _CHOICES.items():
        value = getattr(own, field)
        if value is not None and value not in choices:
            option = "--" + field.replace("_", "-")
            raise ConfigError(f"{option} {value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}")


def short_flag_techniques(own: argparse.Namespace) -> dict[str, Any]:
    """``--lora`` / ``--qlora`` / ``--optimizer`` / ``--checkpointing`` as TrainingConfig arguments (only those given),
    each built as its callback builds it, so a bad value is the callback's own message.

    Example::

        >>> own = estimate_parser().parse_args(["--qlora", "int8", "--checkpointing", "auto"])
        >>> sorted(short_flag_techniques(own))
        ['checkpointing', 'lora']
    """
    from lightning_lowmem.functional.config import CheckpointingConfig, LoRAConfig

    found: dict[str, Any] = {}
    try:
        if own.lora is not None or own.qlora is not None:
            rank = parse_length(own.lora, "--lora") if own.lora is not None else 8
            found["lora"] = LoRAConfig(r=rank, quantize_base=own.qlora)
        if own.optimizer is not None:
            from lightning_lowmem.functional.config import OptimizerConfig

            found["optimizer"] = OptimizerConfig(own.optimizer)
        if own.checkpointing is not None:
            policy = int(own.checkpointing) if own.checkpointing.isdigit() else own.checkpointing
            found["checkpointing"] = CheckpointingConfig(policy)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        message = str(err)
        for field in ("quantize_base", "r", "policy", "name", "optimizer"):
            flag = {"quantize_base": "--qlora", "r": "--lora", "policy": "--checkpointing"}.get(field, "--optimizer")
            message = message.replace(f"`{field}`", flag)
        raise ConfigError(message) from None
    return found

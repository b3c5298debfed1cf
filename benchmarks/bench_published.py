"""The estimate against GPU training-memory figures other projects published, recipe by recipe.

Each row is one published measurement (a fine-tuning framework's table of ``torch.cuda.max_memory_allocated``, a
library's doc with an ``nvidia-smi`` reading), reproduced here with the model's real dimensions (its Hugging Face
``config.json`` in ``examples/hf_configs/``, built on the meta device: no weights downloaded) and the recipe as the
source ran it (precision, LoRA rank / targets / dropout, micro-batch x tokens, checkpointing, optimizer, the loss as
the framework computes it), estimated with ``estimate_memory(..., device="cuda")`` on a CPU-only machine.

What "ours" adds to ``report.peak_bytes``, by the kind of the published number, and nothing else (no per-model
factor): ``allocated`` -- the cuBLAS workspace (allocated through the caching allocator, so ``max_memory_allocated``
counts it); ``nvidia-smi`` -- the workspace and the CUDA context (the package's documented constants; the
allocator's reserved-but-free memory is not modelled before ``estimate_memory(gpu=...)``). "Fits" is judged as the
card would: peak + workspace + context against the card's total memory.

Rows the package cannot express are listed with the reason; rows that need a feature other work adds (NF4 QLoRA,
gradient accumulation) are probed at run time and computed once the feature exists.

Where the source's model code differs from Hugging Face's (the estimate runs HF's): LitGPT fuses q/k/v into one
linear, so its LoRA applies one dropout where HF's separate q_proj/k_proj/v_proj adapters apply three (each keeps
its dropped input and mask: TinyLlama r=32 on every linear, 8 x 512 tokens: 2 x 24 MiB a layer, about 1.0 GiB of
the +1.26 GiB); LitGPT keeps the head and the embedding as two tensors (falcon, gemma: untied here too) and runs
phi-2's GELU as torch's tanh GELU (``hidden_act="gelu_pytorch_tanh"`` here); torchtune's figures are with ``torch.compile``, which the
eager estimate does not model; the HF doc's BERT ran eager attention (``attn_implementation="eager"`` here).
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import smoke
from lightning_lowmem.cli.hf_config import hf_config_batch, hf_config_model
from lightning_lowmem.planning.estimate import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, estimate_memory

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "hf_configs"
GB, GiB, MiB = 1e9, 2**30, 2**20

CARDS = {  # total memory as nvidia-smi reports it (MiB)
    "A10G": 23028 * MiB,
    "RTX 4090": 24564 * MiB,
    "RTX A6000": 49140 * MiB,
}

LITGPT = "https://github.com/Lightning-AI/litgpt/blob/main/config_hub/finetune/README.md"
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"
HF_ANATOMY = "https://huggingface.co/docs/transformers/model_memory_anatomy#memory-utilization-at-vanilla-training"
HF_ONE_GPU = "https://huggingface.co/docs/transformers/v4.27.2/en/perf_train_gpu_one#gradient-accumulation"

HF_CONTEXT = 1343 * MiB
"""The doc's own nvidia-smi reading after ``torch.ones((1, 1)).to("cuda")`` on its GPU: the CUDA context there."""

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI_ALL = ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]


@dataclass(frozen=True)
class Row:
    """One published figure and the recipe that produced it."""

    source: str
    link: str
    model: str  # folder of examples/hf_configs
    recipe: str  # the recipe in words, as the source gives it
    published: float | None  # bytes; None: the source reports an out-of-memory
    kind: str  # "allocated" or "nvidia-smi"
    card: str | None
    batch: int
    seq: int
    precision: str = "bf16-true"
    optimizer: str = "adamw"
    loss: str = "litgpt"  # key of LOSSES
    lora: dict[str, Any] | None = None
    checkpointing: bool = False
    chunked_loss: bool = False
    compression: str | None = None  # ActivationCompression's mode
    accumulate: int = 1
    cannot: str = ""  # why the package cannot express the recipe (the row is listed, not estimated)
    shown: str = ""  # the figure as the source prints it
    context: int = CUDA_CONTEXT_BYTES  # the CUDA context an nvidia-smi figure includes: the source's own reading
    config: dict[str, Any] = field(default_factory=dict)  # config.json values the source's implementation differs in


def _litgpt_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """LitGPT's fine-tuning step: the head on 128-token chunks (``lm_head_chunk_size=128``), the last position
    dropped, cross entropy per chunk (``chunked_cross_entropy``) in the logits' dtype."""
    ids = batch["input_ids"]
    hidden = getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state
    head = model.get_output_embeddings()
    logits = [head(chunk) for chunk in hidden.split(128, dim=1)]
    logits[-1] = logits[-1][..., :-1, :]
    targets = ids[..., 1:]
    losses = [
        F.cross_entropy(chunk.reshape(-1, chunk.size(-1)), target.reshape(-1), reduction="none")
        for chunk, target in zip(logits, targets.split(128, dim=1), strict=True)
    ]
    return torch.cat(losses).sum() / targets.numel()


def _hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


LOSSES: dict[str, Callable[[torch.nn.Module, Any], torch.Tensor]] = {"litgpt": _litgpt_loss, "hf": _hf_loss}


def _lora(r: int, target: list[str], dropout: float = 0.05, **extra: Any) -> dict[str, Any]:
    return {"r": r, "alpha": 16, "dropout": dropout, "target": target, **extra}


def _litgpt(
    model: str, recipe_file: str, peak_gb: float | None, batch: int, lora: dict[str, Any] | None, **kw: Any
) -> Row:
    what = "full fine-tune, AdamW" if lora is None else f"LoRA r={lora['r']} on {'/'.join(lora['target'])}"
    if lora and lora.get("quantize_base"):
        what = f"QLoRA ({lora['quantize_base']}) r={lora['r']} on {'/'.join(lora['target'])}"
    recipe = f"litgpt {recipe_file}: {what}, bf16-true, micro-batch {batch} x 512, no checkpointing"
    accumulate = kw.pop("accumulate", 1)
    if accumulate > 1:
        recipe += f", {accumulate} accumulation steps"
    published = None if peak_gb is None else peak_gb * GB
    return Row(
        "LitGPT config hub",
        LITGPT,
        model,
        recipe,
        published,
        "allocated",
        "A10G",
        batch,
        512,
        lora=lora,
        accumulate=accumulate,
        shown="" if peak_gb is None else f"{peak_gb:.2f} GB",
        **kw,
    )


ROWS: list[Row] = [
    # LitGPT: "Peak memory" printed by litgpt as torch.cuda.max_memory_allocated() / 1e9, 1x A10G (24 GB), Alpaca2k
    _litgpt("Llama-2-7b-hf", "llama-2-7b/lora.yaml", 19.77, 2, _lora(32, ["q_proj", "v_proj"])),
    _litgpt("Mistral-7B-v0.1", "mistral-7b/lora.yaml", 20.66, 2, _lora(32, ["q_proj", "v_proj"])),
    _litgpt("Meta-Llama-3-8B", "llama-3-8b/lora.yaml", 19.73, 1, _lora(32, ["q_proj", "v_proj"])),
    _litgpt("falcon-7b", "falcon-7b/lora.yaml", 16.69, 1, _lora(32, ["query_key_value"])),
    _litgpt("stablelm-base-alpha-3b", "stablelm-base-alpha-3b/lora.yaml", 8.58, 1, _lora(32, ["query_key_value"])),
    # LitGPT's phi-2 runs torch's tanh GELU (gelu_approximate="tanh"): one op, where HF's "gelu_new" is six
    _litgpt(
        "phi-2",
        "phi-2/lora.yaml",
        13.98,
        4,
        _lora(8, [*PHI_ALL, "lm_head"]),
        config={"hidden_act": "gelu_pytorch_tanh"},
    ),
    _litgpt("gemma-2b", "gemma-2b/lora.yaml", 12.62, 2, _lora(8, [*LLAMA_ALL, "lm_head"])),
    _litgpt("TinyLlama-1.1B", "tiny-llama/lora.yaml", 13.50, 8, _lora(32, [*LLAMA_ALL, "lm_head"])),
    _litgpt("gemma-7b", "gemma-7b/lora.yaml", None, 1, _lora(16, [*LLAMA_ALL, "lm_head"])),
    _litgpt("TinyLlama-1.1B", "tiny-llama/full.yaml", 14.10, 4, None, accumulate=8),
    _litgpt("Llama-2-7b-hf", "llama-2-7b/qlora.yaml", 13.68, 2, _lora(32, ["q_proj", "v_proj"], quantize_base="nf4")),
    _litgpt("Mistral-7B-v0.1", "mistral-7b/qlora.yaml", 14.29, 2, _lora(32, ["q_proj", "v_proj"], quantize_base="nf4")),
    _litgpt("Meta-Llama-3-8B", "llama-3-8b/qlora.yaml", 17.41, 2, _lora(32, ["q_proj", "v_proj"], quantize_base="nf4")),
    _litgpt(
        "stablelm-base-alpha-3b",
        "stablelm-base-alpha-3b/qlora.yaml",
        5.24,
        1,
        _lora(32, ["query_key_value"], quantize_base="nf4"),
    ),
    # torchtune README: Llama 3.1 8B, batch 2 x 2048 (packed), torch.compile on, bf16, activation checkpointing
    Row(
        "torchtune README",
        TORCHTUNE,
        "Llama-3.1-8B",
        "torchtune lora_finetune_single_device (8B_lora_single_device.yaml): LoRA r=8 alpha=16 on q/v/output_proj + "
        "MLP, bf16, batch 2 x 2048, activation checkpointing, chunked loss, AdamW, compile",
        16.2 * GiB,
        "allocated",
        "RTX 4090",
        2,
        2048,
        shown="16.2 GiB",
        loss="hf",
        checkpointing=True,
        chunked_loss=True,
        lora=_lora(8, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], dropout=0.0),
    ),
    Row(
        "torchtune README",
        TORCHTUNE,
        "Llama-3.1-8B",
        "torchtune lora_finetune_single_device (8B_qlora_single_device.yaml): QLoRA NF4, r=8 alpha=16 on "
        "q/v/output_proj + MLP, bf16, batch 2 x 2048, activation checkpointing, chunked loss, AdamW, compile",
        7.4 * GiB,
        "allocated",
        "RTX 4090",
        2,
        2048,
        shown="7.4 GiB",
        loss="hf",
        checkpointing=True,
        chunked_loss=True,
        lora=_lora(
            8, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], dropout=0.0, quantize_base="nf4"
        ),
    ),
    Row(
        "torchtune README",
        TORCHTUNE,
        "Llama-3.1-8B",
        "torchtune full_finetune_single_device (8B_full_single_device.yaml): bf16, bitsandbytes PagedAdamW8bit "
        "in backward, batch 2 x 2048, activation checkpointing, chunked loss, compile",
        18.9 * GiB,
        "allocated",
        "RTX 4090",
        2,
        2048,
        shown="18.9 GiB",
        loss="hf",
        checkpointing=True,
        chunked_loss=True,
        optimizer="adamw8bit_in_backward",
        cannot="bitsandbytes' paged 8-bit AdamW keeps its state in CUDA managed memory, outside the torch allocator "
        "torchtune reads: the package has no paged optimizer (its lean recipe at this shape: see item 7 below)",
    ),
    # Hugging Face transformers docs: bert-large-uncased sequence classification, Trainer defaults (fp32, AdamW)
    Row(
        "HF transformers docs",
        HF_ANATOMY,
        "bert-large-uncased",
        "Trainer defaults: fp32, AdamW (torch), batch 4 x 512, no checkpointing",
        14949 * MiB,
        "nvidia-smi",
        None,
        4,
        512,
        precision="32-true",
        shown="14949 MB",
        loss="hf",
        context=HF_CONTEXT,
        config={"attn_implementation": "eager"},
    ),
    Row(
        "HF transformers docs",
        HF_ONE_GPU,
        "bert-large-uncased",
        "Trainer: fp32, AdamW (torch), batch 1 x 512, gradient_accumulation_steps=4",
        8681 * MiB,
        "nvidia-smi",
        None,
        1,
        512,
        precision="32-true",
        shown="8681 MB",
        loss="hf",
        accumulate=4,
        context=HF_CONTEXT,
        config={"attn_implementation": "eager"},
    ),
]

ITEM7_UNCOMPRESSED = Row(
    "this package (#33 item 7)",
    "",
    "Llama-3.1-8B",
    "bf16-true, ActivationCheckpointing, ChunkedCrossEntropy, adafactor_in_backward, batch 2 x 2048",
    None,
    "allocated",
    None,
    2,
    2048,
    loss="hf",
    checkpointing=True,
    chunked_loss=True,
    optimizer="adafactor_in_backward",
)
ITEM7 = replace(
    ITEM7_UNCOMPRESSED,
    recipe="leanest full fine-tune: the above + ActivationCompression('int8') (the checkpointed blocks' saved inputs "
    "kept as int8)",
    compression="int8",
)

NEEDS = {  # a feature's argument -> what the row waits for when this estimate_memory refuses it
    "accumulate_grad_batches": "gradient accumulation in estimate_memory (helper `estimate`)",
    "nf4": "LoRA quantize_base='nf4' (helper `qlora`)",
}


def _model(row: Row) -> torch.nn.Module:
    """The model of ``row``'s config.json (with ``row.config``'s values), float32 on meta."""
    if not row.config:
        return hf_config_model(str(CONFIGS / row.model))
    values = {**json.loads((CONFIGS / row.model / "config.json").read_text()), **row.config}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(values))
        return hf_config_model(folder)


def _batch(row: Row, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if row.model.startswith("bert"):
        ids = torch.zeros(row.batch, row.seq, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": torch.zeros(row.batch, dtype=torch.long, device="meta")}
    batch = hf_config_batch(row.batch, row.seq)
    if row.loss == "litgpt":
        return {"input_ids": batch["input_ids"]}
    return batch


def estimate_row(row: Row) -> tuple[Any, str]:
    """``(report, "")`` or ``(None, why not)``: the row's estimate, or what the package lacks to make it."""
    if row.cannot:
        return None, row.cannot
    model = _model(row)
    kwargs: dict[str, Any] = dict(
        loss_fn=LOSSES[row.loss], precision=row.precision, device="cuda", optimizer=row.optimizer, loop="torch"
    )
    if row.lora:
        kwargs["lora"] = row.lora
    if row.checkpointing:
        kwargs["activation_checkpointing"] = "auto"
    if row.chunked_loss:
        kwargs["cross_entropy"] = "chunked"
    if row.compression:
        kwargs["activation_compression"] = row.compression
    if row.accumulate > 1:
        kwargs["accumulate_grad_batches"] = row.accumulate
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return estimate_memory(model, _batch(row, model), **kwargs), ""
    except (TypeError, ValueError) as err:
        for needle, need in NEEDS.items():
            if needle in str(err):
                return None, f"not expressible yet: needs {need}"
        raise


def _ours(report: Any, row: Row) -> int:
    """Our figure of the published kind: the peak plus what that kind counts beyond the step's tensors."""
    if row.kind == "nvidia-smi":
        return report.peak_bytes + CUBLAS_WORKSPACE_BYTES + row.context
    return report.peak_bytes + CUBLAS_WORKSPACE_BYTES


def _cell(row: Row, report: Any, why: str, seconds: float) -> dict[str, Any]:
    published = "OOM" if row.card else "-"
    if row.published is not None:
        published = f"{row.shown} = {row.published / GiB:.2f} GiB" if row.shown else f"{row.published / GiB:.2f} GiB"
    cells: dict[str, Any] = {
        "source": f"[{row.source}]({row.link})" if row.link else row.source,
        "model": row.model,
        "recipe": row.recipe,
        "card": row.card or "not stated",
        "published": f"{published} ({row.kind})",
    }
    if report is None:
        return {**cells, "ours": "-", "error %": "-", "verdict (theirs / ours)": "-", "note": why}
    ours = _ours(report, row)
    error = "" if row.published is None else round(100 * (ours - row.published) / row.published, 2)
    verdict = "-"
    if row.card:
        theirs_fit = row.published is not None
        ours_fit = report.peak_bytes + CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES <= CARDS[row.card]
        agree = "agrees" if theirs_fit == ours_fit else "**disagrees**"
        verdict = f"{'fits' if theirs_fit else 'OOM'} / {'fits' if ours_fit else 'OOM'} ({agree})"
    kinds = "+ cuBLAS workspace"
    if row.kind == "nvidia-smi":
        kinds += f" + CUDA context {row.context / MiB:.0f} MiB (the source's reading); reserved-but-free not modelled"
    return {
        **cells,
        "ours": f"{ours / GiB:.2f} GiB",
        "error %": error,
        "verdict (theirs / ours)": verdict,
        "note": f"peak {report.peak_bytes / GiB:.2f} GiB {kinds}; estimated in {seconds:.0f} s",
    }


def run(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    """Every row estimated (``device`` is ignored: the estimate is for CUDA, made on this machine's CPU)."""
    rows, errors, verdicts, item7_peak = [], [], [], None
    chosen = (
        [ROWS[4], ROWS[9], ROWS[16]] if smoke() else [*ROWS, ITEM7_UNCOMPRESSED, ITEM7]
    )  # smoke: one of each kind of row, fast
    for row in chosen:
        started = time.perf_counter()
        report, why = estimate_row(row)
        cells = _cell(row, report, why, time.perf_counter() - started)
        rows.append(cells)
        if row is ITEM7_UNCOMPRESSED or row is ITEM7:  # the last one is the target's
            item7_peak = None if report is None else report.peak_bytes
            continue
        if isinstance(cells["error %"], float):
            errors.append(abs(cells["error %"]))
        if "agrees" in str(cells["verdict (theirs / ours)"]):
            verdicts.append("disagrees" not in cells["verdict (theirs / ours)"])
    sources = {r.source for r in ROWS}
    waiting = sum("not expressible yet" in r["note"] for r in rows)
    targets = [
        {
            "target": ">= 12 published figures from >= 3 independent sources",
            "measured": f"{len(ROWS)} figures, {len(sources)} sources",
            "met": len(ROWS) >= 12 and len(sources) >= 3,
        },
        {
            "target": "within 10% on every row the package can express",
            "measured": f"{len(errors)} rows expressed ({waiting} wait for a feature), worst |error| "
            f"{max(errors, default=0):.1f}%, {sum(e > 10 for e in errors)} above 10%",
            "met": bool(errors) and max(errors) <= 10,
        },
        {
            "target": "every fits / OOM verdict right",
            "measured": f"{sum(verdicts)} of {len(verdicts)} right",
            "met": bool(verdicts) and all(verdicts),
        },
        {
            "target": "#33 item 7: the leanest 8B full fine-tune (batch 2 x 2048) estimates <= 17 GiB",
            "measured": "-" if item7_peak is None else f"{item7_peak / GiB:.2f} GiB (peak_bytes)",
            "met": item7_peak is not None and item7_peak <= 17 * GiB,
        },
    ]
    return {
        "title": "The estimate against published GPU training-memory figures",
        "rows": rows,
        "targets": targets,
        "notes": __doc__.split("\n\n", 1)[1].strip(),
    }

"""The rows of ``bench_published``: each published GPU training-memory figure, its source and the recipe that
produced it (the estimate and the table are made in ``bench_published``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.planning.gpus import CUDA_CONTEXT_BYTES, GpuCard

GB, GiB, MiB = 1e9, 2**30, 2**20

CARDS = {  # each source's card: total memory as nvidia-smi reports it (MiB), compute capability (NVIDIA's list)
    name: GpuCard(name, mib * MiB, capability)
    for name, mib, capability in (
        ("A10G", 23028, (8, 6)),
        ("RTX 4090", 24564, (8, 9)),
        ("RTX 4070 Ti SUPER", 16376, (8, 9)),
        ("A100 80GB", 81920, (8, 0)),
    )
}
UNSTATED = GpuCard("not stated", 1 << 50, (8, 0))
"""A card for a row that does not name one: pre-Hopper (the 8 MiB cuBLAS workspace); its capacity is not judged."""

LITGPT = "https://github.com/Lightning-AI/litgpt/blob/main/config_hub/finetune/README.md"
TORCHTUNE = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"
HF_ANATOMY = "https://huggingface.co/docs/transformers/model_memory_anatomy#memory-utilization-at-vanilla-training"
HF_ONE_GPU = "https://huggingface.co/docs/transformers/v4.27.2/en/perf_train_gpu_one#gradient-accumulation"
TORCHAO = "https://github.com/pytorch/ao/blob/main/torchao/optim/README.md#benchmarks"
PEFT = "https://github.com/huggingface/peft/blob/main/README.md#high-performance-on-consumer-hardware"
LOWMEM_FT = "https://github.com/usamec/lowmem_finetuning/blob/main/README.md#results"

BASE_WHY = (
    "its finetune_base.py optimizes model.model.layers only while the embedding and the head still get gradients "
    "(estimate_memory has no optimizer over a subset of the trained parameters), compiled with dynamic shapes, "
    "after an evaluation pass at batch 32"
)
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
    optimizer: Any = "adamw"  # a name or an OptimizerConfig
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
    base: str = "lowmem"  # the quantized base: the package's LoRA (lora=), or "bitsandbytes" (benchmarks/_bnb_qlora.py)


def _lora(r: int, target: list[str], dropout: float = 0.05, **extra: Any) -> dict[str, Any]:
    return {"r": r, "alpha": 16, "dropout": dropout, "target": target, **extra}


def _litgpt(
    model: str, recipe_file: str, peak_gb: float | None, batch: int, lora: dict[str, Any] | None, **kw: Any
) -> Row:
    what = kw.pop(
        "what", "full fine-tune, AdamW" if lora is None else f"LoRA r={lora['r']} on {'/'.join(lora['target'])}"
    )
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


def _litgpt_qlora(model: str, recipe_file: str, peak_gb: float, batch: int, target: list[str]) -> Row:
    """LitGPT's ``--quantize bnb.nf4`` QLoRA: Fabric's ``BitsandbytesPrecision("nf4", bf16)`` makes every
    ``nn.Linear`` (lm_head too) bitsandbytes' 4-bit one, the embedding stays bf16, and ``bnb.optim.PagedAdamW`` keeps
    its state in CUDA managed memory, which ``max_memory_allocated`` does not count (a stateless SGD here)."""
    what = (
        f"QLoRA r=32 on {'/'.join(target)}, --quantize bnb.nf4 (bitsandbytes 0.42 Linear4bit on every linear, "
        "lm_head too; embedding bf16), PagedAdamW"
    )
    lora = _lora(32, target)
    return replace(
        _litgpt(model, recipe_file, peak_gb, batch, lora, what=what),
        base="bitsandbytes",
        loss="litgpt_loop",
        optimizer=OptimizerConfig("sgd", momentum=0.0),
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
    # --quantize bnb.nf4: bitsandbytes' own layers as LitGPT ran them (benchmarks/_bnb_qlora.py: what they keep, and why)
    _litgpt_qlora("Llama-2-7b-hf", "llama-2-7b/qlora.yaml", 13.68, 2, ["q_proj", "v_proj"]),
    _litgpt_qlora("Mistral-7B-v0.1", "mistral-7b/qlora.yaml", 14.29, 2, ["q_proj", "v_proj"]),
    _litgpt_qlora("Meta-Llama-3-8B", "llama-3-8b/qlora.yaml", 17.41, 2, ["q_proj", "v_proj"]),
    _litgpt_qlora("stablelm-base-alpha-3b", "stablelm-base-alpha-3b/qlora.yaml", 5.24, 1, ["query_key_value"]),
    # torchtune README: Llama 3.1 8B, batch 2 x 2048 (packed), torch.compile on, bf16, activation checkpointing; the
    # figures were published in 30b8519e8 (2024-09-24): the recipes are that commit's configs (later commits moved
    # the LoRA one to q/v/output_proj + MLP and took k_proj out of the QLoRA one)
    Row(
        "torchtune README",
        TORCHTUNE,
        "Llama-3.1-8B",
        "torchtune lora_finetune_single_device (8B_lora_single_device.yaml as of the figure, 30b8519e8): LoRA r=8 "
        "alpha=16 on q/v_proj, bf16, batch 2 x 2048, activation checkpointing, chunked loss, AdamW, compile",
        16.2 * GiB,
        "allocated",
        "RTX 4090",
        2,
        2048,
        shown="16.2 GiB",
        loss="hf",
        checkpointing=True,
        chunked_loss=True,
        lora=_lora(8, ["q_proj", "v_proj"], dropout=0.0),
    ),
    Row(
        "torchtune README",
        TORCHTUNE,
        "Llama-3.1-8B",
        "torchtune lora_finetune_single_device (8B_qlora_single_device.yaml as of the figure, 30b8519e8): QLoRA "
        "NF4, r=8 alpha=16 on q/k/v/output_proj + MLP, output and embedding bf16, batch 2 x 2048, activation "
        "checkpointing, chunked loss, AdamW, compile",
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
            8,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            dropout=0.0,
            quantize_base="nf4",
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
    # torchao's low-bit optimizers README: timm ViT-H/14 (630M) on resisc45 (45 classes), 224 px images, batch 8,
    # BF16 AMP, compiled model, AdamW; "Peak memory allocated (GB)" (torch.cuda.max_memory_allocated / 1e9)
    *(
        Row(
            "torchao optim README",
            TORCHAO,
            "vit-huge-patch14-224",
            f"timm vit_huge_patch14_224, 45 classes, BF16 AMP, compiled, {name}, batch 8 x 224 px (257 tokens)",
            figure * GB,
            "allocated",
            "RTX 4070 Ti SUPER",
            8,
            257,
            precision="bf16-mixed",
            optimizer=optimizer,
            shown=f"{figure} GB",
            loss="hf",
        )
        for name, optimizer, figure in (
            ("PyTorch fused AdamW", "adamw", 12.23),
            ("torchao AdamW8bit", "adamw8bit", 8.33),
            ("torchao AdamW4bit", "adamw4bit", 7.72),
        )
    ),
    Row(
        "torchao optim README",
        TORCHAO,
        "Llama-2-7b",
        "Llama2-7B full BF16 fine-tune on Alpaca with torchtune 52d1b838, A100, PyTorch fused AdamW",
        51.6 * GB,
        "allocated",
        None,
        1,
        512,
        shown="51.6 GB",
        cannot="the batch shape is not stated (Alpaca's samples vary in length; torchtune's batch size and "
        "checkpointing of that commit are not given in the README)",
    ),
    # HF PEFT README: "Full Finetuning" on ought/raft/twitter_complaints, one A100 80GB, fp32 AdamW (Trainer defaults);
    # the batch shape is not given: an OOM at 1 x 64 tokens is an OOM at the shape they ran
    *(
        Row(
            "HF PEFT README",
            PEFT,
            model,
            f"{name} full fine-tune, fp32, AdamW; the OOM checked at the smallest batch, 1 x 64 tokens",
            None,
            "allocated",
            "A100 80GB",
            1,
            64,
            precision="32-true",
            loss="hf",
        )
        for model, name in (("bloomz-7b1", "bigscience/bloomz-7b1"), ("mt0-xxl", "bigscience/mt0-xxl"))
    ),
    *(
        Row(
            "HF PEFT README",
            PEFT,
            "T0_3B",
            f"bigscience/T0_3B {recipe}, A100 80GB",
            figure * GB,
            "allocated",
            None,
            1,
            64,
            shown=f"{figure}GB GPU",
            cannot="the batch size and sequence length are not in the README (its example scripts print "
            "TorchTracemalloc's peak minus the memory held when training starts)",
        )
        for recipe, figure in (("full fine-tune", 47.14), ("LoRA r=8 (PEFT-LoRA PyTorch)", 14.4))
    ),
    # usamec/lowmem_finetuning README: Llama-3.2-1B full fine-tunes on HellaSwag padded to 160 tokens, batch 8;
    # the figure is torch.cuda.mem_get_info's total - free (device-wide)
    *(
        Row(
            "lowmem_finetuning README",
            LOWMEM_FT,
            "Llama-3.2-1B",
            f"Llama-3.2-1B, {recipe}, batch 8 x 160",
            figure * GB,
            "nvidia-smi",
            None,
            8,
            160,
            shown=f"{figure} GB",
            cannot=why,
        )
        for recipe, figure, why in (
            ("FP32 Adam", 29.2, BASE_WHY),
            ("FP32 Adafactor", 14.4, BASE_WHY),
            (
                "bf16 weights, compiled, checkpointing, cut cross-entropy, its own Adafactor with stochastic "
                "rounding in backward, embedding and head frozen",
                3.9,
                "the frozen embedding / head and its Adafactor variant have no estimate_memory argument",
            ),
        )
    ),
]

LEAN_QLORA = Row(
    "this package (#33)",
    "",
    "Llama-3.1-8B",
    "leanest NF4 QLoRA at torchtune's shape: LowRankAdapters(r=8 on q/k/v/o/gate/up/down_proj, quantize_base='nf4'), "
    "ActivationCheckpointing, ChunkedCrossEntropy, ActivationCompression('int8'), bf16-true, AdamW, batch 2 x 2048; "
    "the output head and the embedding stay bf16 (quantize_frozen would quantize the head too, which the chunked loss "
    "needs as a float nn.Linear)",
    None,
    "allocated",
    None,
    2,
    2048,
    loss="hf",
    checkpointing=True,
    chunked_loss=True,
    compression="int8",
    lora=_lora(8, LLAMA_ALL, dropout=0.0, quantize_base="nf4"),
)
"""#33's 8B NF4 QLoRA <= 7.4 GiB (torchtune's figure for its QLoRA recipe at the same shape), listed beside it."""

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


def card_of(row: Row) -> GpuCard:
    """The card ``row`` is estimated on (``estimate_memory(gpu=...)``): the source's, :data:`UNSTATED` where it names
    none, with the CUDA context the source itself measured where it did (else the package's 500 MiB)."""
    return replace(CARDS[row.card] if row.card else UNSTATED, cuda_context_bytes=row.context)

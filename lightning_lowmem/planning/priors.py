"""The planner's priors: the step-time factor of each technique that orders the search (:data:`SLOWDOWN`,
:func:`expected_slowdown`), the learning rate a plan sets when it changes the optimizer family
(:data:`DEFAULT_LR`), and what a half-precision plan costs in numerics (:func:`numerics_caveat`)."""

from __future__ import annotations

from lightning_lowmem.functional.config import TrainingConfig

__all__ = ["DEFAULT_LR", "SLOWDOWN", "expected_slowdown", "numerics_caveat"]

SLOWDOWN: dict[str, float] = {
    "precision:32-true": 1.0,
    "precision:bf16-mixed": 1.0,
    "precision:16-mixed": 1.0,
    "precision:bf16-true": 1.0,
    "precision:16-true": 1.0,
    "checkpointing": 1.33,  # one extra forward of the wrapped blocks
    "compression:bf16": 1.05,
    "compression:int8": 1.15,
    "compression:cpu": 1.25,
    "optimizer:adamw": 1.0,
    "optimizer:adam": 1.0,
    "optimizer:sgd": 1.0,
    "optimizer:adafactor": 1.03,
    "optimizer:adamw8bit": 1.05,
    "optimizer:adamw4bit": 1.08,
    "micro_batch_per_split": 0.08,  # each extra micro-batch costs ~8% (smaller kernels, more launches)
    "lora": 0.9,  # no weight gradients for the frozen base
    "qlora": 1.1,  # dequantising the frozen base on every forward
    "sharding:ddp": 1.0,
    "sharding:zero1": 1.05,  # the updated parameters gathered from their owners after each step
    "sharding:fsdp": 1.2,  # parameters gathered per unit in forward and backward, gradients reduce-scattered
    "cross_entropy:chunked": 1.02,  # the output head's matmul recomputed in backward
}
"""Prior step-time factors (relative to plain fp32 on a GPU) used to rank candidates. They order the
search; they are not promises. Mixed / true half precision are ranked 1.0 although they are usually
faster on GPUs, because their numerics differ: the planner prefers them only when they save memory."""

DEFAULT_LR: dict[str, float] = {"adam": 1e-3, "adafactor": 1e-2, "sgd": 1e-2}
"""Learning rate a plan sets when it changes the optimizer *family* (per family, torch's own defaults:
AdamW 1e-3, Adafactor 1e-2 -- a step relative to each weight's RMS --, SGD 1e-2). Within a family
(``adamw`` -> ``adamw8bit``) the configured learning rate is kept."""

PRECISION_RANK = {"32-true": 0, "bf16-mixed": 1, "16-mixed": 1, "bf16-true": 2, "16-true": 2}


def expected_slowdown(config: TrainingConfig, batch_size: int | None = None) -> float:
    """The prior step-time factor of ``config`` (see :data:`SLOWDOWN`)."""
    precision = config.precision_preset or "32-true"
    factor = SLOWDOWN.get(f"precision:{precision}", 1.0)
    # precision changes numerics: a tiny tie-breaker so full precision wins when both fit
    factor *= 1.0 + 0.001 * PRECISION_RANK.get(precision, 0)
    if config.activation_checkpointing is not None:
        factor *= SLOWDOWN["checkpointing"]
    if config.activation_compression:
        factor *= SLOWDOWN[f"compression:{config.activation_compression}"]
    factor *= SLOWDOWN.get(f"optimizer:{config.optimizer_name}", 1.05)
    if config.micro_batch_size and batch_size:
        splits = -(-batch_size // config.micro_batch_size)
        factor *= 1.0 + SLOWDOWN["micro_batch_per_split"] * (splits - 1)
    if config.lora is not None:
        factor *= SLOWDOWN["qlora" if config.lora.quantize_base else "lora"]
    if config.sharding is not None:
        factor *= SLOWDOWN[f"sharding:{config.sharding.kind}"]
    if config.cross_entropy is not None:
        factor *= SLOWDOWN[f"cross_entropy:{config.cross_entropy.mode}"]
    return factor


def numerics_caveat(config: TrainingConfig) -> str | None:
    """What a ``"-true"`` half-precision mix costs in numerics when its optimizer keeps no float32 master weights
    (the prior ranks it as free), or ``None``.

    Example::

        >>> numerics_caveat(TrainingConfig(precision="bf16-true", optimizer="adamw"))[:40]
        'numerics: bf16-true + adamw keeps no flo'
        >>> numerics_caveat(TrainingConfig(precision="bf16-true", optimizer="adamw_bf16_sr")) is None
        True
    """
    precision, optimizer = config.precision_preset, config.optimizer_name or ""
    if precision not in ("bf16-true", "16-true") or "_sr" in optimizer:
        return None
    base = optimizer.removesuffix("_in_backward")
    rounded = {"adafactor": "adafactor_bf16_sr"}.get(base, "adamw_bf16_sr")
    return (
        f"numerics: {precision} + {optimizer} keeps no float32 master weights, so an update smaller than half a "
        f"{precision.split('-')[0]} step of a weight (about 0.4% of it in bf16) is rounded away and small learning rates "
        f"stall; {rounded} (stochastic rounding, the same memory) or bf16-mixed (if it fits) keep them."
    )

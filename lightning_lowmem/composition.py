"""Which techniques compose: every pair of our callbacks, the low-memory strategies' options and the Trainer's
``accumulate_grad_batches`` / ``gradient_clip_val`` either trains correctly together or is refused here, in
``setup``, before any weight changes.

Each of our callbacks calls :func:`check_composition` first thing in its ``setup`` (the first one to run
checks the whole Trainer), and the low-memory strategies call it before they apply their options. A refusal
is one line naming both sides, why they do not compose and what to do instead.

The module imports neither the callbacks nor the strategies (they import it): a callback says what it is
(``composition_technique()``, from the technique callbacks' base class: its label and its tags), a strategy
whether it shards parameters (``shards_parameters``) and which options it was given (``explicit``). A new
callback joins the checks by its tags; a new incompatibility adds one :class:`Rule` to :data:`RULES`, or, for a
pair with a new callback, to that callback's own ``rules`` (checked whenever it is in play).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["RULES", "Rule", "Technique", "check_composition", "optimizer_tags", "techniques_of"]


@dataclass(frozen=True)
class Technique:
    """One switch in play: ``label`` is how a refusal names it (as the user wrote it), ``tags`` what it does."""

    label: str
    tags: frozenset[str]
    optimizer: str | None = None  # the optimizer's name, for optimizer techniques
    rules: tuple[Rule, ...] = ()  # the refusals this technique brings (its callback's ``rules``), beside RULES


@dataclass(frozen=True)
class Rule:
    """``left`` and ``right`` (tags) do not compose: ``reason`` says why, ``instead`` what to do.

    Both are formatted with ``a`` / ``b`` (the two :class:`Technique`\\ s) and ``base`` (``a``'s optimizer
    without ``_in_backward``)."""

    left: str
    right: str
    reason: str
    instead: str


def _optimizer(label: str, name: str) -> Technique:
    tags = {"optimizer"} | ({"in_backward"} if name.endswith("_in_backward") else set())
    return Technique(label, frozenset(tags), optimizer=name)


def optimizer_tags(name: str) -> frozenset[str]:
    """An optimizer technique's tags: ``optimizer``, and ``in_backward`` for one that steps inside backward."""
    return _optimizer(name, name).tags


_ONCE = "keep one of them"
RULES: tuple[Rule, ...] = (
    Rule(
        "in_backward",
        "accumulation",
        "{a.label} steps the optimizer inside every backward, so gradients would never be accumulated",
        "use accumulate_grad_batches=1 (and a larger batch, memory permitting) or an optimizer that steps after "
        "backward, e.g. {base!r}",
    ),
    Rule(
        "in_backward",
        "clipping",
        "{a.label} steps each parameter inside backward, before Lightning could clip the gradients",
        "remove gradient_clip_val or use an optimizer that steps after backward, e.g. {base!r}",
    ),
    Rule(
        "in_backward",
        "microbatch",
        "{a.label} steps the optimizer inside every backward, so each micro-batch backward would be an optimizer step",
        "use a plain optimizer, e.g. {base!r}, or drop {b.label}",
    ),
    Rule(
        "lora",
        "structural_pruning",
        "{b.label} removes channels of the layers {a.label} wraps, and the adapters keep their old shapes (the fit "
        "would fail mid-run)",
        "prune unstructured (structural=False), or prune in one run and add adapters to the smaller model in the next",
    ),
    Rule(
        "lora",
        "qat",
        "{b.label} fake-quantizes the layers {a.label} froze and wrapped, so the loss reaches no trainable weight",
        "train adapters on a quantized frozen base with LowRankAdapters(quantize_base='int8') (QLoRA), or run "
        "QuantizationAwareTraining without adapters",
    ),
    Rule(
        "structural_pruning",
        "grouped_qat",
        "{a.label} shrinks layers to widths that {b.label}'s groups of group_size channels need not divide (the "
        "fit fails when the channels are removed)",
        "use QuantizationAwareTraining('int8_weight_only') (per channel), or prune structurally in one run and "
        "train the smaller model with 4-bit QAT in the next",
    ),
    Rule(
        "chunked_loss",
        "qat",
        "{b.label} fake-quantizes the output head too, and {a.label} reads the head's weight as a plain float matrix "
        "(the fit would stop at its start)",
        "drop ChunkedCrossEntropy for the QAT run, or run QAT on a model whose loss does not need the chunked head",
    ),
    Rule(
        "qat",
        "ptq",
        "{a.label} converts the model to int8 at the end of fit and {b.label} would quantize it again",
        "keep QuantizationAwareTraining alone (its fit end gives the quantized model), or drop it and use "
        "PostTrainingQuantization alone",
    ),
    Rule("ptq", "ptq", "both quantize the model at the end of fit (the second would find it already int8)", _ONCE),
    Rule("qat", "qat", "both insert fake quantization into the same layers", _ONCE),
    *(
        Rule(
            f"plans_{axis}",
            axis,
            f"{{a.label}} plans {what} itself and would silently replace or repeat {{b.label}}'s",
            f"set {option} on the strategy (the plan keeps what is set) and drop {{b.label}}, or drop memory_budget",
        )
        for axis, what, option in (
            ("optimizer", "the optimizer", "optimizer="),
            ("compression", "activation compression", "activation_compression="),
            ("checkpointing", "activation checkpointing", "activation_checkpointing="),
        )
    ),
    Rule(
        "plans_chunked_loss",
        "chunked_loss",
        "{a.label} may plan the chunked cross-entropy itself, and {b.label} would apply it a second time",
        "drop {b.label} (the plan adds the chunked loss to a Hugging Face causal LM when it needs it), or drop "
        "memory_budget",
    ),
    Rule(
        "plans_microbatch",
        "microbatch",
        "{a.label} may plan micro-batches (its own loop around training_step) and {b.label} would wrap the same step "
        "again",
        "drop {b.label} (the plan splits the batch when it must), or drop memory_budget",
    ),
    Rule(
        "pruning",
        "sharded_parameters",
        "{a.label} masks whole weight tensors, and {b.label} shards them into DTensors (the fit would stop at the "
        "first pruning step)",
        "prune under strategy='lowmem' or 'lowmem_ddp', or train under lowmem_fsdp and prune the consolidated "
        "checkpoint in a second run",
    ),
    Rule(
        "ptq",
        "sharded_parameters",
        "{a.label} quantizes at the end of fit, when {b.label} holds the weights as DTensor shards it cannot quantize "
        "(it found no layer, and the model stayed in float)",
        "train under lowmem_fsdp, then load the consolidated checkpoint and quantize it in a run under "
        "strategy='lowmem' (PostTrainingQuantization, or functional.quantize_ on the loaded model)",
    ),
    Rule(
        "optimizer",
        "optimizer",
        "both replace the optimizer configure_optimizers returns, and only one of them can win",
        "set the optimizer in one place",
    ),
    Rule(
        "compression",
        "compression",
        "both pack the activations saved for backward, and only one packing applies",
        "set activation compression in one place",
    ),
    Rule(
        "checkpointing",
        "checkpointing",
        "both wrap blocks with activation checkpointing",
        "set activation checkpointing in one place",
    ),
)


def _callback_technique(callback: Any) -> Technique | None:
    """What a callback says it is (``composition_technique()``, the technique callbacks' base), or ``None``."""
    describe = getattr(callback, "composition_technique", None)
    return describe() if callable(describe) else None


def _strategy_techniques(strategy: Any) -> Iterable[Technique]:
    """The options a low-memory strategy was given explicitly (its ``explicit`` :class:`TrainingConfig`)."""
    name = type(strategy).__name__
    found = []
    if getattr(strategy, "shards_parameters", False):  # FSDP2: DTensor parameters
        found.append(Technique(name, frozenset({"sharded_parameters"})))
    config = getattr(strategy, "explicit", None)
    if config is None:
        return found
    if config.optimizer is not None:
        found.append(_optimizer(f"{name}(optimizer={config.optimizer.name!r})", config.optimizer.name))
    if config.compression is not None:
        found.append(
            Technique(f"{name}(activation_compression={config.compression.mode!r})", frozenset({"compression"}))
        )
    if config.checkpointing is not None:
        found.append(
            Technique(
                f"{name}(activation_checkpointing={config.activation_checkpointing!r})", frozenset({"checkpointing"})
            )
        )
    budget = getattr(strategy, "memory_budget", None)
    if budget is not None:  # the plan chooses every technique not set explicitly (micro-batches always)
        unset = {
            "optimizer": config.optimizer,
            "compression": config.compression,
            "checkpointing": config.checkpointing,
        }
        planned = {f"plans_{axis}" for axis, value in unset.items() if value is None} | {
            "plans_microbatch",
            "plans_chunked_loss",
        }
        found.append(Technique(f"{name}(memory_budget={budget!r})", frozenset(planned)))
    return found


def techniques_of(trainer: Any) -> list[Technique]:
    """Every technique in play on ``trainer``: our callbacks, the strategy's options, accumulation and clipping."""
    found = [technique for callback in trainer.callbacks if (technique := _callback_technique(callback)) is not None]
    found.extend(_strategy_techniques(trainer.strategy))
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate and accumulate > 1:
        found.append(Technique(f"Trainer(accumulate_grad_batches={accumulate})", frozenset({"accumulation"})))
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip:
        found.append(Technique(f"Trainer(gradient_clip_val={clip})", frozenset({"clipping"})))
    return found


def refusal(techniques: list[Technique], rules: Iterable[Rule] | None = None) -> str | None:
    """The first refusal among ``techniques`` (one line), or ``None`` when every pair composes (``rules``:
    :data:`RULES`, read at call time, and the rules the techniques in play bring)."""
    if rules is None:
        rules = (*RULES, *dict.fromkeys(rule for technique in techniques for rule in technique.rules))
    for rule in rules:
        for i, a in enumerate(techniques):
            if rule.left not in a.tags:
                continue
            for j, b in enumerate(techniques):
                if i == j or rule.right not in b.tags or (rule.left == rule.right and j < i):
                    continue
                base = (a.optimizer or "adamw").removesuffix("_in_backward")
                reason = rule.reason.format(a=a, b=b, base=base)
                instead = rule.instead.format(a=a, b=b, base=base)
                return f"{a.label} and {b.label} do not compose: {reason}. Instead, {instead}."
    return None


def check_composition(trainer: Any, stage: str | None = "fit") -> None:
    """Refuse (``ValueError``) a Trainer whose techniques do not compose; only ``fit`` is checked.

    Args:
        trainer: the Lightning ``Trainer`` (its callbacks, strategy, ``accumulate_grad_batches`` and
            ``gradient_clip_val``).
        stage: the ``setup`` stage. Default: ``"fit"``.

    Raises:
        ValueError: the first pair that does not compose, in one line naming both sides and what to do
            instead.

    Example::

        >>> from types import SimpleNamespace
        >>> from lightning_lowmem import MemoryEfficientOptimizer
        >>> trainer = SimpleNamespace(callbacks=[MemoryEfficientOptimizer("adamw_in_backward")],
        ...                           strategy=None, accumulate_grad_batches=1, gradient_clip_val=1.0)
        >>> check_composition(trainer)
        Traceback (most recent call last):
        ...
        ValueError: MemoryEfficientOptimizer('adamw_in_backward') and Trainer(gradient_clip_val=1.0) do not compose: ...
    """
    if stage != "fit":
        return
    message = refusal(techniques_of(trainer))
    if message is not None:
        raise ValueError(message)

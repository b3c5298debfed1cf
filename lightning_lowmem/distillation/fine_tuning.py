"""The student's optimizer defaults, chosen for a pretrained student, and the check that a step did not wreck one.

Distillation usually starts from a student that already knows the task or the language (DistilBERT and MiniLM
students are initialised from pretrained weights). An AdamW step moves every weight by about ``lr`` whatever
the gradient's size (its first step is ``lr * sign(grad)``), so a learning rate made for training from scratch
(1e-3 .. 3e-3) moves a pretrained transformer's weights, whose root-mean-square is a few hundredths, by several
percent **per step**: sixteen such steps took a fine-tuned MiniLM student from 0.882 to chance (issue #34). The
default here is the fine-tuning rate :data:`DEFAULT_LR` (Hugging Face ``Trainer``'s default and the DistilBERT /
MiniLM recipes'); a student trained from scratch passes ``lr`` (~1e-3) itself.

:class:`StepGuard` watches the student while it trains. On the first batch it reads how often the student
already agrees with the teacher (a pretrained student agrees well above chance); on the first
:data:`PROBED_STEPS` optimizer steps (then every :data:`PROBE_EVERY`-th) it measures the relative change of the
student's weight matrices over the step, ``||w_after - w_before|| / ||w_before||``, on a fixed strided sample of at
most :data:`SAMPLE` entries per matrix (a copy of a few KiB, not of the model). It warns once, with the figure, when
a pretrained student moves more than :data:`MAX_STEP_CHANGE` in one step, and says once when a student that does
not look pretrained trains at the fine-tuning default. No Lightning import.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

__all__ = ["DEFAULT_LR", "MAX_STEP_CHANGE", "StepGuard", "WeightChangeProbe", "build_student_optimizer"]

#: the student's learning rate when none is given: a fine-tuning rate (a pretrained student survives it)
DEFAULT_LR = 5e-5
#: relative weight change in one optimizer step above which a pretrained student is warned about
MAX_STEP_CHANGE = 0.02
#: agreement with the teacher on the first batch from which the student is taken to be pretrained
PRETRAINED_AGREEMENT = 0.5
#: steps probed at the start of a fit (every one), then one in every ``PROBE_EVERY``
PROBED_STEPS, PROBE_EVERY = 20, 100
#: entries sampled per parameter by :class:`WeightChangeProbe`
SAMPLE = 1024


def build_student_optimizer(
    name: str, parameters: Iterable[nn.Parameter], lr: float | None, weight_decay: float
) -> torch.optim.Optimizer:
    """The student's optimizer: ``name`` through the optimizer registry, at ``lr`` (``None``: :data:`DEFAULT_LR`)."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer

    chosen = DEFAULT_LR if lr is None else lr
    return build_optimizer(name, [p for p in parameters if p.requires_grad], lr=chosen, weight_decay=weight_decay)


class WeightChangeProbe:
    """``||w_after - w_before|| / ||w_before||`` over one step, on a fixed strided sample of each parameter.

    Example::

        >>> layer = nn.Linear(64, 64)
        >>> probe = WeightChangeProbe(layer.parameters())
        >>> _ = layer.weight.data.mul_(1.1)
        >>> 0.05 < probe.change() < 0.11
        True
    """

    def __init__(self, parameters: Iterable[nn.Parameter], sample: int = SAMPLE) -> None:
        self._saved = []
        for param in parameters:
            if param.requires_grad and param.dim() >= 2:  # the matrices: a LayerNorm's ones would dilute the figure
                stride = max(1, param.numel() // sample)
                self._saved.append((param, stride, self._sample(param, stride).clone()))

    @staticmethod
    def _sample(param: torch.Tensor, stride: int) -> torch.Tensor:
        return param.detach().reshape(-1)[::stride][:SAMPLE].float()

    def change(self) -> float:
        """The relative L2 change of the sampled entries since the probe was made (0.0 for no parameters)."""
        moved = total = 0.0
        for param, stride, before in self._saved:
            moved += float((self._sample(param, stride) - before).pow(2).sum())
            total += float(before.pow(2).sum())
        return math.sqrt(moved / total) if total > 0 else 0.0


class StepGuard:
    """Warn once when a step moves a pretrained student far; say once when a scratch student gets the default.

    Args:
        lr: the learning rate the user gave, ``None`` for :data:`DEFAULT_LR`.
        max_step_change: relative change per step above which a pretrained student is warned about.
            Default: :data:`MAX_STEP_CHANGE`.
    """

    def __init__(self, lr: float | None, max_step_change: float = MAX_STEP_CHANGE) -> None:
        self.lr, self.max_step_change = lr, max_step_change
        self.agreement: float | None = None  # with the teacher, on the first training batch
        self.warned = False
        self.largest_change = 0.0

    @property
    def pretrained(self) -> bool:
        """The student agreed with the teacher on at least :data:`PRETRAINED_AGREEMENT` of its first batch."""
        return self.agreement is not None and self.agreement >= PRETRAINED_AGREEMENT

    def first_batch(self, agreement: float, classes: int) -> str | None:
        """Record the first batch's agreement; a hint when a student near chance trains at the default rate."""
        if self.agreement is not None:
            return None
        self.agreement = agreement
        if self.lr is None and classes > 1 and agreement < 1.0 / classes + 0.1:
            return (
                f"DistillationModule: the student agrees with the teacher on {agreement:.0%} of the first batch (chance: "
                f"{1.0 / classes:.0%}), so it looks untrained, and `lr` is the fine-tuning default {DEFAULT_LR:g}. A "
                "student trained from scratch usually wants `lr` around 1e-3: pass it (keep the default for a "
                "pretrained student)."
            )
        return None

    def probe(self, step: int, student: nn.Module) -> WeightChangeProbe | None:
        """A probe of ``student`` before optimizer step ``step``, or ``None`` when this step is not checked."""
        if self.warned or self.agreement is not None and not self.pretrained:
            return None
        if step < PROBED_STEPS or step % PROBE_EVERY == 0:
            return WeightChangeProbe(student.parameters())
        return None

    def after_step(self, probe: WeightChangeProbe, step: int, lr: float) -> str | None:
        """The warning (once) when the step a probe watched moved a pretrained student more than the limit."""
        change = probe.change()
        self.largest_change = max(self.largest_change, change)
        if self.warned or not self.pretrained or change <= self.max_step_change:
            return None
        self.warned = True
        return (
            f"DistillationModule: optimizer step {step} moved the student's weights by {change:.1%} (relative L2 "
            f"change at lr={lr:g}); the student agreed with the teacher on {self.agreement:.0%} of its first batch, so "
            f"it is pretrained, and steps over {self.max_step_change:.0%} erase what it learned (a pretrained "
            f"transformer is fine-tuned at 1e-5 .. 1e-4). Lower `lr` (default {DEFAULT_LR:g})."
        )

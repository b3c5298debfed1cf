"""`DistillationModule`: train a small student from a frozen teacher, without the usual traps.

The teacher is held *outside* the module's registered children, so by construction it is not in
``parameters()`` (hence in no optimizer), not in ``state_dict()`` (hence in no checkpoint), not wrapped
by DDP, not touched by ``train()`` and not seen by pruning / quantization callbacks that walk the
LightningModule: those act on the student only. It is frozen, kept in eval mode, run under
``torch.no_grad()``, moved to the student's device on first use, and optionally held in bf16 or int8.

Batches: ``(inputs, targets)`` tuples, or dict batches as Hugging Face models take them. Student and
teacher receive the same model inputs through one override point, :meth:`DistillationModule.call_model`
(default: :func:`lightning_lowmem.model_io.forward_batch`: a dict batch as keywords, a tuple's first
element); logits are read from ``.logits``; padded / ignored positions never count in the losses
(:func:`~lightning_lowmem.distillation.batches.position_mask`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_lowmem.distillation.batches import (
    cast_floating,
    counted,
    first_tensor,
    UNSHIFTED_LABELS_WARNING,
    hard_label_loss,
    position_mask,
    takes_labels,
)
from lightning_lowmem.distillation.cache import TeacherCache, batch_keys
from lightning_lowmem.distillation.cached_teacher import CachedTeacherMixin
from lightning_lowmem.distillation.config import DistillationConfig, distillation_losses
from lightning_lowmem.distillation.fine_tuning import StepGuard, build_student_optimizer
from lightning_lowmem.distillation.losses import FeatureRecorder, check_logit_shapes, find_module, make_adapter
from lightning_lowmem.distillation.teacher import TEACHER_PRECISIONS, load_teacher_weights, prepare_teacher  # noqa: F401
from lightning_lowmem.functional.cross_entropy.models import DeferredLogits
from lightning_lowmem.model_io import BatchCallError, forward_batch, output_logits, output_loss

__all__ = ["DistillationModule", "TEACHER_PRECISIONS"]


class DistillationModule(CachedTeacherMixin, L.LightningModule):
    """Knowledge distillation from a frozen ``teacher`` into a trainable ``student``.

    Subclass it (override :meth:`distillation_loss` for a custom loss) or configure it from YAML.

    Batches are ``(inputs, targets, ...)`` tuples or dicts (Hugging Face: ``input_ids``, ``attention_mask``,
    ``labels``). Both models are called through :meth:`call_model` (the one override point for how a batch
    becomes a model call; the default passes a dict batch as keywords, ``labels`` included when the model
    takes them). With dict batches the KD term covers only the positions whose ``labels`` are not
    ``ignore_index`` and whose ``attention_mask`` is 1, and the hard-label term is the student's own
    ``.loss`` when it returns one (Hugging Face models given ``labels``: shifted for causal LMs).

    Args:
        student: the model to train; returns logits ``(B, C)`` or ``(B, T, V)``, or a ``ModelOutput`` /
            dict with ``logits`` (and ``loss``).
        teacher: a module, or a callable that builds one (called on first use, so a valid
            ``teacher_cache`` means it is never built). A LightningModule plus ``teacher_checkpoint``
            restores a trained Lightning teacher. Default: ``None`` (only valid with an existing
            ``teacher_cache``).
        teacher_checkpoint: checkpoint (Lightning ``.ckpt`` or a state dict) loaded into the teacher.
            Default: ``None``.
        loss: name of the logit loss (:func:`~lightning_lowmem.distillation.losses.register_loss`).
            Default: ``"kd"``.
        temperature: softening temperature ``T``. Default: 2.0.
        alpha: weight of the distillation term; ``1 - alpha`` weighs cross-entropy on the labels.
            Default: 0.5.
        hint_layers: student layer name -> teacher layer name, for FitNets hint losses; a learned
            adapter projects the student width when widths differ. Default: ``None``.
        hint_weight: weight of the summed hint losses. Default: 1.0.
        teacher_precision: ``"32"``, ``"bf16"`` or ``"int8"`` (int8 weight-only, through
            :func:`lightning_lowmem.functional.quantization.quantize_`). Default: ``"32"``.
        teacher_cache: path of a teacher-output cache (see :mod:`~lightning_lowmem.distillation.cache`):
            built from the training set on the first fit (then the teacher is released), reused after,
            refused when stale. Default: ``None`` (live teacher).
        cache_top_k: keep only the top-k teacher logits per position in the cache. Default: ``None``.
        cache_dtype: ``"float16"`` or ``"float32"`` on disk. Default: ``"float16"``.
        lr: learning rate. Default: ``None``: 5e-5, a fine-tuning rate that a pretrained student survives (see
            :mod:`~lightning_lowmem.distillation.fine_tuning`); a student trained from scratch wants ~1e-3.
            A step that moves a pretrained student's weights by more than 2% is warned about once.
        weight_decay: weight decay. Default: 1e-4.
        optimizer: name for :func:`~lightning_lowmem.functional.optimizers.build_optimizer`.
            Default: ``"adamw"``.
        ignore_index: label value ignored by losses and metrics. Default: -100.

    The loss, teacher and cache arguments are validated once, by the
    :class:`~lightning_lowmem.distillation.config.DistillationConfig` this builds (kept as :attr:`config`);
    :meth:`distillation_loss` is :func:`~lightning_lowmem.distillation.config.distillation_losses` of it.

    Raises:
        ValueError: missing student or teacher, unknown ``teacher_precision`` / ``loss``, bad numbers,
            hint layers that do not exist (close names listed) or hints combined with a cache.

    Example::

        >>> student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
        >>> module = DistillationModule(student, teacher, temperature=2.0, alpha=0.9)
        >>> any(p is teacher.weight for p in module.parameters())
        False
    """

    def __init__(
        self,
        student: nn.Module | None = None,
        teacher: Union[nn.Module, Callable[[], nn.Module], None] = None,
        teacher_checkpoint: str | None = None,
        loss: str = "kd",
        temperature: float = 2.0,
        alpha: float = 0.5,
        hint_layers: dict[str, str] | None = None,
        hint_weight: float = 1.0,
        teacher_precision: str = "32",
        teacher_cache: str | None = None,
        cache_top_k: int | None = None,
        cache_dtype: str = "float16",
        lr: float | None = None,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if not isinstance(student, nn.Module):
            raise ValueError(f"`student` must be an nn.Module (the model to train), got {type(student).__name__}")
        if teacher is None and teacher_cache is None:
            raise ValueError(
                "missing teacher: pass `teacher` (a module, a callable building one, or a LightningModule with "
                "`teacher_checkpoint`) or an existing `teacher_cache`"
            )
        if teacher is not None and not (isinstance(teacher, nn.Module) or callable(teacher)):
            raise TypeError(f"`teacher` must be an nn.Module or a callable returning one, got {type(teacher).__name__}")
        if teacher is student:
            raise ValueError(
                "`teacher` and `student` are the same object; the teacher must be a separate, frozen model"
            )
        self.config = DistillationConfig(  # every check of the loss arguments is the config's (#27)
            loss=loss,
            temperature=temperature,
            alpha=alpha,
            hint_layers=hint_layers,
            hint_weight=hint_weight,
            teacher_precision=teacher_precision,
            teacher_cache=teacher_cache,
            cache_top_k=cache_top_k,
            cache_dtype=cache_dtype,
            ignore_index=ignore_index,
        )
        self.save_hyperparameters(ignore=["student", "teacher"])
        self.student = student
        # plain lists: the teacher (and its source) must never become a registered child
        self._teacher_source_slot: list[Any] = [teacher] if teacher is not None else []
        self._teacher_slot: list[nn.Module] = []
        self._cache: TeacherCache | None = None
        self._teacher_scores: dict[str, float] = {}  # teacher_val_acc (tuples) / teacher_val_loss (dicts), once
        self._step_guard = StepGuard(lr)  # a step that wrecks a pretrained student is warned about

        self.hint_adapters = nn.ModuleDict()
        self._student_recorder: FeatureRecorder | None = None
        self._teacher_recorder: FeatureRecorder | None = None
        if hint_layers:
            teacher_module = self.teacher
            assert teacher_module is not None
            for student_name, teacher_name in hint_layers.items():
                adapter = make_adapter(
                    find_module(student, student_name, "student"), find_module(teacher_module, teacher_name, "teacher")
                )
                self.hint_adapters[self._adapter_key(student_name)] = adapter

        from torchmetrics import MeanMetric

        self.train_agreement = MeanMetric()
        self.val_acc = MeanMetric()
        self.val_agreement = MeanMetric()
        self.teacher_val_acc = MeanMetric()
        self.teacher_val_loss = MeanMetric()
        self.test_acc = MeanMetric()

    # ------------------------------------------------------------------ teacher
    @staticmethod
    def _adapter_key(name: str) -> str:
        return re.sub(r"\W", "_", name)

    @property
    def teacher(self) -> nn.Module | None:
        """The frozen teacher, built from its source on first access; ``None`` once a cache replaced it."""
        if not self._teacher_slot and self._teacher_source_slot and self._cache is None:
            hp = self.hparams
            teacher = prepare_teacher(self._teacher_source_slot[0], hp.teacher_checkpoint, hp.teacher_precision)
            self._teacher_slot.append(teacher)
        return self._teacher_slot[0] if self._teacher_slot else None

    def release_teacher(self) -> None:
        """Drop the teacher (e.g. once its outputs are cached) so its memory can be freed."""
        self._teacher_slot.clear()
        self._remove_recorders()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @override
    def train(self, mode: bool = True) -> DistillationModule:
        super().train(mode)
        if self._teacher_slot:
            self._teacher_slot[0].eval()  # the teacher never leaves eval mode
        return self

    def call_model(self, model: nn.Module, batch: Any, role: str) -> Any:
        """Run ``model`` (the student or the teacher) on one ``batch``: **the** override point for how a batch
        becomes a model call. Both get the same inputs by default; ``role`` (``"student"`` / ``"teacher"``)
        lets an override map them differently.

        Default: :func:`lightning_lowmem.model_io.forward_batch` (the model's own ``forward_batch(batch)`` if it
        defines one; else a dict batch as keywords, ``labels`` dropped for a model whose ``forward`` takes no
        ``labels``; a tuple / list batch's first element; a tensor as it is).

        Returns:
            The model output: a tensor, or a ``ModelOutput`` / dict with ``logits`` (and ``loss``).

        Example::

            class MyDistillation(DistillationModule):
                def call_model(self, model, batch, role):
                    return model(batch["pixel_values"], mask=batch["pixel_mask"])
        """
        try:
            return forward_batch(model, batch, drop_keys=() if takes_labels(model) else ("labels",))
        except BatchCallError as err:
            raise BatchCallError(
                f"{err} For DistillationModule: override `call_model(self, model, batch, role)` to call the {role} "
                f"({type(model).__name__}) on your batch."
            ) from None

    def forward_batch(self, batch: Any) -> Any:
        """The student's output on ``batch`` (``lightning_lowmem.model_io``'s override point, so callbacks that
        run the model themselves, e.g. post-training quantization, run the student as training does)."""
        return self.call_model(self.student, batch, "student")

    def _teacher_output(self, batch: Any) -> Any:
        teacher = self.teacher
        if teacher is None:
            raise RuntimeError("the teacher was released (cached mode); teacher logits come from the cache")
        reference, device = next(teacher.parameters(), None), first_tensor(batch)
        if reference is not None and device is not None and reference.device != device.device:
            teacher.to(device.device)
        teacher.eval()
        if self.hparams.teacher_precision == "bf16":
            batch = cast_floating(batch, torch.bfloat16)
        return self.call_model(teacher, batch, "teacher")

    @torch.no_grad()
    def teacher_logits(self, batch: Any) -> torch.Tensor:
        """Run the teacher (eval, no grad, on the batch's device) on ``batch`` and return float32 logits.

        Args:
            batch: a batch as the DataLoader yields it (tuple, dict) or a bare input tensor.
        """
        return output_logits(self._teacher_output(batch)).float()

    # ------------------------------------------------------------------ hooks and helpers
    def _ensure_recorders(self) -> None:
        hint_layers = self.hparams.hint_layers
        if not hint_layers or self._student_recorder is not None:
            return
        self._student_recorder = FeatureRecorder(self.student, list(hint_layers), "student")
        self._teacher_recorder = FeatureRecorder(self.teacher, list(hint_layers.values()), "teacher")

    def _remove_recorders(self) -> None:
        for recorder in (self._student_recorder, self._teacher_recorder):
            if recorder is not None:
                recorder.remove()
        self._student_recorder = self._teacher_recorder = None

    @override
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The student's logits: ``module(x)`` for a tensor model, ``module(**batch)`` for a Hugging Face one."""
        return output_logits(self.student(*args, **kwargs))

    def batch_targets(
        self, batch: Any, logits: torch.Tensor, output: Any = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(targets, mask)`` of a batch: the hard labels and the ``bool`` positions that count in the losses and
        metrics (``None``: all). Default: :func:`~lightning_lowmem.distillation.batches.position_mask` (tuples: the
        targets not equal to ``ignore_index``; dicts: ``labels != ignore_index`` and ``attention_mask == 1``).
        Override for other conventions."""
        return position_mask(batch, logits, output, self.hparams.ignore_index)

    def distillation_loss(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        targets: torch.Tensor,
        student_features: dict[str, torch.Tensor],
        teacher_features: dict[str, torch.Tensor],
        *,
        mask: torch.Tensor | None = None,
        student_loss: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The losses of one training step; ``"loss"`` is what is minimised. Override for custom losses.

        Args:
            student_logits, teacher_logits: ``(B, C)`` or ``(B, T, V)``.
            targets: hard labels of the positions' shape, or ``None``.
            student_features, teacher_features: hint-layer outputs by layer name.
            mask: positions that count (padding / ignored labels excluded), or ``None`` (all).
            student_loss: the student's own ``.loss`` (dict batches with ``labels``), used as the hard-label
                term instead of a cross-entropy on unshifted logits; ``None`` otherwise.

        Returns:
            ``{"loss": total, "logit_loss": ..., "hint_loss": ...}`` (``hint_loss`` only with hints).
        """
        hints = self.config.hints
        return distillation_losses(
            self.config,
            student_logits,
            teacher_logits,
            targets,
            mask=mask,
            student_loss=student_loss,
            student_features=student_features,
            teacher_features=teacher_features,
            adapters={name: self.hint_adapters[self._adapter_key(name)] for name in hints},
        )

    def _student_step(self, batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        output = self.call_model(self.student, batch, "student")
        logits = output_logits(output)
        targets, mask = self.batch_targets(batch, logits, output)
        return output, logits, targets, mask

    def _warn_unshifted_once(self) -> None:
        if not getattr(self, "_warned_unshifted", False):
            self._warned_unshifted = True
            rank_zero_warn(UNSHIFTED_LABELS_WARNING)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._ensure_recorders()
        output, student_logits, targets, mask = self._student_step(batch)
        if self._cache is not None:
            # rows found by hashing each sample's input bytes: one small device-to-host copy of the inputs
            rows = self._cache.rows(batch_keys(batch))
            teacher_logits = self._cache.logits(rows, device=student_logits.device)
        else:
            teacher_logits = self.teacher_logits(batch)
        check_logit_shapes(student_logits, teacher_logits)
        student_features = dict(self._student_recorder.features) if self._student_recorder else {}
        teacher_features = dict(self._teacher_recorder.features) if self._teacher_recorder else {}
        dict_batch = isinstance(batch, Mapping)
        if dict_batch and targets is not None and output_loss(output) is None and self.hparams.alpha < 1:
            self._warn_unshifted_once()
        losses = self.distillation_loss(
            student_logits,
            teacher_logits,
            targets,
            student_features,
            teacher_features,
            mask=mask if dict_batch else None,
            student_loss=output_loss(output) if dict_batch else None,
        )
        if isinstance(student_logits, DeferredLogits):
            from lightning_lowmem.distillation.chunked import deferred_argmax

            agree = deferred_argmax(student_logits) == teacher_logits.argmax(-1)  # one more head matmul, no grad
        else:
            agree = student_logits.argmax(-1) == teacher_logits.argmax(-1)
        self.train_agreement.update(counted(agree, mask).float())
        if self._step_guard.agreement is None:  # once: does the student already agree with the teacher?
            hint = self._step_guard.first_batch(float(counted(agree, mask).float().mean()), teacher_logits.size(-1))
            if hint:
                rank_zero_info(hint)
        self.log("train_loss", losses["loss"], prog_bar=True)
        for name, value in losses.items():
            if name != "loss":
                self.log(f"train_{name}", value)
        self.log("train_agreement", self.train_agreement, on_step=False, on_epoch=True)
        return losses["loss"]

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        output, student_logits, targets, mask = self._student_step(batch)
        dict_batch = isinstance(batch, Mapping)
        if dict_batch:  # Hugging Face: the model's own loss (token accuracy of a causal LM would need the shift)
            loss = hard_label_loss(output, student_logits, targets, mask, self.hparams.ignore_index)
            if loss is not None:
                self.log("val_loss", loss, prog_bar=True)
        elif targets is not None:
            flat = student_logits.reshape(-1, student_logits.size(-1)).float()
            self.log(
                "val_loss",
                F.cross_entropy(flat, targets.reshape(-1), ignore_index=self.hparams.ignore_index),
                prog_bar=True,
            )
            self.val_acc.update(counted(student_logits.argmax(-1) == targets, mask).float())
            self.log("val_acc", self.val_acc, prog_bar=True)
        if self._use_cache():
            return  # cached mode: no teacher in memory (its accuracy is logged when the cache is built)
        with torch.no_grad():
            teacher_output = self._teacher_output(batch)
        teacher_logits = output_logits(teacher_output).float()
        check_logit_shapes(student_logits, teacher_logits)
        teacher_pred = teacher_logits.argmax(-1)
        self.val_agreement.update(counted(student_logits.argmax(-1) == teacher_pred, mask).float())
        self.log("val_agreement", self.val_agreement)
        if self._teacher_scores:
            return  # the teacher's score is measured once (it never changes)
        if dict_batch:
            teacher_loss = hard_label_loss(teacher_output, teacher_logits, targets, mask, self.hparams.ignore_index)
            if teacher_loss is not None:
                self.teacher_val_loss.update(teacher_loss.float())
        elif targets is not None:
            self.teacher_val_acc.update(counted(teacher_pred == targets, mask).float())

    @override
    def on_validation_epoch_end(self) -> None:
        if self._use_cache():
            return
        for name in ("teacher_val_acc", "teacher_val_loss"):
            metric = getattr(self, name)
            if not self._teacher_scores and metric.update_called:
                value = float(metric.compute())
                if not self.trainer.sanity_checking:
                    self._teacher_scores[name] = value
            metric.reset()
        for name, value in self._teacher_scores.items():
            self.log(name, value)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        output, student_logits, targets, mask = self._student_step(batch)
        if isinstance(batch, Mapping):
            loss = hard_label_loss(output, student_logits, targets, mask, self.hparams.ignore_index)
            if loss is not None:
                self.log("test_loss", loss)
        elif targets is not None:
            self.test_acc.update(counted(student_logits.argmax(-1) == targets, mask).float())
            self.log("test_acc", self.test_acc)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return output_logits(self.forward_batch(batch)).argmax(-1)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # self.parameters() is the student and the hint adapters: the teacher is not a registered child
        hp = self.hparams
        return build_student_optimizer(hp.optimizer, self.parameters(), hp.lr, hp.weight_decay)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        step, probe = self.global_step, self._step_guard.probe(self.global_step, self.student)  # weights before
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        message = probe and self._step_guard.after_step(probe, step, optimizer.param_groups[0]["lr"])
        if message:
            rank_zero_warn(message)  # once, with the figure

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the teacher is restored from its source (`teacher` + `teacher_checkpoint`), never saved
        checkpoint["distillation"] = dict(self._teacher_scores)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("distillation", {})
        self._teacher_scores = {name: value for name, value in saved.items() if value is not None}

    @override
    def teardown(self, stage: str) -> None:
        self._remove_recorders()

"""`DistillationModule`: train a small student from a frozen teacher, without the usual traps.

The teacher is held *outside* the module's registered children, so by construction it is not in
``parameters()`` (hence in no optimizer), not in ``state_dict()`` (hence in no checkpoint), not wrapped
by DDP, not touched by ``train()`` and not seen by pruning / quantization callbacks that walk the
LightningModule: those act on the student only. It is frozen, kept in eval mode, run under
``torch.no_grad()``, moved to the student's device on first use, and optionally held in bf16 or int8.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lowmem.distillation.cache import TeacherCache, batch_keys, build_teacher_cache
from lightning_lowmem.distillation.losses import (
    FeatureRecorder,
    check_logit_shapes,
    feature_loss,
    find_module,
    get_loss,
    make_adapter,
)

__all__ = ["DistillationModule", "TEACHER_PRECISIONS"]

TEACHER_PRECISIONS: tuple[str, ...] = ("32", "bf16", "int8")


def _logits_of(output: Any) -> torch.Tensor:
    """Logits from a model output: a tensor, an object with ``.logits`` (Hugging Face) or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


def load_teacher_weights(teacher: nn.Module, checkpoint_path: str | Path) -> None:
    """Load a Lightning checkpoint (its ``state_dict``) or a plain state dict file into ``teacher``.

    Raises:
        FileNotFoundError: no file at ``checkpoint_path``.
    """
    path = Path(checkpoint_path)
    if not path.exists():
        raise FileNotFoundError(f"`teacher_checkpoint`={str(path)!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    teacher.load_state_dict(state)


class DistillationModule(L.LightningModule):
    """Knowledge distillation from a frozen ``teacher`` into a trainable ``student``.

    Subclass it (override :meth:`distillation_loss` for a custom loss) or configure it from YAML.

    Args:
        student: the model to train; returns logits ``(B, C)`` or ``(B, T, V)``.
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
        lr: learning rate. Default: 3e-3.
        weight_decay: weight decay. Default: 1e-4.
        optimizer: name for :func:`~lightning_lowmem.functional.optimizers.build_optimizer`.
            Default: ``"adamw"``.
        ignore_index: label value ignored by losses and metrics. Default: -100.

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
        lr: float = 3e-3,
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
            raise ValueError("`teacher` and `student` are the same object; the teacher must be a separate, frozen model")
        if teacher_precision not in TEACHER_PRECISIONS:
            raise ValueError(f"`teacher_precision`={teacher_precision!r} is unknown; choose from {list(TEACHER_PRECISIONS)}")
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"`alpha` must be in [0, 1] (weight of the distillation term), got {alpha}")
        if hint_layers and teacher_cache is not None:
            raise ValueError("`hint_layers` need the live teacher's features; they cannot be used with `teacher_cache`")
        if cache_top_k is not None and cache_top_k <= 0:
            raise ValueError(f"`cache_top_k` must be a positive int or None, got {cache_top_k}")
        get_loss(loss)  # raises for an unknown name
        self.save_hyperparameters(ignore=["student", "teacher"])
        self.student = student
        # plain lists: the teacher (and its source) must never become a registered child
        self._teacher_source_slot: list[Any] = [teacher] if teacher is not None else []
        self._teacher_slot: list[nn.Module] = []
        self._cache: TeacherCache | None = None
        self._teacher_val_acc: float | None = None

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
        self.test_acc = MeanMetric()

    # ------------------------------------------------------------------ teacher
    @staticmethod
    def _adapter_key(name: str) -> str:
        return re.sub(r"\W", "_", name)

    @property
    def teacher(self) -> nn.Module | None:
        """The frozen teacher, built from its source on first access; ``None`` once a cache replaced it."""
        if not self._teacher_slot and self._teacher_source_slot and self._cache is None:
            self._teacher_slot.append(self._prepare_teacher(self._teacher_source_slot[0]))
        return self._teacher_slot[0] if self._teacher_slot else None

    def _prepare_teacher(self, source: nn.Module | Callable[[], nn.Module]) -> nn.Module:
        teacher = source if isinstance(source, nn.Module) else source()
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"the `teacher` callable must return an nn.Module, got {type(teacher).__name__}")
        if self.hparams.teacher_checkpoint:
            load_teacher_weights(teacher, self.hparams.teacher_checkpoint)
        teacher.requires_grad_(False)
        teacher.eval()
        if self.hparams.teacher_precision == "bf16":
            teacher.to(torch.bfloat16)
        elif self.hparams.teacher_precision == "int8":
            from lightning_lowmem.functional.quantization import quantize_

            quantize_(teacher, "int8_weight_only")
        return teacher

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

    @torch.no_grad()
    def teacher_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Run the teacher (eval, no grad, on the inputs' device) and return float32 logits."""
        teacher = self.teacher
        if teacher is None:
            raise RuntimeError("the teacher was released (cached mode); teacher logits come from the cache")
        reference = next(teacher.parameters(), None)
        if reference is not None and reference.device != inputs.device:
            teacher.to(inputs.device)
        teacher.eval()
        if self.hparams.teacher_precision == "bf16" and inputs.is_floating_point():
            inputs = inputs.to(torch.bfloat16)
        return _logits_of(teacher(inputs)).float()

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
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return _logits_of(self.student(inputs))

    def _use_cache(self) -> bool:
        return self.hparams.teacher_cache is not None

    def prepare_teacher_cache(self, dataset: Any, device: torch.device | str = "cpu", build: bool = True) -> TeacherCache:
        """Open the teacher cache for ``dataset`` (building it first if absent), then release the teacher.

        Raises:
            StaleCacheError: the cache on disk was built for another dataset.
            FileNotFoundError: no cache and ``build`` is False.
        """
        path = Path(self.hparams.teacher_cache)
        if not path.exists() and build:
            if not self._teacher_source_slot:
                raise ValueError(f"missing teacher: no cache at {str(path)!r} and no `teacher` to build it from")
            rank_zero_info(f"[DistillationModule] building the teacher cache {path} for {len(dataset)} samples")
            teacher = self.teacher
            assert teacher is not None
            teacher.to(device)
            build_teacher_cache(
                self.teacher_logits, dataset, path, top_k=self.hparams.cache_top_k, dtype=self.hparams.cache_dtype, device=device
            )
        self._cache = TeacherCache.load(path, dataset)
        self.release_teacher()
        return self._cache

    @override
    def on_train_start(self) -> None:
        if not self._use_cache() or self._cache is not None:
            return
        dataset = self.trainer.train_dataloader.dataset
        if self.trainer.is_global_zero:
            self.prepare_teacher_cache(dataset, device=self.device)
        self.trainer.strategy.barrier("teacher_cache")
        if not self.trainer.is_global_zero:
            self.prepare_teacher_cache(dataset, build=False)
        accuracy = self._cache.meta.get("teacher_accuracy") if self._cache else None
        if accuracy is not None:
            rank_zero_info(f"[DistillationModule] teacher accuracy on the cached training set: {accuracy:.4f}")

    def _positions(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets != self.hparams.ignore_index  # (B,) or (B, T)

    def distillation_loss(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        targets: torch.Tensor,
        student_features: dict[str, torch.Tensor],
        teacher_features: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The losses of one training step; ``"loss"`` is what is minimised. Override for custom losses.

        Returns:
            ``{"loss": total, "logit_loss": ..., "hint_loss": ...}`` (``hint_loss`` only with hints).
        """
        logit_loss = get_loss(self.hparams.loss)(
            student_logits,
            teacher_logits,
            targets,
            temperature=self.hparams.temperature,
            alpha=self.hparams.alpha,
            ignore_index=self.hparams.ignore_index,
        )
        losses = {"logit_loss": logit_loss, "loss": logit_loss}
        if self.hparams.hint_layers:
            hint = sum(
                feature_loss(
                    student_features[s_name], teacher_features[t_name], self.hint_adapters[self._adapter_key(s_name)]
                )
                for s_name, t_name in self.hparams.hint_layers.items()
            )
            losses["hint_loss"] = hint
            losses["loss"] = logit_loss + self.hparams.hint_weight * hint
        return losses

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[0], batch[1]
        self._ensure_recorders()
        student_logits = self(inputs)
        if self._cache is not None:
            # rows found by hashing each input's bytes: one small device-to-host copy of the inputs
            rows = self._cache.rows(batch_keys(inputs.detach().cpu()))
            teacher_logits = self._cache.logits(rows, device=student_logits.device)
        else:
            teacher_logits = self.teacher_logits(inputs)
        check_logit_shapes(student_logits, teacher_logits)
        student_features = dict(self._student_recorder.features) if self._student_recorder else {}
        teacher_features = dict(self._teacher_recorder.features) if self._teacher_recorder else {}
        losses = self.distillation_loss(student_logits, teacher_logits, targets, student_features, teacher_features)
        mask = self._positions(student_logits, targets)
        agree = student_logits.argmax(-1) == teacher_logits.argmax(-1)
        self.train_agreement.update(agree[mask].float())
        self.log("train_loss", losses["loss"], prog_bar=True)
        for name, value in losses.items():
            if name != "loss":
                self.log(f"train_{name}", value)
        self.log("train_agreement", self.train_agreement, on_step=False, on_epoch=True)
        return losses["loss"]

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch[0], batch[1]
        student_logits = self(inputs)
        mask = self._positions(student_logits, targets)
        flat = student_logits.reshape(-1, student_logits.size(-1)).float()
        self.log("val_loss", F.cross_entropy(flat, targets.reshape(-1), ignore_index=self.hparams.ignore_index), prog_bar=True)
        self.val_acc.update((student_logits.argmax(-1) == targets)[mask].float())
        self.log("val_acc", self.val_acc, prog_bar=True)
        if self._use_cache():
            return  # cached mode: no teacher in memory (its accuracy is logged when the cache is built)
        teacher_logits = self.teacher_logits(inputs)
        check_logit_shapes(student_logits, teacher_logits)
        teacher_pred = teacher_logits.argmax(-1)
        self.val_agreement.update((student_logits.argmax(-1) == teacher_pred)[mask].float())
        self.log("val_agreement", self.val_agreement)
        if self._teacher_val_acc is None:  # the teacher's accuracy is measured once (it never changes)
            self.teacher_val_acc.update((teacher_pred == targets)[mask].float())

    @override
    def on_validation_epoch_end(self) -> None:
        if self._use_cache():
            return
        if self._teacher_val_acc is None and self.teacher_val_acc.update_called:
            value = float(self.teacher_val_acc.compute())
            self.teacher_val_acc.reset()
            if not self.trainer.sanity_checking:
                self._teacher_val_acc = value
        if self._teacher_val_acc is not None:
            self.log("teacher_val_acc", self._teacher_val_acc)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch[0], batch[1]
        student_logits = self(inputs)
        mask = self._positions(student_logits, targets)
        self.test_acc.update((student_logits.argmax(-1) == targets)[mask].float())
        self.log("test_acc", self.test_acc)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.optimizers import build_optimizer

        # self.parameters() is the student and the hint adapters: the teacher is not a registered child
        return build_optimizer(
            self.hparams.optimizer,
            [p for p in self.parameters() if p.requires_grad],
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
        )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the teacher is restored from its source (`teacher` + `teacher_checkpoint`), never saved
        checkpoint["distillation"] = {"teacher_val_acc": self._teacher_val_acc}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._teacher_val_acc = checkpoint.get("distillation", {}).get("teacher_val_acc")

    @override
    def teardown(self, stage: str) -> None:
        self._remove_recorders()

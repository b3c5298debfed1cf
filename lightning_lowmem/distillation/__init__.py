"""Knowledge distillation: :class:`DistillationModule`, its losses and the cached-teacher mode."""

from lightning_lowmem.distillation.cache import StaleCacheError, TeacherCache, build_teacher_cache
from lightning_lowmem.distillation.config import DistillationConfig, distillation_losses
from lightning_lowmem.distillation.losses import (
    FeatureRecorder,
    feature_loss,
    get_loss,
    kd_loss,
    make_adapter,
    register_loss,
    soft_cross_entropy,
)
from lightning_lowmem.distillation.module import DistillationModule

__all__ = [
    "DistillationConfig",
    "DistillationModule",
    "FeatureRecorder",
    "StaleCacheError",
    "TeacherCache",
    "build_teacher_cache",
    "distillation_losses",
    "feature_loss",
    "get_loss",
    "kd_loss",
    "make_adapter",
    "register_loss",
    "soft_cross_entropy",
]

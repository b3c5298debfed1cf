"""Building the frozen teacher of a distillation: its weights, its precision, no gradients, eval mode.

No Lightning import. :class:`~lightning_lowmem.distillation.DistillationModule` calls
:func:`prepare_teacher` on first use of its teacher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Union

import torch
from torch import nn

__all__ = ["TEACHER_PRECISIONS", "conv1d_to_linear_", "load_teacher_weights", "prepare_teacher"]

TEACHER_PRECISIONS: tuple[str, ...] = ("32", "bf16", "int8")
TeacherSource = Union[nn.Module, Callable[[], nn.Module]]


def load_teacher_weights(teacher: nn.Module, checkpoint_path: str | Path) -> None:
    """Load a Lightning checkpoint (its ``state_dict``) or a plain state dict file into ``teacher``.

    The file is read with :func:`lightning_lowmem.checkpoints.read_checkpoint`, the package's one reader, so a
    checkpoint written through ``CompressedCheckpointIO`` (or holding packed sparse tensors) is a teacher too.

    Raises:
        FileNotFoundError: no file at ``checkpoint_path``.
    """
    from lightning_lowmem.checkpoints.reading import read_checkpoint

    path = Path(checkpoint_path)
    if not path.exists():
        raise FileNotFoundError(f"`teacher_checkpoint`={str(path)!r} does not exist")
    state = read_checkpoint(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    teacher.load_state_dict(state)


@torch.no_grad()
def conv1d_to_linear_(model: nn.Module) -> list[str]:
    """Replace every Hugging Face ``Conv1D`` (GPT-2; weight ``(in, out)``) by the equivalent ``nn.Linear``.

    Only for a frozen model (the new layers hold new parameters): it lets weight-only int8 quantization,
    which handles ``nn.Linear``, reach GPT-2's attention and MLP layers. Returns the names replaced.

    Example::

        >>> from transformers.pytorch_utils import Conv1D
        >>> model = nn.Sequential(Conv1D(8, 4))
        >>> x = torch.randn(2, 4)
        >>> before = model(x)
        >>> conv1d_to_linear_(model), torch.allclose(model(x), before)
        (['0'], True)
    """
    replaced = []
    for fqn, layer in list(model.named_modules()):
        if type(layer).__name__ != "Conv1D" or not hasattr(layer, "nf"):
            continue
        in_features, out_features = layer.weight.shape  # Conv1D: (in, out)
        linear = nn.Linear(
            in_features, out_features, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype
        )
        linear.weight.copy_(layer.weight.t())
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
        linear.requires_grad_(layer.weight.requires_grad)
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
        replaced.append(fqn)
    return replaced


def prepare_teacher(source: TeacherSource, checkpoint: str | None = None, precision: str = "32") -> nn.Module:
    """The teacher ready for distillation: built from ``source``, weights from ``checkpoint``, frozen, in
    eval mode, held in ``precision`` (``"32"``, ``"bf16"``, or ``"int8"`` weight-only; for int8, GPT-2's
    ``Conv1D`` layers are turned into ``nn.Linear`` first so they are quantized too).

    Raises:
        TypeError: the ``source`` callable did not return an ``nn.Module``.
        ValueError: unknown ``precision``.
    """
    if precision not in TEACHER_PRECISIONS:
        raise ValueError(f"`teacher_precision`={precision!r} is unknown; choose from {list(TEACHER_PRECISIONS)}")
    teacher = source if isinstance(source, nn.Module) else source()
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"the `teacher` callable must return an nn.Module, got {type(teacher).__name__}")
    if checkpoint:
        load_teacher_weights(teacher, checkpoint)
    teacher.requires_grad_(False)
    teacher.eval()
    if precision == "bf16":
        teacher.to(torch.bfloat16)
    elif precision == "int8":
        from lightning_lowmem.functional.quantization.ptq import quantize_

        conv1d_to_linear_(teacher)
        quantize_(teacher, "int8_weight_only")
    return teacher

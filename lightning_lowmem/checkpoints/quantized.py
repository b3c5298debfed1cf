"""Quantized checkpoints: what the quantization callbacks record, how a model takes the quantized weights of
a checkpoint before they load, and :func:`load_quantized_checkpoint`.

Writing (:func:`record_checkpoint`, from the callbacks' ``on_save_checkpoint``): every checkpoint the
quantization callbacks write records what wrote it, ``checkpoint["lowmem_quantization"]`` (writer, mode,
layers, Conv1D layers turned into ``nn.Linear``, tied groups). Its torchao tensors are made portable
(:mod:`~lightning_lowmem.functional.quantization.serialization`: they load under any ``map_location``, Lightning's
callable default included, and with ``weights_only=True`` after ``import lightning_lowmem``), so a Trainer
with Lightning's own ``TorchCheckpointIO`` or with ``CompressedCheckpointIO`` resumes from them. When the state
dict cannot load into a plain float model (quantized weights, or Conv1D weights stored as ``nn.Linear``), it
also holds one extra entry whose *key is the instruction*: a Trainer without the callback, or
``load_from_checkpoint`` without a hook, fails on that unexpected key with the message "written by
lightning_lowmem PostTrainingQuantization(...): add it to the Trainer's callbacks, or load the file with
lightning_lowmem.checkpoints.load_quantized_checkpoint" before any weight is used.

Reading (:func:`prepare_for_load`, from the callbacks' load-state-dict pre-hooks, :func:`quantize_like_checkpoint`
and :func:`load_quantized_checkpoint`): the recorded Conv1D layers become ``nn.Linear``, and every layer
whose incoming weight is a torchao tensor takes that tensor as its weight (any format, any mode; layers
that shared a weight when saved share it again), so ``load_state_dict`` then copies in place.

Checkpoints written before the portable format (torchao-pickled weights) cannot be rebuilt under a callable
``map_location``: load them with ``Trainer(plugins=[CompressedCheckpointIO()])`` or
:func:`load_quantized_checkpoint`, whose reader (:func:`~lightning_lowmem.checkpoints.reading.read_checkpoint`)
rebuilds them on CPU. Nothing here imports Lightning.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_lowmem.checkpoints.reading import read_checkpoint
from lightning_lowmem.functional.quantization.layers import convert_conv1d_, is_conv1d, set_submodule
from lightning_lowmem.functional.quantization.ptq import drop_zero_point
from lightning_lowmem.functional.quantization.serialization import is_quantized_tensor, keep_portable_, make_portable

if TYPE_CHECKING:
    import lightning as L

__all__ = [
    "QUANTIZED_CHECKPOINT",
    "quantized_checkpoint_path",
    "CHECKPOINT_KEY",
    "load_quantized_checkpoint",
    "pop_instruction",
    "prepare_for_load",
    "quantize_like_checkpoint",
    "record_checkpoint",
]

CHECKPOINT_KEY = "lowmem_quantization"
#: the file ``PostTrainingQuantization`` writes the quantized model to, in the ``ModelCheckpoint``'s folder
QUANTIZED_CHECKPOINT = "quantized.ckpt"


def quantized_checkpoint_path(trainer: Any) -> str | None:
    """``<checkpoint dir>/quantized.ckpt``: where the quantized model is saved after fit (Lightning's last
    ``ModelCheckpoint`` save comes before ``on_fit_end``, so its files hold the float model); ``None`` when the
    Trainer has no checkpoint callback with a folder (``enable_checkpointing=False``)."""
    dirpath = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
    return f"{str(dirpath).rstrip('/')}/{QUANTIZED_CHECKPOINT}" if dirpath else None


#: the state-dict key of the instruction entry starts with this
INSTRUCTION_PREFIX = "lowmem_quantization:"


# --- writing ---------------------------------------------------------------------------------------------


def instruction_key(writer: str) -> str:
    """The state-dict key that tells a loader without lightning_lowmem's hooks what to add."""
    return (
        f"{INSTRUCTION_PREFIX} written by lightning_lowmem {writer}: add it to the Trainer's callbacks, or load the "
        "file with lightning_lowmem.checkpoints.load_quantized_checkpoint"
    )


def record_checkpoint(
    checkpoint: dict[str, Any], writer: str, record: dict[str, Any], *, instruct: bool = False
) -> None:
    """Record ``writer`` and ``record`` in a checkpoint being saved (see the module docstring); the
    instruction entry is added when the state dict holds quantized tensors or Conv1D layers stored as
    ``nn.Linear`` (``record["conv1d"]``), or when ``instruct``."""
    state_dict = checkpoint.get("state_dict", {})
    for key in [key for key in state_dict if key.startswith(INSTRUCTION_PREFIX)]:
        del state_dict[key]  # one writer's instruction only: the last one to record
    quantized = [key for key, value in state_dict.items() if is_quantized_tensor(value)]
    for key in quantized:
        make_portable(state_dict[key])
    record = {"writer": writer, **record}
    checkpoint[CHECKPOINT_KEY] = record
    if quantized or record.get("conv1d") or instruct:
        payload = json.dumps(record).encode()
        state_dict[instruction_key(writer)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def pop_instruction(state_dict: dict[str, Any], prefix: str = "") -> dict[str, Any] | None:
    """Remove the instruction entry of ``state_dict`` (under ``prefix``); returns the record it holds."""
    record = None
    for key in [key for key in state_dict if key.startswith(prefix + INSTRUCTION_PREFIX)]:
        value = state_dict.pop(key)
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            record = json.loads(bytes(value.tolist()).decode())
    return record


# --- reading ---------------------------------------------------------------------------------------------


def _refuse_static(record: dict[str, Any] | None, source: str) -> None:
    if record and record.get("mode") == "int8_static":
        raise ValueError(
            f"{source} was saved after PostTrainingQuantization(mode='int8_static'): an exported int8 graph cannot "
            "be rebuilt from a checkpoint. Load the float checkpoint and quantize again."
        )


def prepare_for_load(module: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> tuple[list[str], list[str]]:
    """Make ``module`` ready to load ``state_dict``: drop the instruction entry, turn the recorded Conv1D
    layers into ``nn.Linear``, and give every layer whose incoming weight is a torchao tensor that tensor
    as its weight (layers whose incoming weights were one tensor share it; torchao's all-zero zero points
    are dropped). Returns ``(names of the layers that took a quantized weight, Conv1D layers converted)``.

    Raises:
        ValueError: the state dict was written after ``mode="int8_static"``.
    """
    record = pop_instruction(state_dict, prefix)
    _refuse_static(record, "the checkpoint")
    conv1d = [name for name in (record or {}).get("conv1d", []) if _is_conv1d_at(module, name)]
    # without a record (a weights_only Lightning checkpoint skips callbacks' hooks): a quantized weight arriving
    # at a Conv1D was saved from its nn.Linear form, the only form the package quantizes
    conv1d += [
        name
        for name, layer in module.named_modules()
        if name not in conv1d and is_conv1d(layer) and is_quantized_tensor(state_dict.get(f"{prefix}{name}.weight"))
    ]
    convert_conv1d_(module, conv1d)
    adopted: dict[tuple[Any, ...], nn.Parameter] = {}
    names = []
    for fqn, layer in list(module.named_modules()):
        incoming = state_dict.get(f"{prefix}{fqn}.weight" if fqn else f"{prefix}weight")
        if not is_quantized_tensor(incoming) or not isinstance(getattr(layer, "weight", None), torch.Tensor):
            continue
        key = _storage_key(incoming)
        if key not in adopted:
            drop_zero_point(incoming)
            adopted[key] = nn.Parameter(incoming.to(layer.weight.device), requires_grad=False)
        if hasattr(layer, "to_linear") and hasattr(layer, "weight_fake_quantizer"):  # torchao FakeQuantizedLinear
            set_submodule(module, fqn, layer.to_linear())
            layer = module.get_submodule(fqn)
        layer.weight = adopted[key]
        layer.__dict__.pop("extra_repr", None)
        names.append(fqn)
    if names:
        keep_portable_(module)  # saved again without a callback's hook (weights_only=True): still portable
    return names, conv1d


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Tensors saved from one tied weight load as separate objects over the same storages: key them by those."""
    names, _ = tensor.__tensor_flatten__()
    return (type(tensor), tuple(getattr(tensor, name).untyped_storage().data_ptr() for name in names))


def _is_conv1d_at(module: nn.Module, name: str) -> bool:
    try:
        return is_conv1d(module.get_submodule(name))
    except AttributeError:
        return False


def quantize_like_checkpoint(module: nn.Module, checkpoint: dict[str, Any]) -> list[str]:
    """Make ``module`` take the quantized weights of a checkpoint saved by a quantization callback, so that
    its ``state_dict`` loads; a float checkpoint changes nothing.

    Lightning calls ``LightningModule.on_load_checkpoint`` before it loads the weights, so calling this
    from that hook makes ``Model.load_from_checkpoint(path)`` return the quantized model (any
    ``map_location``; ``weights_only=True`` works after ``import lightning_lowmem``).

    Args:
        module: the model the checkpoint's ``state_dict`` belongs to.
        checkpoint: the loaded checkpoint dict (its instruction entry is removed).

    Returns:
        Names of the layers that took a quantized weight.

    Raises:
        ValueError: the checkpoint was saved after ``mode="int8_static"``.

    Example::

        class QuantizedClassifier(DigitsClassifier):
            def on_load_checkpoint(self, checkpoint):
                quantize_like_checkpoint(self, checkpoint)

        model = QuantizedClassifier.load_from_checkpoint("quantized.ckpt")
    """
    _refuse_static(checkpoint.get(CHECKPOINT_KEY), "the checkpoint")
    return prepare_for_load(module, checkpoint.get("state_dict", {}))[0]


def load_quantized_checkpoint(
    model_class: type[L.LightningModule],
    checkpoint_path: Any,
    *,
    map_location: Any = "cpu",
    weights_only: bool | None = None,
    **kwargs: Any,
) -> L.LightningModule:
    """Rebuild a LightningModule from a checkpoint saved by ``PostTrainingQuantization`` (or
    ``QuantizationAwareTraining``), written by Lightning's ``TorchCheckpointIO`` or by ``CompressedCheckpointIO``.

    Reads the file with :func:`~lightning_lowmem.checkpoints.reading.read_checkpoint`, builds
    ``model_class(**hyper_parameters, **kwargs)``, gives its layers the checkpoint's quantized weights (and its
    recorded Conv1D layers the ``nn.Linear`` form), then loads the state dict (a float checkpoint loads as float).

    Args:
        model_class: the LightningModule class (it must save its hyper-parameters).
        checkpoint_path: the ``.ckpt`` file (local or any fsspec URL).
        map_location: where tensors go, as for ``torch.load`` (a callable too). Default: ``"cpu"``.
        weights_only: as for ``torch.load``; ``True`` works after ``import lightning_lowmem``.
            Default: ``None`` (``True``, torch's default).
        **kwargs: override hyper-parameters.

    Raises:
        ValueError: the checkpoint was saved after ``mode="int8_static"``.
        CheckpointCorruptError: the file is truncated or damaged.

    Example::

        model = load_quantized_checkpoint(HFLanguageModel, "quantized.ckpt")
    """
    checkpoint = read_checkpoint(checkpoint_path, map_location=map_location, weights_only=weights_only is not False)
    _refuse_static(checkpoint.get(CHECKPOINT_KEY), repr(str(checkpoint_path)))
    model = model_class(**{**checkpoint.get("hyper_parameters", {}), **kwargs})
    quantize_like_checkpoint(model, checkpoint)
    model.load_state_dict(checkpoint["state_dict"])
    return model

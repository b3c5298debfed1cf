"""`ActivationCheckpointing`: recompute chosen submodules in backward instead of keeping their activations."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.functional.config import CheckpointingConfig
from lightning_lowmem.warnings import LowMemWarning


class ActivationCheckpointing(TechniqueCallback):
    """Wrap submodules of the LightningModule with non-reentrant activation checkpointing for ``fit``.

    Works with any single-process or DDP strategy and any precision (``bf16-mixed`` included):
    the wrap is applied in place in ``on_fit_start`` (after ``configure_model``, so lazily built layers
    are found) and changes no parameter names, so checkpoints saved with it load without it and the
    other way round. Gradients are
    bit-identical to a run without it; each wrapped submodule's forward runs twice (once more in
    backward), typically +20-35% step time for "all blocks". Undone in ``teardown``.

    Args:
        policy: which submodules to wrap; see
            :func:`lightning_lowmem.functional.checkpointing.checkpoint_`. ``"auto"`` = the repeated
            blocks of the model, in ``nn.ModuleList`` s or ``nn.Sequential`` s (e.g. transformer layers,
            a ResNet's blocks; logged at INFO); an int ``k`` = every
            k-th of those; a class name such as ``"Block"``; a module-name pattern such as
            ``"model.h.*"``; or a list of these. Default: ``"auto"``.
        nested: also wrap chosen modules inside other chosen ones, e.g. ``policy=["Block", "*.attn"]``:
            backward then holds one attention's activations at a time instead of a whole block's, for
            one more forward of the inner modules. Default: ``False``.
        strict: a policy that matches no submodule stops ``fit`` with an error listing the model's
            module classes; ``False`` warns and trains without checkpointing. Default: ``True``.

    Hugging Face models: the blocks are found by class name (``"GPT2Block"``, ``"LlamaDecoderLayer"``,
    ``"BertLayer"``, ``"T5Block"``) or ``"auto"``; ``config.use_cache`` is switched off while fitting (a
    training-time KV cache keeps what checkpointing frees; one :class:`LowMemWarning`) and restored in
    ``teardown``. Do not also call the model's ``gradient_checkpointing_enable()`` (it would recompute twice).

    Raises:
        TypeError / ValueError: ``policy`` has an unsupported type or value (int < 1, empty string),
            ``nested`` / ``strict`` is not a bool; at ``fit`` start, a policy matching no submodule.

    Warns:
        NoEffectWarning: ``strict=False`` and the policy matched no submodule of the LightningModule.
        LowMemWarning: the model already checkpoints itself (Hugging Face ``gradient_checkpointing_enable``).

    Example::

        >>> from lightning_lowmem.demo import CharLM, CharLMDataModule
        >>> callback = ActivationCheckpointing(policy="Block")
        >>> trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
        >>> trainer.fit(CharLM(n_layer=2, n_embd=32, n_head=2, block_size=16),
        ...             CharLMDataModule(block_size=16, batch_size=4, max_chars=20_000))
        >>> callback.wrapped
        ['model.h.0', 'model.h.1']
    """

    technique = "checkpointing"
    tags = frozenset({"checkpointing"})
    undo_on_exception = True

    def __init__(self, policy: str | int | list[str] = "auto", nested: bool = False, strict: bool = True) -> None:
        self.config = CheckpointingConfig(policy, nested=nested)  # validates
        if not isinstance(strict, bool):
            raise TypeError(f"`strict` must be True or False, got {type(strict).__name__}: {strict!r}")
        self.policy = policy
        self.nested = nested
        self.strict = strict
        self.wrapped: list[str] = []

    @override
    def composition_label(self) -> str:
        return f"ActivationCheckpointing({self.policy!r})"

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after `configure_model` (so lazily built layers exist); the wrap is in place, so a strategy
        # wrapper around the model (DDP) calls the wrapped submodules as they are
        if self._applied is not None:
            return
        already = [name for name, sub in pl_module.named_modules() if _hf_checkpointing(sub)]
        if already:
            warnings.warn(
                f"ActivationCheckpointing: {already[0] or type(pl_module).__name__} already checkpoints its layers "
                "(Hugging Face gradient_checkpointing_enable()); wrapping them again recomputes every block twice in "
                "backward. Call gradient_checkpointing_disable() on the model or drop this callback.",
                LowMemWarning,
                stacklevel=2,
            )
        self._applied = self.apply_config(pl_module, strict=self.strict)
        self.wrapped = list(self._applied.checkpointed)
        if self.wrapped:
            shown = ", ".join(self.wrapped[:6]) + (", ..." if len(self.wrapped) > 6 else "")
            rank_zero_info(
                f"ActivationCheckpointing(policy={self.config.describe()}): {len(self.wrapped)} modules: {shown}"
            )
        self.warn_if_restored_differs(
            "wrapped",
            self.wrapped,
            "the checkpoint was trained with modules {restored} wrapped, this run wraps {current} "
            f"(policy {self.policy!r}). Weights load either way; only memory and speed differ.",
            default=[],
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"policy": repr(self.policy), "nested": self.nested, "wrapped": list(self.wrapped)}


def _hf_checkpointing(module: torch.nn.Module) -> bool:
    """Whether a ``transformers`` model has its own gradient checkpointing on (``is_activation_checkpointing``
    since transformers 5, ``is_gradient_checkpointing`` before; read from the class, so no deprecation warning)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(module), name, None), property):
            return bool(getattr(module, name))
    return False

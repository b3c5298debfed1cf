"""Freeze the embeddings and the first K blocks (Composer's LayerFreezing): ``requires_grad=False`` in place.

The blocks are the repeated blocks activation checkpointing's ``"auto"`` finds (a GPT's ``h.*``, a Llama's
``model.layers.*``), in model order; the embeddings are the ``nn.Embedding`` modules. A frozen parameter gets no
gradient and, once :func:`~lightning_lowmem.functional.optimizers.convert.drop_frozen_` takes it out of the
optimizer, no optimizer state: the estimator counts that by running this handler on its fake model. The frozen
modules are marked, so LoRA puts no adapter inside them (:data:`~lightning_lowmem.functional.lora.targets.FROZEN_MARK`).

Example::

    >>> from lightning_lowmem.demo import CharLM
    >>> model = CharLM(n_layer=2, n_embd=16, n_head=2, block_size=8)
    >>> freeze_layers_(model, FreezeConfig(blocks=1))
    ['model.wte', 'model.wpe', 'model.h.0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_lowmem.functional.checkpointing import resolve_policy
from lightning_lowmem.functional.lora.targets import FROZEN_MARK
from lightning_lowmem.functional.registry import register_technique

__all__ = ["FreezeConfig", "freeze_layers_", "frozen_modules"]


@dataclass(frozen=True)
class FreezeConfig:
    """What to freeze.

    Args:
        blocks: how many of the model's repeated blocks to freeze, from the first, >= 0 (more than the model
            has is refused when applied). Default: 1.
        embeddings: also freeze every ``nn.Embedding`` (token and position tables). Default: ``True``.

    Raises:
        TypeError / ValueError: ``blocks`` is not an int >= 0, ``embeddings`` not a bool, or nothing is frozen.
    """

    blocks: int = 1
    embeddings: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 0:
            raise ValueError(f"`blocks`={self.blocks!r} must be an int >= 0 (how many first blocks to freeze), e.g. 2")
        if not isinstance(self.embeddings, bool):
            raise TypeError(f"`embeddings`={self.embeddings!r} must be True or False")
        if self.blocks == 0 and not self.embeddings:
            raise ValueError(
                "`blocks`=0 and `embeddings`=False freeze nothing; freeze at least one block or the embeddings"
            )


def frozen_modules(module: nn.Module, config: FreezeConfig) -> list[str]:
    """The qualified names of the modules ``config`` freezes in ``module``: embeddings first, then the blocks.

    Raises:
        ValueError: the model has fewer repeated blocks than ``config.blocks``.
    """
    names = [name for name, sub in module.named_modules() if isinstance(sub, nn.Embedding)] if config.embeddings else []
    blocks = resolve_policy(module, "auto")  # the repeated blocks, as checkpointing's 'auto' finds them
    if config.blocks > len(blocks):
        raise ValueError(
            f"`blocks`={config.blocks} but {type(module).__name__} has {len(blocks)} repeated blocks "
            f"({blocks[:3]}{', ...' if len(blocks) > 3 else ''}); freeze at most {len(blocks)}"
        )
    return names + blocks[: config.blocks]


def freeze_layers_(module: nn.Module, config: FreezeConfig) -> list[str]:
    """Freeze what ``config`` chooses in ``module``, in place, and mark those modules frozen; returns their names."""
    names = frozen_modules(module, config)
    for name in names:
        sub = module.get_submodule(name)
        sub.requires_grad_(False)
        sub.__dict__[FROZEN_MARK] = True
    return names


@register_technique(FreezeConfig, field="freeze_layers", order=18)  # before LoRA (20): frozen blocks get no adapter
def _freeze_layers(module: nn.Module, config: FreezeConfig, applied: Any) -> None:
    """Freeze; the undo gives every parameter its ``requires_grad`` back and removes the marks."""
    from lightning_lowmem.functional.pruning.masks import get_mask

    names = frozen_modules(module, config)
    masked = [
        ".".join(part for part in (name, inner, p) if part)
        for name in names
        for inner, sub in module.get_submodule(name).named_modules()
        for p, _ in sub.named_parameters(recurse=False)
        if get_mask(sub, p) is not None
    ]
    if masked:
        raise ValueError(
            f"FreezeLayers and pruning do not compose: {masked[:3]} are pruned inside the frozen modules; "
            "prune after training, or freeze fewer blocks"
        )
    subs = [module.get_submodule(name) for name in names]
    was = {p: p.requires_grad for sub in subs for p in sub.parameters()}
    marked = [sub for sub in subs if FROZEN_MARK in sub.__dict__]

    def undo() -> None:
        for param, requires_grad in was.items():
            param.requires_grad_(requires_grad)
        for sub in subs:
            if sub not in marked:
                sub.__dict__.pop(FROZEN_MARK, None)

    applied.on_undo(undo)
    applied.reports["freeze_layers"] = freeze_layers_(module, config)

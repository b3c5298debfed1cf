"""`FreezeLayers`: train with the embeddings and the first K blocks frozen (Composer's LayerFreezing)."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lowmem.callbacks._technique_base import TechniqueCallback
from lightning_lowmem.composition import Rule
from lightning_lowmem.functional.techniques.freeze import FreezeConfig
from lightning_lowmem.functional.optimizers.convert import drop_frozen_


class FreezeLayers(TechniqueCallback):
    """Freeze the embeddings and the first ``blocks`` repeated blocks at ``setup``: no gradient, no optimizer state.

    The blocks are those activation checkpointing's ``"auto"`` finds (a GPT's ``h.*``, a Llama's
    ``model.layers.*``); the embeddings every ``nn.Embedding``. Applied at ``setup`` (before
    ``configure_optimizers``); at fit start the frozen parameters are taken out of the optimizers' param groups.
    With ``LowRankAdapters`` the frozen blocks get no adapter, in either callback order; with ``ScheduledPruning``
    the fit is refused (pruning would change the frozen weights). The parameters stay frozen after fit (as LoRA's
    base does; a fit that fails before training gives the flags back). The callback's state
    records the frozen modules; a resumed fit freezes the same ones (another set is refused in one line).

    Args:
        blocks: how many first blocks to freeze, >= 0. Default: 1.
        embeddings: also freeze the embeddings. Default: ``True``.

    Raises:
        ValueError: ``blocks`` not an int >= 0, nothing to freeze; at ``setup``, more blocks than the model has;
            on resume, a checkpoint trained with another frozen set.

    Example::

        >>> from lightning_lowmem.demo import CharLM
        >>> model, callback = CharLM(n_layer=2, n_embd=16, n_head=2, block_size=8), FreezeLayers(blocks=1)
        >>> trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_progress_bar=False,
        ...                     enable_checkpointing=False, enable_model_summary=False)
        >>> callback.setup(trainer, model, "fit")
        >>> callback.frozen
        ['model.wte', 'model.wpe', 'model.h.0']
    """

    technique = "freeze_layers"
    tags = frozenset({"freeze"})
    rules = (
        Rule(
            "freeze",
            "pruning",
            "{b.label} masks weights inside the blocks {a.label} keeps unchanged",
            "freeze fewer blocks than you prune, or prune in a second run",
        ),
    )
    applies_first = True  # LowRankAdapters applies the freeze first: no adapter in a frozen block
    undo_on_teardown = (
        False  # frozen is the fit's result (as Composer's); undone only when the fit fails before training
    )

    def __init__(self, blocks: int = 1, embeddings: bool = True) -> None:
        self.config = FreezeConfig(blocks, embeddings)  # validates
        self.blocks = blocks
        self.embeddings = embeddings
        self.frozen: list[str] = []
        self.removed_from_optimizers = 0

    @override
    def composition_label(self) -> str:
        return f"FreezeLayers(blocks={self.blocks})"

    @override
    def setup_technique(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._applied is not None:
            return
        self.frozen = list(self.apply_config(pl_module).reports["freeze_layers"])
        frozen_params = sum(p.numel() for name in self.frozen for p in pl_module.get_submodule(name).parameters())
        rank_zero_info(f"FreezeLayers(blocks={self.blocks}): {self.frozen} frozen ({frozen_params:,} parameters)")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after configure_optimizers, before optimizer state is restored on resume: saved and restored groups align
        self.removed_from_optimizers += drop_frozen_(trainer.optimizers)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "embeddings": self.embeddings, "frozen": list(self.frozen)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # after `setup` froze this fit's set, before the optimizer state (whose groups follow the set) is restored
        super().load_state_dict(state_dict)
        restored = state_dict.get("frozen")
        if restored is not None and self.frozen and restored != self.frozen:
            raise ValueError(
                f"FreezeLayers(blocks={self.blocks}, embeddings={self.embeddings}) freezes {self.frozen}, but the "
                f"checkpoint was trained with {restored} frozen (its optimizer state fits that set); resume with "
                f"FreezeLayers(blocks={state_dict.get('blocks')}, embeddings={state_dict.get('embeddings')})"
            )


__all__ = ["FreezeLayers"]

"""Low-rank adapters: the adapter layers ``LoraLinear`` / ``LoraConv2d`` / ``LoraMultiheadAttention`` (``layers``),
which layers get them (``targets``), the transforms that add and merge them (``adapters``), adapters-only files
(``files``) and the frozen quantized base of QLoRA (``quantized_base``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "LoraConv2d": "lightning_lowmem.functional.lora.layers",
    "LoraLinear": "lightning_lowmem.functional.lora.adapters",
    "LoraMultiheadAttention": "lightning_lowmem.functional.lora.layers",
    "LoraReport": "lightning_lowmem.functional.lora.adapters",
    "apply_lora_": "lightning_lowmem.functional.lora.adapters",
    "load_adapters": "lightning_lowmem.functional.lora.files",
    "lora_config": "lightning_lowmem.functional.lora.files",
    "lora_state_dict": "lightning_lowmem.functional.lora.files",
    "merge_lora_": "lightning_lowmem.functional.lora.adapters",
    "merged_state_dict": "lightning_lowmem.functional.lora.adapters",
    "save_adapters": "lightning_lowmem.functional.lora.files",
    "trained_modules": "lightning_lowmem.functional.lora.adapters",
    "unmerge_lora_": "lightning_lowmem.functional.lora.adapters",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.lora.adapters import (
        LoraLinear,
        LoraReport,
        apply_lora_,
        merge_lora_,
        merged_state_dict,
        trained_modules,
        unmerge_lora_,
    )
    from lightning_lowmem.functional.lora.files import load_adapters, lora_config, lora_state_dict, save_adapters
    from lightning_lowmem.functional.lora.layers import LoraConv2d, LoraMultiheadAttention

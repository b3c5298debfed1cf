"""Low-rank adapters: ``LoraLinear`` and the transforms that add and merge them (``adapters``), adapters-only files (``files``) and
the frozen quantized base of QLoRA (``quantized_base``).
"""

from lightning_lowmem.functional.lora.adapters import (
    LoraLinear,
    LoraReport,
    apply_lora_,
    merge_lora_,
    merged_state_dict,
    unmerge_lora_,
)
from lightning_lowmem.functional.lora.files import load_adapters, lora_config, lora_state_dict, save_adapters

__all__ = [
    "LoraLinear",
    "LoraReport",
    "apply_lora_",
    "load_adapters",
    "lora_config",
    "lora_state_dict",
    "merge_lora_",
    "merged_state_dict",
    "save_adapters",
    "unmerge_lora_",
]

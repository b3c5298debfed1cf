"""Embedded reference workloads (no downloads): `digits`, `charlm`, and Hugging Face models on charlm's corpus.

The Hugging Face wrappers live in ``lightning_lowmem.models.hf``; ``lightning_lowmem.demo.HFLanguageModel`` /
``HFTextDataModule`` and the module path ``lightning_lowmem.demo.hf`` (YAML ``class_path``) still name them.
"""

import sys

from lightning_lowmem.demo.charlm import CharGPT, CharLM, CharLMDataModule, GPTConfig
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.models import hf
from lightning_lowmem.models.hf import HFLanguageModel, HFTextDataModule

sys.modules[f"{__name__}.hf"] = hf  # the old module path: `import lightning_lowmem.demo.hf` finds the same module

__all__ = [
    "CharGPT",
    "CharLM",
    "CharLMDataModule",
    "DigitsClassifier",
    "DigitsDataModule",
    "GPTConfig",
    "HFLanguageModel",
    "HFTextDataModule",
]

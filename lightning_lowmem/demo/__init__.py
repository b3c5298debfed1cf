"""Embedded reference workloads (no downloads): `digits`, `charlm`, and Hugging Face models on charlm's corpus."""

from lightning_lowmem.demo.charlm import CharGPT, CharLM, CharLMDataModule, GPTConfig
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_lowmem.demo.hf import HFLanguageModel, HFTextDataModule

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

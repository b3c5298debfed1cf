"""Embedded reference workloads (no downloads): `digits` and `charlm`."""

from lightning_lowmem.demo.charlm import CharGPT, CharLM, CharLMDataModule, GPTConfig
from lightning_lowmem.demo.digits import DigitsClassifier, DigitsDataModule

__all__ = ["CharGPT", "CharLM", "CharLMDataModule", "DigitsClassifier", "DigitsDataModule", "GPTConfig"]

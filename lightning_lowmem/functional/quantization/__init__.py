"""Quantization: post-training (weight-only and dynamic, ``ptq``), static int8 through PT2E (``static``),
quantization-aware training (``qat``), the torchao configs behind each mode name (``modes``), layer
selection and Hugging Face ``Conv1D`` conversion (``layers``), portable checkpoints of quantized weights
(``serialization``), the per-layer float fallback search (``search``) and inference compilation (``compile``).
"""

from lightning_lowmem.functional.quantization.compile import CompiledInference, compile_inference
from lightning_lowmem.functional.quantization.modes import MODES, available_modes, embedding_config, torchao_config
from lightning_lowmem.functional.quantization.ptq import QuantizationReport, dequantize_, quantizable_layers, quantize_
from lightning_lowmem.functional.quantization.qat import QAT_MODES, convert_qat_, prepare_qat_, qat_layers
from lightning_lowmem.functional.quantization.search import ToleranceSearchResult, measure_latency, search_float_fallback
from lightning_lowmem.functional.quantization.static import StaticInt8Module, quantize_static

__all__ = [
    "MODES",
    "QAT_MODES",
    "CompiledInference",
    "QuantizationReport",
    "StaticInt8Module",
    "ToleranceSearchResult",
    "available_modes",
    "compile_inference",
    "convert_qat_",
    "dequantize_",
    "embedding_config",
    "measure_latency",
    "prepare_qat_",
    "qat_layers",
    "quantizable_layers",
    "quantize_",
    "quantize_static",
    "search_float_fallback",
    "torchao_config",
]

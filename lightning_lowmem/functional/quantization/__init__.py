"""Quantization: post-training (weight-only and dynamic, ``ptq``), static int8 through PT2E (``static``),
quantization-aware training (``qat``), the torchao configs behind each mode name (``modes``), layer
selection and Hugging Face ``Conv1D`` conversion (``layers``), portable checkpoints of quantized weights
(``serialization``), the per-layer float fallback search (``search``), quantizing within a metric tolerance
(``tolerance``) and inference compilation (``compile``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_lowmem._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CompiledInference": "lightning_lowmem.functional.quantization.compile",
    "MODES": "lightning_lowmem.functional.quantization.modes",
    "QAT_MODES": "lightning_lowmem.functional.quantization.qat",
    "QuantizationReport": "lightning_lowmem.functional.quantization.ptq",
    "StaticInt8Module": "lightning_lowmem.functional.quantization.static",
    "StaticQuantizationError": "lightning_lowmem.functional.quantization.static",
    "ToleranceReport": "lightning_lowmem.functional.quantization.tolerance",
    "ToleranceSearchResult": "lightning_lowmem.functional.quantization.search",
    "available_modes": "lightning_lowmem.functional.quantization.modes",
    "compile_inference": "lightning_lowmem.functional.quantization.compile",
    "convert_qat_": "lightning_lowmem.functional.quantization.qat",
    "dequantize_": "lightning_lowmem.functional.quantization.ptq",
    "embedding_config": "lightning_lowmem.functional.quantization.modes",
    "measure_latency": "lightning_lowmem.functional.quantization.search",
    "prepare_qat_": "lightning_lowmem.functional.quantization.qat",
    "qat_layers": "lightning_lowmem.functional.quantization.qat",
    "quantizable_layers": "lightning_lowmem.functional.quantization.ptq",
    "quantize_": "lightning_lowmem.functional.quantization.ptq",
    "quantize_static": "lightning_lowmem.functional.quantization.static",
    "quantize_within_tolerance": "lightning_lowmem.functional.quantization.tolerance",
    "search_float_fallback": "lightning_lowmem.functional.quantization.search",
    "torchao_config": "lightning_lowmem.functional.quantization.modes",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the lazy exports resolve to, for IDEs and type checkers
    from lightning_lowmem.functional.quantization.compile import CompiledInference, compile_inference
    from lightning_lowmem.functional.quantization.modes import MODES, available_modes, embedding_config, torchao_config
    from lightning_lowmem.functional.quantization.ptq import (
        QuantizationReport,
        dequantize_,
        quantizable_layers,
        quantize_,
    )
    from lightning_lowmem.functional.quantization.qat import QAT_MODES, convert_qat_, prepare_qat_, qat_layers
    from lightning_lowmem.functional.quantization.search import (
        ToleranceSearchResult,
        measure_latency,
        search_float_fallback,
    )
    from lightning_lowmem.functional.quantization.static import (
        StaticInt8Module,
        StaticQuantizationError,
        quantize_static,
    )
    from lightning_lowmem.functional.quantization.tolerance import ToleranceReport, quantize_within_tolerance

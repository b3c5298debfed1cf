"""The named defaults and vocabularies the technique configs share: one definition each, referenced by the
configs, the functional entry points, the callbacks and the strategies. A leaf module (imports nothing of
the package), so every layer may read it.

Example::

    >>> COMPRESSION_MIN_BYTES, GROUP_SIZE, QAT_MODES[0]
    (65536, 32, 'int8_weight_only')
"""

from __future__ import annotations

__all__ = [
    "COMPRESSION_MIN_BYTES",
    "CROSS_ENTROPY_KERNELS",
    "COMPRESSION_MODES",
    "GROUP_SIZE",
    "PRUNING_METHODS",
    "QAT_MODES",
    "QUANTIZATION_MODES",
]

#: activation compression: saved tensors smaller than this stay exact (below it the bookkeeping costs more
#: than it saves). 64 KiB.
COMPRESSION_MIN_BYTES = 1 << 16

#: activation compression modes (:func:`lightning_lowmem.functional.compression.compress_activations`).
COMPRESSION_MODES: tuple[str, ...] = ("bf16", "int8", "cpu")

#: what computes the chunked loss (:func:`lightning_lowmem.functional.cross_entropy.linear_cross_entropy`'s
#: ``kernel=``): a fused CUDA kernel when installed (``"auto"``), ours, Liger-Kernel's, Cut Cross-Entropy's.
CROSS_ENTROPY_KERNELS: tuple[str, ...] = ("auto", "lowmem", "liger", "cce")

#: group length of the grouped (int4) quantization modes: weights share one scale per ``GROUP_SIZE`` inputs.
GROUP_SIZE = 32

#: the quantization mode names and what each is.
QUANTIZATION_MODES: dict[str, str] = {
    "int8_dynamic": "int8 weights + int8 dynamic activations (torchao Int8DynamicActivationInt8WeightConfig)",
    "int8_weight_only": "int8 weights, float activations (torchao Int8WeightOnlyConfig)",
    "int4_weight_only": "packed int4 weights, bf16 activations (torchao Int4WeightOnlyConfig; CUDA only)",
    "intx4_weight_only": "int4 values stored in int8 bytes (torchao IntxWeightOnlyConfig; any device)",
    "int8_static": "int8 weights + calibrated static int8 activations (torchao pt2e, X86InductorQuantizer)",
}

#: modes quantization-aware training can train for (torchao's QATConfig infers the fake quantizers from them).
QAT_MODES: tuple[str, ...] = ("int8_weight_only", "int4_weight_only", "intx4_weight_only")

#: the pruning methods (``torch.nn.utils.prune``'s names, plus ``"nm"``: keep n of every m weights).
PRUNING_METHODS: tuple[str, ...] = (
    "l1_unstructured",
    "random_unstructured",
    "ln_structured",
    "random_structured",
    "nm",
)

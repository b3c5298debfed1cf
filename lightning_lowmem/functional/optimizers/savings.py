"""What a lean optimizer saves on *this* model: its state predicted from the parameter shapes, against fp32 AdamW.

The lean optimizers' figures (``docs/optimizers.md``: 8-bit AdamW ~0.27x, Adafactor ~0.01x of fp32 AdamW's
state on a GPT) hold for models made of large matrices. Conv nets are built otherwise, and two rules of the
optimizers then decide:

* torchao's 8-/4-bit AdamW quantizes a moment only for tensors of at least 4096 elements whose size is a
  multiple of the block (256 / 128); every other tensor keeps two fp32 moments, as AdamW. A width-16 CNN's
  3 x 3 convolutions hold 2304 weights each: 8-bit AdamW saves nothing there.
* torch's ``Adafactor`` factors the second moment of a tensor of 2 or more dims over its *last two* dims:
  a ``(C_out, C_in, kH, kW)`` convolution keeps ``C_out * C_in * (kH + kW)`` floats -- 2x a full second
  moment for a 1 x 1 convolution, 2/3 of one for a 3 x 3 -- where a ``(rows, cols)`` matrix keeps
  ``rows + cols``.

:func:`predicted_state_bytes` applies those rules (exact for the formats above: the tests compare it with
the state torch / torchao allocate) and :func:`lean_optimizer_warning` turns the result into the one-line
reason ``MemoryEfficientOptimizer`` warns with when the optimizer would keep more than half of AdamW's state.
Nothing here imports Lightning or torchao.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lightning_lowmem.memory.units import format_bytes

__all__ = ["LOW_BIT_BLOCK", "LOW_BIT_MIN_NUMEL", "lean_optimizer_warning", "predicted_state_bytes"]

#: torchao's low-bit AdamW quantizes tensors of at least this many elements ...
LOW_BIT_MIN_NUMEL = 4096
#: ... whose size is a multiple of its block: 8-bit 256, 4-bit 128 (one fp32 scale per block and moment)
LOW_BIT_BLOCK = {"8bit": 256, "4bit": 128}
#: warn when the lean optimizer keeps more than this share of fp32 AdamW's state
WARN_ABOVE = 0.5


def _low_bit_bytes(tensor: torch.Tensor, precision: str) -> int:
    numel, block = tensor.numel(), LOW_BIT_BLOCK[precision]
    if numel < LOW_BIT_MIN_NUMEL or numel % block:
        return 8 * numel + 4  # two fp32 moments, and the step
    values = numel if precision == "8bit" else numel // 2  # two moments of 8 / 4 bits each
    code_book = 256 if precision == "8bit" else 16  # fp32 quantization map of each moment
    return 2 * values + 2 * 4 * (numel // block + code_book) + 4


def _adafactor_bytes(tensor: torch.Tensor) -> int:
    if tensor.dim() < 2:
        return 4 * tensor.numel() + 4  # a full fp32 second moment, and the step
    rows = tensor.numel() // tensor.shape[-1]  # the row variance keeps every dim but the last
    cols = tensor.numel() // tensor.shape[-2]  # the column variance every dim but the second-to-last
    return 4 * (rows + cols) + 4


def predicted_state_bytes(name: str, parameters: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``(state bytes of optimizer name, state bytes of fp32 AdamW)`` over the trainable ``parameters``.

    Example::

        >>> conv_1x1, matrix = torch.nn.Conv2d(256, 256, 1, bias=False), torch.nn.Linear(256, 256, bias=False)
        >>> predicted_state_bytes("adafactor", conv_1x1.parameters())  # 2 x 256 x 256 floats, and the step
        (524292, 524288)
        >>> predicted_state_bytes("adafactor", matrix.parameters())  # 256 + 256 floats
        (2052, 524288)
        >>> small = torch.nn.Conv2d(16, 16, 3, bias=False)  # 2304 < 4096 elements: fp32 moments
        >>> predicted_state_bytes("adamw8bit", small.parameters())
        (18436, 18432)
    """
    from lightning_lowmem.functional.optimizers.catalog import state_layout

    family, precision = state_layout(name)
    lean = adamw = 0
    for tensor in {id(p): p for p in parameters if p.requires_grad}.values():
        adamw += 8 * tensor.numel()
        if family == "adam" and precision in LOW_BIT_BLOCK:
            lean += _low_bit_bytes(tensor, precision)
        elif family == "adafactor":
            lean += _adafactor_bytes(tensor)
        elif family == "adam":
            lean += 8 * tensor.numel() if precision == "float" else 4 * tensor.numel()  # bf16 moments: 2 x 2 B
        else:
            lean += 4 * tensor.numel()  # SGD: one momentum buffer
    return lean, adamw


def lean_optimizer_warning(name: str, parameters: Iterable[torch.Tensor]) -> str | None:
    """Why optimizer ``name`` will keep more than half of fp32 AdamW's state on these ``parameters`` (with the
    predicted figures and the tensors responsible), or ``None`` when it saves what it promises (or is no lean
    state optimizer: ``adamw``, ``sgd`` and their in-backward forms).

    Example::

        >>> convs = [torch.zeros(16, 16, 3, 3, requires_grad=True) for _ in range(4)]
        >>> print(lean_optimizer_warning("adamw8bit", convs))  # doctest: +ELLIPSIS
        adamw8bit keeps 72.02 KiB of optimizer state here, 1.00x fp32 AdamW's 72.00 KiB: 4 of 4 parameter tensors ...
    """
    from lightning_lowmem.functional.optimizers.catalog import state_layout

    family, precision = state_layout(name)
    if not (family == "adafactor" or (family == "adam" and precision in LOW_BIT_BLOCK)):
        return None
    parameters = [p for p in {id(p): p for p in parameters}.values() if p.requires_grad]
    lean, adamw = predicted_state_bytes(name, parameters)
    if not adamw or lean <= WARN_ABOVE * adamw:
        return None
    head = (
        f"{name} keeps {format_bytes(lean)} of optimizer state here, {lean / adamw:.2f}x fp32 AdamW's "
        f"{format_bytes(adamw)}: "
    )
    if family == "adam":
        block = LOW_BIT_BLOCK[precision]
        small = [p for p in parameters if p.numel() < LOW_BIT_MIN_NUMEL or p.numel() % block]
        share = sum(p.numel() for p in small) / max(1, sum(p.numel() for p in parameters))
        return head + (
            f"{len(small)} of {len(parameters)} parameter tensors ({100 * share:.0f}% of the parameters) have fewer "
            f"than {LOW_BIT_MIN_NUMEL} elements or a size that is no multiple of the {block}-element block, and "
            "torchao keeps fp32 moments for them (small convolutions, norms, biases). Expect no saving from it on "
            "this model; 'adafactor' or a wider model saves more."
        )
    convs = [p for p in parameters if p.dim() >= 3]
    pointwise = [p for p in convs if p.dim() == 4 and p.shape[-1] == p.shape[-2] == 1]
    return head + (
        f"torch's Adafactor factors the second moment over the last two dims only, so the {len(convs)} conv "
        f"weights (C_out, C_in, kH, kW) keep C_out * C_in * (kH + kW) floats ({len(pointwise)} are 1 x 1: 2x a "
        "full second moment) and 1-D tensors a full one. 'adamw8bit' may save more on this model."
    )

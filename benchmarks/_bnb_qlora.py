"""A memory model of LitGPT's ``--quantize bnb.nf4`` QLoRA, for the LitGPT config-hub rows of ``bench_published``.

Those figures were measured with bitsandbytes 0.42.0 and Lightning 2.3.0.dev20240328 (litgpt's ``pyproject.toml``
at the commits that published them: 41dece20 added Llama-2-7B's 13.68 GB, 43c44323 re-ran the table). Four
behaviours of those libraries make LitGPT's 4-bit run hold more than the package's own NF4 QLoRA, which keeps only
the quantized weight for backward; this module allocates and holds what they do, on the estimator's fake tensors:

1. **bitsandbytes' ``MatMul4Bit`` keeps each 4-bit linear's input** for backward, ``ctx.tensors = (A, B)``, where
   a frozen linear needs only its weight [BNB]_ (L522-525): per Llama block the attention input, the attention
   output, the MLP input and the ``silu(gate) * up`` product (``3 * hidden + intermediate`` values a token), and the
   head's input.
2. **Held until the graph dies, not until backward**: ``ctx.tensors`` is a plain attribute, not
   ``save_for_backward``, so autograd does not free it when the node's backward has run. LitGPT's loop keeps
   ``logits`` (a list of chunks) from one iteration to the next [LITGPT]_ (L276, rebound only when the next forward
   returns; the loss is rebound to a float at L292), and with it the whole graph: the previous iteration's inputs are
   alive at the end of the next forward. ``_litgpt_loop_loss`` in ``bench_published`` runs that iteration first.
3. **A float16 copy, then a bfloat16 copy, of each weight** in forward and backward:
   ``F.dequantize_4bit(B, quant_state).to(A.dtype)`` [BNB]_ (L516, L546) decodes into ``quant_state.dtype``
   [BNB_F]_ (L1026), the dtype of the tensor quantized (L969), which is float16: Lightning's ``_Linear4bit.quantize``
   casts the weight with ``.to(dtype=torch.half)`` first [PL]_ (L334). Training in bf16, ``.to`` copies it. The output
   head's pair (``2 x vocab x hidden x 2`` bytes) is alive at the end of the forward, where the peak is.
4. **What is stored**: Fabric's ``module_init_context`` swaps ``torch.nn.Linear`` for ``_NF4Linear`` [PL]_ (L129-140;
   nf4, ``compress_statistics=False``): every linear, the head too, keeps 4-bit codes and a float32 absmax per 64
   weights; ``nn.Embedding`` stays bf16. LitGPT steps ``bnb.optim.PagedAdamW`` [LITGPT]_ (L183), whose state tensors
   of 1e5+ elements are CUDA managed memory [BNB_O]_ (L304-312, ``F.get_paged``) that
   ``torch.cuda.max_memory_allocated`` (LitGPT's figure, L212) does not count: every LoRA matrix of these rows is larger.

.. [BNB] https://github.com/bitsandbytes-foundation/bitsandbytes/blob/4870580f17767a4165ec05d954dff2b5c25b694d/bitsandbytes/autograd/_functions.py
.. [BNB_F] https://github.com/bitsandbytes-foundation/bitsandbytes/blob/4870580f17767a4165ec05d954dff2b5c25b694d/bitsandbytes/functional.py
.. [BNB_O] https://github.com/bitsandbytes-foundation/bitsandbytes/blob/4870580f17767a4165ec05d954dff2b5c25b694d/bitsandbytes/optim/optimizer.py
.. [PL] https://github.com/Lightning-AI/pytorch-lightning/blob/75553845c6bbcc305fbae38a46ef4e532e4ac85a/src/lightning/fabric/plugins/precision/bitsandbytes.py
.. [LITGPT] https://github.com/Lightning-AI/litgpt/blob/43c44323b9b7fb6e3b567c800e6668c3a9b1ecee/litgpt/finetune/lora.py

Values are not computed: a 4-bit linear's dequantized weight is zeros (the estimator needs shapes and lifetimes).
LoRA wraps the named targets as LitGPT's ``LoRALinear`` does: ``base(x) + (dropout(x) @ A^T @ B^T) * alpha / r``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64  # bitsandbytes' 4-bit blocksize: weights per absmax
ABSMAX_BYTES = 4  # float32 (nf4 without double quantization)


def _dequantize(codes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``F.dequantize_4bit``'s output: one float16 (out, in) tensor (its CUDA kernel allocates nothing else)."""
    return torch.zeros(shape, dtype=torch.float16, device=codes.device)


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes 0.42.0's ``MatMul4Bit``: the same tensors, allocated and held as it does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, bias: torch.Tensor | None, shape: Any) -> torch.Tensor:
        out = F.linear(x, _dequantize(codes, shape).to(x.dtype), bias)  # (..., out); fp16, then x's dtype
        ctx.shape = shape
        # a plain attribute, as bitsandbytes keeps it: backward does not release it, the graph's end does
        ctx.tensors = (x, codes) if any(ctx.needs_input_grad[:2]) else (None, None)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        _, codes = ctx.tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(_dequantize(codes, ctx.shape).to(grad_out.dtype))  # (..., in)
        return grad_x, None, None, None


class Bnb4bitLinear(nn.Module):
    """Lightning's ``_NF4Linear`` (bitsandbytes ``Linear4bit``, nf4, no double quantization): ``codes`` is
    ``Params4bit`` (two weights a byte), ``absmax`` its float32 scales stored as bytes (so a precision's
    ``.to(dtype)`` leaves them float32, as it leaves bitsandbytes' ``quant_state``)."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None, device: Any) -> None:
        super().__init__()
        numel = in_features * out_features
        self.in_features, self.out_features = in_features, out_features
        self.codes = nn.Parameter(torch.empty(numel // 2, 1, dtype=torch.uint8, device=device), requires_grad=False)
        absmax = torch.empty(-(-numel // BLOCK) * ABSMAX_BYTES, dtype=torch.uint8, device=device)
        self.absmax = nn.Parameter(absmax, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMul4Bit.apply(x, self.codes, self.bias, (self.out_features, self.in_features))


class LitGPTLoraLinear(nn.Module):
    """LitGPT's ``LoRALinear`` around a 4-bit base: ``base(x) + (dropout(x) @ A^T @ B^T) * alpha / r``."""

    def __init__(self, base: Bnb4bitLinear, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base, self.scaling = base, alpha / r
        device = base.codes.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device))  # (out, r)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)  # (..., out)
        return self.base(x) + update * self.scaling


def bnb_qlora_(model: nn.Module, r: int, alpha: float, target: list[str], dropout: float = 0.0, **_: Any) -> int:
    """LitGPT's ``--quantize bnb.nf4`` QLoRA on ``model`` in place: every ``nn.Linear`` 4-bit, those named in
    ``target`` (last name component) under a LoRA update, everything but the updates frozen. Returns the number of
    linears converted. Extra keys (the package's ``quantize_base`` ...) are ignored."""
    for param in model.parameters():
        param.requires_grad_(False)
    converted = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            base = Bnb4bitLinear(child.in_features, child.out_features, child.bias, child.weight.device)
            wrapped = LitGPTLoraLinear(base, r, alpha, dropout) if child_name in target else base
            setattr(module, child_name, wrapped)
            converted += 1
    return converted


def saved_inputs(output: torch.Tensor) -> list[torch.Tensor]:
    """The inputs the 4-bit linears of ``output``'s graph hold (``ctx.tensors``), one per storage."""
    seen, held, stack = set(), {}, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_MatMul4BitBackward" and node.tensors[0] is not None:
            held[node.tensors[0].untyped_storage().data_ptr()] = node.tensors[0]
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(held.values())

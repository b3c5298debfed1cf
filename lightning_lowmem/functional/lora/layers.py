"""The adapter layers: :class:`LoraLinear`, :class:`LoraConv2d` and :class:`LoraMultiheadAttention`.

Each keeps its base layer's parameters under their own names (a base checkpoint still loads into the wrapped
model), adds ``lora_A`` / ``lora_B`` and answers the same small protocol, so merging, adapter files and the
callback treat them alike: ``r``, ``alpha``, ``scaling``, ``merged``, ``weight`` (the adapted base weight),
``weight_name`` (its key under the layer's name) and :meth:`delta_weight` (the update, shaped like ``weight``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.functional.multihead_attention import MHA_WEIGHTS
from lightning_lowmem.functional.lora.quantized_base import frozen_linear, is_quantized

__all__ = [
    "ADAPTER_SUFFIXES",
    "RUNNING_STAT_SUFFIXES",
    "LoraConv2d",
    "LoraLinear",
    "LoraMultiheadAttention",
    "conv_refusal",
    "lora_layers",
]

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
# A CNN under LoRA still updates its BatchNorm running statistics in training: they are kept with the adapters
# (adapter files, adapter-only checkpoints), or a reloaded model would normalise with its pretrained statistics.
RUNNING_STAT_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")


def is_hf_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: a linear layer with weight (in_features, out_features); matched
    # by name so transformers stays an optional dependency.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update: ``y = x W^T + b + s * (x A^T) B^T``.

    Subclasses ``nn.Linear`` (same ``weight`` (out, in) / ``bias`` names) so tools that act on linear
    layers, torchao's ``quantize_`` among them, keep working. Build it with :meth:`from_layer`.

    Args:
        weight: frozen base weight, shape (out_features, in_features); kept as the same ``Parameter``.
        bias: frozen base bias (out_features,) or ``None``.
        r: rank of the update (> 0).
        alpha: the update is scaled by ``alpha / r``.
        dropout: dropout probability on the adapter's input. Default: 0.0.
        fan_in_fan_out: the base layer was a Hugging Face ``Conv1D`` (weight stored (in, out)); only
            used to write merged weights back in that layout. Default: ``False``.
    """

    weight_name = "weight"

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        fan_in_fan_out: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a fresh weight
        out_features, in_features = weight.shape
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = weight
        self.bias = bias
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.fan_in_fan_out = fan_in_fan_out
        self.merged = False
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        # new_empty / new_zeros follow the weight: real, meta or fake tensors alike (a torchao-quantized base has
        # no new_empty: a plain tensor on its device stands in)
        like = torch.empty(0, device=weight.device) if is_quantized(weight) else weight
        self.lora_A = nn.Parameter(like.new_empty((r, self.in_features), dtype=dtype))  # (r, in)
        self.lora_B = nn.Parameter(like.new_zeros((self.out_features, r), dtype=dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear; B = 0 keeps step 0 exact

    @classmethod
    def from_layer(cls, layer: nn.Module, *, r: int, alpha: float, dropout: float = 0.0) -> "LoraLinear":
        """Wrap an ``nn.Linear`` or Hugging Face ``Conv1D``; its parameters are frozen and reused."""
        fan_in_fan_out = is_hf_conv1d(layer)
        weight = layer.weight
        if fan_in_fan_out:  # Conv1D stores (in, out): keep one (out, in) copy, as nn.Linear does
            weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        weight.requires_grad_(False)
        bias = layer.bias
        if bias is not None:
            bias.requires_grad_(False)
        return cls(weight, bias, r=r, alpha=alpha, dropout=dropout, fan_in_fan_out=fan_in_fan_out)

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) * B @ A``, shape (out_features, in_features)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = frozen_linear(x, self.weight, self.bias)  # (..., out); differentiable for any quantized base
        if self.merged:
            return out
        update = F.linear(F.linear(self.lora_dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B)  # (..., out)
        return out + (update * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        quantized = f", base={type(self.weight).__name__}" if is_quantized(self.weight) else ""
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, merged={self.merged}{quantized}"


def conv_refusal(layer: nn.Conv2d) -> str | None:
    """Why :class:`LoraConv2d` cannot adapt ``layer`` (``None``: it can).

    Example::

        >>> conv_refusal(nn.Conv2d(8, 8, 3, groups=8))
        'groups=8 (grouped / depthwise)'
    """
    if layer.groups != 1:
        return f"groups={layer.groups} (grouped / depthwise)"
    if layer.padding_mode != "zeros":
        return f"padding_mode={layer.padding_mode!r}"
    if isinstance(layer.padding, str):
        return f"padding={layer.padding!r}"
    return None


_CONV_ATTRIBUTES = (
    "in_channels",
    "out_channels",
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "transposed",
    "output_padding",
    "groups",
    "padding_mode",
)  # what nn.Conv2d's forward and repr read


class LoraConv2d(nn.Conv2d):
    """A frozen ``nn.Conv2d`` plus a trainable low-rank update, as PEFT does it: ``A`` is a convolution with the
    layer's kernel, stride, padding and dilation into ``r`` channels, ``B`` a 1 x 1 convolution from ``r`` to the
    output channels (zero at the start). ``y = conv(x, W) + b + s * conv1x1(conv(x, A), B)``; merged,
    ``W += s * B @ A`` over the flattened kernels (the two convolutions compose into one, exactly).

    Only ``groups=1`` layers with numeric ``padding`` and ``padding_mode="zeros"`` (:func:`conv_refusal`). Build it
    with :meth:`from_layer`; ``weight`` / ``bias`` stay the base layer's ``Parameter`` s.
    """

    weight_name = "weight"

    def __init__(self, layer: nn.Conv2d, *, r: int, alpha: float, dropout: float = 0.0) -> None:
        reason = conv_refusal(layer)
        if reason is not None:
            raise ValueError(f"LoraConv2d cannot adapt a convolution with {reason}; adapt groups=1 zero-padded ones.")
        nn.Module.__init__(self)  # not nn.Conv2d.__init__: that would allocate a fresh weight
        for attribute in _CONV_ATTRIBUTES:
            setattr(self, attribute, getattr(layer, attribute))
        self.weight = layer.weight.requires_grad_(False)
        self.bias = layer.bias.requires_grad_(False) if layer.bias is not None else None
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.merged = False
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = self.weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        kernel = (r, self.in_channels, *self.kernel_size)
        self.lora_A = nn.Parameter(weight.new_empty(kernel, dtype=dtype))  # (r, in, kh, kw)
        self.lora_B = nn.Parameter(weight.new_zeros((self.out_channels, r, 1, 1), dtype=dtype))  # (out, r, 1, 1)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Conv2d; B = 0 keeps step 0 exact

    @classmethod
    def from_layer(cls, layer: nn.Conv2d, *, r: int, alpha: float, dropout: float = 0.0) -> "LoraConv2d":
        """Wrap ``layer``; its parameters are frozen and reused."""
        return cls(layer, r=r, alpha=alpha, dropout=dropout)

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) * B @ A`` as a kernel, shape (out, in, kh, kw)."""
        return (self.lora_B.flatten(1) @ self.lora_A.flatten(1)).view(self.weight.shape) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # (B, out, H', W')
        if self.merged:
            return out
        hidden = F.conv2d(
            self.lora_dropout(x.to(self.lora_A.dtype)), self.lora_A, None, self.stride, self.padding, self.dilation
        )  # (B, r, H', W')
        return out + (F.conv2d(hidden, self.lora_B) * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, merged={self.merged}"


def _no_fused_path(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing: its presence alone keeps ``nn.TransformerEncoderLayer`` off its fused
    inference path, which reads ``self_attn.in_proj_weight`` / ``out_proj.weight`` and would skip the adapters."""


class LoraMultiheadAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` whose projections are adapted for real.

    ``nn.MultiheadAttention`` hands ``in_proj_weight`` and ``out_proj.weight`` to ``F.multi_head_attention_forward``
    as tensors, so no layer wrapped around them would run. This subclass takes the same parameters (same names, the
    same ``Parameter`` objects) and calls the functional form with the *effective* weights: ``in_proj_weight +
    (alpha / r) * B @ A`` when ``in_proj`` is adapted (``lora_A`` (r, E), ``lora_B`` (3E, r) on this module), and
    ``out_proj.weight + out_proj.delta_weight()`` when ``out_proj`` is a :class:`LoraLinear`. The update goes
    through the weights, so adapter ``dropout`` does not apply here. Build it with :meth:`from_module`.
    """

    weight_name = "in_proj_weight"

    @classmethod
    def from_module(
        cls, attention: nn.MultiheadAttention, *, in_proj: bool, r: int, alpha: float
    ) -> "LoraMultiheadAttention":
        """The adapted twin of ``attention`` (its parameters frozen and shared); ``in_proj``: adapt the packed
        ``in_proj_weight`` (needs equal query / key / value widths)."""
        new = cls(
            attention.embed_dim,
            attention.num_heads,
            dropout=attention.dropout,
            bias=attention.in_proj_bias is not None,
            add_bias_kv=attention.bias_k is not None,
            add_zero_attn=attention.add_zero_attn,
            kdim=attention.kdim,
            vdim=attention.vdim,
            batch_first=attention.batch_first,
            device="meta",
        )  # built on meta (nothing allocated), then given the original's parameters
        for name in (*MHA_WEIGHTS, "in_proj_bias", "bias_k", "bias_v"):
            setattr(new, name, getattr(attention, name, None))
        new.out_proj = attention.out_proj
        new.train(attention.training)
        new.r, new.alpha, new.scaling, new.merged = r, alpha, alpha / r, False
        new.lora_A = new.lora_B = None
        if in_proj:
            weight = attention.in_proj_weight  # (3E, E)
            if weight is None:
                raise ValueError("in_proj_weight is None (query / key / value widths differ): adapt out_proj only.")
            dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
            new.lora_A = nn.Parameter(weight.new_empty((r, weight.shape[1]), dtype=dtype))  # (r, E)
            new.lora_B = nn.Parameter(weight.new_zeros((weight.shape[0], r), dtype=dtype))  # (3E, r)
            nn.init.kaiming_uniform_(new.lora_A, a=math.sqrt(5))
        new.register_forward_pre_hook(_no_fused_path)  # owned by the module: gone with it on undo
        return new

    @property
    def weight(self) -> torch.Tensor:
        """The adapted base weight: ``in_proj_weight`` (3E, E)."""
        return self.in_proj_weight

    def delta_weight(self) -> torch.Tensor:
        """The update of ``in_proj_weight``: ``(alpha / r) * B @ A``, shape (3E, E)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def _effective(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        in_weight = self.in_proj_weight
        if self.lora_A is not None and not self.merged:
            in_weight = in_weight + self.delta_weight().to(in_weight.dtype)
        out = self.out_proj
        out_weight = out.weight
        if isinstance(out, LoraLinear) and not out.merged:
            out_weight = out_weight + out.delta_weight().to(out_weight.dtype)
        return in_weight, out_weight

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # nn.MultiheadAttention.forward's general path (no fused kernel: it would read the base weights)
        in_weight, out_weight = self._effective()
        batched = query.dim() == 3
        if self.batch_first and batched:  # (B, T, E) -> (T, B, E), keeping self-attention's `query is key`
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        separate = {}  # query / key / value widths differ: three weights instead of in_proj_weight
        if not self._qkv_same_embed_dim:
            separate = {"use_separate_proj_weight": True, "q_proj_weight": self.q_proj_weight}
            separate.update(k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight)
        attn_output, attn_weights = F.multi_head_attention_forward(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            in_weight,
            self.in_proj_bias,
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            self.dropout,
            out_weight,
            self.out_proj.bias,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
            **separate,
        )
        if self.batch_first and batched:
            attn_output = attn_output.transpose(1, 0)
        return attn_output, attn_weights

    def extra_repr(self) -> str:
        adapted = "in_proj, " if self.lora_A is not None else ""
        return f"{adapted}r={self.r}, alpha={self.alpha}, merged={self.merged}"


def lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> adapter layer (:class:`LoraLinear`, :class:`LoraConv2d`, or a
    :class:`LoraMultiheadAttention` whose ``in_proj_weight`` is adapted) for every one inside ``module``."""
    return {
        name: sub
        for name, sub in module.named_modules()
        if isinstance(sub, (LoraLinear, LoraConv2d))
        or (isinstance(sub, LoraMultiheadAttention) and sub.lora_A is not None)
    }

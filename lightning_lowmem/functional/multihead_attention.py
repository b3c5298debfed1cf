"""``nn.MultiheadAttention``: the layers inside it that a module transform cannot reach.

``nn.MultiheadAttention.forward`` calls ``F.multi_head_attention_forward``, which reads ``in_proj_weight`` and
``out_proj.weight`` / ``out_proj.bias`` as tensors: ``out_proj``'s own ``forward`` is never called. A
transform that swaps or wraps ``out_proj`` (a LoRA adapter, a QAT fake-quantizer) is therefore never run,
and one that changes the weight's type (an int8 torchao tensor) breaks the functional call outside
``torch.inference_mode``. QAT and PTQ ask :func:`mha_out_projections` which layers to leave alone and warn
with :func:`left_alone_message`; pruning masks the tensors in place, so it prunes them (and
``in_proj_weight``) for real; LoRA replaces the whole attention with
:class:`~lightning_lowmem.functional.lora.layers.LoraMultiheadAttention`, which calls the functional form with
the adapted weights.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

__all__ = ["MHA_WEIGHTS", "left_alone_message", "mha_out_projections"]

MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
"""An ``nn.MultiheadAttention``'s own projection weights (packed, or separate when k / v widths differ)."""


def mha_out_projections(module: nn.Module) -> dict[str, str]:
    """``{out_proj name: its nn.MultiheadAttention's name}`` for every ``nn.MultiheadAttention`` in ``module``.

    Example::

        >>> layer = nn.TransformerEncoderLayer(8, 2, batch_first=True)
        >>> mha_out_projections(layer)
        {'self_attn.out_proj': 'self_attn'}
    """
    return {
        f"{name}.out_proj" if name else "out_proj": name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.MultiheadAttention)
    }


def left_alone_message(names: Iterable[str], what: str) -> str:
    """The warning a transform gives for the ``out_proj`` layers it leaves alone (``what``: what it would do)."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    return (
        f"{what} left out {shown}: the out_proj of an nn.MultiheadAttention, whose forward reads out_proj.weight "
        "directly (F.multi_head_attention_forward), so a wrapped or swapped layer there would never be called "
        "(its in_proj_weight is no layer either). They keep their plain weights. Hint: an attention written with "
        "nn.Linear projections and F.scaled_dot_product_attention gets every feature."
    )

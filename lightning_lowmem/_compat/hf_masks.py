"""transformers: the attention-mask decisions it takes from a padding mask's values.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator

from lightning_lowmem._compat.fake_mode import is_fake

__all__ = ["hf_masks_as_unpadded"]


# the decisions ``transformers.masking_utils`` takes from a padding mask's *values* (torch.nn's SDPA then
# runs ``is_causal=True`` / no mask instead of a materialised (B, 1, T, T) mask)
_HF_MASK_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def hf_masks_as_unpadded() -> Iterator[None]:
    """While active, ``transformers`` decides on a *fake* padding mask as on an all-ones one.

    Why private: ``transformers.masking_utils._ignore_causal_mask_sdpa`` /
    ``_ignore_bidirectional_mask_sdpa`` skip building the (B, 1, T, T) attention mask when no token is
    padded, so SDPA runs its flash kernel with ``is_causal``; on a FakeTensor they cannot read the
    values (``is_tracing`` is true for fake tensors) and always build the mask, which the real step with
    an unpadded batch never does. No public switch exists. Each is wrapped so that a fake
    ``padding_mask`` is passed on as ``None`` (no padding: what the caller checked on the real batch);
    real masks and every other argument pass through. Only a ``transformers`` already imported is
    patched, and only the names it has (older versions lack some); all are restored on exit.
    """
    masking = sys.modules.get("transformers.masking_utils")
    originals = {name: getattr(masking, name) for name in _HF_MASK_DECISIONS if hasattr(masking, name)}

    def unpadded(original: Any) -> Any:
        @functools.wraps(original)
        def decide(padding_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
            return original(
                None if padding_mask is not None and is_fake(padding_mask) else padding_mask, *args, **kwargs
            )

        return decide

    for name, original in originals.items():
        setattr(masking, name, unpadded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)

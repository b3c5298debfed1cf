"""torchao's low-bit optimizers: re-quantizing their state after a full (dequantized) load.

Each function names the private name it uses (of torch, Lightning, transformers or torchao) and why no public
API does the job.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["requantize_low_bit_state"]


def requantize_low_bit_state(optimizer: Any) -> int:
    """Turn plain (dequantized) moments of a torchao low-bit AdamW back into its quantized buffers.

    Why private: torchao's ``_AdamBase._new_buffer(p, signed)`` is the one place that knows which buffer a
    parameter gets (quantized when its *local* shard has >= 4096 values divisible by the block size,
    wrapped in a DTensor like the parameter). A full FSDP checkpoint stores the moments dequantized, so
    they load on any number of processes; each rank re-quantizes its own shard here. Returns how many
    buffers were converted (0 for any other optimizer).
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    new_buffer = getattr(inner, "_new_buffer", None)
    if new_buffer is None or not hasattr(inner, "_subclass_zeros"):
        return 0
    converted = 0
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state.get(param, {})
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
                value = state.get(key)
                if not isinstance(value, torch.Tensor):
                    continue
                local = value.to_local() if hasattr(value, "to_local") else value
                if type(local) is not torch.Tensor:
                    continue  # already quantized
                buffer = new_buffer(param, signed)
                buffer_local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
                if type(buffer_local) is torch.Tensor:
                    continue  # too small to quantize: plain either way
                buffer_local.copy_(local)
                state[key] = buffer
                converted += 1
    return converted

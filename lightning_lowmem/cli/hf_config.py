"""``lowmem estimate --hf-config PATH``: a Hugging Face model built from its ``config.json`` alone, on the meta device.

"Will Llama-2-7B fit on my 24 GB GPU?" needs the architecture, not the weights: the model is built from the config
(a ``config.json`` or a folder holding one, e.g. a downloaded checkpoint) with no memory behind its parameters, and
fed a dict batch of ``meta`` tensors (``input_ids``, ``attention_mask``, ``labels``) of ``--batch-size`` x
``--seq-len`` tokens, so estimating a 7B step takes seconds and no download.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.cli.errors import ConfigError

__all__ = ["hf_config_batch", "hf_config_model"]


def _config_path(path: str) -> Path:
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "config.json"
    if not candidate.is_file():
        raise ConfigError(
            f"--hf-config {path!r}: no such file (give a Hugging Face config.json, or the folder of a checkpoint "
            "holding one)"
        )
    return candidate


def hf_config_model(path: str) -> Any:
    """The model ``config.json`` describes (its ``architectures[0]`` class, else a causal LM), on ``meta``.

    Raises:
        ConfigError: no such file, not JSON, no ``model_type``, or a model type this transformers does not know.

    Example::

        >>> import json, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, "config.json"), "w") as f:
        ...     json.dump({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...                "num_attention_heads": 4, "vocab_size": 1000}, f)
        >>> model = hf_config_model(folder)
        >>> type(model).__name__, model.lm_head.weight.device.type
        ('LlamaForCausalLM', 'meta')
    """
    from lightning_lowmem._versions import optional_import

    try:
        transformers = optional_import("transformers", "--hf-config", extra="hf")
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError(str(err)) from err
    file = _config_path(path)
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--hf-config {str(file)!r} is not JSON: {err}") from err
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ConfigError(
            f'--hf-config {str(file)!r} has no `model_type` (e.g. "llama"): is it a Hugging Face config.json?'
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except ValueError as err:
        raise ConfigError(f"--hf-config {str(file)!r}: {err}") from err
    if "vocab_size" not in values:
        warnings.warn(
            f"--hf-config {str(file)!r} has no vocab_size: the {type(config).__name__} default "
            f"{getattr(config, 'vocab_size', '?')} is used, and the logits' memory follows it",
            UserWarning,
            stacklevel=2,
        )
    architectures = values.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_class is not None:
            model = model_class._from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    # float32 master weights, whatever dtype the checkpoint was saved in (`torch_dtype`): the estimate's
    # precision (--precision bf16-true ...) decides what the step holds, as Lightning's precision plugin does
    return model.to(torch.float32)


def hf_config_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A causal-LM dict batch of ``meta`` tensors: every token counted, none padded.

    Example::

        >>> {k: tuple(v.shape) for k, v in hf_config_batch(2, 16).items()}
        {'input_ids': (2, 16), 'attention_mask': (2, 16), 'labels': (2, 16)}
    """
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise ConfigError(
                f"{name} must be a positive number of {'sequences' if 'batch' in name else 'tokens'}, got {value}"
            )
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

"""Physical (structural) pruning: remove whole channels / FFN units with Torch-Pruning's dependency graph.

The module really shrinks (fewer parameters, faster matmuls), coupled layers (BatchNorm, the next
layer's input) are sliced with it, and an optimizer passed in is rebound: its param groups point at
the new parameters and every state tensor (momentum, Adam moments) is sliced like its parameter, so
training continues where it was instead of silently updating the old, detached tensors.

``import torch_pruning`` happens inside :func:`prune_structural_` (``pip install 'lightning-lowmem[prune]'``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_lowmem.model_io import has_forward_batch, output_logits
from lightning_lowmem.warnings import NoEffectWarning

__all__ = [
    "StructuralPruningReport",
    "call_forward_batch",
    "example_row",
    "pruned_shapes",
    "prune_structural_",
    "restore_shapes_",
    "shrink_to_state_dict_",
]

# residual-stream layers: removing their channels would cut the width every block shares
_RESIDUAL_TYPES = (nn.Embedding, nn.LayerNorm)
_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "head_dim")  # head_dim: HF Llama-style attention
_HEAD_NAMES = ("lm_head", "embed_out", "head", "classifier", "score")  # output heads, by their module's own name


@dataclass
class StructuralPruningReport:
    """What :func:`prune_structural_` removed."""

    params_before: int
    params_after: int
    removed_channels: dict[str, int] = field(default_factory=dict)

    @property
    def param_ratio(self) -> float:
        """``params_after / params_before``."""
        return self.params_after / max(self.params_before, 1)


def _import_torch_pruning() -> Any:
    from lightning_lowmem._versions import optional_import

    return optional_import("torch_pruning", "structural pruning", extra="prune", distribution="torch-pruning")


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # GPT-2: weight (in, out)


def _hf_conv1d_pruner(tp: Any) -> Any:
    """A Torch-Pruning pruner for Hugging Face ``Conv1D`` (Torch-Pruning only knows ``nn.Linear``)."""

    class Conv1DPruner(tp.pruner.function.BasePruningFunc):
        def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            keep = sorted(set(range(layer.nf)) - set(idxs))
            layer.nf = len(keep)
            layer.weight = self._prune_parameter_and_grad(layer.weight, keep, 1)
            if layer.bias is not None:
                layer.bias = self._prune_parameter_and_grad(layer.bias, keep, 0)
            return layer

        def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
            keep = sorted(set(range(layer.weight.shape[0])) - set(idxs))
            layer.weight = self._prune_parameter_and_grad(layer.weight, keep, 0)
            return layer

        def get_out_channels(self, layer: nn.Module) -> int:
            return layer.nf

        def get_in_channels(self, layer: nn.Module) -> int:
            return layer.weight.shape[0]

    return Conv1DPruner()


def _trace_inputs(model: nn.Module, example_inputs: Any) -> Any:
    """Example inputs for tracing: a Hugging Face model gets ``use_cache=False`` (its KV cache concatenations
    carry no channel sizes Torch-Pruning can follow, and the cache plays no part in the channel dependencies)."""
    if not isinstance(example_inputs, dict) or "use_cache" in example_inputs:
        return example_inputs
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return example_inputs
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    hf_inside = any(hasattr(getattr(m, "config", None), "use_cache") for m in model.modules())
    if "use_cache" in parameters or (takes_kwargs and hf_inside):
        return {**example_inputs, "use_cache": False}
    return example_inputs


def _is_attention(module: nn.Module) -> bool:
    """An attention module: a head count / size attribute, or (LitGPT's ``CausalSelfAttention``, which keeps its
    head count in ``config``) ``Attention`` in its class name."""
    return any(isinstance(getattr(module, a, None), int) for a in _HEAD_ATTRS) or "Attention" in type(module).__name__


def default_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Conv / Linear (and HF ``Conv1D``) layers except the output head and attention projections.

    The head is the layer named like one (``lm_head``, ``embed_out``, ``head``, ``classifier``, ``score``) wherever
    it sits (LitGPT registers ``lm_head`` before its blocks), else the last layer in module order.
    """
    layers: list[tuple[str, nn.Module]] = []
    attention_children: set[int] = set()
    for _, sub in model.named_modules():
        if _is_attention(sub):
            attention_children.update(id(c) for c in sub.children())
    for fqn, sub in model.named_modules():
        prunable = isinstance(sub, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or _is_hf_conv1d(sub)
        if prunable and id(sub) not in attention_children:
            layers.append((fqn, sub))
    named_heads = [fqn for fqn, _ in layers if fqn.rsplit(".", 1)[-1] in _HEAD_NAMES]
    if named_heads:
        return [(fqn, sub) for fqn, sub in layers if fqn not in named_heads]
    return layers[:-1]


def _out_dim(module: nn.Module) -> int:
    return module.weight.shape[1] if _is_hf_conv1d(module) else module.weight.shape[0]


def _output_rows(module: nn.Module) -> torch.Tensor:
    """The weight as ``(out, rest)``: one row per output channel."""
    weight = module.weight.detach()
    return (weight.t() if _is_hf_conv1d(module) else weight).flatten(1).float()


def prune_structural_(
    model: nn.Module,
    ratio: float,
    example_inputs: Any,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    norm: float = 2,
    importance: Callable[[nn.Module], torch.Tensor] | None = None,
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> StructuralPruningReport:
    """Remove ``ratio`` of the output channels of each prunable layer, in place.

    Each candidate layer's output channels are ranked by the ``norm`` of their weights (zeroed weights
    from mask pruning rank lowest); the lowest are removed with every coupled slice Torch-Pruning's
    dependency graph finds. Groups that touch the residual stream (``nn.Embedding`` / ``nn.LayerNorm``)
    are skipped, so for a transformer the FFN hidden units shrink and the model width stays.

    Args:
        model: the model; changed in place.
        ratio: fraction of output channels to remove per layer, in [0, 1).
        example_inputs: an input ``model(example_inputs)`` accepts (used to trace the graph); a dict is passed
            as keywords (``model(**example_inputs)``, Hugging Face batches).
        optimizer: optimizer(s) rebound to the new parameters, their state sliced. Default: ``None``.
        filter_fn: ``filter_fn(module, fqn)`` chooses root layers. Default: ``None`` = every Conv/Linear
            except the output head and attention projections (:func:`default_candidates`).
        norm: ``p`` of the channel norm. Default: 2.
        importance: ``importance(layer) -> (out_channels,)`` scores overriding the norm. Default: ``None``.
        forward_fn: ``forward_fn(model, example_inputs)`` runs the model for tracing, e.g. the model's own
            ``forward_batch`` on a one-row batch (:func:`example_row` gives both for a model defining one).
            Default: ``None`` (``model(example_inputs)`` / ``model(**example_inputs)``).

    Returns:
        A :class:`StructuralPruningReport`.

    Raises:
        ValueError: ``ratio`` outside [0, 1).

    Example::

        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> prune_structural_(model, 0.5, torch.randn(1, 8)).params_after, model[0].out_features
        (90, 8)
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"`ratio`={ratio!r} must be a float in [0, 1) (fraction of channels to remove per layer)")
    tp = _import_torch_pruning()
    params_before = sum(p.numel() for p in model.parameters())
    report = StructuralPruningReport(params_before, params_before)
    if ratio == 0:
        return report
    if filter_fn is None:
        candidates = default_candidates(model)
    else:
        layer_types = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
        candidates = [
            (n, m)
            for n, m in model.named_modules()
            if (isinstance(m, layer_types) or _is_hf_conv1d(m)) and filter_fn(m, n)
        ]
    was_training = model.training
    model.eval()
    with torch.enable_grad():  # Torch-Pruning traces the graph through autograd
        # a Hugging Face ModelOutput also holds the KV cache (tuples without grad_fn): trace the logits only
        conv1d = {type(m) for m in model.modules() if _is_hf_conv1d(m)}
        graph = tp.DependencyGraph().build_dependency(
            model,
            example_inputs=example_inputs if forward_fn else _trace_inputs(model, example_inputs),
            forward_fn=forward_fn,
            output_transform=output_logits,
            customized_pruners={kind: _hf_conv1d_pruner(tp) for kind in conv1d},
        )
    plans = []
    cut: set[int] = set()  # layers whose output channels an earlier plan already removes (coupled: Llama gate / up)
    for fqn, layer in candidates:
        if id(layer) in cut:
            continue
        channels = _out_dim(layer)
        n_remove = int(round(ratio * channels))
        if n_remove == 0 or n_remove >= channels:
            continue
        if importance is not None:
            scores = importance(layer)
        else:
            scores = torch.linalg.vector_norm(_output_rows(layer), ord=norm, dim=1)  # (out,)
        idxs = torch.topk(scores.cpu(), n_remove, largest=False).indices.sort().values.tolist()
        group = graph.get_pruning_group(layer, graph.get_pruner_of_module(layer).prune_out_channels, idxs=idxs)
        if any(isinstance(dep.target.module, _RESIDUAL_TYPES) for dep, _ in group):
            continue
        if graph.check_pruning_group(group):
            plans.append((fqn, group, n_remove))
            for dep, _ in group:
                pruner = graph.get_pruner_of_module(dep.target.module)
                if pruner is not None and dep.handler == pruner.prune_out_channels:
                    cut.add(id(dep.target.module))

    names_before = dict(model.named_parameters())
    with torch.no_grad():
        saved = _trace_parameters(model)  # each parameter's data now holds its own flat indices
        try:
            for fqn, group, n_remove in plans:
                group.prune()
                report.removed_channels[fqn] = n_remove
        finally:
            kept_index = _restore_parameters(model, saved)
    model.train(was_training)
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or ())
    for opt in optimizers:
        _rebind_optimizer(opt, names_before, dict(model.named_parameters()), kept_index)
    report.params_after = sum(p.numel() for p in model.parameters())
    if not report.removed_channels:
        warnings.warn("prune_structural_ removed nothing (no prunable group found)", NoEffectWarning, stacklevel=2)
    return report


def _trace_parameters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Swap each parameter's data for float64 flat indices so that, after slicing, we know what was kept."""
    saved = {}
    for name, param in model.named_parameters():
        saved[name] = (param, param.data)
        param.data = torch.arange(param.numel(), dtype=torch.float64, device=param.device).view(param.shape)
        param.grad = None
    return saved


def _restore_parameters(
    model: nn.Module, saved: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Put real values back (gathered by the traced indices); return ``{name: kept flat indices}``."""
    kept: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        old_param, old_data = saved.get(name, (None, None))
        if old_data is None:
            continue
        index = param.data.flatten().long()  # (new numel,)
        kept[name] = index
        param.data = old_data.flatten()[index].view(param.shape).clone()
        if old_param is not param:  # Torch-Pruning made a new Parameter: the old one gets its data back
            old_param.data = old_data
    return kept


def _rebind_optimizer(
    optimizer: torch.optim.Optimizer,
    before: dict[str, torch.Tensor],
    after: dict[str, nn.Parameter],
    kept_index: dict[str, torch.Tensor],
) -> None:
    """Point param groups at the new parameters and slice their state like the parameters were sliced."""
    old_to_name = {id(p): n for n, p in before.items()}
    for group in optimizer.param_groups:
        new_params = []
        for old in group["params"]:
            name = old_to_name.get(id(old))
            new = after.get(name) if name is not None else None
            if new is None:
                new_params.append(old)
                continue
            state = optimizer.state.pop(old, None)
            if state:
                optimizer.state[new] = {
                    key: value.flatten()[kept_index[name].to(value.device)].view(new.shape).clone()
                    if isinstance(value, torch.Tensor) and value.shape == old.shape and value.dim() > 0
                    else value
                    for key, value in state.items()
                }
            new_params.append(new)
        group["params"] = new_params


def pruned_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Shapes of every parameter and buffer: save them with the weights to rebuild the pruned architecture."""
    shapes = {name: list(t.shape) for name, t in model.named_parameters()}
    shapes.update({name: list(t.shape) for name, t in model.named_buffers() if t is not None})
    return shapes


_SIZE_ATTRS = {
    nn.Linear: (("out_features", "weight", 0), ("in_features", "weight", 1)),
    nn.Conv1d: (("out_channels", "weight", 0), ("in_channels", "weight", 1)),
    nn.Conv2d: (("out_channels", "weight", 0), ("in_channels", "weight", 1)),
    nn.Conv3d: (("out_channels", "weight", 0), ("in_channels", "weight", 1)),
    nn.BatchNorm1d: (("num_features", "weight", 0),),
    nn.BatchNorm2d: (("num_features", "weight", 0),),
}


@torch.no_grad()
def restore_shapes_(model: nn.Module, shapes: dict[str, Sequence[int]]) -> nn.Module:
    """Resize an unpruned model's parameters/buffers to ``shapes`` so a pruned ``state_dict`` loads into it.

    Example::

        >>> pruned = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> _ = prune_structural_(pruned, 0.5, torch.randn(1, 8))
        >>> fresh = restore_shapes_(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), pruned_shapes(pruned))
        >>> fresh.load_state_dict(pruned.state_dict())
        <All keys matched successfully>
    """
    for fqn, sub in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for pname, param in list(sub.named_parameters(recurse=False)):
            shape = shapes.get(prefix + pname)
            if shape is not None and list(param.shape) != list(shape):
                resized = torch.zeros(shape, dtype=param.dtype, device=param.device)
                setattr(sub, pname, nn.Parameter(resized, param.requires_grad))
        for bname, buf in list(sub.named_buffers(recurse=False)):
            shape = shapes.get(prefix + bname)
            if buf is not None and shape is not None and list(buf.shape) != list(shape):
                setattr(sub, bname, torch.zeros(shape, dtype=buf.dtype, device=buf.device))
        if _is_hf_conv1d(sub):
            sub.nf = sub.weight.shape[1]
        for attr, pname, dim in _SIZE_ATTRS.get(type(sub), ()):
            tensor = getattr(sub, pname, None)
            if tensor is not None:
                size = tensor.shape[dim] * (getattr(sub, "groups", 1) if attr == "in_channels" else 1)
                setattr(sub, attr, size)
    return model


def shrink_to_state_dict_(module: nn.Module, state_dict: dict[str, Any], prefix: str = "") -> dict[str, list[int]]:
    """Give an unpruned ``module`` the smaller shapes of a structurally pruned ``state_dict`` (under
    ``prefix``), so its weights load; anything but a shrink (another model) is left for ``load_state_dict``'s
    size-mismatch error. Returns the shapes changed. Made to be a ``load_state_dict`` pre-hook.

    Example::

        >>> small = nn.Sequential(nn.Linear(8, 4))
        >>> shrink_to_state_dict_(nn.Sequential(nn.Linear(8, 16)), small.state_dict())
        {'0.weight': [4, 8], '0.bias': [4]}
    """
    current = {name: list(t.shape) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    shapes = {
        key[len(prefix) :]: list(value.shape)
        for key, value in state_dict.items()
        if key.startswith(prefix) and isinstance(value, torch.Tensor)
    }
    changed = {name: shape for name, shape in shapes.items() if name in current and current[name] != shape}
    shrunk = all(
        len(shape) == len(current[name]) and all(a <= b for a, b in zip(shape, current[name], strict=True))
        for name, shape in changed.items()
    )
    if changed and shrunk:
        restore_shapes_(module, changed)
        return changed
    return {}


def _first_row(value: Any) -> Any:
    """Every tensor of ``value`` (nested tuples / lists / dicts) cut to its first row, detached."""
    if isinstance(value, torch.Tensor):
        return value[:1].detach().clone() if value.dim() else value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _first_row(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_first_row(v) for v in value)
    return value


def call_forward_batch(model: nn.Module, batch: Any) -> Any:
    """``model.forward_batch(batch)``: the ``forward_fn`` of :func:`prune_structural_` for a model defining one."""
    return model.forward_batch(batch)  # type: ignore[operator]


def example_row(batch: Any, model: nn.Module | None = None) -> Any:
    """One row of a training batch's model inputs (``batch[0]`` of a tuple; every tensor of a dict batch),
    detached: the example :func:`prune_structural_` traces the graph with. When ``model`` defines the
    override point ``forward_batch(batch)`` (:mod:`lightning_lowmem.model_io`), the *whole* batch cut to one
    row instead, to pass with ``forward_fn=``:func:`call_forward_batch`.

    Example::

        >>> batch = (torch.ones(4, 3), torch.zeros(4, 2))
        >>> example_row(batch).shape
        torch.Size([1, 3])
        >>> class TwoInputs(nn.Module):
        ...     def forward_batch(self, batch):
        ...         return self(*batch)
        >>> [t.shape for t in example_row(batch, TwoInputs())]
        [torch.Size([1, 3]), torch.Size([1, 2])]
    """
    if model is not None and has_forward_batch(model):
        return _first_row(batch)
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(x, Mapping):  # Hugging Face dict batch / BatchEncoding: the model is called with keywords
        return {k: v[:1].detach().clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    return x[:1].detach().clone()

"""Build optimizers by name: the single switch that memory-lean optimizers plug into.

Memory per fp32 parameter (state only): ``adamw``/``adam`` 8 B, ``adamw8bit`` ~2 B, ``adamw4bit`` ~1 B,
``adafactor`` ~O(rows + cols) per matrix, ``sgd`` 4 B (momentum). ``adamw_bf16_sr`` is AdamW for bf16
weights (``precision="bf16-true"``) with stochastic rounding of the update, so small updates are not lost;
``adafactor_bf16_sr`` is Adafactor stepped in float32 per parameter and stored with stochastic rounding
(:class:`~lightning_lowmem.functional.stochastic_rounding.StochasticRounding`): almost no state at all.
Adafactor's ``lr`` is a step size *relative* to each parameter's RMS (default 0.01; 0.05 on charlm); its
``eps1`` defaults to float32's machine epsilon for every parameter dtype (torch uses the parameter dtype's,
which for bf16 weights floors the variance estimate and stalls training).
``*_in_backward`` names step each parameter inside backward and free its gradient at once
(:class:`~lightning_lowmem.functional.in_backward.OptimizerInBackward`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def _torchao_optim(class_name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        import torchao.optim  # lazy: importing torchao prints warnings on CPU

        return getattr(torchao.optim, class_name)(params, **kw)

    return build


def _adamw_bf16_sr(params: Any, **kw: Any) -> torch.optim.Optimizer:
    import torchao.optim

    return torchao.optim._AdamW(params, bf16_stochastic_round=True, **kw)


def _adafactor(params: Any, **kw: Any) -> torch.optim.Optimizer:
    kw.setdefault("lr", 1e-2)
    # torch's eps1 default is the *parameter* dtype's epsilon: 0.0078 for bf16 weights, whose square then
    # floors every variance estimate and shrinks most updates to nothing. float32's epsilon for all dtypes.
    kw.setdefault("eps", (torch.finfo(torch.float32).eps, 1e-3))
    return torch.optim.Adafactor(params, **kw)


def _stochastic_rounding(inner: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.stochastic_rounding import StochasticRounding

        return StochasticRounding(params, **{"inner": inner, **kw})

    return build


def _in_backward(inner: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.in_backward import OptimizerInBackward

        return OptimizerInBackward(params, **{"inner": inner, **kw})  # an `inner` argument overrides the name's

    return build


_BUILDERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
    "adam": lambda params, **kw: torch.optim.Adam(params, **kw),
    "sgd": lambda params, **kw: torch.optim.SGD(params, **{"momentum": 0.9, **kw}),
    "adamw8bit": _torchao_optim("AdamW8bit"),
    "adamw4bit": _torchao_optim("AdamW4bit"),
    "adafactor": _adafactor,
    "adamw_bf16_sr": _adamw_bf16_sr,
    "adafactor_bf16_sr": _stochastic_rounding("adafactor"),
    "adamw_in_backward": _in_backward("adamw"),
    "adamw8bit_in_backward": _in_backward("adamw8bit"),
    "adamw4bit_in_backward": _in_backward("adamw4bit"),
    "sgd_in_backward": _in_backward("sgd"),
    "adafactor_in_backward": _in_backward("adafactor"),
    "adafactor_bf16_sr_in_backward": _in_backward("adafactor_bf16_sr"),
}


def available_optimizers() -> list[str]:
    """Names accepted by :func:`build_optimizer`."""
    return sorted(_BUILDERS)


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Create the optimizer called ``name`` over ``params``.

    Args:
        name: one of :func:`available_optimizers` (case-insensitive).
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        **kwargs: optimizer arguments (``lr``, ``weight_decay``, ...).

    Returns:
        The optimizer. ``*_in_backward`` names return an
        :class:`~lightning_lowmem.functional.in_backward.OptimizerInBackward` (hooks already registered).

    Raises:
        ValueError: ``name`` is unknown.

    Example::

        >>> opt = build_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> type(opt).__name__
        'AdamW'
        >>> type(build_optimizer("adafactor", torch.nn.Linear(2, 2).parameters())).__name__
        'Adafactor'
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"`optimizer`={name!r} is unknown; choose one of {available_optimizers()}")
    if kwargs.get("weight_decay", 0) is None:
        kwargs.pop("weight_decay")
    return _BUILDERS[key](params, **kwargs)

"""Build optimizers by name: the single switch that memory-lean optimizers plug into.

Memory per fp32 parameter (state only): ``adamw``/``adam`` 8 B, ``adamw8bit`` ~2 B, ``adamw4bit`` ~1 B,
``adafactor`` ~O(rows + cols) per matrix, ``sgd`` 4 B (momentum). ``adamw_bf16_sr`` is AdamW for bf16
weights (``precision="bf16-true"``) with stochastic rounding of the update, so small updates are not lost;
``adafactor_bf16_sr`` is Adafactor stepped in float32 per parameter and stored with stochastic rounding
(:class:`~lightning_lowmem.functional.optimizers.stochastic_rounding.StochasticRounding`): almost no state at all.
Adafactor's ``lr`` is a step size *relative* to each parameter's RMS (default 0.01; 0.05 on charlm); its
``eps1`` defaults to float32's machine epsilon for every parameter dtype (torch uses the parameter dtype's,
which for bf16 weights floors the variance estimate and stalls training).
``*_in_backward`` names step each parameter inside backward and free its gradient at once
(:class:`~lightning_lowmem.functional.optimizers.in_backward.OptimizerInBackward`).

Hyperparameters are checked against the chosen optimizer's own signature (:func:`optimizer_arguments`,
:func:`check_optimizer_kwargs`): a typo fails when the optimizer is named, with a did-you-mean. Every
optimizer :func:`build_optimizer` returns saves low-bit state as plain tensors and refuses, before anything
is applied, state written by an optimizer of another kind (:func:`state_layout`,
:mod:`~lightning_lowmem.functional.optimizers.state`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable

import torch

from lightning_lowmem.functional.optimizers.state import (
    flatten_low_bit_state,
    low_bit_kinds,
    normalize_loaded_state,
    state_family,
)


def _tensor_lr(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torchao steps with ``lr`` as a tensor: keep it one after loading a state saved with a float ``lr``
    (e.g. by the ``*_in_backward`` wrapper, whose groups LR schedulers edit as floats)."""

    def after_load(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)

    optimizer.register_load_state_dict_post_hook(after_load)
    return optimizer


def _torchao_optim(class_name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        import torchao.optim  # lazy: importing torchao prints warnings on CPU

        return _tensor_lr(getattr(torchao.optim, class_name)(params, **kw))

    return build


def _adamw_bf16_sr(params: Any, **kw: Any) -> torch.optim.Optimizer:
    import torchao.optim

    from lightning_lowmem.functional.optimizers.stochastic_rounding import seed_rounding_draws

    # torchao rounds with the global generator, which no checkpoint holds: seed it from the step count
    return seed_rounding_draws(_tensor_lr(torchao.optim._AdamW(params, bf16_stochastic_round=True, **kw)))


def _adafactor(params: Any, **kw: Any) -> torch.optim.Optimizer:
    kw.setdefault("lr", 1e-2)
    # torch's eps1 default is the *parameter* dtype's epsilon: 0.0078 for bf16 weights, whose square then
    # floors every variance estimate and shrinks most updates to nothing. float32's epsilon for all dtypes.
    kw.setdefault("eps", (torch.finfo(torch.float32).eps, 1e-3))
    return torch.optim.Adafactor(params, **kw)


def _stochastic_rounding(inner: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.optimizers.stochastic_rounding import StochasticRounding

        return StochasticRounding(params, inner=inner, **kw)

    return build


def _in_backward(inner: str) -> Callable[..., torch.optim.Optimizer]:
    def build(params: Any, **kw: Any) -> torch.optim.Optimizer:
        from lightning_lowmem.functional.optimizers.in_backward import OptimizerInBackward

        return OptimizerInBackward(params, inner=inner, **kw)

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


# torchao's optimizer arguments (checked against torchao's signatures by the tests): listed here so that
# naming an optimizer does not import torchao (slow, and it prints warnings on CPU)
_TORCHAO_ADAMW_ARGUMENTS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "block_size", "bf16_stochastic_round")
_ARGUMENTS: dict[str, Callable[[], Iterable[str]]] = {
    "adamw": lambda: _signature_names(torch.optim.AdamW),
    "adam": lambda: _signature_names(torch.optim.Adam),
    "sgd": lambda: _signature_names(torch.optim.SGD),
    "adafactor": lambda: _signature_names(torch.optim.Adafactor),
    "adamw8bit": lambda: _TORCHAO_ADAMW_ARGUMENTS,
    "adamw4bit": lambda: _TORCHAO_ADAMW_ARGUMENTS,
    "adamw_bf16_sr": lambda: [a for a in _TORCHAO_ADAMW_ARGUMENTS if a not in ("block_size", "bf16_stochastic_round")],
    "adafactor_bf16_sr": lambda: _signature_names(torch.optim.Adafactor),
}


def _signature_names(target: Callable[..., Any]) -> list[str]:
    parameters = inspect.signature(target).parameters.values()
    return [p.name for p in parameters if p.name != "params" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def available_optimizers() -> list[str]:
    """Names accepted by :func:`build_optimizer`."""
    return sorted(_BUILDERS)


def _check_name(name: Any, argument: str = "optimizer") -> str:
    key = name.lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        close = difflib.get_close_matches(str(name).lower(), available_optimizers(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"`{argument}`={name!r} is unknown; choose one of {available_optimizers()}{hint}")
    return key


@functools.lru_cache(maxsize=None)
def optimizer_arguments(name: str) -> tuple[str, ...]:
    """The keyword arguments optimizer ``name`` accepts (its constructor's, ``params`` excepted).

    ``*_in_backward`` names accept their inner optimizer's arguments.

    Raises:
        ValueError: ``name`` is unknown.

    Example::

        >>> optimizer_arguments("adafactor")
        ('lr', 'beta2_decay', 'eps', 'd', 'weight_decay', 'foreach', 'maximize')
    """
    key = _check_name(name)
    return tuple(_ARGUMENTS[key.removesuffix("_in_backward")]())


def check_optimizer_kwargs(name: str, kwargs: dict[str, Any], owner: str = "build_optimizer") -> None:
    """Raise when a key of ``kwargs`` is not an argument of optimizer ``name``.

    Args:
        name: one of :func:`available_optimizers`.
        kwargs: the hyperparameters to check.
        owner: who received them, for the message. Default: ``"build_optimizer"``.

    Raises:
        ValueError: an unknown name or argument; the message names it, a close match and every accepted name.

    Example::

        >>> check_optimizer_kwargs("adamw8bit", {"betaz": (0.9, 0.99)})
        Traceback (most recent call last):
        ...
        ValueError: build_optimizer: `betaz` is not an argument of optimizer 'adamw8bit'; did you mean 'betas'? \
'adamw8bit' accepts: lr, betas, eps, weight_decay, amsgrad, block_size, bf16_stochastic_round
    """
    accepted = optimizer_arguments(name)
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(
                f"{owner}: `{key}` is not an argument of optimizer {name.lower()!r}{hint} "
                f"{name.lower()!r} accepts: {', '.join(accepted)}"
            )


def state_layout(name: str) -> tuple[str, str]:
    """What optimizer ``name`` keeps per parameter: (family, precision), e.g. ``("adam", "8bit")``.

    Two names with the same layout can continue each other's state (``adamw8bit`` and
    ``adamw8bit_in_backward``; ``adafactor`` and ``adafactor_bf16_sr``).

    Example::

        >>> state_layout("adamw4bit_in_backward"), state_layout("adafactor_bf16_sr")
        (('adam', '4bit'), ('adafactor', 'float'))
    """
    base = _check_name(name).removesuffix("_in_backward")
    family = "adafactor" if base.startswith("adafactor") else "sgd" if base == "sgd" else "adam"
    precision = "8bit" if "8bit" in base else "4bit" if "4bit" in base else "float"
    return family, precision


def check_loaded_state(name: str, state_dict: dict[str, Any]) -> None:
    """Raise when ``state_dict`` holds per-parameter state that optimizer ``name`` cannot continue from.

    Raises:
        ValueError: a parameter's state is of another family (e.g. AdamW moments into Adafactor) or in a
            low-bit format ``name`` does not use; nothing has been loaded yet.
    """
    family, precision = state_layout(name)
    for index, state in (state_dict.get("state") or {}).items():
        if not isinstance(state, dict) or not state:
            continue
        found, kinds = state_family(state), low_bit_kinds(state)
        if found != family or kinds - {precision}:
            described = f"{found} state" + (f" in {'/'.join(sorted(kinds))}" if kinds else "")
            raise ValueError(
                f"optimizer state to load does not fit optimizer {name!r}: parameter {index} holds "
                f"{sorted(k for k in state if isinstance(k, str))} ({described}), while {name!r} keeps "
                f"{family} state{'' if precision == 'float' else ' in ' + precision}. The checkpoint was written with "
                f"another optimizer: resume with that one, or start from its weights only "
                f"(e.g. `YourModule.load_from_checkpoint(path)`)."
            )


def attach_state_hooks(optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
    """Make ``optimizer.state_dict()`` store low-bit state as plain tensors, and ``load_state_dict`` undo
    that, drop the :func:`~lightning_lowmem.functional.optimizers.state.mark_state_dict` marker and refuse
    state of another layout (:func:`check_loaded_state`). Idempotent; returns ``optimizer``."""
    if getattr(optimizer, "_lowmem_state_hooks", None) is None:
        optimizer.register_state_dict_post_hook(lambda _opt, state_dict: flatten_low_bit_state(state_dict))

        def before_load(_opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
            state_dict = normalize_loaded_state(state_dict)
            check_loaded_state(name, state_dict)
            return state_dict

        optimizer.register_load_state_dict_pre_hook(before_load)
        optimizer._lowmem_state_hooks = name  # type: ignore[attr-defined]
    return optimizer
def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """Create the optimizer called ``name`` over ``params``.

    Args:
        name: one of :func:`available_optimizers` (case-insensitive).
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        **kwargs: optimizer arguments (``lr``, ``weight_decay``, ...).

    Returns:
        The optimizer. ``*_in_backward`` names return an
        :class:`~lightning_lowmem.functional.optimizers.in_backward.OptimizerInBackward` (hooks already registered).

    Raises:
        ValueError: ``name`` is unknown, or a keyword is not an argument of that optimizer.

    Example::

        >>> opt = build_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> type(opt).__name__
        'AdamW'
        >>> type(build_optimizer("adafactor", torch.nn.Linear(2, 2).parameters())).__name__
        'Adafactor'
    """
    key = _check_name(name)
    if kwargs.get("weight_decay", 0) is None:
        kwargs.pop("weight_decay")
    check_optimizer_kwargs(key, kwargs)
    return attach_state_hooks(_BUILDERS[key](params, **kwargs), key)

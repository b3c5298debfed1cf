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
from typing import Any, Callable, Iterable

import torch

from lightning_lowmem.functional.optimizers import in_backward, plain, stochastic_rounding
from lightning_lowmem.functional.optimizers.plain import attach_state_hooks, check_loaded_state

__all__ = [
    "attach_state_hooks",
    "available_optimizers",
    "build_optimizer",
    "check_loaded_state",
    "check_optimizer_kwargs",
    "optimizer_arguments",
    "state_layout",
]


_BUILDERS: dict[str, plain.Builder] = {**plain.BUILDERS, **stochastic_rounding.BUILDERS, **in_backward.BUILDERS}
_ARGUMENTS: dict[str, Callable[[], Iterable[str]]] = {
    **plain.ARGUMENTS,
    **stochastic_rounding.ARGUMENTS,
    **in_backward.ARGUMENTS,
}


def available_optimizers() -> list[str]:
    """Names accepted by :func:`build_optimizer`."""
    return sorted(_BUILDERS)


def check_optimizer_name(name: Any, argument: str = "optimizer") -> str:
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
    key = check_optimizer_name(name)
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
    plain.check_arguments(name, optimizer_arguments(name), kwargs, owner)


def state_layout(name: str) -> tuple[str, str]:
    """What optimizer ``name`` keeps per parameter: (family, precision), e.g. ``("adam", "8bit")``.

    Two names with the same layout can continue each other's state (``adamw8bit`` and
    ``adamw8bit_in_backward``; ``adafactor`` and ``adafactor_bf16_sr``).

    Example::

        >>> state_layout("adamw4bit_in_backward"), state_layout("adafactor_bf16_sr")
        (('adam', '4bit'), ('adafactor', 'float'))
    """
    return plain.layout(check_optimizer_name(name))


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
    return plain.build_from(_BUILDERS, _ARGUMENTS, check_optimizer_name(name), params, **kwargs)

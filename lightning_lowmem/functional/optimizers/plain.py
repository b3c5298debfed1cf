"""The plain optimizers (torch's and torchao's, no wrapper) and what every optimizer of the package shares:
argument checking against the optimizer's own signature, the saved-state hooks, and building with both.

The wrappers (:mod:`~lightning_lowmem.functional.optimizers.stochastic_rounding`,
:mod:`~lightning_lowmem.functional.optimizers.in_backward`) build their inner optimizers from here, and the
catalog (:mod:`~lightning_lowmem.functional.optimizers.catalog`) joins all of them under one name table, so
no module imports back the one that imports it.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Iterable

import torch

from lightning_lowmem.functional.optimizers.state import (
    flatten_low_bit_state,
    low_bit_kinds,
    normalize_loaded_state,
    state_family,
)

Builder = Callable[..., torch.optim.Optimizer]


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
        from lightning_lowmem._versions import require

        require("torchao", f"torchao's {class_name}")
        import torchao.optim  # lazy: importing torchao prints warnings on CPU

        return _tensor_lr(getattr(torchao.optim, class_name)(params, **kw))

    return build


def _adafactor(params: Any, **kw: Any) -> torch.optim.Optimizer:
    kw.setdefault("lr", 1e-2)
    # torch's eps1 default is the *parameter* dtype's epsilon: 0.0078 for bf16 weights, whose square then
    # floors every variance estimate and shrinks most updates to nothing. float32's epsilon for all dtypes.
    kw.setdefault("eps", (torch.finfo(torch.float32).eps, 1e-3))
    return torch.optim.Adafactor(params, **kw)


BUILDERS: dict[str, Builder] = {
    "adamw": lambda params, **kw: torch.optim.AdamW(params, **kw),
    "adam": lambda params, **kw: torch.optim.Adam(params, **kw),
    "sgd": lambda params, **kw: torch.optim.SGD(params, **{"momentum": 0.9, **kw}),
    "adamw8bit": _torchao_optim("AdamW8bit"),
    "adamw4bit": _torchao_optim("AdamW4bit"),
    "adafactor": _adafactor,
}


# torchao's optimizer arguments (checked against torchao's signatures by the tests): listed here so that
# naming an optimizer does not import torchao (slow, and it prints warnings on CPU)
_TORCHAO_ADAMW_ARGUMENTS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "block_size", "bf16_stochastic_round")
ARGUMENTS: dict[str, Callable[[], Iterable[str]]] = {
    "adamw": lambda: _signature_names(torch.optim.AdamW),
    "adam": lambda: _signature_names(torch.optim.Adam),
    "sgd": lambda: _signature_names(torch.optim.SGD),
    "adafactor": lambda: _signature_names(torch.optim.Adafactor),
    "adamw8bit": lambda: _TORCHAO_ADAMW_ARGUMENTS,
    "adamw4bit": lambda: _TORCHAO_ADAMW_ARGUMENTS,
}


def _signature_names(target: Callable[..., Any]) -> list[str]:
    parameters = inspect.signature(target).parameters.values()
    return [p.name for p in parameters if p.name != "params" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def layout(name: str) -> tuple[str, str]:
    """What optimizer ``name`` keeps per parameter: (family, precision), e.g. ``("adam", "8bit")``; read from
    the name alone (the registry's ``state_layout`` checks the name first).

    Two names with the same layout can continue each other's state (``adamw8bit`` and
    ``adamw8bit_in_backward``; ``adafactor`` and ``adafactor_bf16_sr``).

    Example::

        >>> layout("adamw4bit_in_backward"), layout("adafactor_bf16_sr")
        (('adam', '4bit'), ('adafactor', 'float'))
    """
    base = name.lower().removesuffix("_in_backward")
    family = "adafactor" if base.startswith("adafactor") else "sgd" if base == "sgd" else "adam"
    precision = "8bit" if "8bit" in base else "4bit" if "4bit" in base else "float"
    return family, precision


def check_loaded_state(name: str, state_dict: dict[str, Any]) -> None:
    """Raise when ``state_dict`` holds per-parameter state that optimizer ``name`` cannot continue from.

    Raises:
        ValueError: a parameter's state is of another family (e.g. AdamW moments into Adafactor) or in a
            low-bit format ``name`` does not use; nothing has been loaded yet.
    """
    family, precision = layout(name)
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


def check_arguments(name: str, accepted: Iterable[str], kwargs: dict[str, Any], owner: str) -> None:
    """Raise when a key of ``kwargs`` is not in ``accepted`` (the arguments of optimizer ``name``), with a
    did-you-mean and the accepted list; ``owner`` (who received them) starts the message."""
    accepted = tuple(accepted)
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(
                f"{owner}: `{key}` is not an argument of optimizer {name.lower()!r}{hint} "
                f"{name.lower()!r} accepts: {', '.join(accepted)}"
            )


def build_from(
    builders: dict[str, Builder],
    arguments: dict[str, Callable[[], Iterable[str]]],
    name: str,
    params: Iterable[Any],
    owner: str = "build_optimizer",
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (a key of ``builders``) over ``params``: ``kwargs`` checked against
    ``arguments[name]``, ``weight_decay=None`` dropped, the saved-state hooks attached."""
    if kwargs.get("weight_decay", 0) is None:
        kwargs.pop("weight_decay")
    check_arguments(name, arguments[name](), kwargs, owner)
    return attach_state_hooks(builders[name](params, **kwargs), name)

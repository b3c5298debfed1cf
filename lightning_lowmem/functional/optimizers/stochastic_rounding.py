"""Stochastic rounding: train bfloat16 weights with any torch optimizer without losing small updates.

With ``precision="bf16-true"`` the weights themselves are bfloat16 (8 significant bits): an update
smaller than half a unit in the last place is rounded away, every step, and training stalls (a
relative-step optimizer such as Adafactor loses most of its updates). :class:`StochasticRounding` steps
each bfloat16 parameter in float32 with a plain torch optimizer and writes the result back rounded up
or down at random, with the probability of the exact value's position between the two neighbours, so
the rounding error is zero on average and small updates add up.

The float32 copy is made per parameter for the step only, so the extra memory is one parameter's float32
weight and gradient at a time, and the inner optimizer's state stays float32 (Adafactor's factored
state is tiny). Float32 parameters are stepped directly.

The random draws are a pure function of the optimizer's own step count (:func:`rounding_seed`), never of
the global random state: Lightning does not save that state in checkpoints, so a run resumed from one
would otherwise round differently from the uninterrupted run. With the step count in the optimizer's
state, a resumed run draws exactly what the uninterrupted one drew, and the global random state is left
as it was (dropout and data shuffling are unaffected by the rounding).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch

from lightning_lowmem._compat.fake_mode import is_fake
from lightning_lowmem.functional.optimizers import plain

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def rounding_seed(step: int, index: int = 0, offset: int = 0) -> int:
    """The seed of the rounding draws of parameter ``index`` at optimizer step ``step``.

    Args:
        step: the optimizer step the draws are for (what the optimizer's state records).
        index: the parameter's position in the optimizer. Default: 0.
        offset: distinguishes optimizers stepping one parameter each (optimizer-in-backward). Default: 0.

    Returns:
        A seed in ``[0, 2**63)``; different steps and parameters get unrelated streams.

    Example::

        >>> rounding_seed(3, 1) == rounding_seed(3, 1) != rounding_seed(4, 1)
        True
    """
    return (step * _MIX[0] + index * _MIX[1] + offset * _MIX[2]) % (1 << 63)


def _state_step(state: dict[str, Any]) -> int | None:
    """The step count one parameter's optimizer state records (``None`` if it keeps none, e.g. SGD)."""
    step = state.get("step")
    if step is None:
        return None
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def seed_rounding_draws(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make an optimizer that rounds with the global random generator (torchao's ``bf16_stochastic_round``)
    draw from a stream seeded by its own step count, restoring the global random state afterwards.

    A resumed run then rounds exactly as the uninterrupted one (the step count is in the optimizer's
    state; the global random state is in no checkpoint). Set ``optimizer.seed_offset`` to tell apart
    optimizers of one parameter each. Returns ``optimizer`` (its ``step`` wrapped).
    """
    step = optimizer.step
    optimizer.seed_offset = 0  # type: ignore[attr-defined]

    @functools.wraps(step)
    def seeded_step(*args: Any, **kwargs: Any) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(is_fake(p) for p in params):  # a memory estimate: values do not matter, devices may not exist
            return step(*args, **kwargs)
        counts = (_state_step(optimizer.state[p]) for p in params if p in optimizer.state)
        count = next((c for c in counts if c is not None), 0)
        seed = rounding_seed(count, 0, optimizer.seed_offset)  # type: ignore[attr-defined]
        cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            for index in cuda:
                torch.cuda.default_generators[index].manual_seed(seed)
            return step(*args, **kwargs)

    optimizer.step = seeded_step  # type: ignore[method-assign]
    return optimizer


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Write float32 ``src`` into bfloat16 ``dst``, rounding each element up or down at random.

    The 16 low bits of ``src``'s float32 pattern that bfloat16 drops are compared to 16 random bits:
    an element is rounded away from zero with probability ``dropped / 2**16``, so ``E[dst] == src``.

    Args:
        dst: bfloat16 tensor written in place.
        src: float32 tensor of the same shape (left unchanged).
        generator: optional random generator (reproducible rounding).

    Returns:
        ``dst``.

    Raises:
        TypeError: ``dst`` is not bfloat16 or ``src`` not float32.

    Example::

        >>> src = torch.full((10_000,), 1.0 + 2 ** -10)     # between two bf16 neighbours: 1 and 1 + 2**-7
        >>> dst = stochastic_round_(torch.empty(10_000, dtype=torch.bfloat16), src)
        >>> sorted(dst.unique().tolist()), round(dst.float().mean().item(), 3)
        ([1.0, 1.0078125], 1.001)
    """
    if dst.dtype != torch.bfloat16 or src.dtype != torch.float32:
        raise TypeError(f"stochastic_round_ writes float32 into bfloat16; got {src.dtype} -> {dst.dtype}")
    bits = src.contiguous().view(torch.int32)
    numel = bits.numel()
    # 16 random bits per element, drawn 64 at a time (4x fewer draws than one randint per element):
    # random_() leaves bit 63 at 0, so the top 16-bit lane is XORed with the bottom one (still uniform)
    draws = torch.empty((numel + 3) // 4, dtype=torch.int64, device=bits.device).random_(generator=generator)
    draws.bitwise_xor_(draws << 48)
    noise = draws.view(torch.int16)[:numel].view(bits.shape).to(torch.int32).bitwise_and_(0xFFFF)
    # adding to the magnitude bits and truncating rounds away from zero with probability dropped / 2**16
    # (the sign bit is separate in IEEE floats); the truncated float32 converts to bfloat16 exactly
    rounded = noise.add_(bits).bitwise_and_(-65536)
    return dst.copy_(rounded.view(torch.float32))


class StochasticRounding(torch.optim.Optimizer):
    """Step bfloat16 parameters in float32 with ``inner`` and store them with stochastic rounding.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        inner: a plain optimizer name for :func:`~lightning_lowmem.functional.optimizers.build_optimizer`
            (not a low-bit, stochastic-rounding or in-backward one). Default: ``"adafactor"``.
        **kwargs: arguments for the inner optimizer (``lr``, ``weight_decay``, ...).

    Raises:
        ValueError: ``inner`` is unknown or not a plain optimizer.
        TypeError: a parameter is neither bfloat16 nor float32 when it is stepped.

    The wrapper's ``param_groups`` are the ones LR schedulers edit (copied to the inner optimizer at each
    step); ``state_dict`` holds the inner float32 state, and ``load_state_dict`` restores it without a
    detour through bfloat16. Each parameter's rounding draws are seeded by :func:`rounding_seed` from
    the step its inner state records, so a resumed run rounds as the uninterrupted one (an inner
    optimizer without a step count, SGD, counts this wrapper's steps, which restart on resume).

    Example::

        >>> layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
        >>> opt = StochasticRounding(layer.parameters(), inner="adafactor", lr=0.05)
        >>> layer(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> before = layer.weight.detach().clone()
        >>> opt.step()
        >>> bool((layer.weight != before).any()), opt.state[layer.weight]["row_var"].dtype
        (True, torch.float32)
    """

    _PLAIN = ("adamw", "adam", "sgd", "adafactor")

    def __init__(self, params: Iterable[Any], inner: str = "adafactor", **kwargs: Any) -> None:
        if not isinstance(inner, str) or inner.lower() not in self._PLAIN:
            raise ValueError(f"`inner`={inner!r} cannot be stochastically rounded; choose one of {list(self._PLAIN)}")
        self.inner_name = inner.lower()
        plain.check_arguments(self.inner_name, plain.ARGUMENTS[self.inner_name](), kwargs, f"{self.inner_name}_bf16_sr")
        super().__init__(params, dict(kwargs))
        self._proxies: dict[torch.Tensor, torch.nn.Parameter] = {}
        inner_groups = []
        for group in self.param_groups:
            proxies = []
            for param in group["params"]:
                proxy = torch.nn.Parameter(self._empty(param), requires_grad=param.requires_grad)
                self._proxies[param] = proxy
                proxies.append(proxy)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": proxies})
        self.inner = plain.build_from(plain.BUILDERS, plain.ARGUMENTS, self.inner_name, inner_groups)
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in inner_group.items():  # the inner defaults (eps, betas, ...) become visible here
                group.setdefault(key, value)
        self.defaults = {**self.inner.defaults, **self.defaults}
        self.seed_offset = 0  # set per parameter by OptimizerInBackward
        self._steps = 0  # the step count of inner optimizers that keep none
        self._link_state()
        plain.attach_state_hooks(self, self.inner_name)  # the inner optimizer's state layout

    @staticmethod
    def _empty(param: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32, device=param.device)

    def _link_state(self) -> None:
        # one dict per parameter, shared by the wrapper (keyed by the parameter: what state_dict() walks)
        # and the inner optimizer (keyed by the float32 proxy: what its step reads and writes)
        for param, proxy in self._proxies.items():
            self.state[param] = self.inner.state[proxy]

    def _sync_groups(self) -> None:
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every parameter that has a gradient (float32 work copy, then stochastic rounding)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups()
        self._steps += 1
        rounded: list[tuple[int, torch.Tensor, torch.nn.Parameter]] = []
        for index, (param, proxy) in enumerate(self._proxies.items()):
            if param.grad is None:
                continue
            if param.dtype == torch.float32:
                proxy.data, proxy.grad = param.data, param.grad  # stepped in place
            elif param.dtype == torch.bfloat16:
                proxy.data, proxy.grad = param.float(), param.grad.float()
                rounded.append((index, param, proxy))
            else:
                raise TypeError(f"StochasticRounding steps bfloat16 or float32 parameters, got {param.dtype}")
        self.inner.step()
        for index, param, proxy in rounded:
            generator = None  # a memory estimate's fake tensors (maybe "cuda" on a host without one): no draws
            if not is_fake(param):
                step = _state_step(self.inner.state[proxy])
                seed = rounding_seed(self._steps if step is None else step, index, self.seed_offset)
                generator = torch.Generator(param.device).manual_seed(seed)
            stochastic_round_(param.data, proxy.data, generator)
        for param, proxy in self._proxies.items():
            if proxy.grad is not None or proxy.numel():
                proxy.grad, proxy.data = None, self._empty(param)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyperparameters into the wrapper and the float32 state into the inner optimizer."""
        from lightning_lowmem.functional.optimizers.state import normalize_loaded_state

        state_dict = normalize_loaded_state(state_dict)
        super().load_state_dict(state_dict)  # param_groups (lr, ...); its state copy is cast to bf16: replaced
        self.inner.load_state_dict(state_dict)  # same layout, keyed by the float32 proxies: stays float32
        self._link_state()


def _adamw_bf16_sr(params: Any, **kw: Any) -> torch.optim.Optimizer:
    import torchao.optim  # lazy: importing torchao prints warnings on CPU

    # torchao rounds with the global generator, which no checkpoint holds: seed it from the step count
    return seed_rounding_draws(plain._tensor_lr(torchao.optim._AdamW(params, bf16_stochastic_round=True, **kw)))


BUILDERS: dict[str, plain.Builder] = {
    "adamw_bf16_sr": _adamw_bf16_sr,
    "adafactor_bf16_sr": lambda params, **kw: StochasticRounding(params, inner="adafactor", **kw),
}
"""The stochastically rounded optimizers, by registry name."""

ARGUMENTS: dict[str, Callable[[], Iterable[str]]] = {
    "adamw_bf16_sr": lambda: [
        a for a in plain._TORCHAO_ADAMW_ARGUMENTS if a not in ("block_size", "bf16_stochastic_round")
    ],
    "adafactor_bf16_sr": plain.ARGUMENTS["adafactor"],
}

"""Optimizer-in-backward: step each parameter as soon as its gradient is ready, then free that gradient.

Every parameter gets its own small inner optimizer, stepped from a
``Tensor.register_post_accumulate_grad_hook``; the gradient is dropped right after, so at most about one
parameter's gradient is alive at a time instead of the whole model's.

The wrapper is a regular ``torch.optim.Optimizer`` whose ``step(closure)`` only runs the closure (the
backward inside it does the real steps). That keeps Lightning's automatic optimization loop, LR
schedulers (the wrapper's ``param_groups`` are the ones read at each inner step) and checkpointing
(``state_dict`` / ``load_state_dict`` hold every inner optimizer's state) working unchanged. The wrapper's
param groups carry the inner optimizer's full hyperparameters (``betas``, ``eps``...), and its saved state
has the inner optimizer's layout, so a checkpoint resumes bit-identically under the same name.

Adafactor inside backward writes a matrix's update into its gradient, which is dropped right after
(:class:`InPlaceAdafactor`): torch's step makes a second tensor of the matrix's size (the variance estimate), so
a model's largest matrix (a 128k x 4096 output head: 1 GiB in bf16) had two copies of its size alive at once.

Limits: gradient accumulation and gradient clipping cannot work (there is never a full gradient);
every backward is an optimizer step.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable

import torch

from lightning_lowmem.functional.optimizers import plain, stochastic_rounding

SLICE_BYTES = 32 * 2**20
"""The most bytes of the variance estimate :class:`InPlaceAdafactor` holds at once (a slice of rows)."""


class InPlaceAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` whose step of a matrix writes the update into the gradient.

    Every number is computed as torch's single-tensor Adafactor computes it (the same ops on the same values, in
    the same order), so the weights after a step are bit-identical; only the variance estimate
    ``row_var @ col_var`` is made a slice of rows at a time (at most :data:`SLICE_BYTES`) and multiplied into the
    gradient in place, instead of as one tensor of the matrix's size. The gradient then holds the update, so this
    is only for a gradient that is dropped after the step (:class:`OptimizerInBackward` drops it). Parameters of
    another rank step as torch steps them. The state (``step``, ``row_var``, ``col_var``) is torch's.

    Example::

        >>> weight = torch.nn.Parameter(torch.randn(6, 4))
        >>> weight.grad = torch.randn(6, 4)
        >>> InPlaceAdafactor([weight], lr=0.01).step()
        >>> sorted(InPlaceAdafactor([weight]).state_dict()["param_groups"][0])[:3]
        ['beta2_decay', 'd', 'eps']
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step; ``closure`` (forward + backward) runs first when given."""
        if not all(p.grad.dim() == 2 for g in self.param_groups for p in g["params"] if p.grad is not None):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_matrix(param, group)
        return loss

    def _step_matrix(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        grad = param.grad
        if grad.is_sparse or torch.is_complex(param):
            raise RuntimeError(f"Adafactor does not support sparse gradients or complex parameters, got {grad.dtype}")
        state = self.state[param]
        if not state:  # torch's state, as its _init_group makes it
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=scalar)
            state["row_var"] = grad.new_zeros((grad.shape[0], 1))
            state["col_var"] = grad.new_zeros((1, grad.shape[1]))
        lr = float(group["lr"])
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
        if group["maximize"]:
            grad.neg_()
        step_t, row_var, col_var = state["step"], state["row_var"], state["col_var"]
        step_t += 1
        step_float = step_t.item()
        one_minus_beta2_t = step_float ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step_float**0.5))
        alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2_t)
        col_var.lerp_(_column_norm(grad).square_().div_(grad.size(-2)), one_minus_beta2_t)
        row_var_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
        # slices of a multiple of 64 elements: a CPU kernel's vectorized loop then splits each slice as it splits
        # the whole matrix (its scalar remainder loop rounds bf16 rsqrt differently)
        align = 64 // math.gcd(grad.shape[1], 64)
        rows = max(align, SLICE_BYTES // max(1, grad.shape[1] * grad.element_size()) // align * align)
        for start in range(0, grad.shape[0], rows):  # update = rsqrt(clamp(var_estimate)) * grad, a slice at a time
            var_estimate = row_var[start : start + rows] @ col_var  # (rows, cols)
            var_estimate.div_(row_var_mean).clamp_(min=eps1 * eps1).rsqrt_()
            grad[start : start + rows].mul_(var_estimate)
            del var_estimate
        denom = max(1.0, grad.norm(2).item() / ((grad.numel() ** 0.5) * group["d"]))
        param.add_(grad, alpha=-alpha / denom)


_LOOP_ROWS = 1024  # bf16 matrices with at least this many rows take the row loop (torch's kernel: 4-7x slower)


def _column_norm(grad: torch.Tensor) -> torch.Tensor:
    """``torch.norm(grad, dim=-2, keepdim=True)``, bit for bit, faster for a tall bf16 matrix.

    On CPU, torch's bf16 reduction over the rows adds each column's squares one row after another in fp32, with a
    scalar loop (2.8 s for a 128,256 x 2048 head: a tenth of a 1B-dims step). The same additions in the same order,
    one ``addcmul_`` of a whole row at a time into an fp32 accumulator, give the same bits in 0.64 s."""
    if grad.dtype != torch.bfloat16 or grad.device.type != "cpu" or grad.shape[0] < _LOOP_ROWS:
        return torch.norm(grad, dim=-2, keepdim=True)
    total = grad.new_zeros((1, grad.shape[1]), dtype=torch.float32)
    for index in range(grad.shape[0]):  # one row view at a time (`for row in grad` unbinds all rows at once:
        row = grad[index]  # 128k tensor objects, ~64 MiB of host memory no tensor count sees)
        total.addcmul_(row, row)  # squares of bf16 values are exact in fp32: one rounding per addition, as torch's
    return total.sqrt_().to(grad.dtype)


def _in_place_adafactor(params: Any, **kw: Any) -> torch.optim.Optimizer:
    kw.setdefault("lr", 1e-2)
    kw.setdefault("eps", (torch.finfo(torch.float32).eps, 1e-3))  # as plain's "adafactor" (see its comment)
    return InPlaceAdafactor(params, **kw)


_INNER_BUILDERS = {**plain.BUILDERS, **stochastic_rounding.BUILDERS, "adafactor": _in_place_adafactor}
_INNER_ARGUMENTS = {**plain.ARGUMENTS, **stochastic_rounding.ARGUMENTS}


class OptimizerInBackward(torch.optim.Optimizer):
    """Run ``inner`` per parameter inside backward.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        inner: a name for :func:`~lightning_lowmem.functional.optimizers.build_optimizer` (not an
            in-backward one). Default: ``"adamw"``.
        **kwargs: arguments for the inner optimizer (``lr``, ``weight_decay``, ...).

    Raises:
        ValueError: ``inner`` is itself an in-backward optimizer, or unknown.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OptimizerInBackward(model.parameters(), inner="adamw", lr=1e-2)
        >>> before = model.weight.detach().clone()
        >>> model(torch.randn(3, 4)).sum().backward()   # steps happen here
        >>> model.weight.grad is None, bool((model.weight != before).any())
        (True, True)
        >>> opt.remove_hooks()
    """

    def __init__(self, params: Iterable[Any], inner: str = "adamw", **kwargs: Any) -> None:
        if not isinstance(inner, str) or inner.lower() not in _INNER_BUILDERS:
            raise ValueError(
                f"`inner`={inner!r} is not a plain optimizer name; choose one of {sorted(_INNER_BUILDERS)}"
            )
        self.inner_name = inner.lower()
        plain.check_arguments(
            self.inner_name, _INNER_ARGUMENTS[self.inner_name](), kwargs, owner=f"{self.inner_name}_in_backward"
        )
        self.inner_kwargs = dict(kwargs)
        super().__init__(params, dict(kwargs))
        self.inner_optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self._handles: list[Any] = []
        for group_index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                inner_opt = plain.build_from(
                    _INNER_BUILDERS,
                    _INNER_ARGUMENTS,
                    self.inner_name,
                    [{"params": [param], **options}],
                    **self.inner_kwargs,
                )
                if hasattr(inner_opt, "seed_offset"):  # stochastic rounding: one random stream per parameter
                    inner_opt.seed_offset = len(self.inner_optimizers)
                self.inner_optimizers[param] = inner_opt
                # share the per-parameter state dict so the wrapper's state_dict() sees it
                self.state[param] = inner_opt.state[param]
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(group_index, inner_opt)))
                for key, value in inner_opt.param_groups[0].items():  # betas, eps...: a complete saved group
                    if key != "params":
                        group.setdefault(key, float(value) if isinstance(value, torch.Tensor) else value)
        plain.attach_state_hooks(self, f"{self.inner_name}_in_backward")

    def _make_hook(self, group_index: int, inner_opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            group = self.param_groups[group_index]  # looked up each time: load_state_dict replaces groups
            inner_group = inner_opt.param_groups[0]
            for key in ("lr", "weight_decay"):  # follow LR schedulers that edit the wrapper's groups
                if key in group and key in inner_group:
                    value = group[key]
                    if isinstance(inner_group[key], torch.Tensor):  # torchao keeps lr as a tensor
                        inner_group[key].fill_(float(value))
                    else:
                        inner_group[key] = value
            inner_opt.step()
            param.grad = None

        return hook

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward + backward: the real per-parameter steps happen in its backward)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as any optimizer, then load each parameter's saved state into its inner optimizer.

        The inner optimizer loads from the saved tensors themselves, so state it keeps in a dtype other
        than the parameter's (e.g. float32 state of bfloat16 weights under stochastic rounding) is not
        cast on the way.
        """
        from lightning_lowmem.functional.optimizers.state import normalize_loaded_state

        state_dict = normalize_loaded_state(state_dict)  # plain-tensor low-bit state -> torchao tensors
        super().load_state_dict(state_dict)  # groups (checked against this optimizer's layout); ids in saved order
        for group in self.param_groups:  # a torchao optimizer saves lr as a tensor; schedulers expect a float
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            for saved_id, param in zip(saved_group["params"], group["params"], strict=True):
                inner_opt = self.inner_optimizers.get(param)
                if inner_opt is None:
                    continue
                inner_group = {**{k: v for k, v in inner_opt.param_groups[0].items() if k != "params"}, "params": [0]}
                for key in inner_group.keys() & group.keys() - {"params", "lr"}:  # saved betas, eps... (lr: hook)
                    inner_group[key] = group[key]
                saved_state = state_dict["state"].get(saved_id)
                inner_opt.load_state_dict(
                    {"state": {0: saved_state} if saved_state else {}, "param_groups": [inner_group]}
                )
                self.state[param] = inner_opt.state[param]
                # lr / weight_decay reach the inner group in the hook, before every inner step

    def remove_hooks(self) -> None:
        """Detach the gradient hooks: after this, backward leaves ``.grad`` in place and steps nothing."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


BUILDERS: dict[str, plain.Builder] = {
    f"{inner}_in_backward": functools.partial(OptimizerInBackward, inner=inner)
    for inner in ("adamw", "adamw8bit", "adamw4bit", "sgd", "adafactor", "adafactor_bf16_sr")
}
"""The optimizer-in-backward names, by registry name (each accepts its inner optimizer's arguments)."""

ARGUMENTS: dict[str, Callable[[], Iterable[str]]] = {
    name: _INNER_ARGUMENTS[name.removesuffix("_in_backward")] for name in BUILDERS
}

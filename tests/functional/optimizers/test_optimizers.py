import pytest
import torch

from lightning_lowmem.functional.optimizers.catalog import available_optimizers, build_optimizer


def _train(name, steps=3, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = build_optimizer(name, model.parameters(), **kw)
    x, y = torch.randn(16, 256), torch.randn(16, 1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def test_names_listed():
    for name in ("adamw", "adam", "sgd", "adamw8bit", "adamw4bit", "adafactor", "adamw_bf16_sr", "adamw_in_backward"):
        assert name in available_optimizers()


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="`optimizer`='lion' is unknown"):
        build_optimizer("lion", torch.nn.Linear(2, 2).parameters())


@pytest.mark.parametrize("name", ["adafactor", "adamw_in_backward"])
def test_lean_optimizer_reduces_loss(name):
    _, _, losses = _train(name, steps=5, lr=1e-2)
    assert losses[-1] < losses[0]


def test_adamw8bit_state_smaller_and_checkpoint_roundtrip():
    model, opt, losses = _train("adamw8bit", steps=2, lr=1e-3)
    _, ref, _ = _train("adamw", steps=2, lr=1e-3)

    def state_bytes(o):
        total = 0
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    inner = getattr(v, "codes", v)
                    total += inner.numel() * inner.element_size() + sum(
                        t.numel() * t.element_size() for t in (getattr(v, "scale", None),) if t is not None
                    )
        return total

    assert state_bytes(opt) <= 0.3 * state_bytes(ref)
    sd = opt.state_dict()
    opt2 = build_optimizer("adamw8bit", model.parameters(), lr=1e-3)
    opt2.load_state_dict(sd)
    p = next(model.parameters())
    assert torch.equal(opt2.state[p]["exp_avg"].dequantize(), opt.state[p]["exp_avg"].dequantize())


def test_adafactor_steps_bf16_weights_like_float32_ones():
    """torch's eps1 default (the parameter dtype's epsilon, 0.0078 for bf16) would floor the variance of small
    gradients and shrink their updates ~100x; the builder uses float32's epsilon for every dtype."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    grad = 1e-4 * torch.randn(64, 64)
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(weight.to(dtype, copy=True))
        param.grad = grad.to(dtype)
        build_optimizer("adafactor", [param], lr=0.05).step()
        moved[dtype] = (param.float() - weight.to(dtype).float()).abs().mean().item()
    assert moved[torch.bfloat16] == pytest.approx(moved[torch.float32], rel=0.1)
    param = torch.nn.Parameter(weight.to(torch.bfloat16))
    param.grad = grad.to(torch.bfloat16)
    torch.optim.Adafactor([param], lr=0.05).step()  # torch's own default, for contrast
    assert (param.float() - weight.to(torch.bfloat16).float()).abs().mean().item() < 0.2 * moved[torch.float32]

import pytest
import torch

from lightning_lowmem.functional.optimizers.in_backward import OptimizerInBackward
from lightning_lowmem.functional.optimizers.catalog import build_optimizer


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_matches_plain_adamw_and_frees_grads():
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    ref, lean = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    lean_opt = build_optimizer("adamw_in_backward", lean.parameters(), lr=1e-2)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        lean_opt.step(lambda: torch.nn.functional.mse_loss(lean(x), y).backward())
    assert all(p.grad is None for p in lean.parameters())
    for a, b in zip(ref.parameters(), lean.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_state_dict_roundtrip_and_lr_follows_group():
    x = torch.randn(4, 8)
    model = _model()
    opt = OptimizerInBackward(model.parameters(), lr=1e-2)
    model(x).sum().backward()
    sd = opt.state_dict()
    assert len(sd["state"]) == 4 and int(sd["state"][0]["step"]) == 1
    clone = _model()
    opt2 = OptimizerInBackward(clone.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    first = next(clone.parameters())
    assert int(opt2.inner_optimizers[first].state[first]["step"]) == 1
    opt2.param_groups[0]["lr"] = 0.0
    before = first.detach().clone()
    clone(x).sum().backward()
    assert int(opt2.inner_optimizers[first].state[first]["step"]) == 2
    # lr 0 with decoupled weight decay * lr 0: no change
    assert torch.equal(first, before)
    opt.remove_hooks()
    opt2.remove_hooks()


def test_bad_inner_raises():
    with pytest.raises(ValueError, match="`inner`='adamw_in_backward'"):
        OptimizerInBackward(torch.nn.Linear(2, 2).parameters(), inner="adamw_in_backward")


def test_memory_core_sees_at_most_one_parameter_of_gradients():
    """The tracker's grad hook runs before the in-backward step, so gradients are counted, never doubled."""
    from lightning_lowmem.memory import measure_memory

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    x = torch.randn(8, 64)

    def step(optimizer):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    largest = max(p.numel() * p.element_size() for p in model.parameters())
    lean = build_optimizer("adamw_in_backward", model.parameters(), lr=1e-3)
    step(lean)
    assert measure_memory(step, lean).breakdown["gradients"] == largest

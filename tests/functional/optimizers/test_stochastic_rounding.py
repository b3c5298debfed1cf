import copy

import pytest
import torch
from torch import nn

from lightning_lowmem.functional.optimizers.catalog import build_optimizer
from lightning_lowmem.functional.optimizers.stochastic_rounding import StochasticRounding, stochastic_round_


def test_rounding_is_unbiased_and_picks_a_neighbour():
    src = torch.full((200_000,), 1.0 + 2**-10)  # 1/8 of the way from bf16 1.0 to 1.0 + 2**-7
    src[100_000:] *= -3.0
    generator = torch.Generator().manual_seed(0)
    dst = stochastic_round_(torch.empty(200_000, dtype=torch.bfloat16), src, generator=generator)
    up, down = dst[:100_000].float(), dst[100_000:].float()
    assert set(up.unique().tolist()) == {1.0, 1.0078125}
    assert set(down.unique().tolist()) == {-3.0, -3.015625}  # rounded away from zero, never past a neighbour
    assert abs(up.mean().item() - src[0].item()) < 2e-5  # expected value = the float32 value
    assert abs(down.mean().item() - src[-1].item()) < 6e-5
    assert abs((up != 1.0).float().mean().item() - 0.125) < 0.005


def test_representable_values_and_specials_are_kept_exactly():
    src = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, float("inf"), float("-inf"), 2.0**-130])
    exact = src.to(torch.bfloat16)
    for seed in range(5):
        dst = stochastic_round_(torch.empty_like(exact), src, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(dst[:4], exact[:4]) and torch.equal(dst[5:7], exact[5:7])


def test_wrong_dtypes_raise():
    with pytest.raises(TypeError, match="float32 into bfloat16"):
        stochastic_round_(torch.empty(3), torch.zeros(3))
    with pytest.raises(ValueError, match="cannot be stochastically rounded"):
        StochasticRounding([nn.Parameter(torch.zeros(2))], inner="adamw8bit")
    half = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones_like(half)
    with pytest.raises(TypeError, match="bfloat16 or float32 parameters, got torch.float16"):
        StochasticRounding([half]).step()


def _bf16_update(optimizer: str, steps: int = 20) -> float:
    """Mean weight change of a bf16 layer under tiny, consistent Adafactor steps."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.ones(256, 256, dtype=torch.bfloat16))
    opt = build_optimizer(optimizer, [weight], lr=1e-3)  # relative step 1e-3: below bf16's resolution at 1.0
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        opt.step()
    return 1.0 - weight.float().mean().item()


def test_small_updates_add_up_where_plain_bf16_loses_them():
    plain = _bf16_update("adafactor")
    rounded = _bf16_update("adafactor_bf16_sr")
    torch.manual_seed(0)
    reference = nn.Parameter(torch.ones(256, 256))  # float32 weights: the update that should happen
    opt = build_optimizer("adafactor", [reference], lr=1e-3)
    for _ in range(20):
        reference.grad = torch.ones_like(reference)
        opt.step()
    expected = 1.0 - reference.mean().item()
    assert plain == 0.0  # every update rounded away
    assert abs(rounded / expected - 1) < 0.02


def test_float32_parameters_step_exactly_like_the_inner_optimizer():
    torch.manual_seed(0)
    a, b = nn.Linear(16, 8), nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    plain, wrapped = torch.optim.Adafactor(a.parameters(), lr=0.05), StochasticRounding(b.parameters(), lr=0.05)
    for _ in range(3):
        x = torch.randn(4, 16)
        for model, opt in ((a, plain), (b, wrapped)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _train(model, opt, steps, seed):
    torch.manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["adafactor_bf16_sr", "adafactor_bf16_sr_in_backward"])
def test_state_dict_resume_keeps_float32_state_and_continues_identically(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
    opt = build_optimizer(name, model.parameters(), lr=0.05)
    _train(model, opt, 3, seed=1)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
    assert saved_opt["state"][0]["row_var"].dtype == torch.float32
    _train(model, opt, 2, seed=2)

    torch.manual_seed(5)
    resumed = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
    resumed.load_state_dict(saved_model)
    resumed_opt = build_optimizer(name, resumed.parameters(), lr=0.05)
    resumed_opt.load_state_dict(saved_opt)
    state = resumed_opt.state[resumed[0].weight]
    assert state["row_var"].dtype == torch.float32  # not cast to the bf16 parameter's dtype on the way
    assert torch.equal(state["row_var"], saved_opt["state"][0]["row_var"])
    _train(resumed, resumed_opt, 2, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True))
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
        resumed_opt.remove_hooks()


def test_lr_scheduler_edits_reach_the_inner_optimizer():
    weight = nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = StochasticRounding([weight], lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    weight.grad = torch.ones_like(weight)
    opt.step()
    scheduler.step()
    weight.grad = torch.ones_like(weight)
    opt.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.005)


def test_bf16_in_backward_estimate_matches_measurement():
    from lightning_lowmem.demo import CharLM
    from lightning_lowmem.memory import measure_memory
    from lightning_lowmem.planning.estimate import estimate_memory
    from lightning_lowmem.planning.estimate import default_loss

    torch.manual_seed(0)
    model = CharLM(n_layer=2, n_head=2, n_embd=64)
    batch = (torch.randint(0, 256, (8, 64)),) * 2
    estimate = estimate_memory(
        model, batch, optimizer="adafactor_bf16_sr_in_backward", precision="bf16-true", device="cpu"
    )
    model = model.to(torch.bfloat16)
    real = build_optimizer("adafactor_bf16_sr_in_backward", model.parameters())

    def step():
        default_loss(model, batch).backward()
        real.step()
        real.zero_grad(set_to_none=True)

    step()
    measured = measure_memory(step, module=model)
    assert estimate.breakdown["optimizer_state"] == measured.breakdown["optimizer_state"]
    assert abs(estimate.peak_bytes / measured.peak_bytes - 1) < 0.01
    real.remove_hooks()

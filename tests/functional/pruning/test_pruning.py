"""Mask pruning on plain modules: exact sparsity, bool masks, N:M, transposed weights, memory, export."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightning_lowmem.functional.pruning.unstructured import (
    apply_masks_,
    from_sparse_state_dict,
    get_mask,
    prune_,
    remove_pruning_,
    sparsity,
    to_sparse_state_dict,
)
from lightning_lowmem.memory import measure_memory


def _weights(model):
    return [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def test_local_l1_prunes_smallest_magnitudes_per_tensor(tiny_mlp):
    report = prune_(tiny_mlp, 0.5, heads=True)
    for weight in _weights(tiny_mlp):
        assert int((weight == 0).sum()) == round(0.5 * weight.numel())
    kept = tiny_mlp.fc1.weight[tiny_mlp.fc1.weight_mask].abs()
    assert report.per_tensor["fc1.weight"] == 0.5
    # every kept weight is at least as large as every pruned weight had been
    assert tiny_mlp.fc1.weight_mask.dtype == torch.bool and kept.min() > 0
    assert not any("orig" in name for name, _ in tiny_mlp.named_parameters())


def test_global_l1_ranks_across_layers_and_masks_only_grow(tiny_mlp):
    magnitudes = torch.cat([w.detach().abs().flatten() for w in _weights(tiny_mlp)])
    threshold = magnitudes.sort().values[round(0.8 * magnitudes.numel()) - 1]
    prune_(tiny_mlp, 0.8, global_=True, heads=True)
    assert sparsity(tiny_mlp) == pytest.approx(round(0.8 * magnitudes.numel()) / magnitudes.numel())
    for weight in _weights(tiny_mlp):
        assert (weight[weight != 0].abs() >= threshold).all()
    before = tiny_mlp.fc1.weight_mask.clone()
    prune_(tiny_mlp, 0.3, global_=True, heads=True)  # a lower target never un-prunes
    assert torch.equal(tiny_mlp.fc1.weight_mask, before)


def test_relative_amount_follows_torch_prune_iterative_meaning(tiny_mlp):
    prune_(tiny_mlp, 0.5, relative=True, heads=True)
    prune_(tiny_mlp, 0.5, relative=True, heads=True)
    assert sparsity(tiny_mlp) == pytest.approx(0.75, abs=0.01)


def test_int_amount_prunes_that_many_weights(tiny_mlp):
    prune_(tiny_mlp, 10, global_=True, heads=True)
    assert sum(int((w == 0).sum()) for w in _weights(tiny_mlp)) == 10


def test_ln_structured_removes_whole_output_channels_of_conv(tiny_convnet):
    prune_(tiny_convnet, 0.5, "ln_structured", norm=2, parameters_to_prune=[(tiny_convnet.conv2, "weight")], heads=True)
    zero_channels = (tiny_convnet.conv2.weight.flatten(1) == 0).all(dim=1)
    assert int(zero_channels.sum()) == 8  # half of 16 output channels
    norms = torch.linalg.vector_norm(tiny_convnet.conv2.weight.flatten(1), dim=1)
    assert (norms[~zero_channels] > 0).all()


def test_random_structured_with_dim_1_prunes_input_channels(tiny_convnet):
    gen = torch.Generator().manual_seed(0)
    prune_(
        tiny_convnet,
        0.25,
        "random_structured",
        dim=1,
        parameters_to_prune=[(tiny_convnet.conv2, "weight")],
        generator=gen,
        heads=True,
    )
    zero_inputs = (tiny_convnet.conv2.weight.transpose(0, 1).flatten(1) == 0).all(dim=1)
    assert int(zero_inputs.sum()) == 2  # a quarter of 8 input channels


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (3, 8)])
def test_nm_every_group_of_m_has_at_least_m_minus_n_zeros(tiny_mlp, n, m):
    prune_(tiny_mlp, 0.0, "nm", n=n, m=m, heads=True)
    for weight in _weights(tiny_mlp):
        groups = weight.detach().reshape(-1, m)  # consecutive along the input dim (last dim of Linear)
        assert ((groups == 0).sum(dim=1) >= m - n).all()
    assert sparsity(tiny_mlp) == pytest.approx(1 - n / m)


def test_transposed_hf_conv1d_uses_its_input_dim():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(nf=6, nx=8)  # weight (in=8, out=6)
    prune_(layer, 0.0, "nm", n=2, m=4, heads=True)
    per_output = layer.weight.detach().t().reshape(-1, 4)  # (out * in/4, 4): groups along the input dim
    assert ((per_output == 0).sum(dim=1) == 2).all()
    prune_(Conv1D(nf=6, nx=8), 0.5, "ln_structured", heads=True)  # default dim: output = dim 1 here
    layer2 = Conv1D(nf=6, nx=8)
    prune_(layer2, 0.5, "ln_structured", heads=True)
    assert int((layer2.weight == 0).all(dim=0).sum()) == 3  # 3 of 6 output columns


def test_apply_masks_after_optimizer_step_keeps_zeros(tiny_mlp):
    prune_(tiny_mlp, 0.6, global_=True, heads=True)
    opt = torch.optim.AdamW(tiny_mlp.parameters(), lr=0.1)
    tiny_mlp(torch.randn(4, 16)).sum().backward()
    opt.step()
    assert sparsity(tiny_mlp) < 0.6  # Adam moved pruned weights
    assert apply_masks_(tiny_mlp) == 3
    assert sparsity(tiny_mlp) == pytest.approx(0.6, abs=1e-3)


def test_remove_pruning_leaves_plain_parameters_loadable_into_unpruned_model(tiny_mlp):
    fresh = copy.deepcopy(tiny_mlp)
    prune_(tiny_mlp, 0.5, heads=True)
    assert "fc1.weight_mask" not in tiny_mlp.state_dict()  # masks are non-persistent
    assert remove_pruning_(tiny_mlp) == 3 and get_mask(tiny_mlp.fc1) is None
    fresh.load_state_dict(tiny_mlp.state_dict())
    assert sparsity(fresh) == pytest.approx(0.5, abs=1e-3)


def test_sparse_export_round_trips_with_weights_only_and_is_smaller(tiny_mlp):
    prune_(tiny_mlp, 0.9, global_=True, heads=True)
    remove_pruning_(tiny_mlp)
    dense, packed = io.BytesIO(), io.BytesIO()
    torch.save(tiny_mlp.state_dict(), dense)
    torch.save(to_sparse_state_dict(tiny_mlp.state_dict()), packed)
    assert packed.tell() < 0.5 * dense.tell()
    packed.seek(0)
    restored = from_sparse_state_dict(torch.load(packed, weights_only=True))
    for key, value in tiny_mlp.state_dict().items():
        assert torch.equal(restored[key], value)


def _step_peak(model: nn.Module) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 512)

    def step():
        model(x).sum().backward()
        opt.step()
        apply_masks_(model)

    step()
    return measure_memory(step, module=model, optimizer=opt).peak_bytes


def test_mask_overhead_at_most_1_1_bytes_per_weight_vs_torch_prune():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    num_weights = sum(m.weight.numel() for m in base if isinstance(m, nn.Linear))
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    prune_(ours, 0.5, heads=True)
    targets = [(m, "weight") for m in theirs if isinstance(m, nn.Linear)]
    torch_prune.global_unstructured(targets, pruning_method=torch_prune.L1Unstructured, amount=0.5)
    plain_peak = _step_peak(base)
    ours_per_weight = (_step_peak(ours) - plain_peak) / num_weights
    torch_prune_per_weight = (_step_peak(theirs) - plain_peak) / num_weights  # ModelPruning's mechanism
    assert ours_per_weight <= 1.1
    assert torch_prune_per_weight >= 4.0  # float mask (+ weight recomputed from weight_orig)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(target_sparsity=1.5), ValueError, r"`amount`=1.5 must be in \[0, 1\]"),
        (dict(target_sparsity=-3), ValueError, r"`amount`=-3 must be >= 0"),
        (
            dict(target_sparsity=0.5, method="l3"),
            ValueError,
            r"`method`='l3' is unknown; choose one of \['l1_unstructured'",
        ),
        (
            dict(target_sparsity=0.5, method="nm", n=4, m=4),
            ValueError,
            r"`n`=4, `m`=4: N:M pruning needs ints with 1 <= n < m",
        ),
        (
            dict(target_sparsity=0.5, parameter_names=("kernel",)),
            ValueError,
            r"\['kernel'\], which no .*present: \['bias', 'weight'\]",
        ),
        (dict(target_sparsity="half"), TypeError, r"`amount`='half' must be a float"),
    ],
)
def test_bad_input(tiny_mlp, kwargs, error, match):
    with pytest.raises(error, match=match):
        prune_(tiny_mlp, **kwargs, heads=True)


def _tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    table, head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
    head.weight = table.weight  # a tied LM head, as GPT-2's
    return nn.Sequential(table, nn.Linear(16, 16), head)


def test_embeddings_and_tied_heads_left_alone_unless_asked():
    model = _tied_model()
    report = prune_(model, 0.5, global_=True, heads=True)
    assert set(report.per_tensor) == {"1.weight"} and get_mask(model[0]) is None and get_mask(model[2]) is None
    report = prune_(model, 0.5, global_=True, embeddings=True, heads=True)
    assert set(report.per_tensor) == {"0.weight", "1.weight"}  # the tied table is one target, under its first name
    assert report.num_prunable == 50 * 16 + 16 * 16 and report.num_pruned == round(0.5 * report.num_prunable)
    assert get_mask(model[2]) is get_mask(model[0])  # one mask, shared by both owners
    assert report.mask_bytes == sum(b.nbytes for n, b in model.named_buffers() if n.endswith("_mask")) == 50 * 16 + 256
    assert sparsity(model) == pytest.approx(0.5)
    assert remove_pruning_(model) == 2 and get_mask(model[2]) is None and get_mask(model[0]) is None


def test_tied_weight_packed_once_in_the_sparse_state_dict():
    model = _tied_model()
    prune_(model, 0.8, embeddings=True, heads=True)
    packed = to_sparse_state_dict(model.state_dict())
    assert packed["0.weight"] is packed["2.weight"]  # one entry: torch.save stores its bytes once
    untied = {**packed, "2.weight": copy.deepcopy(packed["2.weight"])}
    sizes = []
    for state in (packed, untied):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        sizes.append(buffer.getbuffer().nbytes)
    assert sizes[1] - sizes[0] >= packed["0.weight"]["values"].nbytes  # the shared values are not stored twice
    restored = from_sparse_state_dict(packed)
    assert restored["0.weight"] is restored["2.weight"] and torch.equal(restored["0.weight"], model[0].weight)


def test_parameters_held_by_a_module_with_children_are_found():
    class Wrapped(nn.Module):  # like torchao's FakeQuantizedLinear: owns `weight`, has a child module
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))
            self.observer = nn.Identity()

    model = nn.Sequential(Wrapped(), nn.Linear(8, 8))
    assert set(prune_(model, 0.5, heads=True).per_tensor) == {"0.weight", "1.weight"}


def test_pair_outside_the_model_is_refused_with_the_real_names(tiny_mlp):
    with pytest.raises(
        ValueError,
        match=r"entry \(Linear, 'weight'\) is not a parameter of the TinyMLP being pruned; "
        r"pass modules of that model \(its 'weight' parameters: \['fc1.weight'",
    ):
        prune_(tiny_mlp, 0.5, parameters_to_prune=[(nn.Linear(2, 2), "weight")], heads=True)

"""Distillation losses: hand-computed KD, gradient identities, sequences, hints, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.distillation.losses import (
    FeatureRecorder,
    feature_loss,
    find_module,
    get_loss,
    kd_loss,
    make_adapter,
    register_loss,
    soft_cross_entropy,
)


def test_kd_loss_equals_hand_computation_on_fixed_tensor():
    student = torch.tensor([[1.0, 2.0, 0.0]])
    teacher = torch.tensor([[2.0, 0.0, 1.0]])
    target = torch.tensor([1])
    temperature, alpha = 2.0, 0.3

    def softmax(values):
        exps = [math.exp(v / temperature) for v in values]
        return [e / sum(exps) for e in exps]

    p_s, p_t = softmax([1.0, 2.0, 0.0]), softmax([2.0, 0.0, 1.0])
    kl = sum(t * math.log(t / s) for t, s in zip(p_t, p_s, strict=True))
    ce = -math.log(math.exp(2.0) / (math.exp(1.0) + math.exp(2.0) + math.exp(0.0)))
    expected = alpha * temperature**2 * kl + (1 - alpha) * ce
    got = kd_loss(student, teacher, target, temperature=temperature, alpha=alpha)
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_alpha_one_t_one_gradient_equals_plain_cross_entropy_on_teacher_probabilities():
    torch.manual_seed(0)
    teacher = torch.randn(8, 5)
    student_kd = torch.randn(8, 5, requires_grad=True)
    student_ce = student_kd.detach().clone().requires_grad_(True)
    kd_loss(student_kd, teacher, temperature=1.0, alpha=1.0).backward()
    F.cross_entropy(student_ce, teacher.softmax(-1)).backward()
    torch.testing.assert_close(student_kd.grad, student_ce.grad, rtol=1e-5, atol=1e-7)
    # and the analytic gradient of KL at T=1: (p_student - p_teacher) / N
    expected = (student_ce.detach().softmax(-1) - teacher.softmax(-1)) / 8
    torch.testing.assert_close(student_kd.grad, expected, rtol=1e-5, atol=1e-7)


def test_alpha_zero_is_exactly_hard_label_cross_entropy():
    torch.manual_seed(0)
    student, teacher, target = torch.randn(6, 4), torch.randn(6, 4), torch.randint(0, 4, (6,))
    assert torch.equal(kd_loss(student, teacher, target, alpha=0.0), F.cross_entropy(student, target))


def test_sequence_logits_match_flattened_and_skip_ignored_positions():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)  # (B, T, V)
    target = torch.randint(0, 7, (2, 3))
    target[0, 1] = -100
    got = kd_loss(student, teacher, target, temperature=2.0, alpha=0.5)
    keep = (target != -100).reshape(-1)
    flat_s, flat_t, flat_y = student.reshape(-1, 7)[keep], teacher.reshape(-1, 7)[keep], target.reshape(-1)[keep]
    expected = kd_loss(flat_s, flat_t, flat_y, temperature=2.0, alpha=0.5)
    torch.testing.assert_close(got, expected)


def test_top_k_teacher_with_minus_inf_gives_finite_loss_and_gradient():
    student = torch.randn(4, 6, requires_grad=True)
    teacher = torch.full((4, 6), float("-inf"))
    teacher[:, :2] = torch.tensor([3.0, 1.0])
    loss = kd_loss(student, teacher, temperature=1.0, alpha=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
    # renormalised teacher over its top-2: same as soft CE minus the teacher entropy
    probs = teacher.softmax(-1)
    entropy = -(probs[:, :2] * probs[:, :2].log()).sum(-1).mean()
    assert loss.item() == pytest.approx((soft_cross_entropy(student, probs) - entropy).item(), rel=1e-5)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"student output shape \(2, 10\).*teacher output shape \(2, 12\)"):
        kd_loss(torch.zeros(2, 10), torch.zeros(2, 12), alpha=1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, r"`temperature` must be > 0, got 0.0"),
        ({"alpha": 1.5}, r"`alpha` must be in \[0, 1\].*1.5"),
    ],
)
def test_bad_kd_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kd_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), **kwargs)


def test_targets_required_for_hard_label_term():
    with pytest.raises(ValueError, match=r"`targets` are required.*`alpha`=0.5"):
        kd_loss(torch.zeros(2, 3), torch.zeros(2, 3), alpha=0.5)


def test_feature_loss_with_adapter_learns_a_projection():
    student_layer, teacher_layer = nn.Linear(4, 8), nn.Linear(4, 16)
    adapter = make_adapter(student_layer, teacher_layer)
    assert isinstance(adapter, nn.Linear) and (adapter.in_features, adapter.out_features) == (8, 16)
    features_s, features_t = torch.randn(5, 8), torch.randn(5, 16)
    loss = feature_loss(features_s, features_t, adapter)
    torch.testing.assert_close(loss, F.mse_loss(adapter(features_s), features_t))
    loss.backward()
    assert adapter.weight.grad is not None and adapter.weight.grad.abs().sum() > 0


def test_conv_adapter_projects_channels_and_equal_widths_need_none():
    adapter = make_adapter(nn.Conv2d(1, 4, 3), nn.Conv2d(1, 8, 3))
    assert adapter(torch.randn(2, 4, 5, 5)).shape == (2, 8, 5, 5)
    assert isinstance(make_adapter(nn.Linear(3, 8), nn.Linear(5, 8)), nn.Identity)


def test_feature_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"student \(2, 8\).*teacher \(2, 9\)"):
        feature_loss(torch.zeros(2, 8), torch.zeros(2, 9))


def test_unknown_hint_layer_lists_close_names():
    model = nn.Sequential()
    model.add_module("encoder_fc1", nn.Linear(2, 2))
    model.add_module("encoder_fc2", nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"'encoder_fc3' does not exist in the student; close names: \[.*'encoder_fc1'.*\]"
    ):
        find_module(model, "encoder_fc3", "student")


def test_feature_recorder_captures_and_releases_hooks():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    recorder = FeatureRecorder(model, ["0", "2"])
    model(torch.randn(3, 4))
    assert recorder.features["0"].shape == (3, 8) and recorder.features["2"].shape == (3, 2)
    recorder.remove()
    assert not model[0]._forward_hooks and not model[2]._forward_hooks


def test_registered_custom_loss_and_unknown_name():
    register_loss("test_mse_logits", lambda s, t, y, **kw: F.mse_loss(s, t))
    assert get_loss("test_mse_logits")(torch.ones(2, 2), torch.zeros(2, 2), None).item() == 1.0
    with pytest.raises(ValueError, match=r"`loss`='nope' is not registered; choose from \[.*'kd'"):
        get_loss("nope")
    with pytest.raises(TypeError, match="`fn` must be callable"):
        register_loss("bad", 3)


def test_kd_loss_mask_selects_positions_in_both_terms():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 7, generator=generator), torch.randn(2, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (2, 5), generator=generator)
    mask = torch.tensor([[True, True, True, False, False], [True, False, True, True, False]])
    masked = kd_loss(student, teacher, targets, temperature=2.0, alpha=0.5, mask=mask)
    kept = kd_loss(student[mask], teacher[mask], targets[mask], temperature=2.0, alpha=0.5)  # (N, V) of kept rows
    torch.testing.assert_close(masked, kept)
    student[~mask] = 1e4  # anything at the positions left out
    torch.testing.assert_close(kd_loss(student, teacher, targets, temperature=2.0, alpha=0.5, mask=mask), kept)
    hard = torch.tensor(3.0)
    soft = kd_loss(student, teacher, targets, alpha=1.0, mask=mask)
    torch.testing.assert_close(
        kd_loss(student, teacher, None, alpha=0.25, mask=mask, hard_loss=hard), 0.25 * soft + 0.75 * hard
    )
    with pytest.raises(ValueError, match=r"`mask` shape \(2, 4\) does not match the positions \(2, 5\)"):
        kd_loss(student, teacher, targets, mask=mask[:, :4])

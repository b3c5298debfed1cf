"""Cached teacher: round trip, top-k, stale caches refused, and the memory of cached training."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.distillation import DistillationModule, StaleCacheError, TeacherCache, build_teacher_cache
from lightning_lowmem.distillation.cache import batch_keys
from lightning_lowmem.memory import measure_memory

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def dataset(n: int = 40, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=generator)
    return TensorDataset(x, x[:, :4].argmax(-1))


def teacher() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 6)).eval()


def test_full_cache_round_trip_is_exact_in_float32(tmp_path):
    data, model = dataset(), teacher()
    cache = build_teacher_cache(model, data, tmp_path / "c.npy", dtype="float32", batch_size=7)
    reopened = TeacherCache.load(tmp_path / "c.npy", data)
    rows = reopened.rows(batch_keys(data.tensors[0][[5, 2, 39]]))
    assert rows == [5, 2, 39]
    with torch.no_grad():
        expected = model(data.tensors[0][[5, 2, 39]])
    torch.testing.assert_close(reopened.logits(rows), expected)
    assert cache.meta["num_samples"] == 40 and cache.meta["output_shape"] == [6]


def test_top_k_cache_keeps_the_top_classes_and_renormalises(tmp_path):
    data, model = dataset(), teacher()
    cache = build_teacher_cache(model, data, tmp_path / "k.npy", top_k=2, dtype="float32")
    logits = cache.logits([0, 1])  # (2, 6) with -inf outside the top-2
    with torch.no_grad():
        full = model(data.tensors[0][:2])
    assert (torch.isfinite(logits).sum(-1) == 2).all()
    top = full.topk(2, dim=-1)
    torch.testing.assert_close(logits.gather(-1, top.indices), top.values)
    probs = logits.softmax(-1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_stale_cache_is_refused(tmp_path):
    build_teacher_cache(teacher(), dataset(40), tmp_path / "c.npy")
    with pytest.raises(StaleCacheError, match=r"stale teacher cache .*built for 40 samples, the training set has 30"):
        TeacherCache.load(tmp_path / "c.npy", dataset(30))
    with pytest.raises(
        StaleCacheError, match=r"stale teacher cache .*fingerprint .* differs .*same size, different samples"
    ):
        TeacherCache.load(tmp_path / "c.npy", dataset(40, seed=1))


def test_stale_cache_is_refused_by_the_module_during_fit(tmp_path, tiny_mlp, tiny_trainer_kwargs):
    path = tmp_path / "c.npy"
    build_teacher_cache(teacher(), dataset(40, seed=1), path)
    module = DistillationModule(nn.Linear(16, 6), teacher=teacher, teacher_cache=str(path))
    trainer = L.Trainer(max_steps=1, **tiny_trainer_kwargs)
    with pytest.raises(StaleCacheError, match="delete .* to rebuild it"):
        trainer.fit(module, DataLoader(dataset(40), batch_size=8))


def test_unknown_sample_and_bad_arguments(tmp_path):
    cache = build_teacher_cache(teacher(), dataset(), tmp_path / "c.npy")
    with pytest.raises(KeyError, match="not in the teacher cache"):
        cache.rows(batch_keys(torch.zeros(1, 16)))
    with pytest.raises(ValueError, match=r"`top_k`=9 exceeds the teacher's 6 classes"):
        build_teacher_cache(teacher(), dataset(), tmp_path / "d.npy", top_k=9)
    with pytest.raises(ValueError, match=r"`dtype`='int8' is not supported"):
        build_teacher_cache(teacher(), dataset(), tmp_path / "e.npy", dtype="int8")
    with pytest.raises(FileNotFoundError, match="no teacher cache at"):
        TeacherCache.load(tmp_path / "missing.npy", dataset())


def test_fit_with_cache_builds_once_releases_teacher_and_reuses(tmp_path, tiny_trainer_kwargs):
    path = tmp_path / "cache.npy"
    builds = []

    def build_teacher() -> nn.Module:
        builds.append(1)
        return teacher()

    def run() -> DistillationModule:
        torch.manual_seed(0)
        module = DistillationModule(nn.Linear(16, 6), build_teacher, teacher_cache=str(path), cache_top_k=3)
        trainer = L.Trainer(max_steps=3, limit_val_batches=1, **tiny_trainer_kwargs)
        trainer.fit(module, DataLoader(dataset(), batch_size=8, shuffle=True), DataLoader(dataset(), batch_size=8))
        assert torch.isfinite(trainer.callback_metrics["train_loss"])
        return module

    module = run()
    assert builds == [1] and module.teacher is None and path.exists()
    run()
    assert builds == [1]  # the valid cache was reused: the teacher was never built again


def test_cached_teacher_training_peak_is_within_10_percent_of_student_alone(tmp_path):
    torch.manual_seed(0)
    data = dataset(256)
    student = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 6))
    big_teacher = nn.Sequential(nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 6))
    module = DistillationModule(copy.deepcopy(student), big_teacher, teacher_cache=str(tmp_path / "c.npy"))
    module.prepare_teacher_cache(data)
    del big_teacher
    assert module.teacher is None
    x, y = data.tensors[0][:64], data.tensors[1][:64]
    plain_opt = torch.optim.AdamW(student.parameters())
    cached_opt = torch.optim.AdamW(module.student.parameters())

    def plain_step() -> None:
        F.cross_entropy(student(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=False)

    def cached_step() -> None:
        module.training_step([x, y], 0).backward()
        cached_opt.step()
        cached_opt.zero_grad(set_to_none=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a trainer
        plain_step(), cached_step()  # optimizer state exists in both before measuring
        plain = measure_memory(plain_step, module=student, optimizer=plain_opt)
        cached = measure_memory(cached_step, module=module, optimizer=cached_opt)
    print(f"peak ratio cached/plain: {cached.peak_bytes / plain.peak_bytes:.3f}")
    assert cached.peak_bytes <= 1.1 * plain.peak_bytes, (str(plain), str(cached))
    assert cached.breakdown["parameters"] == plain.breakdown["parameters"]  # no teacher weights anywhere

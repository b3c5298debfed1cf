"""estimate_memory: fake-tensor estimates agree with real measurements; clear errors."""

from __future__ import annotations

import resource
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.functional.config import OptimizerConfig
from lightning_lowmem.memory import measure_memory
from lightning_lowmem.planning.estimate import EstimationError, TrainingConfig, estimate_memory
from lightning_lowmem.demo import CharLM, DigitsClassifier


def _real_peak(module: nn.Module, batch, config: TrainingConfig, loop: str = "lightning") -> int:
    """Measure the same step for real: the estimator's own step function on real tensors (by default in
    Lightning's order, as the estimate of a LightningModule runs it)."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import _apply_model_techniques, _train_step, default_loss

    dtype = {"bf16-true": torch.bfloat16}.get(config.precision_preset)
    autocast = {"bf16-mixed": torch.bfloat16}.get(config.precision_preset)
    if dtype is not None:
        module = module.to(dtype)
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    _apply_model_techniques(module, config)
    optimizer = build_optimizer(config.optimizer.name, [p for p in module.parameters() if p.requires_grad])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(module, batch, default_loss, optimizer, config, autocast, loop=loop)
        report = measure_memory(
            _train_step, module, batch, default_loss, optimizer, config, autocast, loop=loop, module=module
        )
    return report.peak_bytes


def _charlm():
    torch.manual_seed(0)
    return CharLM(n_layer=2, n_head=2, n_embd=64, block_size=32)


def _digits():
    torch.manual_seed(0)
    return DigitsClassifier(arch="cnn", hidden=16)


def _charlm_batch(batch_size: int):
    x = torch.randint(0, 256, (batch_size, 32))
    return (x, torch.roll(x, -1, dims=1))


def _digits_batch(batch_size: int):
    return (torch.rand(batch_size, 1, 8, 8), torch.randint(0, 10, (batch_size,)))


CASES = [
    ("charlm", 8, TrainingConfig()),
    ("charlm", 16, TrainingConfig()),
    ("charlm", 8, TrainingConfig(precision="bf16-true")),
    ("charlm", 8, TrainingConfig(precision="bf16-mixed")),
    ("charlm", 16, TrainingConfig(optimizer="sgd")),
    ("charlm", 16, TrainingConfig(micro_batch_size=4)),
    ("charlm", 16, TrainingConfig(activation_checkpointing="auto")),
    ("charlm", 16, TrainingConfig(activation_compression="int8")),
    ("charlm", 32, TrainingConfig(activation_compression="int8")),  # several int8 chunks per saved tensor
    (
        "charlm",
        32,
        TrainingConfig(precision="bf16-true", activation_checkpointing="auto", activation_compression="bf16"),
    ),
    ("digits", 32, TrainingConfig()),
    ("digits", 128, TrainingConfig(precision="bf16-true")),
]


@pytest.mark.parametrize(
    ("workload", "batch_size", "config"), CASES, ids=[f"{w}-{b}-{c.describe()}" for w, b, c in CASES]
)
def test_estimate_equals_the_measured_step(workload, batch_size, config):
    make_model, make_batch = {"charlm": (_charlm, _charlm_batch), "digits": (_digits, _digits_batch)}[workload]
    batch = make_batch(batch_size)
    estimate = estimate_memory(make_model(), batch, device="cpu", config=config)
    real = _real_peak(make_model(), batch, config)
    assert estimate.meta["loop"] == "lightning"  # a LightningModule, estimated through its training_step
    assert estimate.peak_bytes == real  # the same step, on fake tensors: byte for byte
    assert estimate.source == "estimated" and sum(estimate.breakdown.values()) == estimate.peak_bytes


def test_estimate_allocates_nothing_for_a_large_model_on_meta():
    from lightning_lowmem.demo.charlm import CharGPT, GPTConfig

    with torch.device("meta"):
        model = CharGPT(GPTConfig(n_layer=8, n_embd=1024, n_head=8, block_size=256))  # ~100M parameters
    batch = torch.empty(2, 256, dtype=torch.long, device="meta")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = estimate_memory(model, batch, loss_fn=lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten()))
    n_params = sum(p.numel() for p in model.parameters())
    assert report.breakdown["parameters"] == pytest.approx(4 * n_params, rel=0.01)
    assert report.breakdown["optimizer_state"] == pytest.approx(8 * n_params, rel=0.01)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert grown < 0.25 * report.peak_bytes  # the 1.6 GB of model state was never allocated


def test_cuda_target_rounds_and_lists_overheads():
    model = nn.Linear(3, 3)  # 36 + 12 bytes: each storage rounds up to a 512-byte block on CUDA
    batch = torch.zeros(1, 3)
    cpu = estimate_memory(model, batch, device="cpu")
    cuda = estimate_memory(model, batch, device="cuda")
    assert cuda.peak_bytes > cpu.peak_bytes
    assert cuda.breakdown["parameters"] == 2 * 512
    assert {"cuda_context", "cublas_workspace"} == set(cuda.overheads)


def test_data_dependent_control_flow_gives_a_clear_error():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            hidden = self.fc(x)
            if hidden.sum() > 0:  # depends on an activation's values: fake tensors have none
                return self.fc(hidden)
            return hidden

    with pytest.raises(EstimationError, match=r"depends on tensor \*values\*.*Tried: FakeTensorMode on CPU"):
        estimate_memory(Gate(), torch.randn(2, 4), device="cpu")
    # a question about the batch's own values has the real step's answer (tests/planning/test_batch_values.py)


def test_real_module_is_untouched():
    model = _charlm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate_memory(model, _charlm_batch(4), device="cpu", precision="bf16-true")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "fp8"}, ValueError, "`precision`='fp8' is not a known preset"),
        ({"device": "tpu"}, ValueError, "`device`='tpu' is not supported"),
        ({"steps": 0}, ValueError, "`steps` must be an int >= 1, got 0"),
        ({"activation_compression": "zip"}, ValueError, "`activation_compression`='zip' is unknown"),
        ({"optimizer": "lion"}, ValueError, "`optimizer`='lion' is unknown"),
        ({"loop": "keras"}, ValueError, "`loop`='keras' is unknown; choose 'auto', 'lightning' or 'torch'"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        estimate_memory(nn.Linear(2, 2), torch.zeros(1, 2), **kwargs)


@pytest.mark.cuda
def test_cuda_estimate_within_10_percent_of_allocator():
    model = _charlm()
    batch = _charlm_batch(16)
    estimate = estimate_memory(model, batch, device="cuda")
    model = model.cuda()
    batch = tuple(t.cuda() for t in batch)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats()
        model.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    real = torch.cuda.max_memory_allocated()
    assert estimate.peak_bytes + estimate.overheads["cublas_workspace"] == pytest.approx(real, rel=0.10)


def test_low_bit_optimizer_estimate_after_a_compiled_real_step():
    """torchao compiles its 8-bit step; a compiled kernel fed fake tensors used to crash the process."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer

    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = build_optimizer("adamw8bit", model.parameters(), lr=1e-3)
    for _ in range(2):  # the real, compiled step runs first
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    low_bit = estimate_memory(model, torch.randn(4, 256), optimizer="adamw8bit", device="cpu")
    full = estimate_memory(model, torch.randn(4, 256), optimizer="adamw", device="cpu")
    assert low_bit.breakdown["optimizer_state"] <= 0.3 * full.breakdown["optimizer_state"]
    assert low_bit.breakdown["parameters"] == full.breakdown["parameters"]


@pytest.mark.parametrize(
    "optimizer", ["adafactor", "adafactor_in_backward", "adafactor_bf16_sr", "adafactor_bf16_sr_in_backward"]
)
def test_adafactor_scalars_do_not_stop_the_estimate(optimizer):
    """Adafactor reads step counts and norms with ``.item()``; only values depend on them, not memory."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import default_loss

    torch.manual_seed(0)
    model = CharLM(n_layer=2, n_head=2, n_embd=64)
    batch = (torch.randint(0, 256, (8, 64)),) * 2
    estimate = estimate_memory(model, batch, optimizer=optimizer, device="cpu", loop="torch")
    real = build_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])

    def step():
        default_loss(model, batch).backward()
        real.step()
        real.zero_grad(set_to_none=True)

    step()
    measured = measure_memory(step, module=model)
    assert estimate.breakdown["optimizer_state"] == measured.breakdown["optimizer_state"]
    assert abs(estimate.peak_bytes / measured.peak_bytes - 1) < 0.01


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "sgd"])
def test_state_created_once_per_shape_matches_stepping_every_parameter(optimizer):
    """estimate_memory steps one parameter per shape and copies its state: the same layout, storage by storage."""
    from lightning_lowmem._compat.compiler import force_eager
    from lightning_lowmem._compat.fake_mode import fake_tensor_mode
    from lightning_lowmem.planning import _fake_step
    from lightning_lowmem.memory._tensors import iter_tensors

    model = CharLM(n_layer=3, n_head=2, n_embd=64, block_size=32)

    def layout(by_shape: bool) -> tuple:
        _fake_step.build_lookup_tables(optimizer)
        with fake_tensor_mode(), force_eager():
            params = [nn.Parameter(torch.empty_strided(p.shape, p.stride())) for p in model.parameters()]
            opt = _fake_step.build_optimizer(optimizer, params, {"momentum": 0.9} if optimizer == "sgd" else {})
            if by_shape:
                _fake_step.create_state(opt, params)
            else:
                _fake_step.fake_gradients(params)
                with _fake_step.OptimizerScalars():
                    opt.step()
            tensors = [
                (key, t) for p in params for key, value in sorted(opt.state[p].items()) for t in iter_tensors(value)
            ]
            storages = {id(t.untyped_storage()) for _, t in tensors}
            return [(k, tuple(t.shape), t.dtype, t.untyped_storage().nbytes()) for k, t in tensors], len(storages)

    assert layout(by_shape=True) == layout(by_shape=False)


def test_estimate_equals_the_peak_memory_monitor_measures_in_a_fit(tmp_path):
    """Lightning zeroes gradients between training_step and backward: the previous step's gradients are alive
    during the forward. The estimate of a LightningModule runs that order, so it equals the fit's peak."""
    import lightning as L

    from lightning_lowmem import LowMemoryStrategy, MemoryMonitor
    from tests.nanogpt import NanoGPT, nano_loader

    for precision, optimizer in (("32-true", "adamw"), ("bf16-true", "adafactor")):
        torch.manual_seed(0)
        model = NanoGPT(vocab_size=64, n_layer=2, n_embd=64, n_head=2, block_size=32)
        loader = nano_loader(batches=2, batch_size=4, block_size=32, vocab_size=64)
        estimate = estimate_memory(model, next(iter(loader)), device="cpu", precision=precision, optimizer=optimizer)
        monitor = MemoryMonitor(summary=False)
        trainer = L.Trainer(
            strategy=LowMemoryStrategy(precision=precision, optimizer=optimizer),
            max_steps=2,
            callbacks=[monitor],
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, loader)
        assert estimate.peak_bytes == monitor.last_report.peak_bytes, precision
        assert estimate.breakdown == monitor.last_report.breakdown


@pytest.mark.parametrize(
    "kernel", [{"fused": True}, {"foreach": True}, {"foreach": False}], ids=["fused", "foreach", "for-loop"]
)
def test_adamw_kernel_families_estimate_equals_the_measured_step(kernel):
    """AdamW's three kernels (fused, foreach, per-tensor loop) run on fake tensors as on real ones (CPU)."""
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer
    from lightning_lowmem.planning.estimate import _train_step, default_loss

    batch = _charlm_batch(16)
    estimate = estimate_memory(_charlm(), batch, device="cpu", optimizer=OptimizerConfig("adamw", **kernel))
    model = _charlm()
    config = TrainingConfig(optimizer="adamw")
    optimizer = build_optimizer("adamw", list(model.parameters()), **kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_step(model, batch, default_loss, optimizer, config, None, loop="lightning")
        measured = measure_memory(
            _train_step, model, batch, default_loss, optimizer, config, None, loop="lightning", module=model
        )
    assert estimate.peak_bytes == measured.peak_bytes

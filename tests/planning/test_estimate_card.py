"""A ``device="cuda"`` estimate as the card runs it (issue #33 items 4-6): CUDA autocast's op rules, one kernel
choice for an unpadded batch however its mask is given, and the card (``gpu=``) with its allocator, context and
workspace."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import lightning_lowmem.planning.estimate as estimate_module
from lightning_lowmem.memory.cuda_allocator import CachingAllocator, round_size, segment_size
from lightning_lowmem.planning.estimate import estimate_memory
from lightning_lowmem.planning.gpus import GPUS, resolve_card

MiB = 2**20
B, K, N = 256, 64, 128


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(K, N, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x), -1)


class _Twice(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.a = nn.Linear(K, K)
        self.b = self.a if shared else nn.Linear(K, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _loss(module, batch):
    return module(batch[0]).float().sum()


def _estimate(model, cpu_rules=False, **kwargs):
    patch = (
        pytest.MonkeyPatch.context() if cpu_rules else contextlib.nullcontext()
    )  # CPU autocast's rules: the estimate before CUDA's were installed
    with patch as mp:
        if cpu_rules:
            mp.setattr(estimate_module, "cuda_autocast_rules", lambda device, dtype: contextlib.nullcontext())
        return estimate_memory(
            model, (torch.zeros(B, K),), loss_fn=_loss, optimizer="sgd", precision="16-mixed", device="cuda", **kwargs
        )


# ----------------------------------------------------------------------------- CUDA autocast's rules
def test_cuda_autocast_runs_softmax_in_float32():
    """softmax is on CUDA autocast's float32 list: its output, saved for backward, is fp32 (CPU autocast: fp16)."""
    cuda = _estimate(_Softmax())
    cpu = _estimate(_Softmax(), cpu_rules=True)
    saved = cuda.phases["forward"]["breakdown"]["activations"]
    assert saved == B * K * 2 + B * N * 4  # linear's fp16 input copy + softmax's fp32 output
    assert cpu.phases["forward"]["breakdown"]["activations"] < saved - B * N * 2 + 1024  # fp16 output
    assert cuda.peak_bytes > cpu.peak_bytes


def test_cuda_autocast_caches_one_half_copy_per_weight():
    """With the weight cache on (torch's default; ``autocast_cache=True``), a weight used twice is cast once (the copy
    alive to the end of the forward): two layers hold one more fp16 weight + bias copy than one layer applied twice."""
    shared = _estimate(_Twice(shared=True), autocast_cache=True).other_breakdown["forward temporaries"]
    distinct = _estimate(_Twice(shared=False), autocast_cache=True).other_breakdown["forward temporaries"]
    assert distinct - shared == K * K * 2 + 512  # the weight's fp16 copy + the bias's (128 bytes, one 512-byte block)


def test_cuda_rules_leave_the_cpu_estimate_and_true_precision_alone():
    cpu_estimate = estimate_memory(_Softmax(), (torch.zeros(B, K),), loss_fn=_loss, optimizer="sgd", device="cpu")
    assert torch.softmax(torch.zeros(2, 2, dtype=torch.bfloat16), -1).dtype == torch.bfloat16  # rules removed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(torch.zeros(2, 2, dtype=torch.bfloat16), -1).dtype == torch.bfloat16  # CPU's own again
    assert (
        cpu_estimate.peak_bytes
        == estimate_memory(_Softmax(), (torch.zeros(B, K),), loss_fn=_loss, optimizer="sgd", device="cpu").peak_bytes
    )


# ----------------------------------------------------------------------------- one kernel for an unpadded batch
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_an_all_ones_mask_real_or_meta_gives_one_kernel_and_one_estimate(family):
    """transformers drops an all-ones mask (SDPA runs is_causal / no mask: flash in half precision); a mask given
    on ``meta`` (no values) is taken as unpadded too. Both forms: the same kernels, the same bytes."""
    from tests.planning.test_attention_kernels import _hf

    model, batch = _hf(family, 256, batch_size=2)
    on_meta = {key: value.to("meta") for key, value in batch.items()}
    real = estimate_memory(model, batch, optimizer="adamw", precision="bf16-true", device="cuda")
    meta = estimate_memory(model, on_meta, optimizer="adamw", precision="bf16-true", device="cuda")
    assert real.meta["attention_kernels"] == meta.meta["attention_kernels"] == {"flash": 2}
    assert real.peak_bytes == meta.peak_bytes


# ----------------------------------------------------------------------------- the card
def test_allocator_rounding_and_segments():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(1 * MiB) == 2 * MiB  # small pool
    assert segment_size(1 * MiB + 512) == segment_size(9 * MiB) == 20 * MiB  # large, under 10 MiB
    assert segment_size(10 * MiB + 1) == 12 * MiB  # rounded up to 2 MiB
    allocator = CachingAllocator()
    first = allocator.malloc(3 * MiB)  # opens a 20 MiB segment, split: 17 MiB stay free in it
    second = allocator.malloc(16 * MiB)  # best fit: the 17 MiB rest (no new segment); 1 MiB left is not split
    assert allocator.reserved_bytes == 20 * MiB and allocator.allocated_bytes == 20 * MiB
    allocator.free(first)
    allocator.free(second)  # merged back into one free 20 MiB block
    allocator.malloc(20 * MiB)
    assert allocator.peak_reserved_bytes == 20 * MiB


def test_the_card_reports_allocated_reserved_and_nvidia_smi():
    model = _Softmax()
    plain = _estimate(model)
    report = _estimate(model, gpu="A100-40GB")
    card = GPUS["A100-40GB"]
    gpu = report.meta["gpu"]
    assert report.peak_bytes == gpu["allocated_bytes"] == plain.peak_bytes  # the tensors are the same
    # every tensor is <= 1 MiB (the largest: 128 KiB) and fewer than 2 MiB are alive at once: one small segment
    assert plain.peak_bytes < 2 * MiB and gpu["reserved_bytes"] == 2 * MiB
    assert report.overheads == {"cuda_context": 500 * MiB, "cublas_workspace": 8 * MiB + 128 * 1024}
    assert gpu["nvidia_smi_bytes"] == gpu["reserved_bytes"] + 500 * MiB + 8 * MiB + 128 * 1024
    assert gpu["fits"] and gpu["capacity_bytes"] == 40 * 2**30 == card.capacity_bytes
    assert _estimate(model, gpu="h100-80gb").overheads["cublas_workspace"] == 32 * MiB  # Hopper's workspace


def test_card_capacity_decides_fits():
    from tests.planning.test_attention_kernels import _hf

    model, batch = _hf("llama", 256, batch_size=2)
    report = estimate_memory(model, batch, optimizer="adamw", gpu="T4", precision="bf16-true")
    assert report.meta["gpu"]["fits"]  # a few MiB of tensors beside the context on 15 GiB
    assert report.meta["gpu"]["nvidia_smi_bytes"] < 15 * 2**30


def test_workspace_follows_the_torch_version():
    card = GPUS["A100-80GB"]
    assert card.workspace_bytes("2.13.0") == 8 * MiB + 128 * 1024  # cuBLASLt shares cuBLAS's workspace
    assert card.workspace_bytes("2.10.1") == 8 * MiB + 128 * 1024 + 4 * MiB  # a persistent Lt workspace beside it
    assert GPUS["H100-80GB"].workspace_bytes("2.9.0") == 64 * MiB


def test_unknown_card_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"`gpu`='A100-40G' is not a known card; did you mean 'A100-40GB'\? known: T4,"
    ):
        resolve_card("A100-40G")
    with pytest.raises(ValueError, match=r"`gpu`='T4' is a CUDA card but `device`='cpu'"):
        estimate_memory(_Softmax(), (torch.zeros(2, K),), loss_fn=_loss, device="cpu", gpu="T4")


# ----------------------------------------------------------------------------- lowmem estimate --gpu / accumulation
def test_lowmem_estimate_takes_the_card_and_the_accumulation(tmp_path, capsys):
    """`--gpu NAME` implies --device cuda and answers on the card; `--trainer.accumulate_grad_batches N` with
    `--hf-config` estimates N batches per step: the figures estimate_memory gives for the same arguments."""
    import json

    pytest.importorskip("transformers")
    from lightning_lowmem.cli import main
    from lightning_lowmem.cli.hf_config import hf_config_batch, hf_config_model
    from tests.test_cli import _hf_config_folder

    folder = _hf_config_folder(tmp_path)
    args = ["estimate", "--hf-config", str(folder), "--batch-size", "2", "--seq-len", "64", "--precision", "bf16-true"]
    assert main([*args, "--gpu", "A100-80GB", "--trainer.accumulate_grad_batches", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = hf_config_model(str(folder / "config.json"))
    expected = estimate_memory(
        model, hf_config_batch(2, 64), precision="bf16-true", gpu="A100-80GB", accumulate_grad_batches=4
    )
    assert report["peak_bytes"] == expected.peak_bytes
    assert report["meta"]["gpu"]["reserved_bytes"] == expected.meta["gpu"]["reserved_bytes"]
    assert report["meta"]["accumulate_grad_batches"] == 4 and report["device"] == "cuda"
    assert main([*args, "--gpu", "A100-80GB"]) == 0
    assert "on A100-80GB (80.00 GiB): allocated" in capsys.readouterr().out.replace("\n", "")


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            ["--gpu", "A100"],
            "error: --gpu 'A100' is not a known card; did you mean 'A100-40GB' or 'A100-80GB'? known: T4, ",
        ),
        (["--gpu", "T4", "--device", "cpu"], "error: --gpu 'T4' is a CUDA card but --device 'cpu'"),
        (["--trainer.accumulate_grad_batches", "0"], "error: --trainer.accumulate_grad_batches '0' must be a whole"),
    ],
)
def test_lowmem_estimate_refuses_a_bad_card_or_accumulation_in_one_line(tmp_path, capsys, extra, error):
    from lightning_lowmem.cli import main

    assert main(["estimate", "--hf-config", str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err.startswith(error)


def test_card_capacities_are_nvidia_smi_s_totals_not_the_marketing_figures():
    """A "24 GB" A10G shows 23028 MiB in nvidia-smi, an H100 80GB 81559 MiB: "fits" is judged against what users see."""
    totals = {name: card.capacity_bytes // MiB for name, card in GPUS.items()}
    assert totals["A10G"] == 23028 and totals["L4"] == 23034 and totals["T4"] == 15360
    assert totals["H100-80GB"] == 81559 and totals["H200"] == 143771 and totals["A100-80GB"] == 81920
    assert all(card.capacity_bytes % MiB == 0 for card in GPUS.values())
    # cuBLASLt's persistent workspace of torch 2.9 / 2.10 on sm80-89: 4 MiB from 24 GiB of memory, else 1 MiB
    assert GPUS["RTX3090"].workspace_bytes("2.10.0") - GPUS["A10G"].workspace_bytes("2.10.0") == 3 * MiB

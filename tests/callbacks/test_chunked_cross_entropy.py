"""ChunkedCrossEntropy: Hugging Face causal LMs train to the same weights with no B·T·V logits, the estimate is
the fit's peak, the model comes back as it was (after fit and when fit raises), bad input is refused up front."""

from __future__ import annotations

import functools
import warnings

import lightning as L
import pytest
import torch

from lightning_lowmem import ChunkedCrossEntropy, MemoryEfficientOptimizer, MemoryMonitor, estimate_memory
from lightning_lowmem.functional.cross_entropy import DeferredLogits

hf_zoo = pytest.importorskip("tests.hf_zoo")

NO_DROPOUT = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, "llama": {}}


def _fit(module, callbacks, tiny_trainer_kwargs, family="llama", steps=2, seq_len=32, quiet=True):
    trainer = L.Trainer(
        max_steps=steps, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks, **tiny_trainer_kwargs
    )
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        trainer.fit(module, hf_zoo.hf_data(family, seq_len=seq_len, batch_size=4))
    return trainer


def _patched(module) -> bool:
    return "forward" in module.model.lm_head.__dict__ or "_loss_function" in module.model.__dict__


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_same_weights_as_the_unchunked_loss_and_no_logits_in_training(family, tiny_trainer_kwargs):
    seen = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(pl_module.model(**{k: v for k, v in batch.items() if k != "labels"}).logits)

    weights = []
    # SGD: an update proportional to the gradient (Adam would turn the rounding noise of exactly-zero gradients,
    # such as GPT-2's key biases, into full +-lr steps in either run)
    for callbacks in ([], [ChunkedCrossEntropy(chunk_size=16), Spy()]):
        callbacks = [MemoryEfficientOptimizer("sgd", lr=0.5), *callbacks]
        module = hf_zoo.hf_module(family, vocab_size=2048, **NO_DROPOUT[family])
        _fit(module, callbacks, tiny_trainer_kwargs, family)
        weights.append({name: p.detach().clone() for name, p in module.named_parameters()})
        assert not _patched(module)  # handed back after fit
    assert isinstance(seen[0], DeferredLogits)  # what the model returns while training
    for name, reference in weights[0].items():
        torch.testing.assert_close(weights[1][name], reference, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_estimate_is_the_peak_the_fit_measures(family, tiny_trainer_kwargs):
    """The chunked step estimated on fake tensors equals the fit's measured peak, and is below the unchunked one."""
    peaks = {}
    for chunked in (False, True):
        module = hf_zoo.hf_module(family, vocab_size=8192, **NO_DROPOUT[family])
        data = hf_zoo.hf_data(family, seq_len=64, batch_size=4)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        estimate = estimate_memory(module, batch, device="cpu", cross_entropy="chunked" if chunked else None)
        monitor = MemoryMonitor(summary=False)
        _fit(module, [monitor, *([ChunkedCrossEntropy()] if chunked else [])], tiny_trainer_kwargs, family, seq_len=64)
        measured = monitor.last_report.peak_bytes
        assert abs(estimate.peak_bytes - measured) <= 16, (chunked, estimate.peak_bytes, measured)
        peaks[chunked] = measured
    assert peaks[True] < 0.8 * peaks[False]  # 4 x 64 x 8192 logits: the biggest tensors of this step


def test_model_handed_back_when_fit_raises(tiny_trainer_kwargs):
    class Boom(L.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            raise RuntimeError("boom")

    module = hf_zoo.hf_module("llama")
    with pytest.raises(RuntimeError, match="boom"):
        _fit(module, [ChunkedCrossEntropy(), Boom()], tiny_trainer_kwargs)
    assert not _patched(module)
    assert isinstance(module.model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits, torch.Tensor)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_non_causal_models_refused_before_any_weight_changes(family, tiny_trainer_kwargs):
    module = hf_zoo.hf_module(family)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"whose loss is not the causal LM loss.*chunked_cross_entropy"):
        _fit(module, [ChunkedCrossEntropy()], tiny_trainer_kwargs, family)
    assert all(torch.equal(p, before[name]) for name, p in module.named_parameters())
    assert "forward" not in module.model.get_output_embeddings().__dict__


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_size": 0}, r"`chunk_size`=0 must be a positive int"),
        ({"chunk_size": 1.5}, r"`chunk_size`=1.5"),
        ({"head": ""}, r"`head`='' must be the output head's module name"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChunkedCrossEntropy(**kwargs)


def test_state_round_trip_and_a_changed_head_warns(tiny_trainer_kwargs):
    callback = ChunkedCrossEntropy(chunk_size=8)
    _fit(hf_zoo.hf_module("llama"), [callback], tiny_trainer_kwargs, steps=1)
    state = callback.state_dict()
    assert state == {"chunk_size": 8, "head": None, "heads": ["model.lm_head"]}
    resumed = ChunkedCrossEntropy(chunk_size=8)
    resumed.load_state_dict({**state, "heads": ["lm_head"]})
    with pytest.warns(
        UserWarning, match=r"trained with heads \['lm_head'\] deferred, this run defers \['model.lm_head'\]"
    ):
        _fit(hf_zoo.hf_module("llama"), [resumed], tiny_trainer_kwargs, steps=1, quiet=False)


class _SaveFullWeights(L.Callback):
    """Rank 0 saves the full (gathered) weights at the end of fit."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        weights = trainer.strategy.full_state_dict()  # a collective: every rank calls it
        if trainer.global_rank == 0:
            torch.save({name: value.clone() for name, value in weights.items()}, self.path)


class _InOrder(hf_zoo.HFTextDataModule):
    """The same batches in every process, whatever its RNG state (no shuffling)."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.hparams.batch_size, drop_last=True)


@pytest.mark.slow
def test_two_fsdp_ranks_train_as_one_unchunked_process(tmp_path, tiny_trainer_kwargs):
    """`lowmem_fsdp` over 2 processes with the chunked loss = one process with the plain loss (GPT-2: a tied head,
    sharded with the embedding in the root unit, read by the loss after the head's forward returned)."""
    from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy
    from tests.spawn import fit_saving_results

    path = tmp_path / "fsdp_chunked.pt"
    module = hf_zoo.hf_module("gpt2", vocab_size=2048, **NO_DROPOUT["gpt2"])
    reference = hf_zoo.hf_module("gpt2", vocab_size=2048, **NO_DROPOUT["gpt2"])
    reference.load_state_dict(module.state_dict())
    start = module.model.transformer.h[0].mlp.c_fc.weight.detach().clone()

    def fit(model, callbacks, **kwargs):
        kwargs = {**tiny_trainer_kwargs, "max_steps": 2, "limit_val_batches": 0, "num_sanity_val_steps": 0, **kwargs}
        data = _InOrder(hf_zoo.FAMILIES["gpt2"], seq_len=32, batch_size=4, max_chars=60_000)
        L.Trainer(callbacks=[MemoryEfficientOptimizer("sgd", lr=0.5), *callbacks], **kwargs).fit(model, data)

    strategy = LowMemoryFSDPStrategy(start_method="spawn")
    # each rank sees the whole batch (no distributed sampler): the same global step as one process
    chunked = [ChunkedCrossEntropy(chunk_size=16), _SaveFullWeights(str(path))]
    fit_saving_results(
        lambda: fit(module, chunked, devices=2, strategy=strategy, use_distributed_sampler=False), [path]
    )
    fit(reference, [])
    sharded = torch.load(path)
    assert sharded.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        # the reduction order differs between world sizes: equal up to float rounding
        torch.testing.assert_close(
            sharded[name], value, rtol=1e-4, atol=1e-5, msg=functools.partial("{}: {}".format, name)
        )
    assert not torch.equal(sharded["model.transformer.h.0.mlp.c_fc.weight"], start)  # it trained


# ----------------------------------------------------------------------------- kernel=
def test_kernel_reaches_the_loss_of_a_fit(tiny_trainer_kwargs, monkeypatch):
    """ChunkedCrossEntropy(kernel="liger") -> config -> handler -> the Hugging Face loss -> the library's function
    (a fake liger-kernel; CPU tensors pass for CUDA ones)."""
    import sys
    import types

    from torch.nn import functional as F

    from lightning_lowmem.functional.cross_entropy import kernels

    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, **kwargs):
        calls.append(kwargs)
        logits = F.linear(input, weight, bias).float()
        return F.cross_entropy(logits, target, ignore_index=kwargs["ignore_index"], reduction=kwargs["reduction"])

    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[
        "liger_kernel.transformers.functional"
    ].liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    monkeypatch.setattr(kernels, "on_cuda", lambda tensor: True)
    _fit(hf_zoo.hf_module("llama"), [ChunkedCrossEntropy(kernel="liger")], tiny_trainer_kwargs, steps=2)
    assert len(calls) == 2 and calls[0]["reduction"] == "mean" and calls[0]["ignore_index"] == -100
    _fit(hf_zoo.hf_module("llama"), [ChunkedCrossEntropy(kernel="lowmem")], tiny_trainer_kwargs, steps=1)
    assert len(calls) == 2


def test_kernel_in_yaml(tmp_path, capfd):
    from lightning_lowmem.cli import main

    yaml = """\
model:
  class_path: lightning_lowmem.demo.CharLM
  init_args: {n_layer: 1, n_embd: 32, n_head: 2, block_size: 16}
data:
  class_path: lightning_lowmem.demo.CharLMDataModule
  init_args: {block_size: 16, batch_size: 4, max_chars: 5000}
trainer:
  fast_dev_run: true
  logger: false
  callbacks:
    - class_path: lightning_lowmem.ChunkedCrossEntropy
      init_args: {kernel: %s}
"""
    config = tmp_path / "config.yaml"
    config.write_text(yaml % "lowmem")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--print_config"])
    assert "kernel: lowmem" in capfd.readouterr().out
    config.write_text(yaml % "ligr")
    assert main(["fit", "--config", str(config)]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert err[0].startswith("error: lightning_lowmem.ChunkedCrossEntropy: `kernel`='ligr' is unknown; choose one of")
    assert err[0].endswith("Did you mean 'liger'?") and len(err) == 2

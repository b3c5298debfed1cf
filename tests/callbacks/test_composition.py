"""Every pair of switches composes or is refused before training (issue #26).

The matrix: every pair of our callbacks, and each with the Trainer's ``accumulate_grad_batches`` /
``gradient_clip_val``, either trains (a two-step fit on a tiny model) or is refused in ``setup`` with one line
naming both sides and what to do instead, and the weights are then bit-identical to before the fit.

A new callback joins the matrix with one line in ``SWITCHES`` (and one in ``REFUSED`` per pair it refuses); the labels
come from what each callback says it is, and docs/composition.md's table from the rules (``matrix_table``).
"""

from __future__ import annotations

import itertools
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_lowmem.functional.cross_entropy import chunked_cross_entropy

from lightning_lowmem import (
    ActivationCheckpointing,
    ActivationCompression,
    AutoMicrobatch,
    ChunkedCrossEntropy,
    FreezeLayers,
    LowRankAdapters,
    MemoryEfficientOptimizer,
    MemoryMonitor,
    PostTrainingQuantization,
    QuantizationAwareTraining,
    ScheduledPruning,
)
from lightning_lowmem.composition import RULES, Technique, check_composition, refusal, techniques_of

warnings.filterwarnings("ignore", module="torchao")

#: name -> a callback maker, or the Trainer arguments that switch the feature on.
SWITCHES: dict[str, object] = {
    "checkpointing": lambda: ActivationCheckpointing("Block"),
    "compression": lambda: ActivationCompression("int8", min_bytes=0, log_stats=False),
    "optimizer": lambda: MemoryEfficientOptimizer("adafactor"),
    "in_backward": lambda: MemoryEfficientOptimizer("adafactor_in_backward"),
    "microbatch": lambda: AutoMicrobatch(micro_batch_size=2),
    "lora": lambda: LowRankAdapters(r=2),
    "pruning": lambda: ScheduledPruning("l1_unstructured", schedule="linear", target_sparsity=0.5, end_step=2),
    "structural": lambda: ScheduledPruning(
        "ln_structured", schedule="linear", target_sparsity=0.5, end_step=2, structural=True
    ),
    "ptq": lambda: PostTrainingQuantization("int8_weight_only", latency_batches=0),
    "qat": lambda: QuantizationAwareTraining("intx4_weight_only", group_size=16),
    "monitor": lambda: MemoryMonitor(summary=False),
    "chunked_loss": lambda: ChunkedCrossEntropy(head="model.head"),
    "freeze": lambda: FreezeLayers(blocks=1),
    "accumulation": {"accumulate_grad_batches": 2},
    "clipping": {"gradient_clip_val": 1.0},
}

#: pairs refused, with what the one-line message must say (both sides are checked separately)
REFUSED: dict[frozenset[str], str] = {
    frozenset({"in_backward", "accumulation"}): "would never be accumulated.*accumulate_grad_batches=1",
    frozenset({"in_backward", "clipping"}): "before Lightning could clip.*remove gradient_clip_val",
    frozenset({"in_backward", "microbatch"}): "each micro-batch backward would be an optimizer step",
    frozenset({"lora", "structural"}): "adapters keep their old shapes.*structural=False",
    frozenset({"qat", "ptq"}): "would quantize it again",
    frozenset({"lora", "qat"}): "fake-quantizes the layers.*quantize_base",
    frozenset({"structural", "qat"}): "groups of group_size channels.*'int8_weight_only'.*prune structurally",
    frozenset({"chunked_loss", "qat"}): "fake-quantizes the output head too.*drop ChunkedCrossEntropy for the QAT run",
    frozenset({"freeze", "pruning"}): "masks weights inside the blocks.*freeze fewer blocks",
    frozenset({"freeze", "structural"}): "masks weights inside the blocks.*freeze fewer blocks",
}
#: Lightning itself refuses two callbacks of one class with the same ``state_key`` in ``Trainer()``; our rules
#: refuse the twins it lets through (tested below with different modes)
LIGHTNING = "Found more than one stateful callback of type `({})`".format(
    "|".join(sorted({type(switch()).__name__ for switch in SWITCHES.values() if not isinstance(switch, dict)}))
)
REFUSED.update({frozenset({name}): LIGHTNING for name in SWITCHES if not isinstance(SWITCHES[name], dict)})
REFUSED[frozenset({"pruning", "structural"})] = REFUSED[frozenset({"optimizer", "in_backward"})] = LIGHTNING

SHORT = {
    "checkpointing": "AC",
    "compression": "Comp",
    "optimizer": "MEO",
    "in_backward": "MEO-ib",
    "microbatch": "AMB",
    "lora": "LoRA",
    "pruning": "Prune",
    "structural": "Prune-s",
    "ptq": "PTQ",
    "qat": "QAT",
    "monitor": "Mon",
    "chunked_loss": "CE",
    "freeze": "Freeze",
    "accumulation": "accum",
    "clipping": "clip",
}  # the column names of docs/composition.md's matrix


def _switched_on(*names: str) -> SimpleNamespace:
    """A stand-in Trainer with these switches on (what ``techniques_of`` reads)."""
    callbacks = [SWITCHES[name]() for name in names if not isinstance(SWITCHES[name], dict)]
    settings = {"accumulate_grad_batches": 1, "gradient_clip_val": None}
    for name in names:
        if isinstance(SWITCHES[name], dict):
            settings.update(SWITCHES[name])
    return SimpleNamespace(callbacks=callbacks, strategy=None, **settings)


#: the label each side is named by in a refusal: what the callback (or the Trainer setting) says it is
LABELS = {name: re.escape(techniques_of(_switched_on(name))[0].label) for name in SWITCHES}


def _same_class(a: str, b: str) -> bool:
    makers = [SWITCHES[a], SWITCHES[b]]
    return not any(isinstance(make, dict) for make in makers) and type(makers[0]()) is type(makers[1]())


def matrix_table() -> str:
    """docs/composition.md's matrix, from the composition rules: ✓ composes, ✗ refused by ``check_composition``,
    **1** refused by Lightning (two callbacks of one class), – the same Trainer setting."""
    names = list(SWITCHES)
    lines = ["| | " + " | ".join(SHORT[name] for name in names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            if a == b and isinstance(SWITCHES[a], dict):
                cells.append("–")
            elif _same_class(a, b):
                cells.append("1")
            else:
                cells.append("✗" if refusal(techniques_of(_switched_on(a, b))) else "✓")
        lines.append(f"| **{SHORT[a]}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class BlocksModule(L.LightningModule):
    """``TinyBlocks`` (tests/conftest.py) on 32 fixed random samples, batches of 4."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        generator = torch.Generator().manual_seed(1)
        inputs = torch.randn(32, 16, generator=generator)
        self.data = TensorDataset(inputs, inputs[:, :4].argmax(1))

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return chunked_cross_entropy(self(batch[0]), batch[1])  # F.cross_entropy unless the head defers its logits

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)


class _Trained(L.Callback):
    """Which weights the training steps changed (between train start, after every setup, and train end)."""

    def on_train_start(self, trainer, pl_module):
        self.start = {key: _float(value).clone() for key, value in pl_module.state_dict().items()}

    def on_train_end(self, trainer, pl_module):
        end = {key: _float(value) for key, value in pl_module.state_dict().items()}
        self.changed = [
            key
            for key in end
            if key not in self.start
            or end[key].shape != self.start[key].shape
            or not torch.equal(end[key], self.start[key])
        ]


def _float(tensor: torch.Tensor) -> torch.Tensor:
    """A quantized (torchao) weight as the floats it stands for; an FSDP (DTensor) one as its full tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.dequantize() if type(tensor) is not torch.Tensor and hasattr(tensor, "dequantize") else tensor


def _pairs() -> list[tuple[str, str]]:
    names = list(SWITCHES)
    return [
        (a, b)
        for a, b in itertools.combinations_with_replacement(names, 2)
        if not (a == b and isinstance(SWITCHES[a], dict))
    ]


def _trainer(names: tuple[str, ...], tiny_trainer_kwargs: dict) -> L.Trainer:
    callbacks, settings = [], {}
    for name in names:
        switch = SWITCHES[name]
        if isinstance(switch, dict):
            settings.update(switch)
        else:
            callbacks.append(switch())
    return L.Trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks, **settings, **tiny_trainer_kwargs)


@pytest.mark.parametrize(("a", "b"), _pairs(), ids=[f"{a}+{b}" for a, b in _pairs()])
def test_pair_trains_or_is_refused_before_training(a, b, tiny_blocks, tiny_trainer_kwargs):
    module = BlocksModule(tiny_blocks)
    before = {key: value.detach().clone() for key, value in module.state_dict().items()}
    expected = REFUSED.get(frozenset({a, b}))
    if expected is None:
        trainer = _trainer((a, b), tiny_trainer_kwargs)
        trainer.callbacks.append(trained := _Trained())
        trainer.fit(module)
        assert trainer.global_step == 2, f"{a} + {b} stopped at step {trainer.global_step}"
        assert trained.changed, f"{a} + {b}: the two steps changed no weight"
        return
    error = RuntimeError if expected is LIGHTNING else ValueError  # Lightning refuses in Trainer(), before fit
    with pytest.raises(error, match=expected) as raised:
        _trainer((a, b), tiny_trainer_kwargs).fit(module)
    message = str(raised.value)
    assert "\n" not in message
    if expected is not LIGHTNING:
        assert "do not compose" in message and "Instead," in message
    for side in (a, b) if expected is not LIGHTNING else ():
        assert re.search(LABELS[side], message), (side, message)
    after = module.state_dict()
    assert set(after) == set(before)  # no adapter, mask or quantized layer left behind
    assert all(type(after[key]) is torch.Tensor and torch.equal(before[key], after[key]) for key in before)


#: twins Lightning lets through (different ``state_key``) and a strategy option beside the callback that sets
#: the same thing: (callback makers, strategy options, Trainer arguments, what the message says)
TWINS = {
    "two PTQ": (
        lambda: [PostTrainingQuantization("int8_weight_only"), PostTrainingQuantization("int8_dynamic")],
        {},
        {},
        r"PostTrainingQuantization\('int8_weight_only'\) and PostTrainingQuantization\('int8_dynamic'\) do not"
        r" compose: both quantize the model at the end of fit.*Instead, keep one of them\.",
    ),
    "two QAT": (
        lambda: [
            QuantizationAwareTraining("intx4_weight_only", group_size=16),
            QuantizationAwareTraining("int8_weight_only", group_size=16),
        ],
        {},
        {},
        r"QuantizationAwareTraining\('intx4_weight_only'\) and QuantizationAwareTraining\('int8_weight_only'\).*"
        r"fake quantization",
    ),
    "two compressions": (
        lambda: [ActivationCompression("int8"), ActivationCompression("bf16")],
        {},
        {},
        r"ActivationCompression\('int8'\) and ActivationCompression\('bf16'\) do not compose: both "
        r"pack",
    ),
    "strategy and callback optimizer": (
        lambda: [MemoryEfficientOptimizer("adafactor")],
        {"optimizer": "adamw"},
        {},
        r"MemoryEfficientOptimizer\('adafactor'\) and LowMemoryStrategy\(optimizer="
        r"'adamw'\) do not compose.*set the optimizer in one place",
    ),
    "strategy and callback compression": (
        lambda: [ActivationCompression("int8")],
        {"activation_compression": "bf16"},
        {},
        r"ActivationCompression\('int8'\) and LowMemoryStrategy\(activation_"
        r"compression='bf16'\) do not compose.*in one place",
    ),
    "strategy and callback checkpointing": (
        lambda: [ActivationCheckpointing("Block")],
        {"activation_checkpointing": "auto"},
        {},
        r"ActivationCheckpointing\('Block'\) and LowMemoryStrategy\("
        r"activation_checkpointing='auto'\) do not compose",
    ),
    "strategy in-backward and accumulation": (
        lambda: [],
        {"optimizer": "adamw_in_backward"},
        {"accumulate_grad_batches": 2},
        r"LowMemoryStrategy\(optimizer='adamw_in_backward'\) and Trainer\("
        r"accumulate_grad_batches=2\) do not compose.*e\.g\. 'adamw'",
    ),
    "strategy in-backward and clipping": (
        lambda: [],
        {"optimizer": "sgd_in_backward"},
        {"gradient_clip_val": 0.5},
        r"LowMemoryStrategy\(optimizer='sgd_in_backward'\) and Trainer\("
        r"gradient_clip_val=0.5\) do not compose.*e\.g\. 'sgd'",
    ),
    "budget and optimizer callback": (
        lambda: [MemoryEfficientOptimizer("adafactor")],
        {"memory_budget": "1GiB"},
        {},
        r"LowMemoryStrategy\(memory_budget='1GiB'\) and MemoryEfficientOptimizer\("
        r"'adafactor'\) do not compose: .* plans the optimizer itself.*set optimizer= on",
    ),
    "budget and compression callback": (
        lambda: [ActivationCompression("int8")],
        {"memory_budget": "1GiB"},
        {},
        r"plans activation compression itself.*set activation_compression= on",
    ),
    "budget and checkpointing callback": (
        lambda: [ActivationCheckpointing("Block")],
        {"memory_budget": "1GiB"},
        {},
        r"plans activation checkpointing itself",
    ),
    "budget and AutoMicrobatch": (
        lambda: [AutoMicrobatch()],
        {"memory_budget": "1GiB"},
        {},
        r"may plan micro-batches.*Instead, drop AutoMicrobatch",
    ),
    "budget and ChunkedCrossEntropy": (
        lambda: [ChunkedCrossEntropy(head="model.head")],
        {"memory_budget": "1GiB"},
        {},
        r"may plan the chunked cross-entropy itself.*Instead, drop ChunkedCrossEntropy",
    ),
}


def test_structural_pruning_composes_with_per_channel_qat(tiny_blocks, tiny_trainer_kwargs):
    """Only QAT's 4-bit (grouped) modes are refused beside structural pruning: int8 is per channel."""
    module = BlocksModule(tiny_blocks)
    pruning = ScheduledPruning("ln_structured", schedule="linear", target_sparsity=0.5, end_step=2, structural=True)
    qat = QuantizationAwareTraining("int8_weight_only")
    trainer = L.Trainer(max_steps=3, limit_val_batches=0, callbacks=[pruning, qat], **tiny_trainer_kwargs)
    trainer.fit(module)
    assert trainer.global_step == 3 and module.model.blocks[0].fc1.weight.shape == (8, 8)  # pruned from 16 x 16
    assert qat.converted  # and converted at fit end


def test_a_budget_keeps_what_is_set_explicitly():
    """memory_budget beside a callback is refused only for what the plan chooses: a set option stays fixed."""
    from lightning_lowmem import LowMemoryStrategy
    from lightning_lowmem.composition import techniques_of

    class Stub:
        callbacks = [ActivationCompression("int8")]
        strategy = LowMemoryStrategy(memory_budget="1GiB", optimizer="adafactor", activation_checkpointing="auto")
        accumulate_grad_batches, gradient_clip_val = 1, None

    budget = techniques_of(Stub())[-1]
    assert budget.label == "LowMemoryStrategy(memory_budget='1GiB')"
    assert budget.tags == {"plans_compression", "plans_microbatch", "plans_chunked_loss"}
    with pytest.raises(ValueError, match=r"^LowMemoryStrategy\(memory_budget='1GiB'\) and ActivationCompression"):
        check_composition(Stub())
    Stub.callbacks = [MemoryMonitor()]
    check_composition(Stub())  # the monitor measures whatever the plan chose


@pytest.mark.parametrize("case", list(TWINS))
def test_twins_and_strategy_options_are_refused_before_training(case, tiny_blocks, tiny_trainer_kwargs):
    from lightning_lowmem import LowMemoryStrategy

    make_callbacks, options, settings, expected = TWINS[case]
    module = BlocksModule(tiny_blocks)
    before = {key: value.detach().clone() for key, value in module.state_dict().items()}
    trainer = L.Trainer(
        max_steps=2,
        callbacks=make_callbacks(),
        strategy=LowMemoryStrategy(**options),
        **settings,
        **tiny_trainer_kwargs,
    )
    with pytest.raises(ValueError, match=expected) as raised:
        trainer.fit(module)
    assert "\n" not in str(raised.value)
    after = module.state_dict()
    assert set(after) == set(before) and all(torch.equal(before[key], after[key]) for key in before)


#: each switch alone under ``lowmem_fsdp`` (one process, FSDP2's DTensor parameters): what refuses it, before any
#: weight changes (the others train); before, pruning and in-backward Adafactor stopped mid-fit with DTensor errors
#: and PTQ left the model in float with a warning
UNDER_FSDP = {
    "pruning": r"ScheduledPruning\('l1_unstructured'\) and LowMemoryFSDPStrategy do not compose: .* DTensors.*"
    r"Instead, prune under strategy='lowmem'",
    "structural": r"ScheduledPruning\(structural=True\) and LowMemoryFSDPStrategy do not compose",
    "ptq": r"PostTrainingQuantization\('int8_weight_only'\) and LowMemoryFSDPStrategy do not compose: .*DTensor shards",
    "optimizer": r"the configured optimizer Adafactor \(like 'adafactor'\) cannot step on FSDP's sharded",
    "in_backward": r"the configured optimizer 'adafactor_in_backward' cannot step on FSDP's sharded",
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_each_switch_under_lowmem_fsdp_trains_or_is_refused_before_training(name, tiny_blocks, tiny_trainer_kwargs):
    import torch.distributed as dist

    from lightning_lowmem.strategies.fsdp import LowMemoryFSDPStrategy

    module = BlocksModule(tiny_blocks)
    before = {key: value.detach().clone() for key, value in module.state_dict().items()}
    switch = SWITCHES[name]
    callbacks, settings = ([], dict(switch)) if isinstance(switch, dict) else ([switch()], {})
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=0,
        callbacks=[*callbacks, trained := _Trained()],
        **{**tiny_trainer_kwargs, **settings, "strategy": LowMemoryFSDPStrategy(wrap_policy="Block")},
    )
    try:
        if name not in UNDER_FSDP:
            trainer.fit(module)
            assert trainer.global_step == 2 and trained.changed, name
            return
        with pytest.raises(ValueError, match=UNDER_FSDP[name]) as raised:
            trainer.fit(module)
        assert "\n" not in str(raised.value)
        after = {key: _float(value) for key, value in module.state_dict().items()}
        assert set(after) == set(before) and all(torch.equal(before[key], after[key]) for key in before)
        # a refused optimizer-in-backward leaves no hook behind that would step on the module's next backward
        assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in module.parameters())
    finally:
        if dist.is_initialized():  # the one-process group Lightning made for FSDP
            dist.destroy_process_group()


def test_every_rule_is_tested():
    """A rule added to composition.RULES without a refused pair above would go untested."""
    import lightning_lowmem.callbacks as callbacks

    declared = [rule for name in callbacks.__all__ for rule in getattr(getattr(callbacks, name), "rules", ())]
    tags = {"structural_pruning": "structural", "grouped_qat": "qat"}
    matrix = {
        frozenset({tags.get(rule.left, rule.left), tags.get(rule.right, rule.right)}) for rule in (*RULES, *declared)
    }
    tested = {pair for pair, expected in REFUSED.items() if expected is not LIGHTNING}
    twins = {frozenset({tag}) for tag in ("ptq", "qat", "compression", "optimizer", "checkpointing")}  # TWINS
    budget = {
        frozenset({f"plans_{axis}", axis})
        for axis in ("optimizer", "compression", "checkpointing", "microbatch", "chunked_loss")
    }
    fsdp = {frozenset({tag, "sharded_parameters"}) for tag in ("pruning", "ptq")}  # UNDER_FSDP
    assert matrix - tested == twins | budget | fsdp


def test_refusal_names_the_pair_in_one_line():
    a = Technique(
        "MemoryEfficientOptimizer('sgd_in_backward')", frozenset({"optimizer", "in_backward"}), "sgd_in_backward"
    )
    b = Technique("Trainer(accumulate_grad_batches=4)", frozenset({"accumulation"}))
    assert refusal([a]) is None and refusal([b]) is None
    assert refusal([b, a]) == (
        "MemoryEfficientOptimizer('sgd_in_backward') and Trainer(accumulate_grad_batches=4) do not compose: "
        "MemoryEfficientOptimizer('sgd_in_backward') steps the optimizer inside every backward, so gradients would "
        "never be accumulated. Instead, use accumulate_grad_batches=1 (and a larger batch, memory permitting) or an "
        "optimizer that steps after backward, e.g. 'sgd'."
    )


def test_only_fit_is_checked():
    class Stub:
        callbacks = [MemoryEfficientOptimizer("adamw_in_backward")]
        strategy = None
        accumulate_grad_batches = 2
        gradient_clip_val = None

    check_composition(Stub(), "validate")  # nothing trains: nothing to refuse
    with pytest.raises(ValueError, match=r"MemoryEfficientOptimizer\('adamw_in_backward'\) and Trainer\(accumu"):
        check_composition(Stub(), "fit")


def test_every_technique_callback_is_in_the_matrix():
    """A callback on the technique base (lightning_lowmem.callbacks) that SWITCHES forgets would go unchecked."""
    import lightning_lowmem.callbacks as callbacks
    from lightning_lowmem.callbacks._technique_base import TechniqueCallback

    exported = {name for name in callbacks.__all__ if issubclass(getattr(callbacks, name), TechniqueCallback)}
    in_matrix = {type(switch()).__name__ for switch in SWITCHES.values() if not isinstance(switch, dict)}
    assert exported == in_matrix


def test_the_docs_matrix_is_the_rules():
    """docs/composition.md's table is :func:`matrix_table` (regenerate it with
    ``python -c "from tests.callbacks.test_composition import matrix_table; print(matrix_table())"``)."""
    doc = (Path(__file__).parents[2] / "docs" / "composition.md").read_text()
    assert matrix_table() in doc, "docs/composition.md's matrix differs from the rules; paste:\n" + matrix_table()
    for a, b in _pairs():  # the rules and the refusals the matrix test expects agree
        expected = REFUSED.get(frozenset({a, b}))
        if expected is not LIGHTNING:
            assert (expected is not None) == bool(refusal(techniques_of(_switched_on(a, b)))), (a, b)

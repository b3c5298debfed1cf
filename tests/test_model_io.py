"""`lightning_lowmem.model_io`: how the package calls a user's model on a batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem.model_io import (
    BatchCallError,
    batch_size,
    forward_batch,
    model_inputs,
    output_logits,
    output_loss,
)


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        return {"logits": self.embed(input_ids), "mask": attention_mask}


def test_dict_batches_are_passed_as_keywords_without_dropped_keys():
    ids = torch.tensor([[1, 2, 3]])
    out = forward_batch(KeywordModel(), {"input_ids": ids, "labels": ids}, drop_keys=("labels",))
    assert output_logits(out).shape == (1, 3, 4)


def test_tuple_batches_pass_their_first_element():
    model = nn.Linear(4, 2)
    assert forward_batch(model, (torch.ones(3, 4), torch.zeros(3))).shape == (3, 2)
    assert model_inputs([torch.ones(1)])[0][0].shape == (1,)


def test_a_batch_the_model_cannot_take_names_the_override_point():
    with pytest.raises(BatchCallError, match=r"forward_batch\(self, batch\).*") as info:
        forward_batch(KeywordModel(), {"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.zeros(1)})
    assert "labels" in str(info.value) and "KeywordModel.forward" in str(info.value)
    with pytest.raises(BatchCallError, match="forward_batch"):
        forward_batch(nn.Linear(2, 2), {"x": torch.zeros(1, 2)})


def test_forward_batch_is_the_override_point():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward_batch(self, batch: dict) -> torch.Tensor:
            return self.linear(batch["pixels"]) * 0

    out = forward_batch(Custom(), {"pixels": torch.ones(1, 2), "other": 3})
    assert torch.equal(out, torch.zeros(1, 2))


def test_outputs_are_read_the_hugging_face_way():
    logits, loss = torch.ones(2), torch.tensor(3.0)
    assert output_logits({"loss": loss, "logits": logits}) is logits
    assert output_logits((logits, loss)) is logits
    assert output_loss({"loss": loss, "logits": logits}) is loss
    assert output_loss(logits) is None
    with pytest.raises(TypeError, match="cannot find the logits in a model output of type str"):
        output_logits("nope")


def test_batch_size_of_nested_batches():
    assert batch_size({"a": torch.zeros(5, 2), "b": [torch.zeros(5)]}) == 5
    assert batch_size((torch.zeros(5), torch.zeros(4))) is None


def test_hugging_face_models_through_the_convention(hf_family):
    from tests.hf_zoo import hf_batch, hf_module

    module = hf_module(hf_family)
    batch = hf_batch(hf_family)
    with torch.no_grad():
        out = forward_batch(module, batch)
    assert output_loss(out) is not None and output_logits(out).shape[0] == 4

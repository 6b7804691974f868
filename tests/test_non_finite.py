"""Rows of logits that are not finite, without an engine: which rows are marked, what is sampled instead, and what
the API answers (the engine and server cases are in test_isolation.py)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_bdlora.non_finite import MARKER, finite_stand_in, mark_non_finite_rows, non_finite_message, raise_if_ended


def test_rows_holding_nan_or_positive_inf_are_marked_and_sampled_from_a_finite_stand_in():
    logits = torch.tensor(
        [
            [0.5, 2.0, -1.0, 0.0],
            [0.5, float("nan"), -1.0, 0.0],
            [0.5, float("inf"), -1.0, 0.0],
            [0.5, float("-inf"), float("-inf"), 3.0],  # -Inf is how vLLM masks tokens: left alone
        ]
    )
    original = logits.clone()
    bad = mark_non_finite_rows(logits)
    assert bad.flatten().tolist() == [False, True, True, False]
    assert torch.isnan(logits[1:3]).all() and torch.equal(logits[[0, 3]], original[[0, 3]])
    for stand_in in (finite_stand_in(logits, bad), finite_stand_in(logits)):
        assert torch.equal(stand_in[1:3], torch.zeros(2, 4)) and torch.equal(stand_in[[0, 3]], original[[0, 3]])
        assert stand_in.argmax(dim=-1).tolist() == [1, 0, 0, 3]


def test_an_ended_request_answers_422_naming_its_adapter():
    from vllm.exceptions import GenerationError

    request = SimpleNamespace(lora_request=SimpleNamespace(lora_name="tenant-a"))
    ended = SimpleNamespace(outputs=[SimpleNamespace(finish_reason="error", stop_reason=non_finite_message(request))])
    with pytest.raises(GenerationError) as raised:
        raise_if_ended(ended)
    assert (
        raised.value.status_code == 422
        and "LoRA adapter 'tenant-a'" in str(raised.value)
        and MARKER in str(raised.value)
    )
    for fine in (SimpleNamespace(outputs=[SimpleNamespace(finish_reason="length", stop_reason=None)]),
                 SimpleNamespace(outputs=[SimpleNamespace(finish_reason="error", stop_reason=None)])):  # fmt: skip
        raise_if_ended(fine)  # vLLM's own errors are vLLM's to answer

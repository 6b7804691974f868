"""Model families other than Llama, tested rather than assumed: a BD-LoRA and a standard adapter on tiny random
models of each family (Transformers' own config classes), served at TP=1 and TP=2 against PEFT. Gemma 2 brings its
soft-capped attention, alternating sliding windows and tied embeddings. Phi-3 keeps q, k
and v in one qkv_proj module and gate and up in one gate_up_proj, so its BD blocks do not line up with the
tensor-parallel shards: the misaligned path, served exactly when it fits the per-GPU width."""

import random

import pytest

from tests.conftest import assert_matches_reference, engine_kwargs, run_engine
from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import greedy, load_reference

pytestmark = pytest.mark.engine

FAMILIES = ["qwen2", "qwen3", "mistral", "phi3", "gemma2"]
# vLLM's Gemma 2 and Transformers' differ by 5e-4 in chosen-token logprob on the base model alone (float32, no
# adapter), and by 1.2e-3 with a dense rank-32 adapter as with the same adapter in BD form: the families' own gap,
# which the adapters' larger activations widen. Greedy tokens must still be equal.
LOGPROB_ATOL = {"gemma2": 3e-3}
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
    result = run_engine(spec, tmp_path_factory.mktemp(f"{name}-tp{tp}"))
    assert_matches_reference(result, reference, BATCH, **({"atol": LOGPROB_ATOL[name]} if name in LOGPROB_ATOL else {}))


def test_a_mixture_of_experts_model_is_refused_on_cpu_naming_the_reason(tmp_path):
    """vLLM wraps a mixture of experts' layers for LoRA and runs them with Triton kernels its CPU build lacks: the
    engine stops at start-up with that reason, not later on "triton.language has no attribute float32". (BD on the
    attention of a MoE model, and the refusal of BD factors on experts, need a CUDA GPU.)"""
    model = tiny.make_tiny_model(str(tmp_path / "model"), "qwen3_moe")
    spec = {"engine": engine_kwargs(model, 1, bdlora=True), "adapters": {}, "requests": [], "max_tokens": 1}
    with pytest.raises(pytest.fail.Exception):
        run_engine(spec, tmp_path / "run", timeout=300)
    log = (tmp_path / "run" / "engine.log").read_text()
    assert "LoRA on this mixture-of-experts model (" in log and "on a CUDA GPU" in log, log[-3000:]
    assert "has no attribute 'float32'" not in log

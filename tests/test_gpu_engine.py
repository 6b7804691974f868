"""The same batch as test_engine_vs_peft.py on a CUDA GPU (vLLM's Triton LoRA kernels, which need fp16
or bf16). Greedy paths may legitimately diverge from PEFT's float32 ones after a near-tie, so each step
is checked teacher-forced: PEFT scores vLLM's own continuation, and vLLM's chosen token must be PEFT's
argmax up to LOGPROB_ATOL, with the same log-probability up to LOGPROB_ATOL."""

import math
import re

import pytest
import torch

from tests.conftest import ADAPTERS, BATCH, batch_spec, engine_kwargs, reference_errors, run_engine
from vllm_bdlora.peft_reference import load_reference

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

DTYPE = "float16"
LOGPROB_ATOL = 0.05  # fp16 activations and LoRA weights vs a float32 reference
# A worker's host memory for adapters: fewer than the batch's last three, whose fp16 slot images (at their widths 32,
# 32 and 16 in slots of 64) take 640 KiB together, so that some of them are spilled and read back.
FEW_ADAPTERS_BYTES = 1 << 19


@pytest.mark.parametrize(
    "tp,cuda_graphs,lora_kernels,slots",
    [(1, False, "vllm", None), (2, False, "vllm", None), (2, True, "vllm", None), (1, True, "fused", None),
     (2, True, "auto", None), (1, True, "fused", 2)],
    ids=["tp1", "tp2", "tp2-cudagraphs", "tp1-cudagraphs-fused", "tp2-cudagraphs-auto", "tp1-cudagraphs-fused-2slots"],
)  # fmt: skip
def test_bd_on_gpu_matches_peft(tp, cuda_graphs, lora_kernels, slots, assets, prompts, tmp_path_factory):
    """fused/auto: the layers run the fused kernels, and over this unquantized base the base GEMM after them (delta
    first). slots=2: six adapters through two adapters a step (three GPU slots, one kept for fills ahead; the fused
    kernels also read each slot's width, which a refill must rewrite; see
    test_more_adapters_than_gpu_slots_still_match_peft), each filled from its pinned slot image, with few adapters kept
    in memory: images are spilled, and read back into the regions other images gave back (`vllm_bdlora.image_memory`)
    while fills from those regions may be in flight."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    graphs = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}} if cuda_graphs else {}
    settings = {"lora_kernels": lora_kernels} | ({"adapter_host_memory": FEW_ADAPTERS_BYTES} if slots else {})
    engine = engine_kwargs(assets["model"], tp, bdlora=True, dtype=DTYPE, enforce_eager=not cuda_graphs,
                           additional_config={"bdlora": settings}, **graphs)  # fmt: skip
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts)
    if slots:
        engine["max_loras"] = slots
        spec |= {"load_first": list(ADAPTERS), "adapter_loads": True}  # admitted first: the store spills most
    result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_tp{tp}_{cuda_graphs}_{lora_kernels}_{slots}"))
    if slots:
        (worker,) = result["adapter_loads"]
        fills = worker["loads"]["slot_fill"] + worker["loads"]["slot_fill_ahead"]  # in a step, or ahead of it
        assert worker["imaged"] and fills >= len(ADAPTERS) - slots - 1, worker  # one slot kept for fills ahead
        assert worker["loads"]["restore"] + worker["loads"]["restore_ahead"] > 0, worker["loads"]
    worst = {}
    for name, output in zip(BATCH, result["outputs"], strict=True):
        reference = load_reference(assets["model"], assets[name] if name else None)
        margin, logprob_error = reference_errors(reference, prompts[name], output)
        worst[name] = (margin, logprob_error)
        assert margin < LOGPROB_ATOL, f"{name}: vLLM picked a token {margin:.3f} below PEFT's best"
        assert logprob_error < LOGPROB_ATOL, f"{name}: logprobs differ from PEFT's by {logprob_error:.3f}"
    print("worst (argmax margin, logprob error) per adapter:", worst)


GRAPHS = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
DORA_BATCH = [None, "bd64", "dora16", "bddora64"]


def test_slots_filled_ahead_on_gpu_match_peft(assets, prompts, tmp_path_factory):
    """Fused kernels, CUDA graphs, three adapters a step and four GPU slots (one for fills ahead: the batch's
    waiting adapters are filled into it), room for every adapter in vLLM's host cache, every adapter
    admitted first (as load requests do; an adapter a request names before any load is admitted in its step): after
    the batch, each adapter is asked alone, so each request finds its adapter in host memory and has it copied into
    the least recently used slot, on the fill stream, as it arrives (`vllm_bdlora.adapter_lifecycle.fill_ahead`); its
    step fills nothing and waits for that copy. In the batch, the two adapters the loads left in no slot are filled
    while other adapters' requests run, by the workers' model runner (vLLM's second runner on a GPU) after a step that
    named them, and by no step that runs them: their requests sit that step out. Every answer is checked against
    PEFT."""
    engine = engine_kwargs(assets["model"], 1, bdlora=True, dtype=DTYPE, enforce_eager=False, max_loras=3,
                           max_cpu_loras=len(ADAPTERS), additional_config={"bdlora": {"lora_kernels": "fused"}},
                           compilation_config={"pass_config": {"fuse_allreduce_rms": False}})  # fmt: skip
    after = [name for name in BATCH if name] * 2
    alone = [{"adapter": n, "prompt_token_ids": prompts[n]} for n in after]
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts, adapter_loads=True,
                      load_first=list(ADAPTERS), after=alone)  # fmt: skip
    result = run_engine(spec, tmp_path_factory.mktemp("gpu_fill_ahead"))
    (before,), (later,) = result["adapter_loads"], result["adapter_loads_after"]
    batch = before["loads"]
    assert batch["slot_fill"] == 0 and batch["slot_fill_ahead"] >= len(ADAPTERS) - 4, batch
    ahead = later["loads"]["slot_fill_ahead"] - before["loads"]["slot_fill_ahead"]
    in_step = later["loads"]["slot_fill"] - before["loads"]["slot_fill"]
    assert ahead >= len(after) - 4 and in_step == 0, (before, later)
    references = {name: load_reference(assets["model"], assets[name] if name else None) for name in BATCH}
    for label, names, outputs in (("batch", BATCH, result["outputs"]), ("after", after, result["after"])):
        for name, output in zip(names, outputs, strict=True):
            margin, error = reference_errors(references[name], prompts[name], output)
            assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"{label}/{name}: ({margin:.3f}, {error:.3f})"


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("lora_kernels", ["vllm", "fused"])
def test_a_poisoned_adapter_changes_no_other_answer_on_gpu(tp, lora_kernels, assets, prompts, tmp_path_factory):
    """test_isolation.py on a GPU, CUDA graphs on, both kernel paths: an adapter whose LoRA slot holds NaN
    (written past admission) shares a batch with a base-model request and every other adapter, then each of those is
    sent alone, reusing the KV-cache blocks it left; the poisoned request ends with an error naming its adapter (its
    sampled index stays inside the vocabulary: no device-side assert), and every other answer stays within
    LOGPROB_ATOL of PEFT's."""
    from tests.conftest import MAX_TOKENS

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    engine = engine_kwargs(assets["model"], tp, bdlora=True, dtype=DTYPE, enforce_eager=False,
                           max_loras=len(ADAPTERS) + 1, additional_config={"bdlora": {"lora_kernels": lora_kernels}},
                           **GRAPHS)  # fmt: skip
    batch = [*BATCH[:3], "poisoned", *BATCH[3:]]
    spec = {
        "engine": engine,
        "adapters": {name: assets[name] for name in ADAPTERS} | {"poisoned": assets["bd64"]},
        "requests": [{"adapter": n, "prompt_token_ids": prompts.get(n, prompts["bd64"])} for n in batch],
        "max_tokens": MAX_TOKENS,
        "poison": "poisoned",
        "after": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in BATCH],
    }
    result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_poisoned_tp{tp}_{lora_kernels}"))
    poisoned = result["outputs"][batch.index("poisoned")]  # ended alone, naming its adapter (vllm_bdlora.non_finite)
    assert poisoned["finish_reason"] == "error" and "LoRA adapter 'poisoned'" in poisoned["stop_reason"], poisoned
    honest = [(n, o) for n, o in zip(batch, result["outputs"], strict=True) if n != "poisoned"]
    worst = {}
    for label, pairs in (("batch", honest), ("after", list(zip(BATCH, result["after"], strict=True)))):
        for name, output in pairs:
            reference = load_reference(assets["model"], assets[name] if name else None)
            margin, error = reference_errors(reference, prompts[name], output)
            worst[f"{label}/{name}"] = (round(margin, 4), round(error, 4))
            assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"{label}/{name}: ({margin:.3f}, {error:.3f})"
    print(f"poisoned TP={tp} {lora_kernels} (PEFT argmax margin, logprob error):", worst,
          "KV non-finite entries:", result["kv_non_finite"])  # fmt: skip


def step_cosines(graph_out: dict, eager_out: dict) -> list[float]:
    """Cosine similarity of the next-token distributions (top-20 probabilities, other tokens 0) per step,
    over the steps where both paths chose the same tokens so far."""
    cosines = []
    for step, (g_top, e_top) in enumerate(zip(graph_out["top_logprobs"], eager_out["top_logprobs"], strict=True)):
        ids = sorted(set(g_top) | set(e_top))
        g = torch.tensor([math.exp(g_top[i]) if i in g_top else 0.0 for i in ids])
        e = torch.tensor([math.exp(e_top[i]) if i in e_top else 0.0 for i in ids])
        cosines.append(torch.nn.functional.cosine_similarity(g, e, dim=0).item())
        if graph_out["token_ids"][step] != eager_out["token_ids"][step]:
            break
    return cosines


@pytest.mark.parametrize("lora_kernels", ["vllm", "fused"])
def test_dora_cuda_graphs_match_eager_and_peft(lora_kernels, assets, tmp_path_factory):
    """DoRA (standard and BD) mixed with BD-LoRA and base requests, fp16, TP=1: the CUDA-graph +
    torch.compile path (custom ops: the compose kernel, or with lora_kernels "fused" the fused shrink and
    expand) against the eager path, and both against PEFT's DoRA forward teacher-forced."""
    import random

    rng = random.Random(7)
    prompts = {name: [rng.randrange(4, 512) for _ in range(6 + i)] for i, name in enumerate(DORA_BATCH)}
    reference_adapter = {"bd64": "bd64", "dora16": "dora16", "bddora64": "bddora64_dense"}
    results = {}
    for mode, extra in (("graphs", {"enforce_eager": False, **GRAPHS}), ("eager", {"enforce_eager": True})):
        engine = engine_kwargs(assets["model"], 1, bdlora=True, dtype=DTYPE, max_loras=4,
                               additional_config={"bdlora": {"dora": True, "lora_kernels": lora_kernels}},
                               **extra)  # fmt: skip
        spec = {
            "engine": engine,
            "adapters": {n: assets[n] for n in DORA_BATCH if n},
            "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in DORA_BATCH],
            "max_tokens": 8,
            "top_logprobs": 20,
        }
        results[mode] = run_engine(spec, tmp_path_factory.mktemp(f"gpu_dora_{lora_kernels}_{mode}"))
    summary = {}
    for name, g_out, e_out in zip(DORA_BATCH, results["graphs"]["outputs"], results["eager"]["outputs"], strict=True):
        cosines = step_cosines(g_out, e_out)
        assert min(cosines) >= 0.9999, f"{name}: CUDA-graph vs eager next-token cosine {min(cosines):.6f}"
        reference = load_reference(assets["model"], assets[reference_adapter[name]] if name else None)
        margin, error = reference_errors(reference, prompts[name], g_out)
        summary[name] = (round(min(cosines), 6), round(margin, 4), round(error, 4))
        assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"{name}: differs from PEFT ({margin:.3f}, {error:.3f})"
    print("per request (min graph/eager cosine, PEFT argmax margin, PEFT logprob error):", summary)


# FP8 over this tiny model: vLLM quantizes each layer's weight (q, k and v together, gate and up together) to
# float8_e4m3fn with one scale, and each GEMM's activations with a dynamic one. The reference dequantizes the
# same weights the same way in float32 PEFT; activation quantization (3 mantissa bits) it does not model. On an
# H100 that alone put the base-model request up to 0.21 off the reference (argmax margin 0.10), and LoRA requests
# up to 0.34 (fused BD, margin): the bound is twice the base request's own error. Served wrong, DoRA was ~4-5 off.
FP8_BATCH = [None, "bd64", "std16", "dora16", "bddora64"]
FP8_ATOL = 0.4
FP8_SHARED_SCALES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


def fp8_dequantized(model, tp: int = 1):
    """`model` (PEFT or Transformers) with every decoder projection's base weight replaced by its FP8 round trip
    as vLLM's online FP8 quantization stores it at tensor-parallel size `tp`: one scale per GPU's shard of each
    group (its rows of q, k and v together; its columns of o_proj)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model.model.model
    with torch.no_grad():
        for layer in decoder.layers:
            modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
            for group in FP8_SHARED_SCALES:
                weights = [getattr(modules[n], "base_layer", modules[n]).weight for n in group]
                shard_dim = 1 if group[0] in ("o_proj", "down_proj") else 0  # row- vs column-parallel
                for shard in range(tp):
                    parts = [w.chunk(tp, dim=shard_dim)[shard] for w in weights]
                    scale = max(w.abs().max() for w in parts) / torch.finfo(torch.float8_e4m3fn).max
                    for w in parts:
                        w.copy_((w / scale).to(torch.float8_e4m3fn).float() * scale)
    return model


def peft_errors(assets, prompts, name, output, reference_adapter, quantized, tp: int = 1) -> tuple[float, float]:
    """(argmax margin, logprob error) of one vLLM output against PEFT teacher-forced on its tokens."""
    model = load_reference(assets["model"], assets[reference_adapter.get(name, name)] if name else None)
    return reference_errors(fp8_dequantized(model, tp) if quantized else model, prompts[name], output)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_fp8_base_serves_bd_standard_and_dora_adapters_on_both_kernel_paths(tp, assets, tmp_path_factory):
    """--quantization fp8 over the bf16 model, CUDA graphs on: BD-LoRA, standard LoRA, DoRA and BD-DoRA on vLLM's
    and vllm-bdlora's kernels, each within FP8_ATOL of PEFT on the dequantized weights (DoRA's norm taken over the
    dequantized weight: read from FP8 storage it was off by ~1000x on square layers); and stock vLLM serving the
    densified adapters over the same base, against the same reference. At TP=2 every GPU quantizes its own shard."""
    import random

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    rng = random.Random(11)
    prompts = {name: [rng.randrange(4, 512) for _ in range(6 + i)] for i, name in enumerate(FP8_BATCH)}
    reference_adapter = {"bddora64": "bddora64_dense"}
    runs = {}
    for label, bdlora, kernels in (("vllm", True, "vllm"), ("fused", True, "fused"), ("stock", False, None)):
        batch = FP8_BATCH if bdlora else [None, "bd64", "std16"]
        adapters = {n: assets[n if bdlora else {"bd64": "bd64_dense"}.get(n, n)] for n in batch if n}
        extra = {"additional_config": {"bdlora": {"dora": True, "lora_kernels": kernels}}} if bdlora else {}
        engine = engine_kwargs(assets["model"], tp, bdlora=bdlora, dtype="bfloat16", quantization="fp8",
                               enforce_eager=False, max_loras=4, **GRAPHS, **extra)  # fmt: skip
        spec = {"engine": engine, "adapters": adapters, "max_tokens": 16, "top_logprobs": 5,
                "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in batch]}  # fmt: skip
        result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_fp8_tp{tp}_{label}"))
        runs[label] = dict(zip(batch, result["outputs"], strict=True))
    summary = {}
    for label, outputs in runs.items():
        for name, output in outputs.items():
            summary[f"{label}/{name}"] = peft_errors(assets, prompts, name, output, reference_adapter, True, tp)
    print(f"FP8 TP={tp} (PEFT argmax margin, PEFT logprob error):", summary)
    for key, (margin, error) in summary.items():
        assert margin < FP8_ATOL and error < FP8_ATOL, f"{key}: FP8 vs PEFT ({margin:.3f}, {error:.3f})"
    # vLLM's kernels serve the BD adapters exactly as stock vLLM serves them densified at TP=1. At TP=2 a BD
    # adapter is a rank-32 LoRA per GPU where stock vLLM runs the dense rank 64 (zeros included, its shrink summed
    # across GPUs): other roundings, bounded above through PEFT; the others still take stock vLLM's own path.
    for name in ("bd64", "std16", None) if tp == 1 else ("std16", None):
        assert runs["vllm"][name]["token_ids"] == runs["stock"][name]["token_ids"], name


RAY_LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tensor parallel, pipeline parallel)


@pytest.mark.parametrize("tp,pp", RAY_LAYOUTS, ids=["tp1", "tp2", "pp2"])
def test_ray_executor_serves_bd_adapters_like_the_default_executor(tp, pp, assets, prompts, tmp_path_factory,
                                                                    monkeypatch):  # fmt: skip
    """`--distributed-executor-backend ray` at TP=1, TP=2 and PP=2: the plugin loads in every Ray worker, each
    pipeline stage reports its BD layers from its own worker, and every request equals the default executor's in
    the same layout and PEFT's teacher-forced."""
    pytest.importorskip("ray")
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")  # Ray folds identical lines of several workers into one
    results, logs = {}, {}
    for executor in ("mp", "ray"):
        engine = engine_kwargs(assets["model"], tp, bdlora=True, dtype=DTYPE, pipeline_parallel_size=pp,
                               distributed_executor_backend=executor)  # fmt: skip
        workdir = tmp_path_factory.mktemp(f"gpu_executor_{executor}_tp{tp}_pp{pp}")
        results[executor] = run_engine(batch_spec(engine, {n: assets[n] for n in ADAPTERS}, prompts), workdir)
        logs[executor] = (workdir / "engine.log").read_text()
    worst = {}
    for name, ray_out, mp_out in zip(BATCH, results["ray"]["outputs"], results["mp"]["outputs"], strict=True):
        assert ray_out["token_ids"] == mp_out["token_ids"], f"{name}: Ray executor tokens differ"
        diff = max(abs(a - b) for a, b in zip(ray_out["logprobs"], mp_out["logprobs"], strict=True))
        # Two engine runs of the same batch differ by fp16 summation order alone (up to 3.9e-3 seen on H100s).
        assert diff < 1e-2, f"{name}: Ray executor logprobs differ by {diff:.2e}"
        margin, error = peft_errors(assets, prompts, name, ray_out, {}, quantized=False)
        worst[name] = (round(diff, 5), round(margin, 4), round(error, 4))
        assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"{name}: Ray vs PEFT ({margin:.3f}, {error:.3f})"
    print(f"Ray TP={tp} PP={pp} (logprob diff to mp, PEFT argmax margin, PEFT logprob error):", worst)
    # Every Ray worker's lines carry "(RayWorkerProc pid=N)" (after the engine core's own prefix): each worker
    # loads the plugin (its kernels' launch plans), and the first TP rank of each pipeline stage reports the BD
    # layers it holds and admits the adapter (the plugin logs those once per stage, not once per GPU).
    lines = logs["ray"].splitlines()
    expected = {("vllm-bdlora:",): tp * pp, ("BD-LoRA packed qkv", f"layer(s), TP={tp}"): pp,
                ("vllm-bdlora: adapter 'bd64' (BD-LoRA",): pp}  # fmt: skip
    found = {fragments: ray_workers(lines, *fragments) for fragments in expected}
    print("Ray worker pids per log line:", {fragments[0]: sorted(pids) for fragments, pids in found.items()})
    for fragments, count in expected.items():
        assert len(found[fragments]) == count, (fragments, found[fragments], logs["ray"][-3000:])


def ray_workers(lines: list[str], *fragments: str) -> set[str]:
    """The process ids of the Ray workers that logged a line holding every one of `fragments`."""
    found = set()
    for line in lines:
        worker = re.search(r"\(RayWorker\w* pid=(\d+)\)", line)
        if worker and all(fragment in line for fragment in fragments):
            found.add(worker.group(1))
    return found


def test_moe_model_serves_bd_on_attention_and_refuses_bd_factors_on_experts(tmp_path_factory):
    """A tiny Qwen3-MoE (vLLM's fused MoE layer, whose LoRA runs on Triton kernels vLLM's CPU build lacks): BD-LoRA
    and standard adapters on attention match PEFT, fp16, on both kernel paths; an adapter with block-diagonal factors
    on the experts is refused naming them, and the server keeps serving the others after it."""
    import random

    from vllm_bdlora import tiny

    root = tmp_path_factory.mktemp("moe")
    model = tiny.make_tiny_model(str(root / "model"), "qwen3_moe")
    adapters = {
        "bd32": tiny.make_adapter(model, str(root / "bd32"), 32, nblocks=2, target_modules=tiny.ATTENTION, seed=41),
        "std8": tiny.make_adapter(model, str(root / "std8"), 8, target_modules=tiny.ATTENTION, seed=42),
    }
    adapters["bd-experts"] = tiny.make_bd_experts_adapter(str(root / "bd-experts"))
    batch = [None, "bd32", "std8"]
    rng = random.Random(5)
    prompts = {name: [rng.randrange(4, 512) for _ in range(6 + i)] for i, name in enumerate(batch)}
    for kernels in ("vllm", "fused"):
        engine = engine_kwargs(model, 1, bdlora=True, dtype=DTYPE, enforce_eager=False, max_loras=2, **GRAPHS,
                               additional_config={"bdlora": {"lora_kernels": kernels}})  # fmt: skip
        spec = {"engine": engine, "adapters": adapters, "max_tokens": 16, "expect_errors": ["bd-experts"],
                "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in batch]}  # fmt: skip
        result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_moe_{kernels}"))
        refusal = result["errors"]["bd-experts"]
        assert refusal and "block-diagonal LoRA factors on an expert" in refusal, refusal
        assert "experts.0.up_proj" in refusal and "target_modules_bd_a/b" in refusal, refusal
        worst = {}
        for name, output in zip(batch, result["outputs"], strict=True):
            reference = load_reference(model, adapters[name] if name else None)
            margin, error = reference_errors(reference, prompts[name], output)
            worst[name] = (round(margin, 4), round(error, 4))
            assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"MoE {kernels}/{name}: ({margin:.3f}, {error:.3f})"
        print(f"MoE {kernels} (PEFT argmax margin, PEFT logprob error):", worst)

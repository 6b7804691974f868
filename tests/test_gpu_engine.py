"""The same batch as test_engine_vs_peft.py on a CUDA GPU (vLLM's Triton LoRA kernels, which need fp16
or bf16). Greedy paths may legitimately diverge from PEFT's float32 ones after a near-tie, so each step
is checked teacher-forced: PEFT scores vLLM's own continuation, and vLLM's chosen token must be PEFT's
argmax up to LOGPROB_ATOL, with the same log-probability up to LOGPROB_ATOL."""

import math

import pytest
import torch

from tests.conftest import ADAPTERS, BATCH, batch_spec, engine_kwargs, run_engine
from vllm_bdlora.peft_reference import load_reference

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

DTYPE = "float16"
LOGPROB_ATOL = 0.05  # fp16 activations and LoRA weights vs a float32 reference


@torch.no_grad()
def teacher_forced(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize(
    "tp,cuda_graphs,lora_kernels,slots",
    [(1, False, "vllm", None), (2, False, "vllm", None), (2, True, "vllm", None), (1, True, "fused", None),
     (2, True, "auto", None), (1, True, "fused", 2)],
    ids=["tp1", "tp2", "tp2-cudagraphs", "tp1-cudagraphs-fused", "tp2-cudagraphs-auto", "tp1-cudagraphs-fused-2slots"],
)  # fmt: skip
def test_bd_on_gpu_matches_peft(tp, cuda_graphs, lora_kernels, slots, assets, prompts, tmp_path_factory):
    """fused/auto: the layers run the fused kernels, and over this unquantized base the base GEMM after
    them (delta first). slots=2: six adapters through two GPU slots (the fused kernels also read each slot's
    width, which a refill must rewrite; see test_more_adapters_than_gpu_slots_still_match_peft)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    graphs = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}} if cuda_graphs else {}
    engine = engine_kwargs(assets["model"], tp, bdlora=True, dtype=DTYPE, enforce_eager=not cuda_graphs,
                           additional_config={"bdlora": {"lora_kernels": lora_kernels}}, **graphs)  # fmt: skip
    if slots:
        engine["max_loras"] = slots
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts)
    result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_tp{tp}_{cuda_graphs}_{lora_kernels}_{slots}"))
    worst = {}
    for name, output in zip(BATCH, result["outputs"], strict=True):
        reference = teacher_forced(load_reference(assets["model"], assets[name] if name else None),
                                   prompts[name], output["token_ids"])  # fmt: skip
        chosen = reference[torch.arange(len(output["token_ids"])), torch.tensor(output["token_ids"])]
        margin = (reference.max(dim=-1).values - chosen).max().item()
        logprob_error = (chosen - torch.tensor(output["logprobs"])).abs().max().item()
        worst[name] = (margin, logprob_error)
        assert margin < LOGPROB_ATOL, f"{name}: vLLM picked a token {margin:.3f} below PEFT's best"
        assert logprob_error < LOGPROB_ATOL, f"{name}: logprobs differ from PEFT's by {logprob_error:.3f}"
    print("worst (argmax margin, logprob error) per adapter:", worst)


GRAPHS = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
DORA_BATCH = [None, "bd64", "dora16", "bddora64"]


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
        reference = teacher_forced(load_reference(assets["model"], assets[reference_adapter[name]] if name else None),
                                   prompts[name], g_out["token_ids"])  # fmt: skip
        chosen = reference[torch.arange(len(g_out["token_ids"])), torch.tensor(g_out["token_ids"])]
        margin = (reference.max(dim=-1).values - chosen).max().item()
        error = (chosen - torch.tensor(g_out["logprobs"])).abs().max().item()
        summary[name] = (round(min(cosines), 6), round(margin, 4), round(error, 4))
        assert margin < LOGPROB_ATOL and error < LOGPROB_ATOL, f"{name}: differs from PEFT ({margin:.3f}, {error:.3f})"
    print("per request (min graph/eager cosine, PEFT argmax margin, PEFT logprob error):", summary)

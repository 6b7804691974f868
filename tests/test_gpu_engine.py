"""The same batch as test_engine_vs_peft.py on a CUDA GPU (vLLM's Triton LoRA kernels, which need fp16
or bf16). Greedy paths may legitimately diverge from PEFT's float32 ones after a near-tie, so each step
is checked teacher-forced: PEFT scores vLLM's own continuation, and vLLM's chosen token must be PEFT's
argmax up to LOGPROB_ATOL, with the same log-probability up to LOGPROB_ATOL."""

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


@pytest.mark.parametrize("tp,cuda_graphs", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-cudagraphs"])
def test_bd_on_gpu_matches_peft(tp, cuda_graphs, assets, prompts, tmp_path_factory):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    graphs = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}} if cuda_graphs else {}
    engine = engine_kwargs(assets["model"], tp, bdlora=True, dtype=DTYPE, enforce_eager=not cuda_graphs, **graphs)
    spec = batch_spec(engine, {name: assets[name] for name in ADAPTERS}, prompts)
    result = run_engine(spec, tmp_path_factory.mktemp(f"gpu_tp{tp}_{cuda_graphs}"))
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

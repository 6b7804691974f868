"""The independent reference: PEFT/Transformers greedy decoding on the same weights, in float32.
Used by the tests and by the demo's "same as PEFT" check."""

from __future__ import annotations

import torch


def load_reference(base_dir: str, adapter_dir: str | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.no_grad()
def greedy(model, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and the log-probability of each chosen token."""
    ids = torch.tensor([prompt_token_ids])
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        logits = model(input_ids=ids).logits[0, -1].float()
        log_softmax = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(log_softmax[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


# A GPU serves LoRA in 16 bits (vLLM's GPU LoRA kernels take fp16/bf16 only): its greedy tokens may part from a
# float32 reference where the reference's two best were this close.
GPU_LOGPROB_TOLERANCE = 0.05


@torch.no_grad()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`model`'s log-probabilities (float32) at each step of `tokens` continuing `prompt`, the tokens given: how a
    reference scores another engine's own continuation, so that a near-tie that went the other way is no failure."""
    ids = torch.tensor([prompt + tokens])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def argmax_margin(model, prompt: list[int], tokens: list[int]) -> float:
    """How far below the reference's best token each of `tokens` was, at worst (0: the reference's own greedy)."""
    if not tokens:
        return 0.0
    scores = teacher_forced(model, prompt, tokens)
    chosen = scores[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (scores.max(dim=-1).values - chosen).max().item()

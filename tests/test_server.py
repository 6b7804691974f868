"""The OpenAI-compatible server, started as users start it, TP=2: the README's hand-serving command run as written
(`vllm serve ... --enable-bdlora` over the demo's model and adapters) serves the module's requests; PEFT's example
flags and a bad --lora-modules entry get servers of their own."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import SERVER_MAX_TOKENS, SERVER_PROMPT, cpu_engine_env, peft_words, readme_block_after
from vllm_bdlora import tiny
from vllm_bdlora.serve import demo
from vllm_bdlora.serve.process import free_port, running_server, wait_healthy

PROMPT, MAX_TOKENS = SERVER_PROMPT, SERVER_MAX_TOKENS
PROMPT_TEXT = " ".join(f"w{i}" for i in PROMPT)
START_TIMEOUT = 240
# Where the README's command finds the demo's model and adapters, and where it listens.
DEMO_DIR = os.path.join(tempfile.gettempdir(), "vllm-bdlora-demo")
README_URL = "http://127.0.0.1:8000"


def serve_command(assets, port, lora_modules):
    return [
        "vllm", "serve", assets["model"], "--enable-bdlora", "--tensor-parallel-size", "2",
        "--max-lora-rank", "64", "--max-loras", "4", "--dtype", "float32", "--max-model-len", "256",
        "--enforce-eager", "--port", str(port), "--lora-modules",
        *[f"{name}={path}" for name, path in lora_modules.items()],
    ]  # fmt: skip


def server_env():
    env = cpu_engine_env(2)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


@pytest.fixture(scope="module")
def demo_assets():
    return demo.make_assets(DEMO_DIR)


@pytest.fixture(scope="module")
def server(demo_assets, tmp_path_factory):
    """The README's hand-serving command, as written (port 8000), with none of vLLM's CPU variables set (the plugin
    picks thread binding and KV cache size where vLLM's defaults would stop the server) and runtime adapter loading
    on for the load tests."""
    command = readme_block_after("**Serving by hand on CPU.**")
    assert DEMO_DIR in command and "--port" not in command
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=Path(__file__).parents[1], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_healthy(proc, README_URL, str(log_path), START_TIMEOUT)
        yield README_URL, log_path, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def reference_words(demo_assets, assets):
    """PEFT's answers for the README server's base model, its two adapters and the test assets' bd48 it loads."""
    adapters = {
        None: None,
        "bd-r64": demo_assets["bd-r64"],
        "lora-r16": demo_assets["lora-r16"],
        "bd48": assets["bd48"],
    }
    return {name: peft_words(demo_assets["model"], path) for name, path in adapters.items()}


def complete(url, model, **extra):
    body = {"model": model, "prompt": PROMPT_TEXT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return requests.post(f"{url}/v1/completions", json=body | extra, timeout=120)


def load(url, name, path):
    return requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120)


@pytest.mark.engine
def test_models_lists_adapters(server, demo_assets):
    url, _, _ = server
    ids = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert ids == [demo_assets["model"], "bd-r64", "lora-r16"]


@pytest.mark.engine
def test_the_plugin_picks_the_cpu_settings_the_readme_command_leaves_out(server):
    _, log_path, _ = server
    log = log_path.read_text()
    assert "VLLM_CPU_OMP_THREADS_BIND=" in log and "VLLM_CPU_KVCACHE_SPACE=" in log


@pytest.mark.engine
def test_start_up_warnings_that_ask_nothing_are_left_out(server):
    from vllm_bdlora.serve.quiet_logs import NOTES

    _, log_path, _ = server
    log = log_path.read_text()
    shown = [start for _, start in NOTES if start in log]
    assert not shown, shown
    assert "vllm-bdlora: adapter 'bd-r64'" in log  # the log itself is there


@pytest.mark.engine
def test_startup_logs_say_how_adapters_are_sharded(server, demo_assets):
    from vllm_bdlora.sizing import ModelShape, slot_cost

    _, log_path, _ = server
    log = log_path.read_text()
    assert "BD-LoRA packed qkv (q_proj, k_proj, v_proj): 2 layer(s), TP=2, per-GPU LoRA width 32" in log
    assert "BD-LoRA merged column-parallel (e.g. gate_up_proj): 2 layer(s)" in log
    assert "BD-LoRA row-parallel (e.g. o_proj, down_proj): 4 layer(s)" in log
    # One slot per worker, counted from the tiny model's shapes: width 32 (rank 64 / TP 2), float32, per layer
    # qkv A 3·32·128 + B (64+32+32)·32, gate_up A 2·32·128 + B 2·128·32, o A 32·64 + B 128·32, down A 32·128 + B 128·32;
    # vLLM's embeddings and lm_head LoRA: A and B, vocabulary 512 x rank 64 and hidden 128 x rank 64 each.
    per_layer = 3 * 32 * 128 + 128 * 32 + 2 * 32 * 128 + 2 * 128 * 32 + 32 * 64 + 128 * 32 + 32 * 128 + 128 * 32
    bd_mib = 2 * per_layer * 4 / 2**20
    slot_mib = bd_mib + 2 * (512 * 64 + 128 * 64) * 4 / 2**20
    assert (f"LoRA slots: 5 (--max-loras 4 adapters a step, 1 for fills ahead) x {slot_mib:.2f} MiB per worker = "
            f"{5 * slot_mib:.2f} MiB") in log  # fmt: skip
    assert f"(BD layers {bd_mib:.2f} MiB a slot" in log
    # ... which is what `vllm-bdlora check` computes from the model's config.json for this server
    cost = slot_cost(ModelShape.from_config(demo_assets["model"]), 64, 2, block_diagonal=True)
    assert round(cost.total / 2**20, 2) == round(slot_mib, 2) and round(cost.projections / 2**20, 2) == round(bd_mib, 2)
    assert "adapter 'bd-r64' (BD-LoRA nblocks=2, r=64): 14 module(s) sharded, 14 block-diagonal" in log
    assert "adapter 'lora-r16' (standard LoRA, r=16): 14 module(s) sharded, 0 block-diagonal" in log


@pytest.mark.engine
@pytest.mark.parametrize("model", ["base", "bd-r64", "lora-r16"])
def test_completion_chat_and_stream_match_peft(server, demo_assets, reference_words, model):
    url, _, _ = server
    name = None if model == "base" else model
    served = demo_assets["model"] if name is None else name
    expected = reference_words[name]
    completion = complete(url, served).json()["choices"][0]["text"]
    assert completion.split() == expected
    chat = requests.post(
        f"{url}/v1/chat/completions",
        json={"model": served, "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": MAX_TOKENS,
              "temperature": 0, "ignore_eos": True},
        timeout=120,
    ).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"].split() == expected
    with complete(url, served, stream=True) as response:
        chunks = [
            json.loads(line[len(b"data: "):])["choices"][0]["text"]
            for line in response.iter_lines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"
        ]  # fmt: skip
    assert len(chunks) > 1 and "".join(chunks).split() == expected


@pytest.mark.engine
def test_dynamic_load_and_unload(server, assets, reference_words):
    url, _, _ = server
    assert load(url, "bd48", assets["bd48"]).status_code == 200
    assert complete(url, "bd48").json()["choices"][0]["text"].split() == reference_words["bd48"]
    response = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "bd48"}, timeout=60)
    assert response.status_code == 200
    assert complete(url, "bd48").status_code == 404


@pytest.mark.engine
def test_an_unknown_model_is_answered_with_what_is_served(server, demo_assets):
    """A mistyped adapter name gets 404 naming the served adapters and the one probably meant, not only the base."""
    url, _, _ = server
    answer = complete(url, "bd-r46")
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert "The model `bd-r46` does not exist. Did you mean `bd-r64`?" in message, message
    assert f"base model `{demo_assets['model']}`" in message and "`lora-r16`" in message, message


def test_the_unknown_model_answer_lists_close_names_first_and_counts_the_rest():
    from vllm_bdlora.answers import LISTED_ADAPTERS, unknown_model_message

    adapters = [f"tenant-{i:03d}" for i in range(LISTED_ADAPTERS + 5)] + ["support-bd128"]
    message = unknown_model_message("suport-bd128", ["base"], adapters)
    assert "Did you mean `support-bd128`?" in message
    assert "adapters: `support-bd128`, `tenant-000`" in message and "and 6 more (GET /v1/models" in message
    assert (
        unknown_model_message("x", ["base"], [])
        == "The model `x` does not exist. Served: base model `base`; no adapters."
    )


def broken_copy(source, destination, edit_config=None):
    shutil.copytree(source, destination)
    if edit_config:
        config = json.loads((destination / "adapter_config.json").read_text())
        edit_config(config)
        (destination / "adapter_config.json").write_text(json.dumps(config))
    return destination


def test_a_servers_port_is_one_the_kernel_never_hands_to_a_socket_bound_to_port_0():
    """A running engine's workers bind dozens of listeners to port 0; a server's port must not be one of those the
    kernel may choose for them before the server binds it."""
    import socket

    from vllm_bdlora.serve.process import ephemeral_port_range

    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(32)]
    assert len(set(ports)) == len(ports), ports
    assert not any(low <= port <= high for port in ports), (ports, low, high)
    for port in ports:  # free on every interface, as `vllm serve` binds it
        with socket.socket() as s:
            s.bind(("", port))


@pytest.mark.engine
def test_bad_adapters_get_400_and_the_server_keeps_serving(server, assets, reference_words, tmp_path):
    url, _, _ = server
    cases = {
        "too_wide": (assets["std64"], ("--max-lora-rank 128",)),
        "nblocks_not_a_number": (
            broken_copy(assets["bd64"], tmp_path / "nb", lambda c: c["use_bdlora"].update(nblocks="two")),
            ("use_bdlora.nblocks must be a positive integer",),
        ),
        "for_a_deeper_model": (  # its layer 2 does not exist here
            tiny.make_adapter(
                tiny.make_tiny_llama(str(tmp_path / "deeper"), num_hidden_layers=3), str(tmp_path / "deep"), rank=8
            ),
            ("model.layers.2.self_attn.q_proj", "no such LoRA-capable module in this model"),
        ),
        "rank_over_max": (
            tiny.make_adapter(assets["model"], str(tmp_path / "r128"), rank=128, nblocks=2, seed=3),
            ("LoRA rank 128 is greater than max_lora_rank 64", "Fix: start the server with --max-lora-rank 128"),
        ),
        "for_a_wider_model": (  # what vllm-bdlora check says too (test_check.py)
            tiny.make_adapter(
                tiny.make_tiny_llama(str(tmp_path / "wider"), hidden_size=256), str(tmp_path / "wide"), rank=8
            ),
            ("made for another base model: lora_A takes 256 inputs, this model's layer takes 128",),
        ),
    }
    for name, (path, messages) in cases.items():
        response = load(url, name, path)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == "BadRequestError"
        for message in (f"LoRA adapter rejected: '{name}'", *messages):
            assert message in error["message"], error
    missing = load(url, "missing", tmp_path / "does-not-exist")
    assert missing.status_code == 404
    # Every other adapter still serves, and serves the same tokens.
    for model in ("bd-r64", "lora-r16"):
        assert complete(url, model).json()["choices"][0]["text"].split() == reference_words[model]
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]][1:] == ["bd-r64", "lora-r16"]


@pytest.mark.engine
def test_bad_adapter_at_startup_stops_the_server_with_a_clear_message(assets):
    proc = subprocess.run(
        serve_command(assets, free_port(), {"bd64": assets["bd64"], "wide": assets["std64"]}),
        env=server_env(), capture_output=True, text=True, timeout=START_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "LoRA adapter rejected: 'wide'" in output
    assert "start the server with --max-lora-rank 128" in output


@pytest.mark.engine
def test_peft_bdlora_example_flags_serve_concurrent_and_streaming_clients(assets, asset_words, tmp_path):
    """PEFT's examples/bdlora_finetuning/vllm_server.bash passes --block_diagonal_sharded_loras (the flag of vLLM's
    BD-LoRA pull request) to `python -m vllm.entrypoints.openai.api_server`; its chat.py sends 32 concurrent
    deterministic completions. Served here with those flags (plus float32 and a short context for CPU)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", assets["model"], "--enable-lora",
        "--lora-modules", f"lora1={assets['bd64']}", f"lora2={assets['std16']}", "--tensor-parallel-size", "2",
        "--block_diagonal_sharded_loras", "--max-lora-rank", "128", "--enforce-eager", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256",
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with running_server(command, str(log_path), 2, server_env(), START_TIMEOUT) as (_, url):
        assert "--block-diagonal-sharded-loras is read as --enable-bdlora" in log_path.read_text()
        deterministic = {"temperature": 0, "top_p": 1, "top_k": 1}
        jobs = [("lora1", "bd64"), ("lora2", "std16")] * 16
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda job: complete(url, job[0], **deterministic).json(), jobs))
        for (_, adapter), answer in zip(jobs, answers, strict=True):
            assert answer["choices"][0]["text"].split() == asset_words[adapter]
        with complete(url, "lora1", stream=True, **deterministic) as response:
            chunks = [json.loads(line[len(b"data: "):])["choices"][0]["text"] for line in response.iter_lines()
                      if line.startswith(b"data: ") and line != b"data: [DONE]"]  # fmt: skip
        assert len(chunks) > 1 and "".join(chunks).split() == asset_words["bd64"]


@pytest.mark.engine
def test_ctrl_c_stops_the_server_in_a_few_lines_without_a_traceback(server):
    """The module's last test: Ctrl-C (SIGINT to the terminal's process group) stops the README's server with status
    0 in seconds, and what it prints after is a few lines, without a traceback or the interpreter's teardown noise."""
    _, log_path, proc = server
    before = len(log_path.read_text())
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    # What the server's children (the resource tracker) print as they exit: until the log stops growing, 5 s at most.
    size, settle = -1, time.monotonic() + 5
    while time.monotonic() < settle and size != (size := len(log_path.read_text())):
        time.sleep(1)
    after = log_path.read_text()[before:]
    assert len(after.strip().splitlines()) <= 5, after
    for noise in ("Traceback", "Exception ignored", "nanobind", "[shutdown]", "resource_tracker"):
        assert noise not in after, after

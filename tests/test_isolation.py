"""One tenant's adapter never changes another tenant's answer: vLLM with the plugin at TP=2 on CPU against PEFT.

Admission refuses every adapter whose values could overflow (test_admission.py, and the bad-adapter corpus the
server tests send); this file writes NaN straight into an admitted adapter's LoRA slot, past admission, and holds
every other request to PEFT's answer: in the same batch (every LoRA op path masks, test_kernels_isolation.py checks
the GPU kernels) and afterwards, when requests reuse the KV-cache blocks its request left."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import ADAPTERS, BATCH, MAX_TOKENS, assert_matches_reference, engine_kwargs, run_engine
from tests.test_server import server_env
from vllm_bdlora.serve.process import free_port, running_server

pytestmark = pytest.mark.engine


def test_a_poisoned_adapter_in_an_engine_of_its_own_changes_no_other_answer(
    assets, prompts, peft_reference, tmp_path_factory
):
    """The poisoned request shares one batch with a base-model request and every other adapter; then each of
    those is sent alone. The spec poisons its engine, which its host shuts down after it (tests/engine_runner.py).
    The poisoned request's NaN logits end it alone (vllm_bdlora.non_finite).
    Its NaN hidden states never reach the KV cache (cpu_kv_cache_holds_finite_values: vLLM's
    CPU attention weighs a reused block's stale rows by zero, and 0 x NaN is NaN)."""
    engine = engine_kwargs(assets["model"], 2, bdlora=True, max_loras=len(ADAPTERS) + 1)
    adapters = {name: assets[name] for name in ADAPTERS} | {"poisoned": assets["bd64"]}
    batch = [*BATCH[:3], "poisoned", *BATCH[3:]]
    spec = {
        "engine": engine,
        "adapters": adapters,
        "requests": [{"adapter": n, "prompt_token_ids": prompts.get(n, prompts["bd64"])} for n in batch],
        "max_tokens": MAX_TOKENS,
        "poison": "poisoned",
        "after": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in BATCH],
    }
    result = run_engine(spec, tmp_path_factory.mktemp("poisoned"))
    poisoned = result["outputs"][batch.index("poisoned")]
    # the poison reached its own request, which ended with an error naming its adapter and no token
    assert poisoned["finish_reason"] == "error" and poisoned["token_ids"] == [], poisoned
    assert "LoRA adapter 'poisoned': the logits of this request held NaN or Inf" in poisoned["stop_reason"]
    honest = [(name, output) for name, output in zip(batch, result["outputs"], strict=True) if name != "poisoned"]
    assert_matches_reference({"outputs": [o for _, o in honest]}, peft_reference, [n for n, _ in honest])
    assert result["kv_non_finite"] == [0, 0]
    assert_matches_reference({"outputs": result["after"]}, peft_reference)


def overflowing_adapter(source: str, path: Path, gain: float = 6e4) -> Path:
    """`source` (a standard LoRA adapter) with every MLP module's gain `|s| x ||A|| x ||B||` set to `gain`: under the
    float16 limit admission enforces (65,504), yet gate x up of a normalised hidden state overflows float16."""
    from safetensors.torch import load_file, save_file

    from vllm_bdlora.adapter_lifecycle.files import module_scaling

    shutil.copytree(source, path)
    tensors = load_file(path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    for name in list(tensors):
        if ".lora_B" in name and (".gate_proj" in name or ".up_proj" in name):
            a = tensors[name.replace(".lora_B", ".lora_A")].float()
            b = tensors[name].float()
            module = name.split(".lora_B", 1)[0].removeprefix("base_model.model.")
            scale = gain / (abs(module_scaling(config, module)) * a.norm() * b.norm())
            tensors[name] = (b * scale).to(tensors[name].dtype)
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def test_an_adapter_overflowing_float16_ends_its_request_alone_on_a_server(assets, tmp_path):
    """A finite adapter admission accepts overflows in float16 arithmetic at TP=2: its request is answered 422 naming
    it (vLLM samples such rows anyway and answers garbage, or on a GPU kills the engine), while the base model and
    another adapter in the same batch answer as when sent alone, and the server goes on."""
    overflow = overflowing_adapter(assets["std16"], tmp_path / "overflow")
    command = [
        "vllm", "serve", assets["model"], "--enable-bdlora", "--tensor-parallel-size", "2", "--max-lora-rank", "64",
        "--max-loras", "2", "--dtype", "float16", "--max-model-len", "256", "--enforce-eager",
        "--port", str(free_port()), "--lora-modules", f"bd64={assets['bd64']}", f"overflow={overflow}",
    ]  # fmt: skip
    with running_server(command, str(tmp_path / "server.log"), 2, server_env(), 240) as (_, url):

        def ask(model):
            body = {"model": model, "prompt": "w10 w20 w30 w40 w50 w60", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            return requests.post(f"{url}/v1/completions", json=body, timeout=120)

        alone = {model: ask(model).json()["choices"][0]["text"] for model in ("bd64", assets["model"])}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, ["overflow", "bd64", assets["model"]] * 2))
        for answer in answers[0::3]:
            assert answer.status_code == 422, answer.text
            message = answer.json()["error"]["message"]
            assert "LoRA adapter 'overflow'" in message and "held NaN or Inf" in message, message
        for answer, model in zip(answers, ["overflow", "bd64", assets["model"]] * 2, strict=True):
            if model != "overflow":
                assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == alone[model], answer.text
        streamed = requests.post(f"{url}/v1/completions", json={"model": "overflow", "prompt": "w10 w20",
                                 "max_tokens": 4, "stream": True}, timeout=120)  # fmt: skip
        assert "LoRA adapter 'overflow'" in streamed.text and "[DONE]" in streamed.text, streamed.text
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        assert ask("bd64").json()["choices"][0]["text"] == alone["bd64"]
        log = (tmp_path / "server.log").read_text()
        assert "held NaN or Inf" in log and "Traceback" not in log, log[-3000:]

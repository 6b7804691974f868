"""Ray Serve LLM, deployed as the README says: its `bdlora-serve.yaml` (read from the README) with a tiny model, TP=2,
two replicas, and adapters multiplexed from an S3 store on 127.0.0.1 (moto's server). Answers equal PEFT's, every
replica loads the plugin and shards BD layers, each adapter is loaded by one replica and later requests for it are
routed there, and a refused adapter gets HTTP 400 while the replicas keep serving."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from bench.bad_adapters import BAD_ADAPTERS
from tests.conftest import cpu_engine_env, ray_serve_llm_unavailable, readme_block_after
from vllm_bdlora.peft_reference import greedy, load_reference
from vllm_bdlora.serve.process import free_port, wait_healthy

UNAVAILABLE = ray_serve_llm_unavailable()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")]

TP, REPLICAS = 2, 2
PROMPT = [10, 20, 30, 40, 50, 60]
MAX_TOKENS = 16
START_TIMEOUT = 600
BUCKET = "adapters"
S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
ADAPTERS = ("bd64", "std16")
REFUSED = next(bad for bad in BAD_ADAPTERS if bad.kind == "nan_weights")


def readme_serve_config() -> dict:
    """The README's `bdlora-serve.yaml`."""
    import yaml

    return yaml.safe_load(readme_block_after("`serve run bdlora-serve.yaml`:", "yaml"))


def serve_config(model: str, port: int) -> dict:
    """The README's file, pointed at the tiny model and the local store, sized for this machine's CPU."""
    config = readme_serve_config()
    llm = config["applications"][0]["args"]["llm_configs"][0]
    assert llm["engine_kwargs"]["additional_config"] == {"bdlora": {}}
    llm["model_loading_config"] = {"model_id": "tiny", "model_source": model}
    llm["lora_config"]["dynamic_lora_loading_path"] = f"s3://{BUCKET}"
    llm["engine_kwargs"].update(tensor_parallel_size=TP, max_lora_rank=64, dtype="float32", max_model_len=256,
                                enforce_eager=True)  # fmt: skip
    llm["deployment_config"]["num_replicas"] = REPLICAS
    llm["accelerator_config"] = {"kind": "cpu"}
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    return config


@pytest.fixture(scope="module")
def s3_store(assets, tmp_path_factory):
    """moto's S3 server on 127.0.0.1 holding the adapters (and one the server must refuse), one folder each."""
    import boto3

    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(endpoint, timeout=10)
                break
            except requests.RequestException:
                assert time.monotonic() < deadline and proc.poll() is None, "moto's S3 server did not start"
                time.sleep(0.5)
        s3 = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in S3_ENV.items() if "KEY" in k},
                          region_name=S3_ENV["AWS_DEFAULT_REGION"])  # fmt: skip
        s3.create_bucket(Bucket=BUCKET)
        folders = {name: assets[name] for name in ADAPTERS}
        folders[REFUSED.kind] = REFUSED.make(assets["bd64"], tmp_path_factory.mktemp("bad") / REFUSED.kind)
        for name, folder in folders.items():
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                s3.upload_file(os.path.join(folder, file), BUCKET, f"{name}/{file}")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def ray_serve(assets, s3_store, tmp_path_factory):
    """`serve run bdlora-serve.yaml` in its own process group, healthy; yields (url, log path)."""
    import yaml

    workdir = tmp_path_factory.mktemp("ray_serve")
    port = free_port()
    config_path = workdir / "bdlora-serve.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(assets["model"], port)))
    env = {
        **cpu_engine_env(TP),
        **S3_ENV,
        "AWS_ENDPOINT_URL": s3_store,
        # A local Ray cluster counts this machine's cores (2); each replica's placement group asks one CPU per TP
        # worker, plus one for the replica.
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": REPLICAS * (TP + 1) + 2}),
        "RAY_DEDUP_LOGS": "0",  # every replica's start-up lines, not one of them
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    log_path = workdir / "serve.log"
    serve = str(Path(sys.executable).parent / "serve")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve, "run", str(config_path)], cwd=workdir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, str(log_path), START_TIMEOUT, route="/v1/models", name="serve run")
        yield url, log_path
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # serve run shuts its application and local Ray cluster down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(url: str, model: str) -> requests.Response:
    body = {"model": model, "prompt": " ".join(f"w{t}" for t in PROMPT), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return requests.post(f"{url}/v1/completions", json=body, timeout=300)


def replica_lines(log: str, needle: str) -> dict[str, list[str]]:
    """Lines containing `needle`, by the Serve replica (its pid in Ray's prefix) that logged them."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        match = re.search(r"\(ServeReplica:[^ ]* pid=(\d+)", line)
        if match and needle in line:
            found.setdefault(match.group(1), []).append(line)
    return found


def test_ray_serve_multiplexes_bd_adapters_over_replicas_as_peft(ray_serve, assets):
    url, log_path = ray_serve
    expected = {}
    for name in (None, *ADAPTERS):
        tokens, _ = greedy(load_reference(assets["model"], assets[name] if name else None), PROMPT, MAX_TOKENS)
        expected[name] = [f"w{t}" for t in tokens]
    assert complete(url, "tiny").json()["choices"][0]["text"].split() == expected[None]
    for name in ADAPTERS:  # the first request for each adapter loads it on one replica
        assert complete(url, f"tiny:{name}").json()["choices"][0]["text"].split() == expected[name], name
    time.sleep(10)  # the replicas report what they hold to Serve's routers
    for _ in range(3):
        for name in ADAPTERS:
            assert complete(url, f"tiny:{name}").json()["choices"][0]["text"].split() == expected[name], name

    log = log_path.read_text(errors="replace")
    sharded = replica_lines(log, f"BD-LoRA packed qkv (q_proj, k_proj, v_proj): 2 layer(s), TP={TP}")
    assert len(sharded) == REPLICAS, f"the plugin's start-up report came from {len(sharded)} replica(s)"
    for name, kind in (("bd64", "(BD-LoRA nblocks=2, r=64)"), ("std16", "(standard LoRA, r=16)")):
        admitted = replica_lines(log, f"vllm-bdlora: adapter 'tiny:{name}' {kind}")
        # One replica admitted it (its TP rank 0 logs the line once); every later request went there.
        assert len(admitted) == 1 and len(next(iter(admitted.values()))) == 1, admitted


def test_ray_serve_refuses_a_bad_adapter_with_400_and_keeps_serving(ray_serve, assets):
    url, _ = ray_serve
    response = complete(url, f"tiny:{REFUSED.kind}")
    assert response.status_code == REFUSED.status, response.text[:2000]
    message = response.json()["error"]["message"]
    assert f"tiny:{REFUSED.kind}" in message and all(part in message for part in REFUSED.says), message
    for name in ADAPTERS:
        assert complete(url, f"tiny:{name}").status_code == 200

"""A server an adversarial client cannot break: `vllm serve --enable-bdlora` at TP=2 with --api-key,
--allowed-adapter-roots and a one-adapter CPU cache (so adapters are dropped and read again), against PEFT.

Covered: every route but the probes needs the key (/metrics too, with one series of vLLM's LoRA gauge); adapter
paths outside the roots get one uniform 403; names and paths outside the rules get 400; every kind of bad adapter
gets a 4xx naming it (bench/bad_adapters.py), at once, and the others keep serving; an admitted adapter whose files
are changed or deleted afterwards keeps being served as admitted; an unload removes the adapter from the engine and a
reload serves it again; a bad --lora-modules entry stops start-up naming it; a stopped worker turns /health to 503
until it runs again; a dead engine turns /health to 503 and the process exits non-zero."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from bench.bad_adapters import BAD_ADAPTERS
from tests.test_server import server_env
from vllm_bdlora.access import OPEN_PATHS, PATH_REFUSED
from vllm_bdlora.peft_reference import greedy, load_reference
from vllm_bdlora.serve.process import free_port, running_server
from vllm_bdlora.tenants import TENANT_ROUTES

pytestmark = pytest.mark.engine

KEY = "operator-key-0123456789"  # the key file's admin key
AUTH = {"Authorization": f"Bearer {KEY}"}
ACME, GLOBEX = "acme-key-0123456789abc", "globex-key-0123456789ab"  # two tenants' keys
PROMPT = [10, 20, 30, 40, 50, 60]
LONG_PROMPT = [4 + (37 * i) % 500 for i in range(200)]  # longer than one KV block (128 tokens on CPU)
MAX_TOKENS = 12
START_TIMEOUT = 240


def serve_command(model, port, lora_modules, *extra):
    return [
        "vllm", "serve", model, "--enable-bdlora", "--tensor-parallel-size", "2", "--max-lora-rank", "64",
        "--max-loras", "1", "--max-cpu-loras", "1", "--dtype", "float32", "--max-model-len", "256",
        "--enforce-eager", "--port", str(port), *extra, "--lora-modules",
        *[f"{name}={path}" for name, path in lora_modules.items()],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def roots(assets, tmp_path_factory):
    """An allowed root holding copies of two adapters, and a directory outside it holding another."""
    base = tmp_path_factory.mktemp("guards")
    inside, outside = base / "adapters", base / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    for name in ("bd64", "std16", "bd48"):
        shutil.copytree(assets[name], inside / name)
    for tenant, adapter in (("acme", "bd48"), ("globex", "std16")):
        shutil.copytree(assets[adapter], inside / tenant / adapter)
    shutil.copytree(assets["bd64"], outside / "bd64")
    return inside, outside


def tenant_key_file(path, inside):
    tenants = [
        {"name": "operator", "key": KEY, "admin": True},
        {"name": "acme", "key": ACME, "adapters": ["acme-*"], "roots": [str(inside / "acme")]},
        {"name": "globex", "key_sha256": hashlib.sha256(GLOBEX.encode()).hexdigest(), "adapters": ["globex-*", "bd64"],
         "roots": [str(inside / "globex")], "base_model": False},
    ]  # fmt: skip
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.fixture(scope="module")
def server(assets, roots, tmp_path_factory):
    inside, _ = roots
    base = tmp_path_factory.mktemp("guarded")
    log_path = base / "server.log"
    command = serve_command(
        assets["model"], free_port(), {"bd64": inside / "bd64"}, "--allowed-adapter-roots", str(inside),
        "--tenant-keys", str(tenant_key_file(base / "keys.json", inside)),
    )  # fmt: skip
    with running_server(command, str(log_path), 2, server_env(), START_TIMEOUT) as (process, url):
        yield url, log_path, process


def peft_answers(assets, prompt) -> dict[str, list[str]]:
    """PEFT's greedy words for `prompt` under each adapter the tests load."""
    models = {name: load_reference(assets["model"], assets[name]) for name in ("bd64", "std16", "bd48")}
    return {name: [f"w{t}" for t in greedy(model, prompt, MAX_TOKENS)[0]] for name, model in models.items()}


@pytest.fixture(scope="module")
def reference_words(assets):
    return peft_answers(assets, PROMPT)


@pytest.fixture(scope="module")
def long_prompt_words(assets):
    return peft_answers(assets, LONG_PROMPT)


def complete(url, model, prompt=PROMPT):
    body = {"model": model, "prompt": " ".join(f"w{i}" for i in prompt), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    response = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"].split()


def load(url, name, path, headers=AUTH):
    body = {"lora_name": name, "lora_path": str(path)}
    return requests.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)


def unload(url, name):
    return requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60)


def routes_from_log(log: str) -> list[tuple[str, str]]:
    """(path, method) of every route the app has: vLLM logs them all at start-up (mounts without methods)."""
    routes = []
    for path, methods in re.findall(r"Route: (\S+), Methods: (.+)", log):
        routes += [(path, m.strip()) for m in methods.split(",")]
    routes += [(path, "GET") for path in re.findall(r"Route: (\S+), Endpoint: ", log)]
    return sorted(set(routes))


def assert_every_route_but_the_probes_needs_a_key(url, log: str, key: str) -> None:
    routes = routes_from_log(log)
    paths = {path for path, _ in routes}
    assert {"/v1/completions", "/adapters", "/adapters/{adapter_name}", "/invocations", "/health"} <= paths
    open_to_anyone = []
    for path, method in routes:
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            status = requests.request(method, f"{url}{concrete}", headers=headers, timeout=30).status_code
            if status != 401:
                open_to_anyone.append((method, path, status))
    assert sorted({path for _, path, _ in open_to_anyone}) == sorted(OPEN_PATHS & paths), open_to_anyone
    # The key still opens the guarded routes.
    assert requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200


def test_every_route_but_the_probes_needs_a_key_from_the_key_file(server):
    url, log_path, _ = server
    assert_every_route_but_the_probes_needs_a_key(url, log_path.read_text(), KEY)
    log = log_path.read_text()
    assert "2 tenant key(s) and 1 admin key(s) from" in log, log[-2000:]
    # A tenant's key opens only the tenants' routes; the rest need an admin key.
    for path, method in routes_from_log(log):
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        if concrete.rstrip("/") in OPEN_PATHS or TENANT_ROUTES.fullmatch(concrete):
            continue
        status = requests.request(method, f"{url}{concrete}", headers=tenant(ACME), timeout=30).status_code
        assert status == 403, (method, path, status)


def tenant(key):
    return {"Authorization": f"Bearer {key}"}


def post(url, route, body, key):
    return requests.post(f"{url}{route}", json=body, headers=tenant(key), timeout=120)


def test_a_tenant_key_uses_loads_and_sees_only_its_own_adapters(server, roots, assets, reference_words):
    """Two tenants on one server: each loads from its own directory under its own names; neither can use, replace
    (load_inplace), unload or see the other's adapter, whatever route it tries; an admin key can."""
    url, _, _ = server
    inside, _ = roots
    acme_path, globex_path = inside / "acme" / "bd48", inside / "globex" / "std16"
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "acme-a", "lora_path": str(acme_path)}, ACME).ok
    assert post(url, "/adapters", {"name": "globex-b", "src": str(globex_path)}, GLOBEX).ok

    def words(model, key):
        body = {"model": model, "prompt": " ".join(f"w{i}" for i in PROMPT), "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return post(url, "/v1/completions", body, key)

    assert words("acme-a", ACME).json()["choices"][0]["text"].split() == reference_words["bd48"]
    assert words("globex-b", GLOBEX).json()["choices"][0]["text"].split() == reference_words["std16"]
    # globex against acme's adapter
    for answer in (words("acme-a", GLOBEX), words("acme-unloaded", GLOBEX)):
        assert answer.status_code == 404 and "acme-a" not in answer.text.replace("'acme-a'", ""), answer.text
    takeover = {"lora_name": "acme-a", "lora_path": str(globex_path), "load_inplace": True}
    refusals = [
        post(url, "/v1/load_lora_adapter", takeover, GLOBEX),
        post(url, "/v1/unload_lora_adapter", {"lora_name": "acme-a"}, GLOBEX),
        requests.delete(f"{url}/adapters/acme-a", headers=tenant(GLOBEX), timeout=60),
        post(url, "/v1/load_lora_adapter", {"lora_name": "globex-c", "lora_path": str(acme_path)}, GLOBEX),
        post(url, "/v1/load_lora_adapter", {"lora_name": "acme-b", "lora_path": str(acme_path)}, GLOBEX),
    ]
    assert [r.status_code for r in refusals] == [403] * 5, [r.text for r in refusals]
    assert "may load and unload only adapters named globex-*, bd64" in refusals[0].text, refusals[0].text
    assert PATH_REFUSED in refusals[3].json()["error"]["message"]
    # globex may not use the base model; acme may
    assert words(assets["model"], GLOBEX).status_code == 404 and words(assets["model"], ACME).status_code == 200
    # the lists: own adapters only
    listed = {key: {m["id"] for m in requests.get(f"{url}/v1/models", headers=tenant(key), timeout=10).json()["data"]}
              for key in (ACME, GLOBEX, KEY)}  # fmt: skip
    assert "acme-a" in listed[ACME] and not {"globex-b", "bd64"} & listed[ACME], listed
    assert {"globex-b", "bd64"} <= listed[GLOBEX] and "acme-a" not in listed[GLOBEX], listed
    assert {"acme-a", "globex-b", "bd64"} <= listed[KEY], listed
    scraped = {key: requests.get(f"{url}/metrics", headers=tenant(key), timeout=10).text for key in (ACME, GLOBEX, KEY)}
    assert 'adapter_name="acme-a"' in scraped[KEY] and 'adapter_name="globex-b"' in scraped[KEY]
    assert 'adapter_name="acme-a"' in scraped[ACME] and "globex-b" not in scraped[ACME]
    assert "acme-a" not in scraped[GLOBEX] and "vllm:lora_requests_info" not in scraped[GLOBEX]
    # nothing globex tried changed acme's answers; the operator unloads both
    assert words("acme-a", ACME).json()["choices"][0]["text"].split() == reference_words["bd48"]
    for name in ("acme-a", "globex-b"):
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": name}, KEY).ok


def test_adapter_paths_outside_the_roots_get_one_uniform_403(server, roots, tmp_path):
    url, _, _ = server
    inside, outside = roots
    (inside / "link-out").symlink_to(outside / "bd64")
    attempts = [
        outside / "bd64",  # exists, outside
        outside / "nothing-here",  # does not exist, outside
        f"{inside}/../elsewhere/bd64",  # traversal
        inside / "link-out",  # a symlink inside that points outside
        "relative/bd64",  # relative to the server's working directory
        "/etc",
    ]
    bodies = set()
    for i, path in enumerate(attempts):
        response = load(url, f"escape{i}", path)
        assert response.status_code == 403, (path, response.text)
        bodies.add(response.json()["error"]["message"].replace(f"escape{i}", "NAME"))
    assert len(bodies) == 1 and PATH_REFUSED in bodies.pop()  # nothing tells the paths apart
    sagemaker = requests.post(f"{url}/adapters", json={"name": "escape-sm", "src": str(outside / "bd64")},
                              headers=AUTH, timeout=60)  # fmt: skip
    assert sagemaker.status_code == 403, sagemaker.text
    assert load(url, "inside", inside / "std16").status_code == 200
    assert unload(url, "inside").status_code == 200


@pytest.mark.parametrize("bad", BAD_ADAPTERS, ids=lambda b: b.kind)
def test_bad_adapter_gets_4xx_naming_it_and_the_others_keep_serving(server, roots, assets, reference_words, bad):
    inside, _ = roots
    url, log_path, _ = server
    name = f"bad-{bad.kind}"
    path = bad.make(assets["bd64"], inside / name)
    log_start = len(log_path.read_text())
    started = time.monotonic()
    response = load(url, name, path)
    assert time.monotonic() - started < 30, "a bad adapter must be refused at once (a FIFO is not waited on)"
    assert response.status_code == bad.status, response.text
    message = response.json()["error"]["message"]
    for fragment in (name, *bad.says):
        assert fragment in message, message
    log = log_path.read_text()[log_start:]
    assert "Traceback" not in log, log  # a refusal is the client's error: one line in the log, not a traceback
    if bad.status == 400:
        assert [line for line in log.splitlines() if "WARNING" in line and f"rejected: '{name}'" in line], log
    assert complete(url, "bd64") == reference_words["bd64"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_pattern_keys_that_backtrack_in_python_load_at_once_and_stall_no_one(server, roots, assets, reference_words):
    """rank_pattern / alpha_pattern keys with nested quantifiers, which Python's re (and PEFT) would backtrack on for
    minutes holding the interpreter lock: the adapter loads in seconds while another tenant's requests run, and is
    served as its unmatched keys leave it (bd64's answer)."""
    url, _, _ = server
    inside, _ = roots
    path = inside / "backtracking"
    shutil.copytree(assets["bd64"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["rank_pattern"] = {"(.|.)*!": config["r"], "(a|aa)+$": config["r"], r"(\w+\.)*\d!": config["r"]}
    config["alpha_pattern"] = {"(x+x+)+y": config["lora_alpha"], "((a*)*)*b": config["lora_alpha"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    with ThreadPoolExecutor(2) as pool:
        others = pool.submit(lambda: [complete(url, "bd64") for _ in range(3)])
        started = time.monotonic()
        response = load(url, "backtracking", path)
        loaded_in = time.monotonic() - started
        assert others.result(timeout=120) == [reference_words["bd64"]] * 3
    assert response.status_code == 200 and loaded_in < 30, (response.text, loaded_in)
    assert complete(url, "backtracking") == reference_words["bd64"]
    assert unload(url, "backtracking").status_code == 200


def with_extra_tensors(source, path, extra, config_edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({**tensors, **extra(tensors)}, path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    config_edit(config)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_adapters_vllm_itself_cannot_serve_get_400_naming_the_adapter(server, roots, assets, reference_words):
    """Past the file checks, vLLM's own reader refuses an adapter for a classification head on a generative model
    (modules_to_save) and an embedding LoRA over another vocabulary: each is the client's error, a 400 naming the
    adapter, and the others keep serving."""
    import torch

    url, _, _ = server
    inside, _ = roots
    hidden = json.loads((Path(assets["model"]) / "config.json").read_text())["hidden_size"]
    vocabulary = json.loads((Path(assets["model"]) / "config.json").read_text())["vocab_size"]

    def score_head(tensors):
        return {"base_model.model.score.weight": torch.randn(2, hidden)}

    def other_vocabulary(tensors):
        prefix = "base_model.model.model.embed_tokens"
        return {f"{prefix}.lora_embedding_A": torch.randn(16, vocabulary + 64) * 0.01,
                f"{prefix}.lora_embedding_B": torch.randn(hidden, 16) * 0.01}  # fmt: skip

    cases = {
        "classifier-head": with_extra_tensors(assets["std16"], inside / "classifier-head", score_head,
                                              lambda c: c.update(modules_to_save=["score"])),
        "other-vocabulary": with_extra_tensors(assets["std16"], inside / "other-vocabulary", other_vocabulary,
                                               lambda c: c["target_modules"].append("embed_tokens")),
    }  # fmt: skip
    for name, path in cases.items():
        response = load(url, name, path)
        assert response.status_code == 400, (name, response.status_code, response.text)
        assert name in response.json()["error"]["message"], response.text
    assert complete(url, "bd64") == reference_words["bd64"]


def test_admitted_adapter_is_served_as_admitted_after_its_files_change(server, roots, reference_words):
    """One CPU cache entry: loading std16 drops bd48 from it, so the next bd48 request reads bd48 again. Its
    files were re-saved with other weights, then truncated, then deleted: each time it is served as admitted."""
    url, log_path, _ = server
    inside, _ = roots
    source = inside / "bd48"
    log_start = len(log_path.read_text())
    assert load(url, "bd48", source).status_code == 200
    assert load(url, "std16", inside / "std16").status_code == 200
    assert complete(url, "bd48") == reference_words["bd48"]
    edits = [
        lambda: shutil.copyfile(inside / "bd64" / "adapter_model.safetensors", source / "adapter_model.safetensors"),
        lambda: os.truncate(source / "adapter_model.safetensors", 100),
        lambda: shutil.rmtree(source),
    ]
    for edit in edits:
        assert complete(url, "std16") == reference_words["std16"]  # evicts bd48 from the CPU cache
        edit()
        assert complete(url, "bd48") == reference_words["bd48"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    log = log_path.read_text()[log_start:]
    assert "Traceback" not in log
    assert log.count("vllm-bdlora: adapter 'bd48'") == 1, log  # logged when admitted, not on every re-read


def test_an_adapter_swapping_run_logs_each_adapter_once(server, roots, assets, reference_words):
    """9 requests alternating over three adapters through one GPU slot and one CPU-cache entry: every request
    swaps the slot and reads its adapter again, and the log holds one admission line per adapter and no other
    vllm-bdlora line (re-reads log at DEBUG)."""
    url, log_path, _ = server
    inside, _ = roots
    names = ("swap-bd64", "swap-std16", "swap-bd48")
    log_start = len(log_path.read_text())
    for name in names:
        shutil.copytree(assets[name.removeprefix("swap-")], inside / name)
        assert load(url, name, inside / name).status_code == 200
    for i in range(9):
        name = names[i % 3]
        assert complete(url, name) == reference_words[name.removeprefix("swap-")]
    log = log_path.read_text()[log_start:]
    ours = [line for line in log.splitlines() if "vllm-bdlora" in line]
    assert [sum(f"vllm-bdlora: adapter '{name}'" in line for line in ours) for name in names] == [1, 1, 1], ours
    assert len(ours) == 3 and "Traceback" not in log, ours
    for name in names:
        assert unload(url, name).status_code == 200


@pytest.mark.parametrize(
    ("name", "path_suffix"),
    [("forged\nINFO vllm: all good", ""), ("nul\0name", ""), ("x" * 129, ""), ("ok-name", "\0"), ("other", "")],
    ids=["newline", "nul", "too_long", "nul_in_path", "the_metrics_overflow_label"],
)
def test_names_and_paths_outside_the_rules_get_400_naming_the_rule(server, roots, name, path_suffix):
    url, log_path, _ = server
    inside, _ = roots
    log_start = len(log_path.read_text())
    response = load(url, name, f"{inside / 'std16'}{path_suffix}")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    rule = "without control characters" if path_suffix else "reserved" if name == "other" else "letters, digits and"
    assert rule in message, message
    log = log_path.read_text()[log_start:]
    assert not any(line.startswith("INFO vllm: all good") for line in log.splitlines())  # no forged log line
    assert "\0" not in log
    assert "Traceback" not in log


def test_bad_tenant_key_file_stops_startup_naming_it(assets, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "a", "key": ACME, "adapters": ["a-*"]},
                                            {"name": "b", "key": ACME, "adapters": ["b-*"]}]}))  # fmt: skip
    proc = subprocess.run(
        serve_command(assets["model"], free_port(), {"bd64": assets["bd64"]}, "--tenant-keys", str(keys)),
        env=server_env(), capture_output=True, text=True, timeout=START_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"--tenant-keys {keys}: tenant 'b': its key is another tenant's too" in proc.stderr, proc.stderr[-3000:]


def test_metrics_need_the_key_and_keep_one_lora_series_at_the_step_limit(server, reference_words):
    url, _, _ = server
    assert requests.get(f"{url}/metrics", timeout=10).status_code == 401
    for name in ("bd64", "bd64", "bd64"):
        complete(url, name)
    metrics = requests.get(f"{url}/metrics", headers=AUTH, timeout=10)
    assert metrics.status_code == 200
    series = [line for line in metrics.text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(series) == 1, series
    # --max-loras 1 with a slot kept for fills ahead: the label says the step limit the operator set, not the slots
    assert 'max_lora="1"' in series[0], series


def test_unload_removes_the_adapter_from_the_engine_and_a_reload_serves_it(server, roots, reference_words):
    """Both unload routes reach the engine: each logs the removal (on every rank the GPU slot, the host-cache entry
    and what the worker kept go); the same name loads and serves again, five times over."""
    url, log_path, _ = server
    inside, _ = roots
    log_start = len(log_path.read_text())
    for cycle in range(5):
        assert load(url, "cycled", inside / "std16").status_code == 200
        assert complete(url, "cycled") == reference_words["std16"]
        if cycle % 2:
            response = requests.delete(f"{url}/adapters/cycled", headers=AUTH, timeout=60)
        else:
            response = unload(url, "cycled")
        assert response.status_code == 200, response.text
    assert unload(url, "cycled").status_code == 404  # already gone: the engine's removal is not repeated
    deadline = time.monotonic() + 30
    log = ""
    while time.monotonic() < deadline:
        log = log_path.read_text()[log_start:]
        if log.count("vllm-bdlora: adapter 'cycled' removed from the engine") == 5:
            break
        time.sleep(0.5)
    assert log.count("vllm-bdlora: adapter 'cycled' removed from the engine") == 5, log[-3000:]
    assert complete(url, "bd64") == reference_words["bd64"]


def test_a_reload_at_the_same_name_and_path_never_answers_from_the_old_weights_kv(
    server, roots, assets, long_prompt_words
):
    """Redeploying a fine-tune to the same path: unloaded and loaded again, or loaded in place, the name answers a
    prompt longer than one KV block as its new files do, never from KV its previous weights computed."""
    url, _, _ = server
    inside, _ = roots
    path = inside / "redeployed"

    def deploy(source):
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(assets[source], path)

    deploy("bd64")
    assert load(url, "redeployed", path).status_code == 200
    for _ in range(2):  # the second answer reads the first one's cached blocks
        assert complete(url, "redeployed", LONG_PROMPT) == long_prompt_words["bd64"]
    assert unload(url, "redeployed").status_code == 200
    deploy("bd48")
    assert load(url, "redeployed", path).status_code == 200
    assert complete(url, "redeployed", LONG_PROMPT) == long_prompt_words["bd48"]
    deploy("std16")
    body = {"lora_name": "redeployed", "lora_path": str(path), "load_inplace": True}
    response = requests.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    assert complete(url, "redeployed", LONG_PROMPT) == long_prompt_words["std16"]
    assert unload(url, "redeployed").status_code == 200


def test_bad_lora_modules_entry_stops_startup_naming_it(assets, tmp_path):
    truncated = BAD_ADAPTERS[0].make(assets["bd64"], tmp_path / "truncated")
    proc = subprocess.run(
        serve_command(assets["model"], free_port(), {"bd64": assets["bd64"], "broken": truncated}),
        env=server_env(), capture_output=True, text=True, timeout=START_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "LoRA adapter rejected: 'broken'" in output and "adapter_model.safetensors: truncated" in output
    assert "EngineCore" not in output  # refused before the model loads


def test_lora_modules_outside_the_roots_stop_startup_naming_the_entry(assets, tmp_path):
    (tmp_path / "adapters").mkdir()
    proc = subprocess.run(
        serve_command(assets["model"], free_port(), {"outside": assets["bd64"]},
                      "--allowed-adapter-roots", str(tmp_path / "adapters")),
        env=server_env(), capture_output=True, text=True, timeout=START_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"LoRA adapter 'outside': {PATH_REFUSED}" in output and "EngineCore" not in output


@pytest.mark.parametrize(
    ("adapter", "flags", "fix"),
    [("bd64", ["--enable-lora"], "--enable-bdlora"), ("dora16", ["--enable-bdlora"], "--enable-dora")],
    ids=["bd-without-enable-bdlora", "dora-without-enable-dora"],
)
def test_adapters_the_flags_do_not_serve_stop_startup_naming_the_flag(assets, adapter, flags, fix):
    """At TP=2 on a CPU without vLLM's CPU variables, vLLM's own thread-binding check would stop the server first,
    in a long traceback that never names the adapter: the plugin stops it before, in a few lines naming the flag."""
    command = ["vllm", "serve", assets["model"], *flags, "--tensor-parallel-size", "2", "--max-lora-rank", "64",
               "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--port", str(free_port()),
               "--lora-modules", f"{adapter}={assets[adapter]}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=START_TIMEOUT)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"LoRA adapter rejected: '{adapter}'" in output and f"start the server with {fix}" in output, output
    assert "EngineCore" not in output and "NUMA" not in output and "Traceback" not in output, output


def test_a_stopped_worker_turns_health_to_503_and_back(server, reference_words):
    """A worker stopped (SIGSTOP) leaves vLLM's /health at 200 for the executor's 300 s while nothing progresses:
    here it answers 503 within seconds, and 200 again once the worker runs."""
    import signal

    import psutil

    url, _, process = server
    workers = [p for p in psutil.Process(process.pid).children(recursive=True) if "Worker_TP1" in " ".join(p.cmdline())]
    assert workers, "no worker process found"
    worker = workers[0]
    worker.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        while requests.get(f"{url}/health", timeout=10).status_code == 200:
            assert time.monotonic() - stopped < 5, "/health still answers 200 five seconds after a worker stopped"
            time.sleep(0.2)
    finally:
        worker.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    while requests.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() - resumed < 30, "/health does not come back once the worker runs again"
        time.sleep(0.2)
    assert complete(url, "bd64") == reference_words["bd64"]


def test_dead_engine_turns_health_to_503_and_exits_non_zero(server, roots):
    """The module's last test, since it ends the module's server: a worker killed under a generation and an adapter
    load: /health turns 503 within 2 s, both requests are answered, and the process exits with status 1 (vLLM alone
    leaves the load waiting forever, and its HTTP server's shutdown waits for it: the process never exits)."""
    import psutil

    url, log_path, proc = server
    inside, _ = roots
    log_start = len(log_path.read_text())
    answers = {}

    def post(name, route, body):
        try:
            answers[name] = requests.post(f"{url}{route}", json=body, headers=AUTH, timeout=90)
        except requests.RequestException as e:
            answers[name] = e

    # Streamed, and the worker killed once its first tokens arrive, so that the kill lands inside a step whatever the
    # machine's speed: a generation done before the kill would leave the engine core idle, and it would answer the
    # load with an error itself, leaving no call waiting on the dead engine.
    generation = {"model": "bd64", "prompt": "w5 w6", "max_tokens": 250, "ignore_eos": True, "stream": True}
    streaming = threading.Event()

    def generate():
        try:
            with requests.post(f"{url}/v1/completions", json=generation, headers=AUTH, timeout=90,
                               stream=True) as response:  # fmt: skip
                for _ in response.iter_lines():
                    streaming.set()
            answers["generation"] = response
        except requests.RequestException as e:
            answers["generation"] = e

    client = threading.Thread(target=generate)
    client.start()
    assert streaming.wait(timeout=60), answers.get("generation")
    processes = psutil.Process(proc.pid).children(recursive=True)
    worker = next(p for p in processes if "Worker_TP1" in " ".join(p.cmdline()))
    worker.kill()
    killed = time.monotonic()
    # Sent while the engine core notices the dead worker: it reaches the engine core just before or after the
    # executor's failure notice (see the end).
    load = {"lora_name": "std16-late", "lora_path": str(inside / "std16")}
    loader = threading.Thread(target=post, args=("load", "/v1/load_lora_adapter", load))
    loader.start()
    while requests.get(f"{url}/health", timeout=5).status_code == 200:
        assert time.monotonic() - killed < 2, "/health still answers 200 two seconds after a worker died"
        time.sleep(0.1)
    client.join(timeout=60)
    loader.join(timeout=60)
    assert not client.is_alive(), "an in-flight request hangs after the engine died"
    assert not loader.is_alive(), "an adapter load in flight hangs after the engine died"
    assert isinstance(answers["load"], requests.Response) and answers["load"].status_code >= 500, answers["load"]
    assert proc.wait(timeout=60) == 1
    log = log_path.read_text()[log_start:]
    assert "the engine died" in log
    # The load is answered one of two ways, by the order in which the engine core's input queue got it and the
    # executor's failure notice (the executor marks itself failed, shuts its workers down, then posts the notice):
    # a load taken before the notice fails in the engine core (its call to the workers finds the executor failed);
    # one behind it is left waiting when the engine core dies, and the server answers it.
    if "Invocation of add_lora method failed" not in log:
        assert "call(s) waiting on the dead engine" in log
    assert "did not stop within" not in log  # the orderly stop, not the deadline, ended it

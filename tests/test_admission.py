"""The checks that need no engine: adapter files on disk, path confinement, admitted copies and the executor's
verdict on the ranks' replies. The same code answers the server's requests (test_server_guards.py)."""

import os
from types import SimpleNamespace

import pytest
import torch

from bench.bad_adapters import BAD_ADAPTERS
from vllm_bdlora.access import OPEN_PATHS, is_allowed_adapter_path, needs_api_key
from vllm_bdlora.adapter_files import check_adapter_dir, module_rank
from vllm_bdlora.adapters import AdapterLoadFailure, AdapterRejected
from vllm_bdlora.admission import (
    COPY_DIR_PREFIX,
    AdmissionReceipt,
    AdmittedCopies,
    check_admission_replies,
    remove_copies_of_dead_processes,
)
from vllm_bdlora.loading import non_finite_problems

# Found only once the tensors are read (by the worker) or by vLLM's own path lookup.
AFTER_READ = {"nan_weights", "inf_weights", "missing_path"}


@pytest.mark.parametrize("bad", [b for b in BAD_ADAPTERS if b.kind not in AFTER_READ], ids=lambda b: b.kind)
def test_every_file_problem_is_named_before_any_tensor_is_read(assets, tmp_path, bad):
    path = bad.make(assets["bd64"], tmp_path / bad.kind)
    with pytest.raises(AdapterRejected) as rejected:
        check_adapter_dir(path, bad.kind)
    message = str(rejected.value)
    assert f"LoRA adapter rejected: '{bad.kind}'" in message and "Fix:" in message
    for fragment in bad.says:
        assert fragment in message


@pytest.mark.parametrize("name", ["bd64", "bd64_nb4", "std16", "dora16", "bddora64"])
def test_good_adapters_pass_with_their_shapes(assets, name):
    files = check_adapter_dir(assets[name], name)
    assert files.config["r"] in (16, 64) and any(".lora_A." in t for t in files.tensor_shapes)


def test_rank_pattern_matches_dotted_suffixes_as_peft_does():
    config = {"r": 16, "rank_pattern": {"q_proj": 8, "layers.1.mlp.up_proj": 4}}
    assert module_rank(config, "model.layers.0.self_attn.q_proj") == 8
    assert module_rank(config, "model.layers.1.mlp.up_proj") == 4
    assert module_rank(config, "model.layers.0.mlp.up_proj") == 16
    assert module_rank(config, "model.layers.0.self_attn.xq_proj") == 16  # a suffix at a "." boundary only


@pytest.mark.parametrize("factor", ["lora_a", "lora_b"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_factors_are_named(factor, value):
    weights = {"lora_a": torch.randn(4, 8), "lora_b": torch.randn(8, 4)}
    weights[factor][1, 2] = value
    finite = SimpleNamespace(lora_a=torch.randn(4, 8), lora_b=torch.randn(8, 4))
    model = SimpleNamespace(
        loras={"model.layers.0.mlp.up_proj": SimpleNamespace(**weights), "model.layers.0.mlp.down_proj": finite}
    )
    name = "lora_A" if factor == "lora_a" else "lora_B"
    problems = non_finite_problems((m, w.lora_a, w.lora_b) for m, w in model.loras.items())
    assert problems == [f"model.layers.0.mlp.up_proj: {name} holds NaN or Inf"]


def test_only_the_probes_are_open():
    for path in OPEN_PATHS:
        assert not needs_api_key(path) and not needs_api_key(path + "/")
    for path in ("/adapters", "/adapters/x", "/invocations", "/v1/completions", "/docs", "/openapi.json", "/",
                 "/healthz", "/health/../adapters"):  # fmt: skip
        assert needs_api_key(path), path


def test_paths_are_confined_after_resolution(tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "a")
    roots = [str(root)]
    assert is_allowed_adapter_path(str(root / "a"), roots)
    assert is_allowed_adapter_path(str(root / "in"), roots)
    assert is_allowed_adapter_path(str(root / "not-yet"), roots)  # inside: vLLM answers 404 itself
    assert is_allowed_adapter_path("a", roots, cwd=str(root))
    for escape in (str(outside), str(root / "out"), f"{root}/../elsewhere", "../elsewhere", f"{root}x", "/"):
        assert not is_allowed_adapter_path(escape, roots, cwd=str(root)), escape
    assert is_allowed_adapter_path("/anything", [])  # no roots: no confinement


def test_admitted_copy_survives_changes_to_its_source(assets, tmp_path):
    source = tmp_path / "source"
    import shutil

    shutil.copytree(assets["bd64"], source)
    copies = AdmittedCopies(str(tmp_path / "copies"))
    os.mkdir(copies.parent)
    first = copies.stage(str(source), "bd64")
    copies.keep(7, first)
    shutil.rmtree(source)
    assert copies.get(7) == first and check_adapter_dir(first.directory, "bd64").config["r"] == 64
    assert sorted(os.listdir(first.directory)) == ["adapter_config.json", "adapter_model.safetensors"]
    # An in-place reload replaces the copy (and deletes the old one) only once kept.
    shutil.copytree(assets["std16"], source)
    second = copies.stage(str(source), "bd64")
    assert second.digest != first.digest and copies.get(7) == first
    copies.keep(7, second)
    assert copies.get(7) == second and not os.path.exists(first.directory)
    copies.forget(7)
    assert copies.get(7) is None and not os.path.exists(second.directory)
    copies.remove_all()
    assert os.listdir(copies.parent) == []


def test_copies_of_dead_workers_are_removed(tmp_path):
    dead = tmp_path / f"{COPY_DIR_PREFIX}999999999-x"
    alive = tmp_path / f"{COPY_DIR_PREFIX}{os.getpid()}-x"
    other = tmp_path / "unrelated"
    for d in (dead, alive, other):
        d.mkdir()
    remove_copies_of_dead_processes(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_ranks_that_copied_different_bytes_are_refused_and_cleaned_up():
    request = SimpleNamespace(lora_name="ad", lora_int_id=3)
    removed = []
    assert check_admission_replies([AdmissionReceipt(True, "x"), AdmissionReceipt(True, "x")], request, None)
    with pytest.raises(RuntimeError, match="files changed while the tensor-parallel ranks were reading them"):
        check_admission_replies(
            [AdmissionReceipt(True, "x"), AdmissionReceipt(True, "y")], request, lambda: removed.append(3)
        )
    assert removed == [3]
    failure = AdapterLoadFailure("LoRA adapter rejected: 'ad'. bad")
    other = AdapterLoadFailure(f"LoRA adapter rejected: 'ad'. {AdapterRejected.OTHER_RANK}")
    with pytest.raises(RuntimeError, match="bad"):
        check_admission_replies([other, failure], request, None)


def test_cpu_defaults_only_where_vllms_own_would_stop_the_server():
    from vllm_bdlora.serve.cpu_defaults import cpu_defaults

    assert cpu_defaults(2, {}, [0, 1], nodes=1, free_gib=20) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "2"
    }  # fmt: skip
    assert cpu_defaults(2, {}, list(range(8)), nodes=1, free_gib=3)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3|4-7"
    assert cpu_defaults(2, {}, list(range(8)), nodes=1, free_gib=3)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cpu_defaults(2, {}, [0, 1], nodes=2, free_gib=20) == {}  # a node per worker: vLLM's own defaults
    assert cpu_defaults(4, {}, [0, 1], nodes=1, free_gib=20)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|0|1"  # TP2 x PP2
    assert cpu_defaults(1, {}, [0, 1], nodes=1, free_gib=20) == {}
    users = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert cpu_defaults(2, users, [0, 1], nodes=1, free_gib=20) == {}


@pytest.mark.parametrize(
    ("runtime_loading", "config", "warns"),
    [
        ("True", {"bdlora": {}}, True),
        ("True", {"bdlora": {"allowed_adapter_roots": ["/adapters"]}}, False),
        ("", {"bdlora": {}}, False),
        ("True", {}, False),  # not a BD-LoRA server: stock vLLM's behaviour, no word from the plugin
    ],
)
def test_unconfined_runtime_loading_is_named_at_startup(monkeypatch, caplog, runtime_loading, config, warns):
    import logging

    from vllm_bdlora.config import BdLoraSettings
    from vllm_bdlora.patching.cli import warn_if_adapter_paths_unconfined

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", runtime_loading)
    with caplog.at_level(logging.WARNING, logger="vllm.bdlora"):
        warn_if_adapter_paths_unconfined(BdLoraSettings.from_additional_config(config))
    assert ("--allowed-adapter-roots DIR" in caplog.text) == warns

"""The checks that need no engine: adapter files on disk (opened once, confined, regular files only), the values an
adapter may hold, adapter names and paths, the store a worker keeps admitted adapters in (host budget, spill files,
admissions on threads of their own) and the executor's verdict on the ranks' replies. The same code answers the
server's requests (test_server_guards.py)."""

import errno
import json
import math
import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from bench.bad_adapters import BAD_ADAPTERS
from vllm_bdlora.access import (
    ADAPTER_NAME_MAX,
    OPEN_PATHS,
    adapter_failure_status,
    adapter_name_problem,
    adapter_path_problem,
    is_allowed_adapter_path,
    needs_api_key,
)
from vllm_bdlora.adapter_lifecycle import values
from vllm_bdlora.adapter_lifecycle.calls import (
    AdmissionReceipt,
    Failed,
    Reading,
    Ready,
    Unknown,
    check_admission_replies,
)
from vllm_bdlora.adapter_lifecycle.files import (
    UNREADABLE,
    AdapterPathRefused,
    check_adapter_dir,
    module_rank,
    open_adapter,
)
from vllm_bdlora.adapter_lifecycle.read_and_cut import AdmittedAdapter
from vllm_bdlora.adapter_lifecycle.store import ADMISSIONS_READING, AdapterStore, StoreFull
from vllm_bdlora.adapter_lifecycle.values import (
    ESTIMATE_MARGIN,
    MAX_GAIN,
    config_scale_problems,
    estimated_norms,
    gain_limit,
    module_gain,
    norm_and_finite,
    norms_and_finite,
    value_problems,
)
from vllm_bdlora.adapters import AdapterLoadFailure, AdapterRejected

# Found only once the tensors are read (by the worker) or by vLLM's own path lookup.
AFTER_READ = {"nan_weights", "inf_weights", "missing_path", "huge_factor"}


@pytest.mark.parametrize("bad", [b for b in BAD_ADAPTERS if b.kind not in AFTER_READ], ids=lambda b: b.kind)
def test_every_file_problem_is_named_before_any_tensor_is_read(assets, tmp_path, bad):
    path = bad.make(assets["bd64"], tmp_path / bad.kind)
    started = time.monotonic()
    with pytest.raises(AdapterRejected) as rejected:
        check_adapter_dir(path, bad.kind)
    assert time.monotonic() - started < 30  # a FIFO is refused, not waited on
    message = str(rejected.value)
    assert f"LoRA adapter rejected: '{bad.kind}'" in message and "Fix:" in message
    for fragment in bad.says:
        assert fragment in message


@pytest.mark.parametrize("name", ["bd64", "bd64_nb4", "std16", "dora16", "bddora64"])
def test_good_adapters_pass_with_their_shapes(assets, name):
    files = check_adapter_dir(assets[name], name)
    assert files.config["r"] in (16, 64) and any(".lora_A." in t for t in files.tensor_shapes)


def test_a_missing_file_a_symlink_a_fifo_and_a_directory_get_one_message(assets, tmp_path):
    """What an answer says about a file must not tell what exists on the server's disk."""
    answers = set()
    for kind in ("missing", "fifo", "symlink", "system_symlink", "directory"):
        path = tmp_path / kind
        shutil.copytree(assets["bd64"], path)
        config = path / "adapter_config.json"
        os.remove(config)
        if kind == "fifo":
            os.mkfifo(config)
        elif kind == "symlink":
            os.symlink(assets["bd64"] + "/adapter_config.json", config)
        elif kind == "system_symlink":
            os.symlink("/etc/passwd", config)
        elif kind == "directory":
            os.mkdir(config)
        with pytest.raises(AdapterRejected) as rejected:
            check_adapter_dir(str(path), "ad")
        answers.add(str(rejected.value))
    assert len(answers) == 1 and f"adapter_config.json {UNREADABLE}" in answers.pop()


def test_confinement_is_checked_on_the_directory_that_was_opened(assets, tmp_path):
    """A symlink inside a root re-pointed outside after the API server's path check: what the worker opens is
    outside, and it is refused as the API server refuses it."""
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    root.mkdir()
    shutil.copytree(assets["bd64"], root / "bd64")
    shutil.copytree(assets["std16"], outside)
    link = root / "current"
    link.symlink_to(root / "bd64")
    assert is_allowed_adapter_path(str(link), [str(root)])  # the API server's check passes
    link.unlink()
    link.symlink_to(outside)  # re-pointed before the worker opens it
    with pytest.raises(AdapterPathRefused) as refused:
        open_adapter(str(link), "ad", [str(root)])
    assert adapter_failure_status(str(refused.value)) == 403
    assert open_adapter(str(root / "bd64"), "ad", [str(root)]).config["r"] == 64
    with pytest.raises(AdapterPathRefused):  # outside and missing: the same answer as outside and present
        open_adapter(str(tmp_path / "nothing"), "ad", [str(root)])


def test_an_opened_adapter_reads_what_was_opened_even_if_the_path_changes(assets, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(assets["bd64"], source)
    with open_adapter(str(source), "bd64") as opened:
        before = {n: t.clone() for n, t in opened.tensor_views().items()}
        shutil.rmtree(source)
        shutil.copytree(assets["std16"], source)  # replaced by another adapter under the same path
        after = opened.tensor_views()
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert opened.unchanged()
    with open_adapter(str(source), "x") as other:
        assert other.identity != opened.identity


def test_a_weights_file_written_in_place_while_open_is_seen_as_changed(assets, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(assets["bd64"], source)
    with open_adapter(str(source), "bd64") as opened:
        with open(source / "adapter_model.safetensors", "r+b") as f:
            f.seek(os.path.getsize(source / "adapter_model.safetensors") - 4)
            f.write(b"\0\0\0\0")
        os.utime(source / "adapter_model.safetensors", ns=(1, 1))
        assert not opened.unchanged()


def test_rank_pattern_matches_dotted_suffixes_as_peft_does():
    config = {"r": 16, "rank_pattern": {"q_proj": 8, "layers.1.mlp.up_proj": 4}}
    assert module_rank(config, "model.layers.0.self_attn.q_proj") == 8
    assert module_rank(config, "model.layers.1.mlp.up_proj") == 4
    assert module_rank(config, "model.layers.0.mlp.up_proj") == 16
    assert module_rank(config, "model.layers.0.self_attn.xq_proj") == 16  # a suffix at a "." boundary only


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("rank_pattern", {"q_proj(": 8}, "rank_pattern key 'q_proj(' is not a pattern vllm-bdlora matches (missing )"),
        ("rank_pattern", {r"(q)_\1": 8}, "rank_pattern key '(q)_\\\\1'"),  # a back-reference
        ("alpha_pattern", {"(?=q)q_proj": 8}, "alpha_pattern key '(?=q)q_proj'"),  # look-ahead
        ("rank_pattern", {"q" * 600: 8}, "600 characters, over the limit of 512"),
        ("alpha_pattern", {f"layers.{i}.q_proj": 8 for i in range(300)}, "alpha_pattern has 300 keys"),
        ("target_modules", "(?<=x)q_proj", "target_modules '(?<=x)q_proj'"),
        ("layers_pattern", ["layers", r"\Z"], "layers_pattern"),
        ("layers_to_transform", "0", "layers_to_transform must be a layer index"),
    ],
)
def test_a_pattern_the_server_cannot_match_in_linear_time_is_named(assets, tmp_path, field, value, says):
    path = tmp_path / "ad"
    shutil.copytree(assets["bd64"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    config[field] = value
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejected) as refused:
        check_adapter_dir(str(path), "ad")
    assert says in str(refused.value) and "adapter_config.json" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"r": 8, "lora_alpha": 16}, []),
        ({"r": 8, "lora_alpha": 1e308}, ["lora_alpha 1e+308 / r (r 8)"]),
        ({"r": 8, "lora_alpha": -1e7}, ["lora_alpha -1e+07 / r (r 8)"]),
        ({"r": 64, "lora_alpha": 8e6, "use_rslora": True}, []),  # 1e6: at the limit
        ({"r": 64, "lora_alpha": 8.1e6, "use_rslora": True}, ["lora_alpha 8.1e+06 / sqrt(r) (r 64)"]),
        ({"r": 8, "alpha_pattern": {"q_proj": 1e9}}, ["alpha_pattern['q_proj'] 1e+09 / r (r 8)"]),
        ({"r": 8, "lora_alpha": 8e6, "rank_pattern": {"q_proj": 1}},
         ["lora_alpha (rank_pattern 'q_proj') 8e+06 / r (rank_pattern['q_proj'] 1)"]),
    ],
)  # fmt: skip
def test_scales_over_the_limit_are_named_with_key_and_value(config, names):
    problems = config_scale_problems(config)
    assert len(problems) == len(names)
    for problem, name in zip(problems, names, strict=True):
        assert problem.startswith(name) and "over the limit" in problem, problem


def test_gain_bounds_what_a_module_can_add_to_any_input():
    torch.manual_seed(0)
    a, b, scaling = torch.randn(8, 64), torch.randn(32, 8), 2.0
    gain = module_gain(a, b, scaling)
    for _ in range(20):
        x = torch.randn(64)
        assert (scaling * b @ (a @ x)).norm() <= gain * x.norm() * (1 + 1e-6)
    assert value_problems([("m", a, b, scaling)], torch.float32) == ([], [])


@pytest.mark.parametrize(
    ("scale", "dtype", "refused"),
    [(1.0, torch.float32, False), (1e5, torch.bfloat16, False), (2e6, torch.float32, True),
     (1e30, torch.bfloat16, True), (1e4, torch.float16, False), (2e5, torch.float16, True),
     (1e300, torch.float32, True)],
)  # fmt: skip
def test_modules_whose_gain_would_overflow_the_serving_dtype_are_named(scale, dtype, refused):
    # ||A||_F = ||B||_F = 0.8: a gain of 0.64 x scale
    a, b = torch.full((4, 16), 0.1, dtype=torch.float64), torch.full((16, 4), 0.1, dtype=torch.float64)
    non_finite, problems = value_problems([("model.layers.0.mlp.up_proj", a, b * scale, 1.0)], dtype)
    assert non_finite == [] and bool(problems) == refused
    if refused:
        assert problems[0].startswith("model.layers.0.mlp.up_proj: ")
    assert math.isfinite(MAX_GAIN)


@pytest.mark.parametrize(("entry", "refused"), [(6e4, False), (7e4, True)])
def test_a_scaled_lora_b_entry_float16_cannot_hold_is_named_though_the_gain_is_small(entry, refused):
    # vLLM multiplies B by s in the serving dtype: one entry over float16's 65504 overflows whatever A is
    a, b = torch.full((4, 16), 1e-4), torch.zeros(16, 4)
    b[3, 1] = entry / 2
    non_finite, problems = value_problems([("model.layers.0.self_attn.o_proj", a, b, 2.0)], torch.float16)
    assert module_gain(a, b, 2.0) < 1e3 and non_finite == []
    assert problems == ([f"model.layers.0.self_attn.o_proj: scaling 2 x the largest lora_B entry is {entry:.3g}, "
                         "more than float16 holds"] if refused else [])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("factor", ["lora_a", "lora_b"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_factors_are_named(factor, value, dtype):
    weights = {"lora_a": torch.randn(4, 8, dtype=dtype), "lora_b": torch.randn(8, 4, dtype=dtype)}
    weights[factor][1, 2] = value
    finite = SimpleNamespace(lora_a=torch.randn(4, 8), lora_b=torch.randn(8, 4))
    model = SimpleNamespace(
        loras={"model.layers.0.mlp.up_proj": SimpleNamespace(**weights), "model.layers.0.mlp.down_proj": finite}
    )
    name = "lora_A" if factor == "lora_a" else "lora_B"
    problems, _ = value_problems(((m, w.lora_a, w.lora_b, 1.0) for m, w in model.loras.items()), torch.float32)
    assert problems == [f"model.layers.0.mlp.up_proj: {name} holds NaN or Inf"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_largest_finite_factors_are_finite(dtype):
    """The finiteness check is one float64 norm: every entry at the dtype's largest value must not overflow it."""
    factor = torch.full((512, 4096), torch.finfo(dtype).max, dtype=dtype)
    factor[::2] *= -1
    assert norm_and_finite(factor)[1]
    factor[511, 4095] = float("nan")
    assert not norm_and_finite(factor)[1]


def test_the_batched_norms_answer_what_each_factor_alone_does():
    """One reduction for all factors of at most 32 bits, the rest one by one, in their order: the same norms and the
    same finiteness as `norm_and_finite` per factor, NaN, Inf and the dtype's largest values included."""
    generator = torch.Generator().manual_seed(3)
    factors = [torch.randn(4, 4096, generator=generator).to(torch.bfloat16),
               torch.randn(14336, 4, generator=generator),
               torch.randn(8, 8, generator=generator, dtype=torch.float64),
               torch.randn(4, 16, generator=generator).half(),
               torch.full((64, 64), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)]  # fmt: skip
    factors[1][7, 1] = float("nan")
    factors[3][0, 0] = float("inf")
    factors[2][1, 1] = float("inf")
    expected = [norm_and_finite(factor) for factor in factors]
    batched = list(norms_and_finite(factors))
    finiteness = [True, False, False, False, True]
    assert [finite for _, finite in batched] == [finite for _, finite in expected] == finiteness
    for (norm, finite), (reference, _) in zip(batched, expected, strict=True):
        assert not finite or norm == pytest.approx(reference, rel=1e-12) and norm > 0


def test_a_bfloat16_norms_estimate_lies_well_within_its_margin():
    """The premise of the estimates: bfloat16 factors of an 8B adapter's shapes (strided slices included, as a
    narrow adapter's B is in its slot image) reduced in bfloat16 land within a quarter of `ESTIMATE_MARGIN` of their
    float64 norms."""
    generator = torch.Generator().manual_seed(11)
    factors = [torch.randn(8, 4096, generator=generator).to(torch.bfloat16) * 3,
               torch.randn(14336, 8, generator=generator).to(torch.bfloat16)[:, :4],
               torch.randn(4096, 16, generator=generator).to(torch.bfloat16)[::2] * 1e-3,
               torch.full((1024, 8), 7.0).to(torch.bfloat16)]  # fmt: skip
    for (estimate, finite, exact), factor in zip(estimated_norms(factors), factors, strict=True):
        reference = norm_and_finite(factor)[0]
        assert finite and not exact and abs(estimate - reference) <= ESTIMATE_MARGIN / 4 * reference


@pytest.mark.parametrize("serving", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("over", [False, True])
def test_bfloat16_factors_a_hair_from_the_limit_get_the_float64_verdict(serving, over):
    """A gain 0.1% either side of the limit is inside the estimates' margin: such a module is judged on float64
    norms, refused exactly when they say so and named with their gain."""
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(8, 4096, generator=generator).to(torch.bfloat16)
    b = torch.randn(4096, 8, generator=generator).to(torch.bfloat16)
    scaling = gain_limit(serving) / module_gain(a, b, 1.0) * (1.001 if over else 0.999)
    non_finite, problems = value_problems([("model.layers.0.mlp.up_proj", a, b, scaling)], serving)
    assert non_finite == [] and bool(problems) == over, problems
    if over:
        assert f"gain {module_gain(a, b, scaling):.3g} " in problems[0]


def test_only_modules_an_estimate_leaves_open_are_reduced_again_in_float64(monkeypatch):
    """bfloat16 factors clear of every limit (trained adapters' gains are 1e1 to 1e4) are reduced once; a module near
    the limit and a factor past bfloat16's range (finite, its estimate not) are reduced again, in float64, and only
    they."""
    again = []
    exact = values.norm_and_finite
    monkeypatch.setattr(values, "norm_and_finite", lambda tensor: again.append(tensor) or exact(tensor))
    generator = torch.Generator().manual_seed(2)

    def factors(scale=1.0):
        return (torch.randn(8, 512, generator=generator).to(torch.bfloat16) * scale,
                torch.randn(512, 8, generator=generator).to(torch.bfloat16))  # fmt: skip

    clear = [(f"model.layers.{i}.mlp.up_proj", *factors(), 2.0) for i in range(4)]
    assert value_problems(clear, torch.bfloat16) == ([], []) and again == []
    near_a, near_b = factors()
    near = ("model.layers.4.mlp.up_proj", near_a, near_b, 0.99 * MAX_GAIN / module_gain(near_a, near_b, 1.0))
    huge = torch.full((64, 64), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    again.clear()
    non_finite, problems = value_problems([*clear, near, ("model.layers.5.mlp.up_proj", huge, huge, 1.0)],
                                          torch.bfloat16)  # fmt: skip
    assert non_finite == [] and [p.split(":")[0] for p in problems] == ["model.layers.5.mlp.up_proj"], problems
    assert {id(t) for t in again} == {id(near_a), id(near_b), id(huge)}, len(again)


@pytest.mark.parametrize("name", ["support-bd128", "org/adapter:v1.2", "a", "x" * ADAPTER_NAME_MAX, "tenant_7@eu+1"])
def test_adapter_names_of_the_safe_set_pass(name):
    assert adapter_name_problem(name) is None


@pytest.mark.parametrize(
    "name", ["", "line\nbreak", "nul\0byte", "x" * (ADAPTER_NAME_MAX + 1), "-leading", "space here", "é", None, 7]
)
def test_adapter_names_outside_the_safe_set_are_refused_naming_the_rule(name):
    problem = adapter_name_problem(name)
    assert problem is not None and "letters, digits" in problem
    assert "\n" not in problem and "\0" not in problem and len(problem) < 400


def test_adapter_paths_with_control_characters_are_refused():
    assert adapter_path_problem("/adapters/a") is None
    for path in ("/adapters/a\0b", "/adapters/\nx", "", None):
        assert "not allowed" in adapter_path_problem(path)


def test_only_the_probes_are_open():
    for path in OPEN_PATHS:
        assert not needs_api_key(path) and not needs_api_key(path + "/")
    for path in ("/adapters", "/adapters/x", "/invocations", "/v1/completions", "/docs", "/openapi.json", "/",
                 "/healthz", "/health/../adapters", "/metrics"):  # fmt: skip
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


# -- the store ---------------------------------------------------------------------------------------------------


def kept(identity: str, values: float, n: int = 256):
    """An admitted adapter as the store sees it: a template LoRAModel whose module weights hold tensors."""
    weights = SimpleNamespace(
        lora_a=torch.full((4, n), float(values)), lora_b=torch.full((n, 4), -float(values), dtype=torch.bfloat16)
    )
    return AdmittedAdapter("a", SimpleNamespace(loras={"m": weights}), identity, "", [], None)


def test_the_store_spills_past_its_budget_and_reads_back_exactly(tmp_path):
    store = AdapterStore(host_budget=kept("x", 0).nbytes * 2, spill_dir=str(tmp_path))
    adapters = {i: kept(f"id{i}", float(i)) for i in range(1, 5)}
    for i, adapter in adapters.items():
        store.keep(i, adapter)
    assert store.resident_bytes <= store.host_budget and store.ids() == {1, 2, 3, 4}
    assert os.listdir(tmp_path) == []  # spill files are unlinked as soon as made
    assert adapters[1].template.loras["m"].lora_a is None  # the least recently used were spilled
    for i in (1, 2, 3, 4):
        got = store.get(i)
        assert torch.equal(got.template.loras["m"].lora_a, torch.full((4, 256), float(i)))
        assert torch.equal(got.template.loras["m"].lora_b, torch.full((256, 4), -float(i), dtype=torch.bfloat16))
        assert store.resident_bytes <= store.host_budget
    assert store.status([1, 9]) == {1: Ready("id1"), 9: Unknown()}
    assert store.forget(2) and not store.forget(2) and store.get(2) is None
    store.remove_all()
    assert store.ids() == set() and store.resident_bytes == 0


def test_a_spilled_adapter_is_read_back_ahead_of_the_step_and_a_load_meanwhile_waits_for_it(tmp_path, monkeypatch):
    store = AdapterStore(host_budget=kept("x", 0).nbytes * 2, spill_dir=str(tmp_path))
    for i in (1, 2, 3):
        store.keep(i, kept(f"id{i}", float(i)))
    assert store.spilled_ids() == {1} and store.needs_restore(1)
    reading, release = threading.Event(), threading.Event()
    preadv = os.preadv

    def slow_preadv(*args):  # hold the read-back until the test has asked for the adapter
        reading.set()
        release.wait(10)
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    timings = []
    assert store.restore_ahead([1, 2, 9], timings.append) == [1]  # only the spilled one is read back
    assert reading.wait(10) and store.needs_restore(1)
    assert ADMISSIONS_READING.any()  # the worker's queue reader leaves the interpreter lock to it, as to admissions
    assert store.restore_ahead([1]) == [1]  # already under way: still not in memory, and not read a second time
    assert store.reading_back([1, 2, 9]) == [1]
    got = []
    loader = threading.Thread(target=lambda: got.append(store.get(1)))
    loader.start()
    loader.join(0.2)
    assert loader.is_alive()  # a load waits for the read-back rather than reading the spill file a second time
    release.set()
    loader.join(10)
    assert torch.equal(got[0].template.loras["m"].lora_a, torch.full((4, 256), 1.0))
    assert not store.needs_restore(1) and 1 in store.resident_ids() and len(timings) == 1
    assert store.restore_ahead([1]) == [] and store.reading_back([1]) == []  # in memory: nothing to wait for
    assert store.resident_bytes <= store.host_budget  # another adapter was spilled to make room


def test_an_adapter_a_request_named_stays_in_memory_until_a_step_takes_it(tmp_path):
    """Adapters named by requests (found in memory, or read back) are passed over when the budget spills, while
    another can go, until a step takes them (`get`) or `named_kept_s` passes; when every other one is named, the
    least recently used goes after all."""

    def read_back(adapter_id):
        assert store.restore_ahead([adapter_id]) == [adapter_id]
        deadline = time.monotonic() + 10
        while store.needs_restore(adapter_id) and time.monotonic() < deadline:
            time.sleep(0.01)

    store = AdapterStore(host_budget=kept("x", 0).nbytes * 3, spill_dir=str(tmp_path))
    for i in (1, 2, 3, 4):
        store.keep(i, kept(f"id{i}", float(i)))
    assert store.spilled_ids() == {1}
    assert store.restore_ahead([2]) == []  # in memory: named
    read_back(1)  # named, and read back: 3 goes
    assert store.resident_ids() == {1, 2, 4}
    store.keep(5, kept("id5", 5.0))  # least recently used first: 2, 4, 1; 2 is named
    assert store.resident_ids() == {1, 2, 5}
    store.get(2)  # a step took it: an adapter like any other from now on, and the most recently used
    store.keep(6, kept("id6", 6.0))  # 1 named, 5 goes
    store.keep(7, kept("id7", 7.0))  # 1 named, 2 goes
    assert store.resident_ids() == {1, 6, 7}
    assert store.restore_ahead([6, 7]) == []  # every one but the next kept is named: the least recently used goes
    store.keep(8, kept("id8", 8.0))
    assert store.resident_ids() == {6, 7, 8}
    store.named_kept_s = 0.0
    assert store.restore_ahead([6]) == []  # named, but for no time: 6 is as any other
    store.get(7)
    store.get(8)
    store.keep(9, kept("id9", 9.0))
    assert store.resident_ids() == {7, 8, 9}


@pytest.mark.parametrize("then", ["forget", "reload"])
def test_an_adapter_forgotten_or_reloaded_while_read_back_ahead_is_never_served_stale(tmp_path, monkeypatch, then):
    store = AdapterStore(host_budget=kept("x", 0).nbytes, spill_dir=str(tmp_path))
    store.keep(1, kept("a", 1.0))
    store.keep(2, kept("b", 2.0))
    release = threading.Event()
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: release.wait(10) and preadv(*args))
    assert store.restore_ahead([1]) == [1]
    change = (lambda: store.forget(1)) if then == "forget" else (lambda: store.keep(1, kept("a2", 3.0)))
    changing = threading.Thread(target=change)
    changing.start()
    changing.join(0.2)
    assert changing.is_alive()  # it waits for the read-back, which would otherwise land after it
    release.set()
    changing.join(10)
    if then == "forget":
        assert 1 not in store.ids() and store.get(1) is None
    else:
        assert store.get(1).identity == "a2"


def test_a_spill_that_finds_no_space_keeps_the_adapter_and_says_why(tmp_path, monkeypatch):
    store = AdapterStore(host_budget=kept("x", 0).nbytes, spill_dir=str(tmp_path))
    store.keep(1, kept("a", 1.0))

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(StoreFull) as full:
        store.keep(2, kept("b", 2.0))
    assert "No space left on device" in str(full.value) and adapter_failure_status(str(full.value)) == 507
    assert store.get(1).template.loras["m"].lora_a is not None and store.get(2) is None


def test_admissions_run_on_threads_and_a_stuck_one_does_not_hold_up_the_next():
    store = AdapterStore(host_budget=2**30, threads=1)
    stuck = threading.Event()
    store.begin(1, "stuck", lambda: stuck.wait(60) and kept("never", 0.0))
    store.begin(2, "next", lambda: kept("b", 2.0))
    time.sleep(0.2)
    status = store.status([1, 2])
    assert isinstance(status[1], Reading) and status[1].seconds > 0.1  # reading for 0.2 s
    assert status[2] == Reading(0.0)  # one read at a time: 2 waits for 1, and its reading time has not begun
    assert store.forget(1)  # given up at its deadline: its slot goes to the next admission
    deadline = time.monotonic() + 10
    while isinstance(store.status([2])[2], Reading) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.status([2]) == {2: Ready("b")}
    assert store.take_staged(2).identity == "b" and store.get(2).identity == "b"
    stuck.set()
    store.begin(3, "bad", lambda: (_ for _ in ()).throw(AdapterRejected("bad", ["x: broken"])))
    deadline = time.monotonic() + 10
    while isinstance(store.status([3])[3], Reading) and time.monotonic() < deadline:
        time.sleep(0.01)
    state = store.status([3])[3]
    assert isinstance(state, Failed) and "LoRA adapter rejected: 'bad'" in state.message
    with pytest.raises(AdapterRejected):
        store.take_staged(3)


def test_beginning_an_admission_does_not_wait_for_its_thread_to_run(monkeypatch):
    """A worker's main thread begins admissions for the engine core, which waits for its answer: it hands the new
    thread over rather than wait in Thread.start for the thread to run (slowed down here to a second)."""
    start = threading.Thread.start

    def slow_start(thread):
        if thread.name.startswith("bdlora-admit-"):
            time.sleep(1.0)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    store = AdapterStore(host_budget=2**30, threads=2)
    began = time.monotonic()
    store.begin(1, "a", lambda: kept("a", 1.0))
    store.begin(2, "b", lambda: kept("b", 2.0))
    assert time.monotonic() - began < 0.5
    assert store.take_staged(1, timeout=10).identity == "a" and store.take_staged(2, timeout=10).identity == "b"


def test_ranks_that_read_different_files_are_refused_and_cleaned_up():
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


def test_failure_statuses_follow_their_messages():
    from vllm_bdlora.access import PATH_REFUSED, STORE_FULL

    assert adapter_failure_status(str(AdapterRejected("a", ["x"]))) == 400
    assert adapter_failure_status(f"LoRA adapter 'a': {PATH_REFUSED}") == 403
    assert adapter_failure_status(f"LoRA adapter 'a' not admitted: {STORE_FULL} (disk full)") == 507
    assert adapter_failure_status("something else") is None


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


def test_cpu_defaults_measure_the_numa_node_as_vllm_does(monkeypatch):
    """A machine whose free memory looks ample while its NUMA node's (clamped to the container's limit) falls short
    of vLLM's 0.92: vLLM's own measure says so, and the KV cache gets sized instead of vLLM stopping the server."""
    import os

    from vllm.utils import cpu_resource_utils

    from vllm_bdlora.serve import cpu_defaults

    gib = 2**30
    node = cpu_resource_utils.MemoryNodeInfo(total_memory=int(17.34 * gib), available_memory=int(15.73 * gib))
    monkeypatch.setattr(cpu_resource_utils, "get_memory_node_info", lambda node_id=0: node)
    monkeypatch.setattr(cpu_defaults, "numa_nodes", lambda: 1)
    monkeypatch.setattr(os, "environ", {})
    assert cpu_defaults.apply_cpu_defaults(1, utilization=0.92) == {"VLLM_CPU_KVCACHE_SPACE": "3"}
    # 21.05 of 23.54 GiB: 0.92 of it was free when the API server looked, not when its worker did (seen on a CI runner)
    node = cpu_resource_utils.MemoryNodeInfo(total_memory=int(23.54 * gib), available_memory=int(21.7 * gib))
    monkeypatch.setattr(os, "environ", {})
    assert cpu_defaults.apply_cpu_defaults(1, utilization=0.92) == {"VLLM_CPU_KVCACHE_SPACE": "5"}
    node = cpu_resource_utils.MemoryNodeInfo(total_memory=256 * gib, available_memory=250 * gib)  # a server's own
    monkeypatch.setattr(os, "environ", {})
    assert cpu_defaults.apply_cpu_defaults(1, utilization=0.92) == {}


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


def test_a_large_header_is_parsed_without_the_lock_holding_parser(monkeypatch):
    """json's C parser holds the interpreter lock for its whole run (seconds for the 100 MiB the format allows,
    while the worker's engine step waits): past LOCK_HOLDING_PARSE_LIMIT the header goes to json's Python parser,
    which gives the same object."""
    from vllm_bdlora.adapter_lifecycle import files as adapter_files

    entry = {"dtype": "F32", "shape": [8, 128], "data_offsets": [0, 4096]}
    header = {f"base_model.model.model.layers.{i}.mlp.up_proj.lora_A.weight": entry for i in range(20000)}
    raw = json.dumps(header).encode()
    assert len(raw) > adapter_files.LOCK_HOLDING_PARSE_LIMIT
    expected = json.loads(raw)

    def refuse(*args, **kwargs):
        raise AssertionError("json.loads holds the lock: not for a header this large")

    monkeypatch.setattr(adapter_files.json, "loads", refuse)
    assert adapter_files.parse_header_json(raw) == expected


def test_pattern_keys_times_modules_are_bounded():
    from vllm_bdlora.name_patterns import MAX_PATTERN_MATCHES, matching_work_problem

    config = {"rank_pattern": {f"k{i}": 8 for i in range(200)}, "alpha_pattern": {f"a{i}": 8 for i in range(56)}}
    assert matching_work_problem(config, MAX_PATTERN_MATCHES // 256, "adapter_config.json") is None
    problem = matching_work_problem(config, MAX_PATTERN_MATCHES // 256 + 1, "adapter_config.json")
    assert "256 rank_pattern/alpha_pattern keys over 1025 modules" in problem and "over the limit" in problem


def test_a_fills_model_copy_is_copy_copy_of_vllms_classes_and_falls_back_for_others():
    """A fill copies the adapter's LoRAModel and its module weights (vLLM registers them in place) with a shortcut
    for plain classes; it must give what `copy.copy` gives: a new object of the same class, the same attributes, a
    dict of its own. A class with its own copy or slots gets `copy.copy` itself."""
    import copy

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    from vllm_bdlora.adapter_lifecycle.read_and_cut import _model_copy, _shallow_copy

    weights = LoRALayerWeights("m", 4, 8, torch.randn(4, 16), torch.randn(16, 4))
    packed = PackedLoRALayerWeights.pack([weights, None])
    model = LoRAModel(3, 4, {"m": weights, "p": packed})
    copied = _model_copy(model)
    assert type(copied) is LoRAModel and copied is not model and copied.loras is not model.loras
    for name in ("m", "p"):
        ours, reference = copied.loras[name], copy.copy(model.loras[name])
        assert type(ours) is type(reference) and ours is not model.loras[name]
        assert ours.__dict__ == reference.__dict__ and ours.__dict__ is not model.loras[name].__dict__
    copied.loras["m"].lora_a = None  # vLLM's registration rewrites the copy, never the template
    assert model.loras["m"].lora_a is weights.lora_a is not None

    class OwnCopy:
        def __init__(self):
            self.copies = 0

        def __copy__(self):
            made = OwnCopy()
            made.copies = self.copies + 1
            return made

    class Slotted:
        __slots__ = ("x",)

    assert _shallow_copy(OwnCopy()).copies == 1
    slotted = Slotted()
    slotted.x = 5
    assert _shallow_copy(slotted).x == 5

"""The benchmark suite's pieces: adapters in PEFT's formats, parameter counts, report logic, and one
small end-to-end sweep on CPU (the same code path the GPU sweeps take)."""

import csv
import gc
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from bench import report
from bench.adapters import trainable_params, write_adapter
from bench.shapes import SHAPES
from vllm_bdlora import tiny


@pytest.mark.parametrize("nblocks", [None, 2])
def test_written_adapters_match_peft_format_and_load_in_peft(assets, tmp_path, nblocks):
    from peft import PeftModel

    from vllm_bdlora.peft_reference import load_reference

    ours = write_adapter(SHAPES["tiny"], str(tmp_path / "ours"), rank=16, nblocks=nblocks)
    peft_own = tiny.make_adapter(assets["model"], str(tmp_path / "peft"), rank=16, nblocks=nblocks)
    ours_tensors = load_file(f"{ours}/adapter_model.safetensors")
    peft_tensors = load_file(f"{peft_own}/adapter_model.safetensors")
    assert {k: v.shape for k, v in ours_tensors.items()} == {k: v.shape for k, v in peft_tensors.items()}
    assert all(v.abs().sum() > 0 for v in ours_tensors.values())
    model = load_reference(assets["model"], None)
    peft_model = PeftModel.from_pretrained(model, ours)
    trained = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert trained == trainable_params(SHAPES["tiny"], 16, nblocks)
    config = json.loads(open(f"{ours}/adapter_config.json").read())
    assert ("use_bdlora" in config) == bool(nblocks)


def test_parameter_counts_match_the_paper():
    """BD-LoRA paper, Llama-3.1-8B, N=8: BD rank 128 has 144.7M parameters, LoRA rank 64 167.8M."""
    shape = SHAPES["llama-3.1-8b"]
    assert round(trainable_params(shape, 64) / 1e5) == 1678
    assert round(trainable_params(shape, 128, nblocks=8) / 1e5) == 1447


def test_paired_ranks_have_equal_parameters_only_at_four_blocks():
    """The counts README.md and bench/README.md state for BD r'=128 at each TP against LoRA r=64."""
    shape = SHAPES["llama-3.1-8b"]
    bd = {tp: round(trainable_params(shape, 128, nblocks=tp) / 1e5) for tp in (1, 2, 4, 8)}
    assert bd == {1: 3355, 2: 2265, 4: 1720, 8: 1447}
    assert abs(bd[4] / round(trainable_params(shape, 64) / 1e5) - 1) < 0.03


def synthetic_row(mode, rank, tpot, throughput, concurrency=1):
    return {
        "mode": mode, "tp": 4, "rank": rank, "trainable_params": rank * 1e6, "input_len": 1024, "output_len": 128,
        "concurrency": concurrency, "num_adapters": 0 if mode == "base" else 1, "median_tpot_ms": tpot,
        "median_ttft_ms": 50.0, "median_e2el_ms": 1000.0, "output_throughput": throughput,
    }  # fmt: skip


def test_targets_are_judged_from_the_numbers():
    rows = [
        synthetic_row("base", 0, 10.0, 100),
        synthetic_row("bdlora", 128, 10.4, 96),  # within 5% of base
        synthetic_row("slora", 64, 13.0, 77),  # 1.25x slower than BD: under the 1.3x target
        synthetic_row("nfs", 64, 10.6, 94),
    ]
    verdicts = report.targets(report.index(rows))
    assert verdicts[0].endswith("met")
    assert verdicts[1].endswith("MISSED")
    assert verdicts[2].endswith("met (measured at r=64; not at r=256)")
    assert verdicts[3].endswith("not measured")  # no BS=64 point
    assert verdicts[4].endswith("not measured")  # no BD-DoRA point
    dora = report.targets(report.index([*rows, synthetic_row("bddora", 128, 11.4, 90)]))[4]
    assert dora.endswith("met")  # 11.4 <= 1.10 x 10.4 = 11.44
    slow = report.targets(report.index([*rows, synthetic_row("bddora", 128, 11.5, 90)]))[4]
    assert slow.endswith("MISSED")


def test_targets_are_judged_again_for_the_fused_kernels_when_they_ran():
    rows = [
        synthetic_row("base", 0, 10.0, 100),
        synthetic_row("bdlora", 128, 12.0, 80),  # 1.2x base; S-LoRA only 1.25x slower
        synthetic_row("bdfused", 128, 10.2, 98),  # within 5% of base; S-LoRA 1.47x slower
        synthetic_row("slora", 64, 15.0, 66),
        synthetic_row("bdlora", 128, 20.0, 500, concurrency=64),
        synthetic_row("bdfused", 128, 21.0, 450, concurrency=64),
        synthetic_row("slora", 64, 25.0, 470, concurrency=64),
    ]
    verdicts = report.targets(report.index(rows))
    assert len(verdicts) == 9
    assert "vLLM's LoRA kernels" in verdicts[0] and verdicts[0].endswith("MISSED")
    assert verdicts[1].endswith("MISSED")
    assert verdicts[3].endswith("met (measured at r=64; not at r=16, 256)")
    fused = verdicts[5:]
    assert all("fused kernels" in line for line in fused)
    assert fused[0].endswith("met") and fused[1].endswith("met")
    assert fused[2].endswith("not measured")  # no NFS point
    assert fused[3].endswith("MISSED (measured at r=64; not at r=16, 256)")  # 450 < S-LoRA's 470


def test_fused_mode_serves_bd_adapters_on_the_fused_kernels_and_is_compared():
    from bench.sweep import ServerConfig, parse_args, serve_command

    args = parse_args(["--out", "unused", "--modes", "bdfused"])
    command = serve_command(args, ServerConfig("bdfused", 4, 128, 1), "m", {"a0": "/adapter"}, 8000)
    assert "--enable-bdlora" in command and "--enable-lora" not in command
    config = json.loads(command[command.index("--additional-config") + 1])
    assert config == {"bdlora": {"lora_kernels": "fused"}}
    for mode in ("bdlora", "bddora"):  # named, not left to the plugin's default ("auto": fused on CUDA)
        command = serve_command(args, ServerConfig(mode, 4, 128, 1), "m", {"a0": "/adapter"}, 8000)
        assert json.loads(command[command.index("--additional-config") + 1]) == {"bdlora": {"lora_kernels": "vllm"}}
    rows = [synthetic_row("bdlora", 128, 10.0, 100), synthetic_row("bdfused", 128, 8.0, 125),
            synthetic_row("nfs", 64, 10.6, 94)]  # fmt: skip
    (_, fused_vs_nfs, line) = report.speedups(report.index(rows)[(4, 1024, 128, 1, 1)])
    assert fused_vs_nfs.startswith("BD r'=128 on the fused kernels") and "vs nfs r=64" in fused_vs_nfs
    assert "TPOT 1.32× faster" in fused_vs_nfs  # 10.6 / 8.0
    assert "on the fused kernels: TPOT 1.25× faster" in line and "throughput ×1.25" in line
    assert (report.speed(8.0, 10.0), report.speed(13.0, 10.0)) == ("1.25× faster", "1.30× slower")
    (alone,) = report.speedups(report.index(rows[:2])[(4, 1024, 128, 1, 1)])  # no standard-rank baseline needed
    assert alone == line


def test_lora_target_modules_reach_every_lora_server_and_not_base():
    from bench.sweep import ServerConfig, parse_args, serve_command

    args = parse_args(["--out", "unused", "--lora-target-modules", "qkv_proj,o_proj,gate_up_proj,down_proj"])
    for mode in ("bdfused", "nfs", "slora"):
        command = serve_command(args, ServerConfig(mode, 4, 128, 1), "m", {"a0": "/adapter"}, 8000)
        at = command.index("--lora-target-modules")
        assert command[at + 1 : at + 5] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert "--lora-target-modules" not in serve_command(args, ServerConfig("base", 4, 0, 0), "m", {}, 8000)
    default = serve_command(parse_args(["--out", "x"]), ServerConfig("nfs", 4, 64, 1), "m", {"a0": "/a"}, 8000)
    assert "--lora-target-modules" not in default


def test_bdlora_settings_reach_every_bd_server_beside_its_kernels():
    from bench.sweep import ServerConfig, parse_args, serve_command

    args = parse_args(["--out", "unused", "--bdlora-settings", '{"one_launch_max_tokens":16}'])
    for mode, kernels in (("bdfused", "fused"), ("bdlora", "vllm")):
        command = serve_command(args, ServerConfig(mode, 2, 128, 1), "m", {"a0": "/adapter"}, 8000)
        section = json.loads(command[command.index("--additional-config") + 1])["bdlora"]
        assert section == {"lora_kernels": kernels, "one_launch_max_tokens": 16}
    assert "--additional-config" not in serve_command(args, ServerConfig("nfs", 2, 64, 1), "m", {"a0": "/a"}, 8000)


def test_a_run_without_tp4_points_reports_speedups_instead_of_unmeasured_targets(tmp_path):
    rows = [{**synthetic_row(mode, rank, tpot, tput), "tp": 8}
            for mode, rank, tpot, tput in (("bdfused", 128, 11.0, 77), ("slora", 64, 15.9, 55))]  # fmt: skip
    text = report.write_summary(str(tmp_path), rows, report.index(rows))
    assert "## Targets" not in text
    assert "BD r'=128 on the fused kernels (128M params); vs slora r=64 (64M): TPOT 1.45× faster" in text


def test_many_adapter_sections_say_ttft_includes_waiting_for_a_slot(tmp_path):
    rows = [{**synthetic_row("bdfused", 128, 7.0, 2000), "num_adapters": 16}, synthetic_row("bdfused", 128, 5.0, 170)]
    text = report.write_summary(str(tmp_path), rows, report.index(rows))
    many, one = text.split("## TP=4, 1024/128 tokens, 16 adapter(s)")[1], text.split("16 adapter(s)")[0]
    assert "round-robin over the 16 adapters" in many and "wait for a GPU slot" in many
    assert "round-robin" not in one
    runs = [{"started": "t1", "command": "python -m bench.sweep --max-loras 8 --tp 4"}]
    (tmp_path / "environment.json").write_text(json.dumps({"runs": runs}))
    assert "`--max-loras` of them (8)" in report.write_summary(str(tmp_path), rows, report.index(rows))


def test_a_resumed_sweep_adds_its_command_to_the_environment_record(tmp_path, monkeypatch):
    from bench import run_record

    monkeypatch.setattr(run_record, "environment", lambda: {"vllm": "0.26.0"})
    (tmp_path / "environment.json").write_text(json.dumps({"vllm": "0.26.0", "started": "t1", "command": "first"}))
    for argv in (["--tp", "2"], ["--tp", "4", "--extra-server-args", "--a b"]):
        run_record.record_environment(str(tmp_path), "bench.sweep", argv)
    runs = json.loads((tmp_path / "environment.json").read_text())["runs"]
    assert [r["command"] for r in runs] == [
        "first", "python -m bench.sweep --tp 2", "python -m bench.sweep --tp 4 --extra-server-args '--a b'"
    ]  # fmt: skip
    text = report.write_summary(str(tmp_path), [synthetic_row("bdlora", 128, 10.0, 100)], {})
    assert "- started t1: `first`" in text and "`python -m bench.sweep --tp 2`" in text


def test_profiled_servers_write_their_tables_beside_the_results(tmp_path):
    from bench.sweep import ServerConfig, parse_args, serve_command

    args = parse_args(["--out", str(tmp_path), "--profile-concurrency", "64"])
    command = serve_command(args, ServerConfig("bdfused", 4, 128, 1), "m", {"a0": "/adapter"}, 8000)
    profiler = json.loads(command[command.index("--profiler-config") + 1])
    assert profiler["profiler"] == "torch" and profiler["max_iterations"] > 0
    assert profiler["torch_profiler_dir"] == str(tmp_path / "profiles" / "bdfused-tp4-r128-a1")
    unprofiled = serve_command(parse_args(["--out", "x"]), ServerConfig("bdfused", 4, 128, 1), "m", {}, 8000)
    assert "--profiler-config" not in unprofiled
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--profile-concurrency", "64", "--load-generator", "llmperf"])


def test_load_profiles_record_each_view_and_close_the_samplers_logs(tmp_path, monkeypatch):
    """`sampled_stacks.recording` runs one sampler per view around the block, stops each with SIGINT (on which py-spy
    writes its file) and closes the logs of their messages. A stand-in sampler takes py-spy's place: same command
    line, same signal."""
    import subprocess
    import sys
    import warnings

    from bench import sampled_stacks

    sampler = tmp_path / "sampler.py"
    sampler.write_text(
        "import signal, sys, time\n"
        "out = sys.argv[sys.argv.index('--output') + 1]\n"
        "def stop(*_):\n"
        "    open(out, 'w').write('process 1:\"python\";thread (1): main;f (m.py:1) 3\\n')\n"
        "    print('stopped', file=sys.stderr)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        "print('sampling', file=sys.stderr, flush=True)\n"
        "while True: time.sleep(0.01)\n"
    )
    monkeypatch.setattr(sampled_stacks.shutil, "which", lambda name: "/stand-in/" + name)
    monkeypatch.setattr(sampled_stacks, "record_command",
                        lambda pid, path, args: [sys.executable, str(sampler), "--output", path, *args])  # fmt: skip
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    prefix = str(tmp_path / "load-profile")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sampled_stacks.recording(target.pid, prefix):
                logs = [tmp_path / f"load-profile-{view}.log" for view in sampled_stacks.VIEWS]
                deadline = time.monotonic() + 60  # each sampler has its handler in place once it says so
                while not all(log.exists() and "sampling" in log.read_text() for log in logs):
                    assert time.monotonic() < deadline, "the stand-in samplers never started"
                    time.sleep(0.05)
            gc.collect()
    finally:
        target.kill()
        target.wait()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]  # every log was closed
    for view in sampled_stacks.VIEWS:
        assert sampled_stacks.read_stacks(f"{prefix}-{view}.txt") == {"python / main": {("f (m.py:1)",): 3}}
        assert (tmp_path / f"load-profile-{view}.log").read_text().split() == ["sampling", "stopped"]


@pytest.mark.engine
def test_small_sweep_end_to_end_on_cpu(tmp_path):
    from bench.sweep import COLUMNS, main

    out = tmp_path / "results"
    argv = [
        "--model-shape", "tiny", "--tp", "1", "--modes", "base,bdlora", "--ranks", "8", "--io", "16/8",
        "--concurrency", "1", "--adapters", "1", "--max-model-len", "128", "--dtype", "float32",
        "--out", str(out), "--workdir", str(tmp_path / "work"), "--start-timeout", "240",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = list(csv.DictReader(open(out / "points.csv")))
    assert [(r["mode"], r["rank"]) for r in rows] == [("base", "0"), ("bdlora", "16")]
    assert set(COLUMNS) == set(rows[0])
    assert all(float(r["median_tpot_ms"]) > 0 and float(r["output_throughput"]) > 0 for r in rows)
    assert all(float(r["median_itl_ms"]) > 0 for r in rows)
    summary = (out / "summary.md").read_text()
    assert "| bdlora | 16 |" in summary and "python -m bench.sweep --model-shape tiny --tp 1" in summary
    raw = json.loads((out / "raw" / "bdlora-tp1-r16-a1_io16-8_bs1.json").read_text())
    assert len(raw["ttfts"]) == raw["completed"] and "itls" not in raw  # per-request timings kept, tokens not
    assert (out / "plots" / "tp1_io16-8_adapters1.png").stat().st_size > 0
    assert torch.cuda.is_available() or "CPU only" in summary


LLMPERF_SUMMARY = {  # the keys LLMPerf's token_benchmark_ray.py writes to <model>_<in>_<out>_summary.json
    "results_inter_token_latency_s_quantiles_p50": 0.0042,
    "results_inter_token_latency_s_quantiles_p99": 0.0061,
    "results_ttft_s_quantiles_p50": 0.031,
    "results_ttft_s_quantiles_p99": 0.090,
    "results_end_to_end_latency_s_quantiles_p50": 0.57,
    "results_mean_output_throughput_token_per_s": 210.5,
    "results_num_completed_requests": 12,
}

FAKE_LLMPERF = """
import argparse, json, os
from transformers import LlamaTokenizerFast
from llmperf_marker import SRC  # the launcher put the checkout's src/ on the path
# What LLMPerf loads to count tokens resolves to the served model's word-level tokenizer.
assert len(LlamaTokenizerFast.from_pretrained("hf-internal-testing/llama-tokenizer").encode("w5 w6 w7")) == 3
p = argparse.ArgumentParser()
for flag in ("--model", "--mean-input-tokens", "--stddev-input-tokens", "--mean-output-tokens",
             "--stddev-output-tokens", "--max-num-completed-requests", "--num-concurrent-requests", "--timeout",
             "--results-dir", "--llm-api", "--additional-sampling-params"):
    p.add_argument(flag)
a = p.parse_args()
assert os.environ["OPENAI_API_BASE"].endswith("/v1") and a.llm_api == "openai"
summary = json.loads(os.environ["FAKE_SUMMARY"])
summary["model"] = a.model
name = f"{a.model}_{a.mean_input_tokens}_{a.mean_output_tokens}_summary.json"
with open(os.path.join(a.results_dir, name), "w") as f:
    json.dump(summary, f)
"""


def test_llmperf_results_are_normalised_to_the_sweep_schema(tmp_path, monkeypatch):
    """LLMPerf's command line and summary file through the sweep's point runner, with a stand-in script and
    no server (tests/test_llmperf.py runs the real LLMPerf): launcher, tokenizer substitution, environment,
    warm-up, summary pick-up, unit conversion."""
    import argparse
    import sys

    from bench import load_generators
    from bench.load_generators import normalise, run_point

    checkout = tmp_path / "llmperf"
    (checkout / "src").mkdir(parents=True)
    (checkout / "src" / "llmperf_marker.py").write_text("SRC = True\n")
    (checkout / "token_benchmark_ray.py").write_text(FAKE_LLMPERF)
    model = tmp_path / "model"
    model.mkdir()
    tiny.make_tokenizer(str(model), 64)
    warmed = []
    monkeypatch.setattr(load_generators, "warm_up", lambda *a: warmed.append(a) or "warm-up: stand-in")
    monkeypatch.setenv("FAKE_SUMMARY", json.dumps(LLMPERF_SUMMARY))
    args = argparse.Namespace(load_generator="llmperf", llmperf_dir=str(checkout), llmperf_python=sys.executable,
                              prompts_per_concurrency=4)  # fmt: skip
    raw = tmp_path / "point.json"
    rc, result = run_point(args, str(model), {"a0": "/adapter"}, "http://127.0.0.1:1", (1024, 128), 4, str(raw),
                           str(tmp_path / "point.log"))  # fmt: skip
    assert rc == 0 and result["model"] == "a0", (tmp_path / "point.log").read_text()
    assert warmed == [("http://127.0.0.1:1", "a0", (1024, 128), 4)]
    row = normalise("llmperf", result)
    assert row["median_tpot_ms"] == pytest.approx(4.2) and row["median_ttft_ms"] == pytest.approx(31.0)
    assert row["median_itl_ms"] is None  # LLMPerf keeps no per-gap latencies
    assert row["median_e2el_ms"] == pytest.approx(570.0) and row["output_throughput"] == 210.5


def test_summary_names_the_load_generator_that_ran(tmp_path):
    rows = [{**synthetic_row("bdlora", 128, 10.0, 100), "load_generator": "llmperf", "p99_ttft_ms": None}]
    text = report.write_summary(str(tmp_path), rows, report.index(rows))
    assert "load generator `llmperf token_benchmark_ray`" in text and "vllm bench serve" not in text
    assert "| bdlora | 128 | 128 | 10.00 | - | 50.0 | - |" in text  # no ITL or p99 reported: dashes, not a crash


def test_a_second_load_generator_gets_its_own_table_beside_the_first(tmp_path):
    """Both generators against the same servers: tables, speed-ups and plots come from `vllm bench serve`'s points;
    LLMPerf's follow in a table of their own with each number's ratio to the first generator's."""
    first = [synthetic_row("base", 0, 5.0, 200), synthetic_row("bdlora", 128, 6.0, 150)]
    second = [{**row, "load_generator": "llmperf", "median_tpot_ms": row["median_tpot_ms"] * 1.5,
               "median_ttft_ms": 100.0} for row in first]  # fmt: skip
    rows = [{**row, "load_generator": "vllm"} for row in first] + second
    table = report.index(rows)
    assert {r["load_generator"] for section in table.values() for r in section.values()} == {"vllm"}
    text = report.write_summary(str(tmp_path), rows, table)
    assert "load generator `llmperf token_benchmark_ray`" in text and "`vllm bench serve`" in text
    assert "Measured by `llmperf token_benchmark_ray` against the same servers" in text
    assert "| bdlora | 128 | 9.00 | 100.0 | 1000 | 150.0 | 1.50 | 2.00 |" in text
    assert "| base | 0 | 7.50 | 100.0 | 1000 | 200.0 | 1.50 | 2.00 |" in text


@pytest.mark.parametrize("generators", ["vllm,vllm", "vllm,ab", ""])
def test_load_generator_lists_are_checked(generators):
    from bench.sweep import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--load-generator", generators, "--out", "x"])


def test_first_wave_time_is_read_from_per_request_timings(tmp_path):
    """Four requests at concurrency 2: the first wave is the two that start first, whatever their order in the
    file; its time runs from the first start to the later of their first tokens. A median TTFT cannot show it."""
    (tmp_path / "raw").mkdir()
    raw = {"start_times": [10.3, 10.0, 10.6, 10.01], "ttfts": [0.05, 0.2, 0.05, 0.5]}
    (tmp_path / "raw" / "p.json").write_text(json.dumps(raw))
    row = {**synthetic_row("bdfused", 128, 10.0, 100, concurrency=2), "raw_file": "raw/p.json"}
    assert report.first_wave_ms(str(tmp_path), row) == pytest.approx(510.0)
    text = report.write_summary(str(tmp_path), [row], report.index([row]))
    assert "| bdfused | 128 | 128 | 10.00 | - | 50.0 | - | 510 |" in text
    older = {**row, "raw_file": "raw/missing.json"}  # raw files from before --save-detailed: no column value
    assert report.first_wave_ms(str(tmp_path), older) is None


def test_resuming_a_points_file_with_older_columns_rewrites_its_header_first(tmp_path):
    """A sweep resumed into a folder an older sweep wrote (no median_itl_ms column) must not append rows
    whose fields run past that header: the file is rewritten with today's columns, its rows kept."""
    from bench.sweep import COLUMNS, points_so_far

    old_columns = [c for c in COLUMNS if c != "median_itl_ms"]
    path = tmp_path / "points.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_columns)
        writer.writeheader()
        writer.writerow({**{c: "1" for c in old_columns}, "mode": "base", "raw_file": "raw/base-a.json"})
    assert points_so_far(str(path)) == {"base-a.json"}
    with open(path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=COLUMNS).writerow({**{c: "2" for c in COLUMNS}, "mode": "bdfused"})
    rows = report.read_points(str(tmp_path))
    assert [r["mode"] for r in rows] == ["base", "bdfused"] and None not in rows[0]
    assert rows[0]["median_itl_ms"] is None and rows[1]["median_itl_ms"] == 2.0
    assert points_so_far(str(tmp_path / "absent.csv")) == set()
    (tmp_path / "empty.csv").write_text("")  # a sweep cut before its first point: left for main to head
    assert points_so_far(str(tmp_path / "empty.csv")) == set() and (tmp_path / "empty.csv").read_text() == ""


def test_median_itl_comes_from_the_points_or_else_the_raw_file(tmp_path):
    """Points written before the column existed still show the median inter-token latency, read from vLLM's
    own result file; a point that has the column uses it; neither: a dash, not a zero."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "p.json").write_text(json.dumps({"median_itl_ms": 6.56}))
    older = {**synthetic_row("bdfused", 128, 15.4, 100, concurrency=64), "raw_file": "raw/p.json"}
    assert report.median_itl_ms(str(tmp_path), older) == pytest.approx(6.56)
    newer = {**older, "median_itl_ms": 6.4}
    assert report.median_itl_ms(str(tmp_path), newer) == pytest.approx(6.4)
    text = report.write_summary(str(tmp_path), [older], report.index([older]))
    assert "| bdfused | 128 | 128 | 15.40 | 6.56 | 50.0 |" in text
    assert report.median_itl_ms(str(tmp_path), synthetic_row("base", 0, 10.0, 100)) is None


def test_overview_compares_bd_only_with_baselines_of_the_same_run(tmp_path):
    """Two runs: S-LoRA in one, NFS and base in the other. BD is compared with each baseline of its own run and
    never across runs (a cross-run S-LoRA ratio here would be 13/8, not None); tp2 is listed before tp16."""
    from bench import overview
    from bench.sweep import COLUMNS

    runs = {
        "tp2-run": [synthetic_row("bdfused", 128, 10.0, 100), synthetic_row("slora", 64, 13.0, 80)],
        "tp16-run": [{**synthetic_row("bdfused", 128, 8.0, 100), "median_itl_ms": 6.0},
                    synthetic_row("nfs", 64, 10.0, 90), {**synthetic_row("base", 0, 5.0, 200), "median_itl_ms": 4.8}],
    }  # fmt: skip
    for run, rows in runs.items():
        (tmp_path / "serving" / run).mkdir(parents=True)
        with open(tmp_path / "serving" / run / "points.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows({**row, "model_shape": "llama-3.1-8b"} for row in rows)
    a, b = overview.comparisons(str(tmp_path))
    assert (a["run"], a["tpot_vs_slora"], a["tpot_vs_nfs"], a["tpot_over_base"]) == ("tp2-run", 1.3, None, None)
    assert (b["run"], b["tpot_vs_slora"], b["tpot_vs_nfs"], b["tpot_over_base"]) == ("tp16-run", None, 1.25, 1.6)
    assert b["throughput_vs_nfs"] == pytest.approx(100 / 90)
    assert a["itl_over_base"] is None and b["itl_over_base"] == pytest.approx(1.25)  # the decode step: 6.0 / 4.8
    overview.main([str(tmp_path)])
    text = (tmp_path / "overview.md").read_text()
    assert "| `tp16-run` | llama-3.1-8b | 4 | 1024/128 | 1 | 1 | fused | 64 / 128 | — | 1.25× |" in text
    assert text.rstrip().endswith("| 1.60× | 1.25× |")
    assert (tmp_path / "overview.png").stat().st_size > 0


def test_llmperf_is_refused_for_many_adapter_points(tmp_path):
    from bench.sweep import parse_args

    (tmp_path / "token_benchmark_ray.py").write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--load-generator", "llmperf", "--llmperf-dir", str(tmp_path), "--adapters", "many"])
    assert parse_args(["--out", "x", "--load-generator", "llmperf", "--llmperf-dir", str(tmp_path), "--adapters", "1"])


def fused_lora_report_of(tmp_path, row) -> str:
    """bench.kernels.fused_lora's report of a one-row results JSON, as a bare H200 host without vLLM writes it."""
    from bench.kernels.fused_lora import report

    env = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "time": "now", "command": "python3 -m ..."}
    results = {"environment": env, "copy_bandwidth_gbs": 4197, "rows": [{"vllm_ms": None, **row}]}
    (tmp_path / "fused_lora.json").write_text(json.dumps(results))
    return open(report(str(tmp_path / "fused_lora.json"))).read()


def test_fused_lora_report_from_a_host_without_vllm_marks_vllm_columns_unmeasured(tmp_path):
    """A bare GPU host (torch + Triton, no vLLM) times only our kernels: the report must still be written,
    with vLLM's columns and the vLLM-relative targets shown as not measured (it crashed on None before)."""
    ours = {"base_gemm_only_ms": 0.0042, "base_gemm_tflops": 2.0, "layer_op_ms": 0.0096, "delta_first_ms": 0.0097}
    ours |= {"fused_expand_ms": 0.0092, "fused_linear_ms": 0.0118, "layer_op_lora_overhead_ms": 0.0054}
    text = fused_lora_report_of(tmp_path, {"layer": "o_proj", "tokens": 16, "adapters": 1, "width": 32, **ours})
    assert "| o_proj | 16 | 0.0042 (2.0) | - | **0.0096 (-)** |" in text
    assert "- / 5.4" in text
    assert "decode (1-64 tokens): never slower than vLLM, o_proj: not measured" in text


def test_fused_lora_benchmark_ab_tests_the_expand_width_loop_where_the_width_loops(tmp_path):
    """Widths past UNROLLED_WIDTH_STEPS rank steps get the unrolled expand timed beside the default loop (the
    constant raised only while the path launches), and the report gets a section comparing the two."""
    from bench.kernels.fused_lora import width_loops, with_width_unrolled
    from vllm_bdlora.kernels import fused_lora as fused_lora

    assert width_loops(512, 32) and width_loops(256, 32)
    assert not width_loops(128, 32) and not width_loops(32, 16)
    seen = with_width_unrolled(lambda: fused_lora.unrolls_width(512, 32))()
    assert seen and not fused_lora.unrolls_width(512, 32)

    ours = {"base_gemm_only_ms": 0.5, "base_gemm_tflops": 500.0, "layer_op_ms": 0.6, "delta_first_ms": 0.61}
    ours |= {"fused_expand_ms": 0.62, "fused_linear_ms": 0.9, "layer_op_lora_overhead_ms": 0.1}
    ours |= {"layer_op_unrolled_ms": 0.66, "fused_expand_unrolled_ms": 0.62}
    text = fused_lora_report_of(
        tmp_path, {"tp": 1, "layer": "qkv_proj", "tokens": 4096, "adapters": 1, "width": 512, **ours}
    )
    assert "LoRA width 512 (BD r'=512)" in text
    assert "| qkv_proj | 1 | 4096 | 0.6000 / 0.6600 (1.100) | 0.6200 / 0.6200 (1.000) |" in text


def test_fused_lora_report_lists_paths_that_failed_to_compile(tmp_path):
    """A path that cannot run at some point (the split-graph GEMM asked for more shared memory than an H200 has at
    width 256) is recorded, shown as "-" in its table cell and named with its error, while the others are timed."""
    ours = {"base_gemm_only_ms": 0.05, "base_gemm_tflops": 500.0, "layer_op_ms": 0.06, "delta_first_ms": 0.061}
    ours |= {"fused_expand_ms": 0.062, "fused_linear_ms": None, "layer_op_lora_overhead_ms": 0.01}
    ours["fused_linear_error"] = "OutOfResources: out of resource: shared memory, Required: 278528"
    text = fused_lora_report_of(
        tmp_path, {"tp": 2, "layer": "o_proj", "tokens": 1024, "adapters": 1, "width": 256, **ours}
    )
    assert "| 0.0620 (-) | - (-) |" in text
    assert "- o_proj, 1024 tokens, 1 adapter(s), fused_linear: OutOfResources: out of resource: shared memory" in text


def test_fused_lora_report_refuses_a_json_from_before_the_layer_op_and_says_why(tmp_path):
    """A benchmark JSON written before the layer op existed (tests/data/fused-lora-report) has no layer-op
    columns: `--report` on it names that, rather than failing with a KeyError."""
    import shutil

    from bench.kernels.fused_lora import main

    run = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "fused-lora-report")
    shutil.copy(os.path.join(run, "fused_lora.json"), tmp_path / "fused_lora.json")
    with pytest.raises(SystemExit, match="predates the layer op \\(no layer_op_ms, delta_first_ms column\\)"):
        main(["--report", str(tmp_path / "fused_lora.json")])
    assert not (tmp_path / "fused_lora.md").exists()


def test_report_refuses_a_folder_without_points_and_names_what_to_give(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "has no points.csv" in capsys.readouterr().err


def test_decode_kernel_report_rebuilds_the_committed_one_from_its_json(tmp_path):
    """bench.kernels.decode_lora's markdown is a function of its JSON: the committed H200 run's report comes
    back unchanged (per-layer rows and the per-decoder-layer sums the README quotes)."""
    import shutil

    from bench.kernels.decode_lora import report

    run = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "decode-report")
    shutil.copy(os.path.join(run, "decode_lora.json"), tmp_path / "decode_lora.json")
    text = open(report(str(tmp_path / "decode_lora.json"))).read()
    assert text == open(os.path.join(run, "decode_lora.md")).read()
    assert "| 4 | 1 | 40.8 | 66.0 (1.62) | 45.3 (1.11) |" in text


def test_decode_kernel_report_sums_multi_slot_layers_by_the_adapters_a_batch_mixes(tmp_path):
    """--slots rows (a layer with more LoRA slots than its batch's adapters) get per-decoder-layer sums of their
    own, and, where rows record the layer op's choice, what the op runs: the three kernels' time where it turns
    the one kernel down."""
    import shutil

    from bench.kernels.decode_lora import report

    run = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
    for name in ("decode-report-slots-r512-mixed", "decode-report-slots-r128-one"):
        shutil.copy(os.path.join(run, name, "decode_lora.json"), tmp_path / "decode_lora.json")
        text = open(report(str(tmp_path / "decode_lora.json"))).read()
        assert text == open(os.path.join(run, name, "decode_lora.md")).read()
    assert "| 1 | 1 of 4 slots | 4 | 113.2 | 172.3 (1.52) | 156.9 (1.39) | 1.10× |" in text
    data = json.loads(open(os.path.join(run, "decode-report-slots-r512-mixed", "decode_lora.json")).read())
    for row in data["rows"]:
        row["layer_op_picks"] = "one launch" if row["tokens"] == 1 else "three kernels"
    (tmp_path / "decode_lora.json").write_text(json.dumps(data))
    text = open(report(str(tmp_path / "decode_lora.json"))).read()
    assert "| 1 | 4 | 1 | 113.7 | 244.6 (2.15) | 256.8 (2.26) | 0.95× | 256.8 (2.26) |" in text
    assert "| 1 | 4 | 16 | 114.5 | 334.6 (2.92) | 543.3 (4.75) | 0.62× | 334.6 (2.92) |" in text
    # beside it what the row-width rule runs (a projection the GPU table has not measured): 4 x 128 columns at TP=1
    # r'=512 is past 128, so the three kernels even at one token
    assert "| 0.95× | 256.8 (2.26) | 244.6 (2.15) |" in text and "row-width rule µs (×base) |" in text
    assert "one-launch plan |" in text and "; the layer op picks three kernels" in text


def test_decode_kernel_benchmark_refuses_fewer_slots_than_adapters(capsys):
    """A layer holds one adapter per slot: --slots below --adapters' count is an error naming the fix (it used to
    be raised to the adapters silently), before a GPU is asked for."""
    from bench.kernels.decode_lora import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--slots", "2", "--adapters", "1,4", "--out", "unused"])
    assert exit_info.value.code == 2
    assert "--slots 2 is fewer than the 1,4 adapters" in capsys.readouterr().err


def test_decode_configs_report_names_the_multi_slot_plans_among_the_candidates(tmp_path):
    """--configs rows record which candidates are a 4-slot layer's plans for batches mixing 1, 2 or 4 adapters;
    the committed H200 run's report is a function of its JSON."""
    import shutil

    from bench.kernels.decode_lora import configs_report

    run = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "decode-configs-report")
    shutil.copy(os.path.join(run, "decode_configs.json"), tmp_path / "decode_configs.json")
    text = open(configs_report(str(tmp_path / "decode_configs.json"))).read()
    assert text == open(os.path.join(run, "decode_configs.md")).read()
    assert "| whole blocks 32x256, 128+4 programs (table) (4 slots, sized for 1) | 5.86 | 1.412 |" in text


def test_decode_kernel_benchmark_times_70b_layers_at_tp8_on_one_gpu(tmp_path):
    """--model-shape llama-3.1-70b --tp 8 times the layers one GPU of a TP=8 70B server runs (no 8-GPU host
    needed), and its report names that shape instead of 8B's."""
    import shutil

    from bench.kernels.decode_lora import main, report
    from bench.kernels.fused_lora import layers

    assert layers(8, "llama-3.1-70b") == (
        ("qkv_proj", 8192, (1024, 128, 128)),
        ("o_proj", 1024, (8192,)),
        ("gate_up_proj", 8192, (3584, 3584)),
        ("down_proj", 3584, (8192,)),
    )
    with pytest.raises(SystemExit) as typo:
        main(["--model-shape", "llama-3.1-7b", "--out", str(tmp_path)])  # refused, not timed as 8B
    assert typo.value.code == 2
    if not torch.cuda.is_available():  # past the argument check, the benchmark asks for its GPU
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main(["--model-shape", "llama-3.1-70b", "--tp", "8", "--out", str(tmp_path)])
    run = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "decode-report")
    shutil.copy(os.path.join(run, "decode_lora.json"), tmp_path / "decode_lora.json")
    data = json.loads((tmp_path / "decode_lora.json").read_text())
    data["rows"] = [{"shape": "llama-3.1-70b", **row} for row in data["rows"]]
    (tmp_path / "decode_lora.json").write_text(json.dumps(data))
    text = open(report(str(tmp_path / "decode_lora.json"))).read()
    assert "Llama-3.1-70B per-GPU shapes" in text and "Llama-3.1-8B" not in text


def test_compile_time_benchmark_compiles_a_layers_variants_for_a_gpu_without_one(tmp_path, monkeypatch):
    """The first-start compile benchmark compiles, for sm_90 and without launching, every variant `warm_up` would
    (shrink and expand configurations, one decode-kernel variant per row tile), timing each by kernel; the
    machine's own Triton driver (none on CPU) is back in place afterwards."""
    from triton.runtime import driver

    from bench.kernels.compile_time import H200, compile_layer, compile_only, forget_compiled_kernels
    from vllm_bdlora.kernels.plans import ROW_TILES, launch_variants, table_for

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # nothing found compiled from an earlier run
    before = driver._active
    forget_compiled_kernels()
    heights = (512, 128, 128)  # qkv_proj of a small model, LoRA width 16
    with compile_only(90) as seconds:
        launches = compile_layer(512, heights, 16, decode=True)
    shrinks, expands = launch_variants(table_for(H200, 132).prefill_ranges(sum(heights), 512, 16, 3), True)
    assert launches == len(shrinks) + len(expands) + len(ROW_TILES)
    assert len(seconds["_routed_shrink_kernel"]) == len(shrinks)
    assert len(seconds["_fused_expand_kernel"]) == len(expands)
    assert len(seconds["_decode_lora_linear_kernel"]) == len(ROW_TILES)
    assert all(s > 0 for times in seconds.values() for s in times)
    assert any(name.endswith(".cubin") for _, _, files in os.walk(tmp_path) for name in files)  # sm_90 binaries
    assert driver._active is before


def test_compile_time_benchmark_compiles_every_decode_plan_of_a_layer_with_several_slots(tmp_path, monkeypatch):
    """With --slots above 1 a layer launches decode plans sized for the adapters a batch may mix: the benchmark
    compiles one variant per plan `warm_up` would launch on an H200, as the server's layer would (the shrink and
    expand variants left out here: the test above compiles those)."""
    from bench.kernels.compile_time import H200, compile_layer, compile_only, forget_compiled_kernels, main
    from vllm_bdlora.kernels import lora_op
    from vllm_bdlora.kernels.plans import layer_plans, table_for

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lora_op, "compile_variants", lambda *args: 0)
    forget_compiled_kernels()
    hidden, heights, width = 1024, (2048, 1024, 1024), 16  # o_proj-sized at TP=4 in three slices
    plans = layer_plans(table_for(H200, 132), sum(heights), hidden, 3 * width, 4, 3, 256)
    assert len(plans) >= 2  # batches of one adapter, and of more
    with compile_only(90) as seconds:
        launches = compile_layer(hidden, heights, width, decode=True, slots=4)
    assert launches == len(seconds["_decode_lora_linear_kernel"]) == len(plans)
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--slots", "0"])


def test_shrink_split_report_marks_the_default_and_shows_splits_not_run(tmp_path):
    """bench.kernels.shrink_split: one row per layer point with a time per split; the report bolds the split
    the plan table picked, dashes the splits too fine for the hidden dimension, and the CLI asks for a GPU."""
    from bench.kernels.harness import write_results
    from bench.kernels.shrink_split import main, report, split_config
    from vllm_bdlora.kernels.plans import table_for

    default = table_for("NVIDIA H200", 132).prefill_launch(1, 28672, 4096, 512, 2).shrink
    assert default.split_k == 2 and split_config(default, 4096, 16).split_k == 16
    assert split_config(default, 256, 4).block_k == 64  # a part of 64 features gets a 64-deep step
    row = {"tp": 1, "layer": "gate_up_proj", "tokens": 1, "adapters": 1, "width": 512, "default_split": 16,
           "split1_us": 30.0, "split2_us": 20.5, "split4_us": 18.25, "split8_us": 19.0, "split16_us": 24.0,
           "best_split": 4, "default_over_best": 1.315, "best_gbs": 3300.0, "best_of_copy_bw": 0.8}  # fmt: skip
    narrow = {**row, "layer": "o_proj", "width": 16, "default_split": 4, "split4_us": 5.0}
    del narrow["split16_us"]  # 16 parts of a short hidden dimension: not run
    path = write_results(str(tmp_path), "shrink_split", [row, narrow], {"copy_bandwidth_gbs": 4100.0})
    text = open(report(path)).read()
    assert "(BD r'=512)" in text
    assert "| 1 | gate_up_proj | 512 | 1 | 1 | 30.0 | 20.5 | 18.25 | 19.0 | **24.0** | 16 | 4 | 1.315 |" in text
    assert "| 1 | o_proj | 16 | 1 | 1 | 30.0 | 20.5 | **5.0** | 19.0 | - |" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main(["--out", str(tmp_path)])


def test_host_overhead_benchmark_times_every_projections_wrappers_on_the_cpu(tmp_path, monkeypatch):
    """It runs where CI does (kernel launches stubbed) and writes a row per piece and projection, the plain-integer
    helpers beside Triton's, and a report summing the decoder layer's wrappers."""
    from bench.kernels import host_overhead
    from vllm_bdlora.kernels import fused_lora

    monkeypatch.setattr(fused_lora, "launch", fused_lora.launch)  # the benchmark stubs it out: restored afterwards
    monkeypatch.setattr(host_overhead, "LOOPS", 3)
    monkeypatch.setattr(host_overhead, "CALLS_PER_LOOP", 2)
    assert host_overhead.main(["--out", str(tmp_path), "--tokens", "1100"]) == 0
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    pieces = {(row["piece"], row["layer"]) for row in rows}
    for layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert {("lora_shrink_wrapper", layer), ("fused_expand_wrapper", layer)} <= pieces
    assert {("triton_cdiv", ""), ("launch_math_cdiv", "")} <= pieces
    assert all(row["us"] > 0 for row in rows)
    assert "summed over the decoder layer's projections" in (tmp_path / "host_overhead.md").read_text()


def _decode_row(layer, us, plan, tokens=1):
    return {"tp": 4, "layer": layer, "tokens": tokens, "adapters": 1, "slots": 1, "shape": "llama-3.1-8b",
            "one_launch_us": us, "base_gemm_us": 5.0, "plan": plan}  # fmt: skip


def test_switch_table_pairs_rounds_and_names_changed_plans(tmp_path):
    from bench.kernels.switch_table import main, side_round_line

    assert side_round_line("0-r3/tp4_8") == ("0", 3, "tp4_8")
    assert side_round_line("8b-new-r12") == ("new", 12, "8b")
    assert side_round_line("notes") is None
    times = {"0": {1: 8.0, 2: 7.0, 3: 8.5}, "1": {1: 7.5, 2: 7.2, 3: 8.0}}  # B faster in rounds 1 and 3
    for side, rounds in times.items():
        for round_, us in rounds.items():
            folder = tmp_path / f"{side}-r{round_}" / "tp4"
            folder.mkdir(parents=True)
            plan = "whole" if side == "0" else "stream-K"
            rows = [_decode_row("qkv_proj", us, plan), _decode_row("o_proj", 5.5, "w")]
            (folder / "decode_lora.json").write_text(json.dumps({"rows": rows}))
    main([str(tmp_path), "--sides", "0,1", "--out", str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    assert "| tp4 | llama-3.1-8b | 4 | 1 | 1 | 1 | qkv_proj | 8.00 | 7.50 | -0.50 | 2/3 | whole → stream-K |" in text
    assert "| o_proj | 5.50 | 5.50 | +0.00 | 0/3 |  |" in text
    # per layer: rounds 1 and 3 faster on side 1 (13.0 < 13.5, 13.5 < 14.0), round 2 slower (12.7 > 12.5)
    assert "| tp4 | llama-3.1-8b | 4 | 1 | 1 | 1 | 10.0 | 13.50 (1.350x) | 13.00 (1.300x) | 2/3 |" in text
    with pytest.raises(SystemExit, match="no layer was timed on both sides"):
        main([str(tmp_path), "--sides", "0,2"])


def test_switch_table_judges_each_table_change_on_the_batches_it_serves(tmp_path):
    """A searched table against the table before it: each decoder layer as served, and each change (a key's plan,
    a row limit) held or not by the search's rule on the batches it touches, summed."""
    from bench.kernels.switch_table import main

    def row(layer, n, tokens, adapters, us, plan, picks="one launch", three=50.0):
        return {"shape": "llama-3.1-8b", "tp": 1, "layer": layer, "tokens": tokens, "adapters": adapters,
                "slots": 12, "K": 4096, "N": n, "width": 16, "slices": 1, "mixed_width": 1 << 30, "plan": plan,
                "layer_op_picks": picks, "one_launch_us": us, "three_kernels_us": three,
                "base_gemm_us": 10.0}  # fmt: skip

    for round_ in (1, 2):
        sides = {
            # o_proj's 4-token key: 10% less on both of its batches; gate_up_proj's: 1% less, within the gain
            "old": [row("o_proj", 4096, 4, 1, 20.0, "a"), row("o_proj", 4096, 4, 4, 20.0, "a"),
                    row("gate_up_proj", 28672, 4, 4, 100.0, "c"),
                    # down_proj's row limit: 8 tokens ran the three kernels before, the one kernel after
                    row("down_proj", 4096, 8, 8, 45.0, "d", picks="three kernels"),
                    row("down_proj", 4096, 4, 4, 40.0, "d")],
            "new": [row("o_proj", 4096, 4, 1, 18.0, "b"), row("o_proj", 4096, 4, 4, 18.0, "b"),
                    row("gate_up_proj", 28672, 4, 4, 99.0, "e"),
                    row("down_proj", 4096, 8, 8, 45.0, "d"), row("down_proj", 4096, 4, 4, 40.0, "d")],
        }  # fmt: skip
        for side, rows in sides.items():
            folder = tmp_path / f"{side}-r{round_}" / "tp1-w16"
            folder.mkdir(parents=True)
            (folder / "decode_lora.json").write_text(json.dumps({"rows": rows}))
    main([str(tmp_path), "--sides", "old,new", "--out", str(tmp_path / "t.md")])
    text = (tmp_path / "t.md").read_text()
    # as served: 8 tokens ran the three kernels' 50 µs before, the one kernel's 45 after
    assert "| tp1-w16 | llama-3.1-8b | 1 | 12 | 8 | 8 | 50.00 | 45.00 | -10.0% | 2/2 | down_proj: three kernels → " \
           "one launch |" in text  # fmt: skip
    assert "| 12 | 4 | 4 | 160.00 | 157.00 | -1.9% | 2/2 |  |" in text
    o_key = "out=4096 hidden=4096 total_width=16 slots=many tile=16 adapters=4"
    assert f"| o_proj | {o_key} | 4x1, 4x4 | 40.00 | 36.00 | -10.0% | 2/2 | **new** |" in text
    assert "total_width=16 slots=many tile=16 adapters=4 | 4x4 | 100.00 | 99.00 | -1.0% | 2/2 | **old** |" in text
    # the limit is judged on the batch between the two limits alone, not on the 4-token batch both served alike
    assert "| down_proj | out=4096 hidden=4096 total_width=16 slots=many | 8x8 | 50.00 | 45.00 | -10.0% | 2/2 | " \
           "**new** |" in text  # fmt: skip
    assert "4x4, 8x8" not in text


def test_switch_table_derives_each_layer_under_the_table_assembled_from_the_changes(tmp_path):
    """--table: each projection's batch takes the times of the side it runs as under the assembled table (looked up
    as a server does); a table under which a batch runs as on neither side is refused. --assemble writes the
    changes that held into the table before."""
    from bench.kernels.decode_lora import describe
    from bench.kernels.switch_table import main
    from vllm_bdlora.kernels.plans import PlanTable, batch_plan, decode_key, make_plan, mixed_rows_key

    shape = (4096, 4096, 16)  # TP=1 o_proj, rank 16, 12 slots
    old_plan, new_plan, other = (make_plan(*shape, 12, block_n=bn, block_k=128, stream_k=True, gemv_programs=100)
                                 for bn in (32, 64, 128))  # fmt: skip

    def table_with(plan):
        return PlanTable("Test GPU", 132, {decode_key(*shape, 12, 16, 4): plan},
                         {}, {mixed_rows_key(*shape): 16})  # fmt: skip

    def row(layer, plan, us):
        served = describe(batch_plan(table_with(plan), *shape, 12, 4, 1, 1 << 30))
        return {"shape": "llama-3.1-8b", "tp": 1, "layer": layer, "tokens": 4, "adapters": 4, "slots": 12,
                "K": 4096, "N": 4096, "width": 16, "slices": 1, "mixed_width": 1 << 30, "plan": served,
                "layer_op_picks": "one launch", "one_launch_us": us, "three_kernels_us": 50.0,
                "base_gemm_us": 10.0}  # fmt: skip

    for round_ in (1, 2):
        for side, plan, us in (("old", old_plan, 20.0), ("new", new_plan, 17.0)):
            folder = tmp_path / "runs" / f"{side}-r{round_}" / "tp1-w16"
            folder.mkdir(parents=True)
            (folder / "decode_lora.json").write_text(json.dumps({"rows": [row("o_proj", plan, us)]}))
    for name, plan in (("kept.json", new_plan), ("reverted.json", old_plan), ("other.json", other)):
        (tmp_path / name).write_text(table_with(plan).to_json())
    runs = str(tmp_path / "runs")
    main([runs, "--sides", "old,new", "--table", str(tmp_path / "kept.json"), "--out", str(tmp_path / "t.md")])
    assert (
        "| tp1-w16 | llama-3.1-8b | 1 | 12 | 4 | 4 | 20.00 | 17.00 | -15.0% | o_proj |"
        in (tmp_path / "t.md").read_text()
    )
    main([runs, "--sides", "old,new", "--table", str(tmp_path / "reverted.json"), "--out", str(tmp_path / "t.md")])
    assert "| tp1-w16 | llama-3.1-8b | 1 | 12 | 4 | 4 | 20.00 | 20.00 | +0.0% |  |" in (tmp_path / "t.md").read_text()
    with pytest.raises(SystemExit, match="o_proj at 4 tokens, 4 adapters .* as on neither side"):
        main([runs, "--sides", "old,new", "--table", str(tmp_path / "other.json")])

    # --assemble: the held change written into the table before, under the key it was judged at, even where the new
    # side's table served it from another entry (4-token batches falling back to a 2-adapter entry)
    one, two, four = (decode_key(*shape, 12, 16, adapters) for adapters in (1, 2, 4))
    limit = {mixed_rows_key(*shape): 16}
    (tmp_path / "before.json").write_text(PlanTable("Test GPU", 132, {one: old_plan}, {}, dict(limit)).to_json())
    after = PlanTable("Test GPU", 132, {one: old_plan, two: new_plan}, {}, dict(limit))
    (tmp_path / "after.json").write_text(after.to_json())
    main([runs, "--sides", "old,new", "--table", str(tmp_path / "before.json"), "--assemble",
          str(tmp_path / "after.json"), "--out", str(tmp_path / "t.md")])  # fmt: skip
    written = PlanTable.from_json((tmp_path / "before.json").read_text())
    assert written.decode == {one: old_plan, four: new_plan}  # 2- and 3-token batches keep the plan they ran
    text = (tmp_path / "t.md").read_text()
    assert "the changes that held (1)" in text and "| 4 | 4 | 20.00 | 17.00 | -15.0% | o_proj |" in text


def _stand_in_host(tmp_path, python_source: str, **env):
    """bench/hosts/gpu_host.sh with its /root moved under tmp_path (HOST_ROOT) and a stand-in `python3` (running
    python_source) first on PATH; returns a runner of one step (its completed process) and the stand-in /root."""
    import subprocess
    import sys

    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n{python_source}")
    fake.chmod(0o755)
    root = tmp_path / "root"
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "hosts", "gpu_host.sh")
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "HOST_ROOT": str(root), **env}  # fmt: skip

    def step(*args):
        return subprocess.run(["bash", script, *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    return step, root


def test_gpu_host_switch_alternates_the_sides_round_by_round(tmp_path):
    """The host script's `switch` step, with a stand-in python3 that records which side ran and writes a result."""
    import tarfile
    import textwrap

    step, _ = _stand_in_host(tmp_path, textwrap.dedent("""
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        side = os.environ["BDLORA_TRY"]
        with open(os.environ["ORDER"], "a") as f:
            f.write(side + "\\n")
        os.makedirs(out, exist_ok=True)
        row = {"tp": 4, "layer": "qkv_proj", "tokens": 1, "adapters": 1, "one_launch_us": 8 - int(side),
               "base_gemm_us": 5, "plan": "p"}
        with open(os.path.join(out, "decode_lora.json"), "w") as f:
            json.dump({"rows": [row]}, f)
    """), ORDER=str(tmp_path / "order"))  # fmt: skip
    switched = step("switch", "BDLORA_TRY", "1-3", "--tp 4")
    assert switched.returncode == 0, switched.stderr
    assert (tmp_path / "order").read_text().split() == ["0", "1", "1", "0", "0", "1"]
    with tarfile.open(tmp_path / "out" / "switch.tgz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith("decode_lora.json"))
    assert names == [f"switch/{v}-r{r}/tp4/decode_lora.json" for v in "01" for r in (1, 2, 3)]


def test_gpu_host_stops_on_a_host_without_the_bundle(tmp_path):
    """A host taken back between the part calls comes back bare: `install` must fail with what it found, and
    `queue` must refuse to start sweeps that would each die on a missing vLLM (stand-in python3 without it)."""
    step, root = _stand_in_host(tmp_path, "import sys\nsys.exit(1)\n")
    installed = step("install")
    assert installed.returncode == 1 and "install failed" in installed.stdout
    queued = step("queue", "llama-3.1-8b 1 64 base")
    assert queued.returncode == 3 and "run install first" in queued.stdout
    assert not (root / "queue.plan").exists()


def test_gpu_host_brings_compile_caches_back_in_parts_and_install_restores_them(tmp_path):
    """`watch` returns the host's compile caches as parts small enough for a call's 16 MiB file limit, or says
    their size and leaves them when over COMPILE_CACHE_MAX_MIB; `install` on the next host unpacks the parts."""
    step, root = _stand_in_host(tmp_path, "import sys\nsys.exit(0)\n")
    compiled = root / ".cache" / "vllm" / "torch_compile_cache" / "hash" / "rank_0_0"
    compiled.mkdir(parents=True)
    (compiled / "artifact").write_bytes(os.urandom(20 * 1024 * 1024))  # incompressible: two parts
    (root / ".triton" / "cache" / "kernel").mkdir(parents=True)
    (root / ".triton" / "cache" / "kernel" / "k.cubin").write_bytes(b"cubin")
    (root / "results").mkdir()
    (root / "queue.log").write_text("== 00:00:00 queue done\n")
    watched = step("watch", "1")
    assert "in 2 part(s)" in watched.stdout, watched.stdout + watched.stderr
    parts = sorted((tmp_path / "out").glob("compile-cache-*"))
    assert [p.name for p in parts] == ["compile-cache-00", "compile-cache-01"]
    assert max(p.stat().st_size for p in parts) <= 15 * 1024 * 1024
    archived = (root / "compile-cache.tgz").stat().st_mtime_ns
    first = [p.read_bytes() for p in parts]
    again = step("watch", "1")  # nothing compiled since: the same archive, not compressed again
    assert "in 2 part(s)" in again.stdout, again.stdout + again.stderr
    assert (root / "compile-cache.tgz").stat().st_mtime_ns == archived
    assert [p.read_bytes() for p in sorted((tmp_path / "out").glob("compile-cache-*"))] == first
    (root / ".triton" / "cache" / "kernel" / "later.cubin").write_bytes(b"later")  # a server compiled more
    step("watch", "1")
    assert (root / "compile-cache.tgz").stat().st_mtime_ns != archived
    (root / ".triton" / "cache" / "kernel" / "later.cubin").unlink()
    original = (compiled / "artifact").read_bytes()
    for dir_ in (root / ".cache", root / ".triton"):
        shutil.rmtree(dir_)
    (root / "pkg").mkdir()
    for part in parts:
        shutil.copy(part, root / "pkg")
    (tmp_path / ".gpu").mkdir()
    (tmp_path / ".gpu" / "install_bundle.sh").write_text("exit 0\n")
    installed = step("install")
    assert "restored the compile caches of an earlier host (2 part(s))" in installed.stdout, installed.stdout
    assert (compiled / "artifact").read_bytes() == original
    assert (root / ".triton" / "cache" / "kernel" / "k.cubin").read_bytes() == b"cubin"
    over = tmp_path / "over"
    over.mkdir()
    limited_step, limited_root = _stand_in_host(over, "import sys\nsys.exit(0)\n", COMPILE_CACHE_MAX_MIB="10")
    shutil.copytree(root, limited_root)
    limited = limited_step("watch", "1")
    assert "over 10 MiB: not brought back" in limited.stdout, limited.stdout + limited.stderr
    assert not list((over / "out").glob("compile-cache-*"))


def test_figures_are_saved_as_palette_pngs_that_look_like_the_rendering(tmp_path):
    """A committed plot is a 256-colour PNG: every pixel within a few shades of matplotlib's own rendering, and
    the file smaller than that rendering's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image, ImageChops

    from bench.plots import save_png

    fig, ax = plt.subplots(figsize=(4, 3))
    for slope, style in ((1, "-"), (2, "--"), (3, ":")):
        ax.plot(range(10), [slope * x for x in range(10)], style, marker="o", label=f"slope {slope}")
    ax.legend()
    fig.savefig(tmp_path / "rendered.png", dpi=110)
    save_png(fig, str(tmp_path / "saved.png"), dpi=110)
    plt.close(fig)
    with Image.open(tmp_path / "rendered.png") as rendered, Image.open(tmp_path / "saved.png") as saved:
        assert saved.mode == "P" and saved.size == rendered.size
        difference = ImageChops.difference(rendered.convert("RGB"), saved.convert("RGB"))
        assert max(high for _, high in difference.getextrema()) <= 64  # anti-aliasing shades, nothing more
        assert sum(difference.convert("L").histogram()[16:]) < 0.01 * saved.size[0] * saved.size[1]
    assert (tmp_path / "saved.png").stat().st_size < (tmp_path / "rendered.png").stat().st_size


def test_prefill_profile_sorts_kernels_by_kind_and_reports_each_case_against_the_base(tmp_path):
    from bench.prefill_profile import kernel_kind, write_report

    assert kernel_kind("_fused_expand_kernel_0d1d2d") == "lora_ours"
    assert kernel_kind("_lora_shrink_kernel") == "lora_vllm"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert kernel_kind("void flash::flash_fwd_splitkv_kernel<...>") == "attention"
    assert kernel_kind("triton_poi_fused_mul_silu_0") == "other"
    assert kernel_kind("triton_poi_fused_fused_lora_slices__mul_silu_slice_1") == "other"  # Inductor's, the base's
    assert (
        kernel_kind("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<") == "attention"
    )
    row = {
        "model_shape": "llama-3.1-8b",
        "tokens": 1024,
        "max_cudagraph_capture_size": 512,
        "gpu_busy_ms": 21.7,
        "gpu_waiting_ms": 9.0,
        "gemm_ms": 19.5,
        "attention_ms": 0.2,
        "lora_ours_ms": 0.0,
        "lora_vllm_ms": 0.0,
        "other_ms": 2.0,
        "lora_op_calls_per_request": 0,
        "lora_op_host_us_per_call": 0.0,
        "engine_start_s": 88,
    }
    rows = [{**row, "case": "base", "request_ms_median": 30.0},
            {**row, "case": "bd-eager", "request_ms_median": 75.0, "lora_ours_ms": 6.6, "lora_vllm_ms": 1.6,
             "lora_op_calls_per_request": 128, "lora_op_host_us_per_call": 300.0,
             "top_kernels": [{"name": "_fused_expand_kernel", "kind": "lora_ours", "calls_per_request": 128.0,
                              "ms_per_request": 3.25},
                             {"name": "triton_poi_fused_fused_lora_slices__mul_silu_slice_1", "kind": "lora_vllm",
                              "calls_per_request": 32.0, "ms_per_request": 0.9}]}]  # fmt: skip
    (tmp_path / "environment.json").write_text(json.dumps({"gpus": ["NVIDIA H100"], "vllm": "0.26.0", "torch": "2.11"}))
    text = open(write_report(str(tmp_path), rows, "python -m bench.prefill_profile --out x")).read()
    # the Inductor kernel recorded as LoRA under older rules counts as the base's elementwise work (other: 2.0 + 0.9)
    assert "| bd-eager | 512 | 75.0 | 2.50 |" in text and "| 7.3 | 2.9 |" in text and "| 128 | 300 |" in text
    assert "NVIDIA H100" in text and "| `triton_poi_fused_fused_lora_slices__mul_silu_slice_1` | other | 32 |" in text
    assert "## bd-eager: kernels by GPU time" in text and "| `_fused_expand_kernel` | lora_ours | 128 | 3.250 |" in text


def test_admission_stage_benchmark_times_every_stage_and_stocks_read(tmp_path):
    from bench import admission_stages

    admission_stages.main(["--shape", "tiny", "--tp", "2", "--adapters", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "stages.json").read_text())
    assert list(result["bd_admission_ms"]) == ["open and map", "cut to the rank", "slot image", "check values",
                                               "LoRAModel in host memory", "total"]  # fmt: skip
    assert all(ms > 0 for ms in result["bd_admission_ms"].values())
    beside = result["bd_admission_beside_spinning_reader_ms"]
    assert list(beside) == list(result["bd_admission_ms"]) and all(ms > 0 for ms in beside.values())
    assert result["stock_read_ms"]["from_local_checkpoint"] > 0
    text = (tmp_path / "stages.md").read_text()
    assert "| BD: cut to the rank |" in text and "| BD on a thread beside a spinning reader: total |" in text


def test_image_memory_benchmark_compares_per_image_blocks_with_shared_slabs(tmp_path):
    from bench import image_memory

    image_memory.main(["--shape", "tiny", "--tp", "2", "--width", "4", "--images", "6", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "image_memory.json").read_text())
    assert list(result["ways"]) == ["one pinned block per image", "regions of shared slabs"]
    assert result["region_bytes"] >= result["image_bytes"] and result["slab_bytes"] % result["region_bytes"] == 0
    assert all(way["ms_per_image_accumulating"] > 0 and way["ms_per_image_recycling"] > 0
               for way in result["ways"].values())  # fmt: skip
    assert "| regions of shared slabs |" in (tmp_path / "image_memory.md").read_text()


def test_slot_images_benchmark_keeps_a_narrow_adapter_in_its_own_width_and_checks_every_fill(tmp_path):
    """An adapter a quarter and half the slot's width: its image takes a quarter and half the bytes of one as wide as
    the slot, and both fill the slot alike (the benchmark exits otherwise); an adapter as wide as the slot has one
    kind of image."""
    from bench import slot_images

    slot_images.main(["--shape", "tiny", "--tp", "2", "--slot-width", "8", "--widths", "2,4,8", "--images", "2",
                      "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "slot_images.json").read_text())
    by_width = {row["adapter_width"]: row["kinds"] for row in result["widths"]}
    for width, share in ((2, 0.25), (4, 0.5), (8, 1.0)):
        own, slot = by_width[width]["adapter's width"], by_width[width]["slot's width"]
        assert own["image_width"] == width and slot["image_width"] == 8
        assert own["image_bytes"] == pytest.approx(share * slot["image_bytes"], rel=0.1)
        assert own["build_ms"] > 0 and own["fill_host_ms"] > 0 and own["fill_gpu_ms"] is None
    assert "| 2 | adapter's width | 2 |" in (tmp_path / "slot_images.md").read_text()
    with pytest.raises(SystemExit):
        slot_images.parse_args(["--slot-width", "8", "--widths", "16", "--out", str(tmp_path)])


@pytest.mark.engine
def test_slot_fill_host_benchmark_times_every_fill(tmp_path):
    """Run as its command line says (its own process: it holds a vLLM engine in-process to time the worker)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "bench.slot_fill_host", "--layers", "2", "--adapters", "2", "--rounds", "2",
               "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, cwd=repo, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "slot_fill_host.json").read_text())
    assert result["fills"] == 4 and result["adapted_projections"] == 14
    assert 0 < result["ms_per_fill_median"] <= result["ms_per_fill_p90"]

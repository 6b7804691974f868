"""The many-adapter benchmark (bench/workload.py, bench/many_adapters.py): its traffic laws, its report's arithmetic,
equal memory turned into each mode's slots and cache entries, and one small run end to end against a real BD-LoRA
server (tiny model, TP=2, 64 adapters, CPU) whose figures come from the server's /metrics."""

import json
import math
import re
import statistics
import sys

import pytest

from bench.workload import Timing, plan, popularity_weights, summarise, tiers
from vllm_bdlora.metrics import ADMISSION_STAGES, IN_STEP_CAUSES


def test_zipf_shares_fall_with_rank_and_tiers_split_the_expected_requests():
    weights = popularity_weights("zipf:1.0", 1024)
    assert math.isclose(sum(weights), 1.0) and weights[0] / weights[9] == pytest.approx(10.0)
    labels = tiers(weights)
    head = sum(w for w, t in zip(weights, labels, strict=True) if t == "head")
    assert 0.5 <= head < 0.5 + weights[0] and labels.count("head") < labels.count("torso") < labels.count("tail")
    planned, _ = plan("zipf:1.0", "poisson:10", "fixed:16/8", 1024, 4000, seed=1)
    top = sum(p.adapter == 0 for p in planned) / len(planned)
    assert top == pytest.approx(weights[0], abs=0.02)


def test_distinct_requests_name_every_adapter_once_before_any_twice():
    planned, _ = plan("distinct", "concurrency:4", "fixed:16/8", 64, 100)
    firsts = [p.adapter for p in planned[:64]]
    assert sorted(firsts) == list(range(64)) and firsts != list(range(64))  # all of them, shuffled


@pytest.mark.parametrize(("arrivals", "cv"), [("poisson:50", 1.0), ("gamma:50:4", 4.0)])
def test_arrivals_have_the_asked_rate_and_burstiness(arrivals, cv):
    planned, _ = plan("uniform", arrivals, "fixed:16/8", 8, 20000, seed=3)
    gaps = [b.send_at - a.send_at for a, b in zip(planned, planned[1:], strict=False)]
    assert len(planned) / planned[-1].send_at == pytest.approx(50, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)


def test_chat_lengths_stay_within_their_bounds():
    planned, _ = plan("single", "concurrency:1", "chat", 4, 2000, seed=2)
    assert all(16 <= p.input_len <= 2048 and 8 <= p.output_len <= 512 for p in planned)
    assert 150 < statistics.median(p.input_len for p in planned) < 400


def test_summary_counts_goodput_and_tiers():
    timings = [Timing(i, "a", 0, "head" if i < 6 else "tail", 16, 8, ttft=0.1 * (i + 1), tpot=0.01, tokens=8,
                      status=200) for i in range(10)]  # fmt: skip
    timings.append(Timing(10, "b", 9, "tail", 16, 8, status=400, error="refused"))
    out = summarise(timings, 2.0, ttft_slo_s=0.5)
    assert (out["completed"], out["failed"]) == (10, 1) and out["goodput_per_s"] == 2.5  # 5 within 0.5 s, in 2 s
    assert out["output_tokens_per_s"] == 40 and out["head_requests"] == 6 and out["tail_requests"] == 4
    assert out["all_ttft_p50_ms"] == pytest.approx(550) and out["error_examples"] == ["refused"]


@pytest.mark.parametrize(("rank", "image_over_share"), [(2, 1.0), (3, 8 / 6), (4, 1.0)])
def test_a_bd_adapter_narrower_than_a_slot_takes_an_image_of_its_own_width_on_a_gpu(monkeypatch, rank,
                                                                                   image_over_share):  # fmt: skip
    """On a GPU a BD worker keeps each adapter as a slot's image at the power of two holding its width: at TP=1 in
    slots of vLLM's smallest width, 8, a BD r'=4 adapter (--rank 2) and an r'=8 one take their own bytes, an r'=6
    one (--rank 3) those of width 8."""
    from bench import many_adapters

    args = many_adapters.parse_args(["--tp", "1", "--rank", str(rank), "--gpu-memory", "512MiB",
                                     "--host-memory", "24GiB", "--workloads", "zipf:1.0 poisson:4 fixed:1024/128 10",
                                     "--out", "/tmp/x"])  # fmt: skip
    on_cpu = many_adapters.budgets(args, "bdlora")
    monkeypatch.setattr(many_adapters, "slot_images_kept", lambda: True)
    on_gpu = many_adapters.budgets(args, "bdlora")
    assert on_gpu["max_lora_rank"] == 8 and on_cpu["host_bytes_per_adapter"] == on_cpu["adapter_bytes"]
    assert on_gpu["host_bytes_per_adapter"] == pytest.approx(image_over_share * on_gpu["adapter_bytes"], rel=0.01)
    assert on_gpu["host_entries"] == 24 * 2**30 // on_gpu["host_bytes_per_adapter"]


def test_equal_memory_gives_bd_more_host_entries_and_records_both():
    """BD r'=32 in 4 blocks against standard r=16 (equal parameters at TP=4): each BD worker keeps a quarter of an
    adapter where stock vLLM keeps all of it, so the same host memory holds four times the adapters."""
    from bench.many_adapters import budgets, parse_args

    args = parse_args(["--tp", "4", "--rank", "16", "--gpu-memory", "2GiB", "--host-memory", "16GiB",
                       "--workloads", "zipf:1.0 poisson:4 fixed:1024/128 10", "--out", "/tmp/x"])  # fmt: skip
    bd, nfs, slora = (budgets(args, mode) for mode in ("bdlora", "nfs", "slora"))
    assert bd["host_entries"] / nfs["host_entries"] == pytest.approx(4, rel=0.05)
    assert bd["adapter_bytes"] == pytest.approx(nfs["adapter_bytes"], rel=0.05)
    assert bd["max_loras"] > nfs["max_loras"] and slora["max_loras"] > nfs["max_loras"]
    for b in (bd, nfs, slora):
        assert b["max_loras"] * b["slot_bytes"] <= 2 * 2**30 < (b["max_loras"] + 1) * b["slot_bytes"]


def test_figures_are_read_once_the_servers_refresh_has_caught_up(monkeypatch):
    from bench import many_adapters

    lookups = "vllm:lora_cache_lookups_total"
    scrapes = iter([{lookups: {"gpu": 10}}, {lookups: {"gpu": 14}}, {lookups: {"gpu": 17}}, {lookups: {"gpu": 17}}])
    monkeypatch.setattr(many_adapters, "scrape", lambda url: next(scrapes))
    monkeypatch.setattr(many_adapters.time, "sleep", lambda s: None)
    assert many_adapters.settled_scrape("http://server") == {lookups: {"gpu": 17}}


@pytest.mark.engine
def test_a_small_run_reports_every_request_and_the_servers_own_figures(tmp_path):
    from bench import many_adapters

    out = tmp_path / "out"
    status = many_adapters.main([
        "--model-shape", "tiny", "--tp", "2", "--modes", "bdlora", "--adapters", "64", "--rank", "16",
        "--distinct-files", "4", "--gpu-memory", "1MiB", "--host-memory", "2MiB", "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "8", "--extra-server-args=--enforce-eager",
        "--workloads", "zipf:1.0 poisson:20 fixed:16/8 60", "distinct concurrency:4 fixed:16/8 40",
        "--workdir", str(tmp_path / "work"), "--out", str(out),
    ])  # fmt: skip
    rows = json.loads((out / "summary.json").read_text())
    servers = json.loads((out / "servers.json").read_text())
    assert status == 0, (rows, servers)
    assert [r["completed"] for r in rows] == [60, 40] and all(r["failed"] == 0 for r in rows)
    server = servers[0]
    assert "--max-loras" in server["bd_slots_line"] and server["max_loras"] >= 1  # the plugin sized the slots
    # the load phase's time split: 64 reads on admission threads, 64 add_lora calls the engine loop waited for
    load = server["load_figures"]
    assert load["loads_admission"] == load["loads_add_lora"] == 64 and load["load_add_lora_mean_ms"] > 0, load
    # and one admission's stages, per adapter: together within the admission's own time, none over its wall time on
    # the CPU clock
    walls = [load.get(f"admission_{stage}_wall_ms", 0.0) for stage in ADMISSION_STAGES]
    assert 0 < sum(walls) <= load["load_admission_mean_ms"] and walls[0] > 0, load
    assert all(load.get(f"admission_{stage}_cpu_ms", 0.0) <= wall + 1e-3
               for stage, wall in zip(ADMISSION_STAGES, walls, strict=True))  # fmt: skip
    zipf, distinct = rows
    assert 0 <= zipf["gpu_hit_rate"] <= 1 and zipf["steps"] > 0 and zipf["step_p99_ms"] > 0
    # distinct through few slots: every request's adapter fills a slot, in its step (a GPU miss: a lookup per step and
    # adapter, the steps after its first hit) or ahead of it, except those the zipf workload left in one, at most one
    # per slot; the adapters come from what the workers kept
    slots = int(re.search(r"(\d+) slots, --max-loras", server["bd_slots_line"]).group(1))
    assert distinct["gpu_misses"] + distinct.get("loads_slot_fill_ahead", 0) >= 40 - slots > 0, distinct
    assert distinct["loads_reread"] + distinct.get("loads_restore", 0) > 0
    # each slot a step filled is timed as that step's wait: one slot_fill per GPU miss (most requests sit out a step
    # while their adapter is filled instead, so there may be none)
    assert distinct.get("loads_slot_fill", 0) == distinct["gpu_misses"], distinct
    for row in rows:  # each fill a step made itself, with its cause
        causes = sum(row.get(f"in_step_{cause}", 0) for cause in IN_STEP_CAUSES)
        assert causes == row.get("loads_slot_fill", 0), row
        # a request sits out one step at most while its adapter is filled beside it
        assert 0 <= row["held_slot_fill"] <= row["requests"] and row["held_starved_adapter"] >= 0, row
    assert distinct["gpu_misses"] == 0 or distinct["load_slot_fill_mean_ms"] > 0, distinct
    # 2 MiB of host memory per worker holds some of the 64 adapters; the others are spilled, and a request naming
    # one has its workers read it back ahead of the step that fills its slot
    assert sum(row.get("loads_restore_ahead", 0) for row in rows) > 0, rows
    # and its request waits for that read-back, not the step: with four requests in flight the host budget has room
    # for their adapters, so no step reads a spill file (under zipf, bursts name more adapters than it holds)
    assert distinct.get("loads_restore", 0) == 0, distinct
    lines = (out / "requests.csv").read_text().splitlines()
    assert len(lines) == 1 + 100
    summary = (out / "summary.md").read_text()
    assert "## Servers (equal memory)" in summary and "| bdlora | 64 | 60/60 |" in summary
    assert "add_lora 64 (" in summary
    assert "## One admission's stages" in summary and "| bdlora | " in summary.split("## One admission's stages")[1]
    assert (out / "plots" / "ttft_cdf_zipf1.0_poisson20_fixed16-8_60.png").exists(), sys.argv

"""Launch plans as data: every entry of every committed per-GPU table, and the structural default for any shape,
is a launch the kernels can run (all programs resident, shared memory, coverage, token ranges); lookups fall back
as documented; a table written by the benchmark's candidate search reads back as it was written."""

import glob
import json
import logging
import os
import re
from dataclasses import replace

import pytest

from vllm_bdlora.kernels.plans import (
    CONFIG_DIR,
    DECODE_MAX_TOKENS,
    ROW_TILES,
    SHARED_MEMORY_BYTES,
    LaunchConfig,
    PlanTable,
    PrefillRange,
    default_decode_plan,
    default_prefill_ranges,
    largest_tile,
    launch_variants,
    plan_problems,
    state_words,
    table_for,
    table_path,
)

TABLES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))
DECODE_KEY = re.compile(r"out=(\d+) hidden=(\d+) total_width=(\d+) slots=(1|many) tile=(\d+) adapters=(\d+)$")
PREFILL_KEY = re.compile(r"out=(\d+) hidden=(\d+) width=(\d+) slices=(\d+)$")


def load(path) -> PlanTable:
    with open(path) as f:
        return PlanTable.from_json(f.read(), source=path)


def test_there_is_a_table_for_each_gpu_the_project_serves_on():
    names = {os.path.basename(path) for path in TABLES}
    assert {"NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json"} <= names
    for path in TABLES:
        table = load(path)
        assert table_path(table.device) == path  # named after the device it was written on
        assert table.sms > 0 and table.decode and table.prefill


def prefill_problems(r: PrefillRange, hidden: int, width: int, slices: int) -> list[str]:
    problems = []
    for name, config in (("shrink", r.shrink), ("expand", r.expand)):
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(config, field)
            if value < 16 or value & (value - 1):
                problems.append(f"{name} {field} {value}: not a power of two of at least 16 (tl.dot)")
        warps = config.num_warps
        if warps & (warps - 1) or not 1 <= warps <= 16 or not 1 <= config.num_stages <= 8:
            problems.append(f"{name}: {warps} warps, {config.num_stages} stages")
    if r.shrink.split_k & (r.shrink.split_k - 1) or hidden // r.shrink.split_k < 16:
        problems.append(f"split_k {r.shrink.split_k} of a hidden dimension of {hidden}")
    if r.expand.split_k != 1:
        problems.append("the expand sums the shrink's parts itself: its own split_k must be 1")
    if r.delta_first and slices == 1:
        problems.append("delta first is for packed layers (it saves re-reading the output of several slices)")
    return problems


@pytest.mark.parametrize("path", TABLES, ids=os.path.basename)
def test_every_decode_entry_is_a_launch_the_kernel_can_run_for_its_key(path):
    table = load(path)
    for key, plan in table.decode.items():
        match = DECODE_KEY.match(key)
        assert match, key
        out, hidden, total_width, slots, tile, adapters = match.groups()
        out, hidden, total_width, tile, adapters = map(int, (out, hidden, total_width, tile, adapters))
        assert tile in ROW_TILES and 1 <= adapters <= DECODE_MAX_TOKENS, key
        assert not (slots == "1" and adapters > 1), key  # one slot: one adapter per batch
        if plan is None:  # the three-kernel path for this key
            continue
        assert plan.block_m == tile, key
        assert tile <= largest_tile(1 if slots == "1" else 2), key
        assert plan_problems(plan, out, hidden, total_width, table.sms) == [], key
        # the layer's decode state (int32 words, allocated per BD layer at start-up) holds this plan's partial sums
        assert state_words(total_width, plan) * 4 <= 8 << 20, (key, state_words(total_width, plan))


@pytest.mark.parametrize("path", TABLES, ids=os.path.basename)
def test_every_prefill_entry_covers_every_batch_size_with_valid_launches(path):
    table = load(path)
    for key, ranges in table.prefill.items():
        match = PREFILL_KEY.match(key)
        assert match, key
        out, hidden, width, slices = map(int, match.groups())
        starts = [r.from_tokens for r in ranges]
        assert starts[0] == 1 and starts == sorted(set(starts)), key  # every batch size falls in one range
        for r in ranges:
            assert prefill_problems(r, hidden, width, slices) == [], (key, r)
        assert all(r.shrink.block_m == 16 for r in ranges if r.from_tokens <= DECODE_MAX_TOKENS), key
        shrinks, expands = launch_variants(ranges, delta_first_layer=slices > 1)
        assert len(shrinks) <= 8 and len(expands) <= 12, key  # few variants: the first start compiles them all


@pytest.mark.parametrize("sms", [16, 78, 114, 132, 1 << 20])
@pytest.mark.parametrize("slots", [1, 4])
def test_the_structural_default_is_valid_for_any_shape_or_says_three_kernels(sms, slots):
    shapes = [(out, hidden, width) for out in (16, 768, 1536, 4096, 6144, 14336, 28672, 57344)
              for hidden in (256, 1024, 4096, 8192, 14336) for width in (8, 48, 96, 256, 1536)]  # fmt: skip
    runnable = 0
    for out, hidden, width in shapes:
        for tile in ROW_TILES:
            for adapters in (1, 2, 4, 16):
                plan = default_decode_plan(out, hidden, width, slots, sms, tile, adapters)
                if plan is None:
                    assert tile > largest_tile(slots) or sms < 64 or out > 128 * sms or tile > 16 or width > 256
                    continue
                runnable += 1
                assert plan.block_m == tile
                assert plan_problems(plan, out, hidden, width, sms) == [], (out, hidden, width, tile, adapters)
                assert plan.num_stages * plan.stage_bytes() <= SHARED_MEMORY_BYTES
    assert runnable > len(shapes)


@pytest.mark.parametrize("out,hidden,width,slices", [(6144, 4096, 128, 3), (512, 256, 8, 1), (57344, 8192, 512, 2)])
def test_the_structural_default_prefill_ranges_are_valid(out, hidden, width, slices):
    ranges = default_prefill_ranges(out, hidden, width, slices)
    assert [r.from_tokens for r in ranges] == [1, DECODE_MAX_TOKENS + 1]
    for r in ranges:
        assert prefill_problems(r, hidden, width, slices) == []


def test_a_shape_the_table_lacks_takes_the_default_and_says_how_to_tune_it(caplog):
    """Lookups: the table's entry; for more adapters than the layer's entries hold, the entry of the most; a shape
    with no entry, the structural default, logged once per layer shape with the command that tunes it."""
    table = table_for("NVIDIA H200", 132)
    gate_up = (28672, 4096, 256, 4)  # TP=1 gate_up_proj, BD r'=128, 4 slots
    entry = table.decode["out=28672 hidden=4096 total_width=256 slots=many tile=16 adapters=8"]
    assert table.decode_plan(*gate_up, 16, 8) == replace(entry, row_gather=True)  # 8 adapters: rows gather B
    assert table.decode_plan(*gate_up, 16, 16) == table.decode_plan(*gate_up, 16, 8)
    caplog.set_level(logging.INFO, logger="vllm.bdlora")
    unknown = (1000, 3000, 40, 1)
    plan = table.decode_plan(*unknown, 16, 1)
    assert plan == default_decode_plan(*unknown, 132, 16, 1)
    said = [r.getMessage() for r in caplog.records if "no launch plan" in r.getMessage()]
    assert len(said) == 1 and "out=1000 hidden=3000" in said[0] and "--write-table" in said[0]
    table.decode_plan(*unknown, 16, 1)  # asked again: a lookup, not another log line
    table.decode_plan(*unknown, 16, 2)  # the same layer with more adapters: said already
    assert len([r for r in caplog.records if "no launch plan" in r.getMessage()]) == 1
    assert table.prefill_ranges(1000, 3000, 40, 1) == default_prefill_ranges(1000, 3000, 40, 1)


def test_a_table_reads_back_as_written_and_is_not_used_on_another_sm_count(tmp_path, monkeypatch, caplog):
    table = table_for("NVIDIA H200", 132)
    again = PlanTable.from_json(table.to_json())
    assert again.decode == table.decode and again.prefill == table.prefill
    assert (again.device, again.sms) == (table.device, table.sms)
    caplog.set_level(logging.INFO, logger="vllm.bdlora")
    other = table_for("NVIDIA H200", 60)  # e.g. a MIG slice: the table's grids would not fit
    assert other.decode == {} and other.sms == 60
    assert any("written on 132 SMs" in r.getMessage() for r in caplog.records)
    none = table_for("Some Future GPU", 200)
    assert none.decode == {} and any("no launch-plan table" in r.getMessage() for r in caplog.records)


def test_the_candidate_search_writes_a_faster_plan_and_keeps_the_entry_within_noise(tmp_path, capsys):
    """`bench.kernels.decode_lora --configs --write-table`: per key, the fastest candidate replaces the table's entry
    only where it saves more than --min-gain; a key the table lacked gets the fastest (or the structural default where
    it kept its place); the file is rewritten."""
    from dataclasses import asdict

    from bench.kernels.decode_lora import write_table
    from bench.kernels.harness import update_plan_table
    from vllm_bdlora.kernels.plans import make_plan

    path = str(tmp_path / "gpu.json")
    entry = make_plan(1536, 4096, 96, 4, block_n=32, block_k=256, stream_k=True, gemv_programs=128)
    other = make_plan(1536, 4096, 96, 4, block_n=64, block_k=128, stream_k=True, gemv_programs=128)
    key = "out=1536 hidden=4096 total_width=96 slots=1 tile=16 adapters=1"
    with open(path, "w") as f:
        f.write(PlanTable("Test GPU", 132, {key: entry}, {}).to_json())

    def row(plan, us, incumbent, n=1536, tokens=1):
        return {"N": n, "K": 4096, "width": 32, "slices": 3, "slots": 1, "tile": 16, "adapters": 1, "us": us,
                "tokens": tokens, "default": incumbent, "plan": "p", "plan_fields": asdict(plan)}  # fmt: skip

    update_plan_table(path, lambda table: write_table([row(entry, 10.0, True), row(other, 9.9, False)], table, 0.02))
    assert "kept" in capsys.readouterr().out and load(path).decode[key] == entry
    update_plan_table(path, lambda table: write_table([row(entry, 10.0, True), row(other, 9.0, False)], table, 0.02))
    assert load(path).decode[key] == other and "10.0 µs -> 9.0 µs" in capsys.readouterr().out
    new_layer = make_plan(3072, 4096, 96, 4, block_n=32, block_k=256, stream_k=False)
    update_plan_table(path, lambda table: write_table([row(new_layer, 7.0, False, n=3072)], table, 0.02))
    assert load(path).decode[key.replace("1536", "3072")] == new_layer and load(path).decode[key] == other
    # a key the table lacked whose structural default kept its place: written, so that the entry of fewer adapters
    # (which a key without one falls back to) does not stand in for it
    default = make_plan(2048, 4096, 96, 4, block_n=32, block_k=256, stream_k=False)
    rival = make_plan(2048, 4096, 96, 4, block_n=64, block_k=128, stream_k=False)
    update_plan_table(path, lambda table: write_table([row(default, 8.0, True, n=2048),
                                                       row(rival, 7.9, False, n=2048)], table, 0.02))  # fmt: skip
    assert load(path).decode[key.replace("1536", "2048")] == default
    # batches of two token counts in one row tile share the key's plan: the candidate of least time over both wins,
    # not the one fastest at either alone
    both = make_plan(4096, 4096, 96, 4, block_n=32, block_k=256, stream_k=False)
    one_sided = make_plan(4096, 4096, 96, 4, block_n=64, block_k=128, stream_k=False)
    timed = [
        row(both, 6.0, True, n=4096, tokens=4),
        row(both, 9.0, True, n=4096, tokens=16),
        row(one_sided, 5.0, False, n=4096, tokens=4),
        row(one_sided, 12.0, False, n=4096, tokens=16),
    ]
    update_plan_table(path, lambda table: write_table(timed, table, 0.02))
    assert "kept (15.0 µs; best other 15.0 µs)" in capsys.readouterr().out  # 6 + 9 against 5 + 12
    assert load(path).decode[key.replace("1536", "4096")] == both


def test_the_one_launch_plan_search_decides_on_its_confirming_rounds(tmp_path, capsys):
    """`decode_lora --configs`: the table's plan and the CONFIRM_TOP fastest others are timed again in rounds; a plan
    lucky in the sweep but no faster in the rounds keeps no place, one confirmed faster takes it, and a plan
    confirmed at only one of a key's token counts does not compete."""
    from dataclasses import asdict

    from bench.kernels.decode_lora import configs_report, confirm_rows, write_table
    from bench.kernels.harness import CONFIRM_ROUNDS, CONFIRM_TOP, update_plan_table
    from vllm_bdlora.kernels.plans import make_plan

    path = str(tmp_path / "gpu.json")
    key = "out=1536 hidden=4096 total_width=96 slots=1 tile=16 adapters=1"
    plans = [make_plan(1536, 4096, 96, 4, block_n=bn, block_k=bk, stream_k=True, gemv_programs=128)
             for bn in (32, 64, 128) for bk in (64, 128, 256, 512)]  # fmt: skip
    table_plan, faster = plans[0], plans[2]  # plans[1]: fastest in the sweep alone
    with open(path, "w") as f:
        f.write(PlanTable("Test GPU", 132, {key: table_plan}, {}).to_json())

    def swept(tokens, sweep_us):  # one batch's candidate rows, the table's plan slowest in the sweep
        return [{"N": 1536, "K": 4096, "width": 32, "slices": 3, "slots": 1, "tile": 16, "adapters": 1,
                 "tokens": tokens, "default": plan == table_plan, "plan": f"plan {i}", "plan_fields": asdict(plan),
                 "us": us} for i, (plan, us) in enumerate(zip(plans, sweep_us, strict=True))]  # fmt: skip

    def rounds_time(faster_us):  # the rounds: every plan 10 µs but `faster`
        calls = []

        def time_us(i):
            calls.append(i)
            return faster_us if i == 2 else 10.0

        return time_us, calls

    sweep = [12.0, 8.0, 9.5] + [9.6 + i / 100 for i in range(len(plans) - 3)]  # lucky fastest, 9 under the table's
    time_us, calls = rounds_time(10.0)
    rows = confirm_rows(swept(1, sweep), time_us)
    confirmed = [i for i, r in enumerate(rows) if "confirmed_us" in r]
    assert confirmed == list(range(1 + CONFIRM_TOP)) and len(calls) == CONFIRM_ROUNDS * (1 + CONFIRM_TOP)
    assert calls[0] == 0  # the table's plan first, however slow its single timing
    assert rows[1]["us"] == 8.0 and rows[1]["confirmed_us"] == 10.0 and rows[1]["us_rounds"] == [10.0] * 3
    update_plan_table(path, lambda table: write_table(rows, table, 0.02))
    assert "kept (10.0 µs; best other 10.0 µs)" in capsys.readouterr().out and load(path).decode[key] == table_plan
    results = tmp_path / "decode_configs.json"
    env = {"gpu": "Test GPU", "torch": "t", "triton": "t", "time": "now", "command": "c"}
    results.write_text(json.dumps({"environment": env, "rows": [{**r, "tp": 1, "layer": "qkv_proj",
                                                                  "base_gemm_us": 5.0, "over_base": 2.0}
                                                                 for r in rows]}))  # fmt: skip
    text = open(configs_report(str(results))).read()
    assert "| plan | µs | ×base | rounds' median µs |" in text and "| **plan 1** | 8.0 | 2.0 | 10.0 |" in text
    assert "| plan 10 | 9.67 | 2.0 | - |" in text  # not among the eight fastest: not timed again

    # confirmed faster at both token counts of the key: written
    both = confirm_rows(swept(1, sweep), rounds_time(9.0)[0]) + confirm_rows(swept(4, sweep), rounds_time(9.0)[0])
    update_plan_table(path, lambda table: write_table(both, table, 0.02))
    assert "(20.0 µs -> 18.0 µs)" in capsys.readouterr().out and load(path).decode[key] == faster
    # confirmed faster at one count only (at the other it fell out of the sweep's eight fastest): no candidate
    with open(path, "w") as f:
        f.write(PlanTable("Test GPU", 132, {key: table_plan}, {}).to_json())
    slow_at_four = sweep[:2] + [99.0] + sweep[3:]
    one_count = confirm_rows(swept(1, sweep), rounds_time(9.0)[0]) + confirm_rows(swept(4, slow_at_four),
                                                                                    rounds_time(9.0)[0])  # fmt: skip
    update_plan_table(path, lambda table: write_table(one_count, table, 0.02))
    assert "kept (20.0 µs" in capsys.readouterr().out and load(path).decode[key] == table_plan


def test_the_one_launch_plan_search_writes_no_plan_slower_than_the_three_kernels(tmp_path, capsys):
    """Where the table holds no plan for a batch, the layer runs the three kernels (on an H100 at TP=1, gate_up_proj
    in 64-row tiles): the search times them as the incumbent, so a one-launch plan is written only where it beats
    them, and where none does the key stays without an entry. Candidates are plans of the batch's own row tile."""
    from dataclasses import asdict

    from bench.kernels.decode_lora import candidate_plans, write_table
    from bench.kernels.harness import update_plan_table
    from vllm_bdlora.kernels.plans import default_decode_plan

    path = str(tmp_path / "gpu.json")
    with open(path, "w") as f:
        f.write(PlanTable("Test GPU", 132, {}, {}).to_json())
    assert default_decode_plan(28672, 4096, 16, 1, 132, 64, 1) is None  # the structural rule: three kernels
    plans = candidate_plans(28672, 4096, 16, 1, 1, load(path), block_m=64)
    assert plans and {p.block_m for p in plans} == {64}
    key = "out=28672 hidden=4096 total_width=16 slots=1 tile=64 adapters=1"

    def rows(plan_us):
        three = {"plan": "none: three kernels", "plan_fields": None, "default": True, "us": 93.0}
        return [{"N": 28672, "K": 4096, "width": 8, "slices": 2, "slots": 1, "tile": 64, "adapters": 1, "tokens": 64,
                 **r} for r in [three, {"plan": "p", "plan_fields": asdict(plans[0]), "default": False,
                                        "us": plan_us}]]  # fmt: skip

    update_plan_table(path, lambda table: write_table(rows(108.0), table, 0.02))
    assert "kept (93.0 µs; best other 93.0 µs)" in capsys.readouterr().out and key not in load(path).decode
    update_plan_table(path, lambda table: write_table(rows(92.0), table, 0.02))  # within --min-gain
    assert key not in load(path).decode
    update_plan_table(path, lambda table: write_table(rows(88.0), table, 0.02))
    assert "(93.0 µs -> 88.0 µs)" in capsys.readouterr().out and load(path).decode[key] == plans[0]


def test_the_one_launch_plan_search_times_each_batch_with_the_plan_that_serves_it(tmp_path, capsys):
    """A layer of 12 slots serves a decode batch from the plan sized for the adapters a batch of its size may mix
    (its plan is chosen from its size alone), so a 16-token batch holding one adapter runs the 12-adapter key's plan,
    gathering each row's B. The search times each batch with that plan and its candidates, and decides that key on
    all the batches it serves: a plan fast at one adapter but slow at twelve does not win."""
    from dataclasses import asdict

    from bench.kernels.decode_lora import LIFTED_WIDTH, served_candidates, write_table
    from bench.kernels.harness import update_plan_table
    from vllm_bdlora.kernels.plans import batch_plan, make_plan, plan_adapters

    shape, width = (4096, 4096, 16), 16  # TP=1 o_proj, rank 16
    assert [plan_adapters(12, width, t, LIFTED_WIDTH) for t in (1, 4, 16)] == [1, 4, 12]
    assert plan_adapters(1, width, 16, LIFTED_WIDTH) == 1
    key = "out=4096 hidden=4096 total_width=16 slots=many tile=16 adapters=12"
    one = "out=4096 hidden=4096 total_width=16 slots=many tile=16 adapters=1"
    plans = [make_plan(*shape, 16, block_n=bn, block_k=128, stream_k=True, gemv_programs=100) for bn in (32, 64, 128)]
    table = PlanTable("Test GPU", 132, {key: plans[0], one: plans[1]}, {})
    tile, sized, incumbent, _, candidates = served_candidates(table, *shape, 12, 16, width)
    assert (tile, sized) == (16, 12) and incumbent == batch_plan(table, *shape, 12, 16, 1, LIFTED_WIDTH)
    assert incumbent.block_n == 32 and incumbent.row_gather  # not the 1-adapter key's plan, and rows gather B
    assert candidates and all(p.row_gather for p in candidates)

    path = str(tmp_path / "gpu.json")
    with open(path, "w") as f:
        f.write(table.to_json())

    def rows(us_by_adapters):  # a 16-token batch holding 1, 4 or 12 adapters: the table's plan, then plans[2]
        return [{"N": 4096, "K": 4096, "width": width, "slices": 1, "slots": 12, "tile": 16, "tokens": 16,
                 "adapters": a, "plan_adapters": 12, "default": plan == plans[0], "plan": f"bn {plan.block_n}",
                 "plan_fields": asdict(plan), "us": us}
                for a, pair in us_by_adapters.items()
                for plan, us in zip((plans[0], plans[2]), pair, strict=True)]  # fmt: skip

    update_plan_table(path, lambda t: write_table(rows({1: (20.0, 15.0), 4: (20.0, 21.0), 12: (25.0, 31.0)}), t, 0.02))
    out = capsys.readouterr().out
    assert f"{key}: kept (65.0 µs; best other 65.0 µs)" in out and f"{one}:" not in out
    assert load(path).decode[key] == plans[0] and load(path).decode[one] == plans[1]
    update_plan_table(path, lambda t: write_table(rows({1: (20.0, 18.0), 4: (20.0, 18.0), 12: (25.0, 23.0)}), t, 0.02))
    assert "(65.0 µs -> 59.0 µs)" in capsys.readouterr().out and load(path).decode[key] == plans[2]
    # a plan timed at only some of the batches the key serves does not compete
    with open(path, "w") as f:
        f.write(table.to_json())
    partial = [
        r for r in rows({1: (20.0, 10.0), 4: (20.0, 10.0), 12: (25.0, 10.0)}) if r["adapters"] != 12 or r["default"]
    ]
    update_plan_table(path, lambda t: write_table(partial, t, 0.02))
    assert "kept (65.0 µs; best other 65.0 µs)" in capsys.readouterr().out and load(path).decode[key] == plans[0]
    # rows of searches that keyed each batch by the adapters it held are read as before
    legacy = [{k: v for k, v in r.items() if k != "plan_adapters"} for r in rows({1: (20.0, 10.0)})]
    update_plan_table(path, lambda t: write_table(legacy, t, 0.02))
    assert f"{one}: bn 128 (20.0 µs -> 10.0 µs)" in capsys.readouterr().out


MIXED_ROWS_KEY = re.compile(r"out=(\d+) hidden=(\d+) total_width=(\d+) slots=many$")


@pytest.mark.parametrize("path", TABLES, ids=os.path.basename)
def test_every_measured_row_limit_is_a_batch_a_multi_slot_layer_can_run(path):
    for key, rows in load(path).mixed_rows.items():
        assert MIXED_ROWS_KEY.match(key), key
        assert isinstance(rows, int) and 0 <= rows <= largest_tile(2), (key, rows)


def test_measured_row_limits_read_back_and_take_the_width_rules_place_unless_set(caplog):
    """A multi-slot projection the table measured runs the one kernel up to its measured tokens (wider or narrower
    than the row-width rule would allow), logged once; one it did not measure keeps the rule; a width the operator
    set applies as set; a table without measured rows writes as before they existed."""
    from vllm_bdlora.kernels.plans import (
        DEFAULT_MAX_MIXED_ADAPTERS,
        DEFAULT_MAX_MIXED_WIDTH,
        mixed_rows_key,
        one_launch_tokens,
    )

    qkv = (384, 4096, 48)  # TP=4 qkv_proj, 16 columns per slice
    table = PlanTable("Test GPU", 132, {}, {}, {mixed_rows_key(*qkv): 16, mixed_rows_key(3584, 4096, 64): 0})
    assert table.to_json().endswith(
        '"mixed_rows": {\n"out=3584 hidden=4096 total_width=64 slots=many": 0,\n'
        '"out=384 hidden=4096 total_width=48 slots=many": 16\n}\n}'
    )
    again = PlanTable.from_json(table.to_json())
    assert again.mixed_rows == table.mixed_rows
    bare = PlanTable("Test GPU", 132, {}, {})
    assert "mixed_rows" not in bare.to_json() and PlanTable.from_json(bare.to_json()).mixed_rows == {}

    def served(rows, width, set_width=None, max_adapters=DEFAULT_MAX_MIXED_ADAPTERS, slots=12):
        return one_launch_tokens(rows, set_width, max_adapters, width, slots)

    caplog.set_level(logging.INFO, logger="vllm.bdlora")
    assert served(again.measured_rows(*qkv), 16) == 16  # the rule would stop at 128 // 16 = 8
    assert served(again.measured_rows(3584, 4096, 64), 32) == 0  # the rule would allow 4
    assert served(again.measured_rows(1000, 4096, 48), 16) == DEFAULT_MAX_MIXED_WIDTH // 16 == 8  # not measured
    assert served(again.measured_rows(*qkv), 16, set_width=128) == 8  # the operator's width
    assert served(again.measured_rows(*qkv), 16, max_adapters=4) == 4  # and the operator's adapter limit
    again.measured_rows(*qkv)
    said = [r.getMessage() for r in caplog.records if "as measured" in r.getMessage()]
    assert len(said) == 2 and "up to 16 tokens" in said[0] and "up to 0 tokens" in said[1]


def test_the_row_limit_search_keeps_the_tokens_up_to_the_first_loss():
    """`bench.kernels.decode_lora --write-table` (timed rows): per multi-slot projection, the most tokens up to which
    the one kernel took no more time than the three kernels (within the tolerance) at every count timed, each count
    summed over its adapter counts; single-slot rows and batches without a plan write nothing."""
    from bench.kernels.decode_lora import write_row_limits
    from vllm_bdlora.kernels.plans import mixed_rows_key

    def row(tokens, one, three, n=384, adapters=1, slots=12, plan="whole blocks"):
        return {"N": n, "K": 4096, "width": 16, "slices": 3, "slots": slots, "tokens": tokens, "adapters": adapters,
                "one_launch_us": one, "three_kernels_us": three, "plan": plan}  # fmt: skip

    table = PlanTable("Test GPU", 132, {}, {})
    rows = [row(1, 5.0, 6.0), row(4, 5.0, 6.0), row(4, 7.0, 6.5, adapters=4),  # 12.0 against 12.5: a win
            row(8, 6.0, 6.1), row(8, 7.3, 6.5, adapters=8),  # 13.3 against 12.6: the first loss past 2%
            row(16, 5.0, 9.0),  # a win after a loss does not count
            row(1, 9.0, 1.0, n=3584), row(4, 1.0, 9.0, n=3584),  # loses at the first count: 0
            row(4, 1.0, 9.0, n=4096, slots=1), row(4, 1.0, 9.0, n=8192, plan="none: three kernels")]  # fmt: skip
    said = write_row_limits(rows, table, 0.02)
    assert table.mixed_rows == {mixed_rows_key(384, 4096, 48): 4, mixed_rows_key(3584, 4096, 48): 0}
    assert len(said) == 2 and "up to 4 tokens (was no entry" in said[0] and "8: 0.95x" in said[0]
    within_noise = [row(4, 5.0, 6.0), row(8, 10.1, 10.0), row(16, 9.0, 8.0)]  # 1% slower at 8 tokens: noise
    write_row_limits(within_noise, table, 0.02)
    assert table.mixed_rows[mixed_rows_key(384, 4096, 48)] == 8


def test_launch_configs_are_hashable_keys_of_the_variant_sets():
    assert len({LaunchConfig(16, 32, 64), LaunchConfig(16, 32, 64), LaunchConfig(16, 32, 64, split_k=2)}) == 2


def test_the_prefill_search_replaces_the_range_holding_the_timed_batch():
    """`bench.kernels.fused_lora --pairs --write-table`: the fastest pair replaces the shrink and expand of the range
    holding the timed token count, where it saves more than --min-gain; other ranges stay; a layer the table lacks
    starts from the structural default's ranges."""
    from bench.kernels.fused_lora import write_prefill_table
    from vllm_bdlora.kernels.plans import prefill_key

    table = PlanTable("Test GPU", 132, {}, {})
    faster = {"ms": 0.5, "shrink": {"block_m": 64, "block_n": 128, "block_k": 64, "split_k": 2, "num_warps": 4,
                                    "num_stages": 4},
              "expand": {"block_m": 128, "block_n": 256, "block_k": 32, "split_k": 1, "num_warps": 8,
                         "num_stages": 2}}  # fmt: skip
    row = {"N": 6144, "K": 4096, "width": 128, "slices": 3, "tokens": 1024, "pairs_default_ms": 0.51,
           "pairs_top5": [faster]}  # fmt: skip
    write_prefill_table([row], table, 0.02)  # within noise: the default's ranges, unchanged
    key = prefill_key(6144, 4096, 128, 3)
    assert table.prefill[key] == default_prefill_ranges(6144, 4096, 128, 3)
    said = write_prefill_table([{**row, "pairs_default_ms": 0.8}], table, 0.02)
    ranges = table.prefill[key]
    assert ranges[-1].shrink == LaunchConfig(**faster["shrink"])
    assert ranges[-1].expand == LaunchConfig(**faster["expand"])
    assert ranges[0] == default_prefill_ranges(6144, 4096, 128, 3)[0] and "0.8 -> 0.5 ms" in said[0]


def test_the_prefill_search_takes_one_pair_good_at_every_count_of_a_range():
    """Rows at 1,024 and 4,096 tokens fall in one range: the pair of lowest mean time over the default's wins, not
    the last count's best, and a pair slower than the default at either count by more than --min-gain is never
    chosen; with no pair saving more than --min-gain on the mean, the range stays."""
    from bench.kernels.fused_lora import write_prefill_table
    from vllm_bdlora.kernels.plans import prefill_key

    def pair(shrink_k, expand_n, ms):
        return {"ms": ms, "shrink": {"block_m": 64, "block_n": 16, "block_k": shrink_k, "split_k": 1, "num_warps": 4,
                                     "num_stages": 3},
                "expand": {"block_m": 64, "block_n": expand_n, "block_k": 16, "split_k": 1, "num_warps": 4,
                           "num_stages": 2}}  # fmt: skip

    def row(tokens, default, times):  # times: (shrink_k, expand_n) -> ms, every pair timed at this count
        timed = sorted((pair(*launch, ms) for launch, ms in times.items()), key=lambda p: p["ms"])
        return {"N": 4096, "K": 4096, "width": 16, "slices": 1, "tokens": tokens, "pairs_default_ms": default,
                "pairs_top5": timed[:5], "pairs_all": timed}  # fmt: skip

    fast_at_4096_only = (64, 256)  # 0.8x at 4,096 tokens, 1.05x at 1,024
    good_at_both = (128, 128)  # 0.92x at both
    rows = [row(1024, 1.0, {fast_at_4096_only: 1.05, good_at_both: 0.92, (32, 64): 0.99}),
            row(4096, 4.0, {fast_at_4096_only: 3.2, good_at_both: 3.68, (32, 64): 3.9})]  # fmt: skip
    table = PlanTable("Test GPU", 132, {}, {})
    said = write_prefill_table(rows, table, 0.02)
    chosen = table.prefill[prefill_key(4096, 4096, 16, 1)][-1]
    assert (chosen.shrink.block_k, chosen.expand.block_n) == good_at_both
    assert len(said) == 1 and "1024 tokens 1.0 -> 0.92 ms, 4096 tokens 4.0 -> 3.68 ms" in said[0]

    table = PlanTable("Test GPU", 132, {}, {})
    no_pair_saves = [row(1024, 1.0, {fast_at_4096_only: 1.05, (32, 64): 0.99}),
                     row(4096, 4.0, {fast_at_4096_only: 3.2, (32, 64): 3.96})]  # fmt: skip
    write_prefill_table(no_pair_saves, table, 0.02)
    assert table.prefill[prefill_key(4096, 4096, 16, 1)] == default_prefill_ranges(4096, 4096, 16, 1)


def test_the_prefill_search_decides_on_its_confirming_rounds_not_the_sweep():
    """A pair the sweep timed 11% faster than the table's launches, which the confirming rounds time the same, leaves
    the range as it was; a pair the confirming rounds time faster at both counts replaces it, and a pair confirmed at
    one count only never competes."""
    from bench.kernels.fused_lora import write_prefill_table
    from vllm_bdlora.kernels.plans import prefill_key

    def pair(shrink_k, ms):
        return {"ms": ms, "shrink": {"block_m": 64, "block_n": 16, "block_k": shrink_k, "split_k": 1, "num_warps": 4,
                                     "num_stages": 3},
                "expand": {"block_m": 64, "block_n": 128, "block_k": 16, "split_k": 1, "num_warps": 4,
                           "num_stages": 2}}  # fmt: skip

    def row(tokens, sweep, confirmed):  # shrink block_k -> ms, the table's launches as "current"
        return {"N": 4096, "K": 4096, "width": 16, "slices": 1, "tokens": tokens,
                "pairs_default_ms": sweep.pop("current"), "pairs_all": [pair(k, ms) for k, ms in sweep.items()],
                "pairs_top5": [], "pairs_default_confirmed_ms": confirmed.pop("current"),
                "pairs_confirmed": [pair(k, ms) for k, ms in confirmed.items()]}  # fmt: skip

    lucky, real, once = 32, 128, 256  # shrink block_k of three pairs
    rows = [row(1024, {"current": 1.0, lucky: 0.89, real: 0.97}, {"current": 0.97, lucky: 0.97, real: 0.97}),
            row(4096, {"current": 4.0, lucky: 3.56, real: 3.9}, {"current": 3.9, lucky: 3.9, real: 3.9})]  # fmt: skip
    table = PlanTable("Test GPU", 132, {}, {})
    said = write_prefill_table(rows, table, 0.02)
    assert table.prefill[prefill_key(4096, 4096, 16, 1)] == default_prefill_ranges(4096, 4096, 16, 1)
    assert "kept (1024 tokens 0.97 ms, 4096 tokens 3.9 ms)" in said[0]

    rows = [row(1024, {"current": 1.0, lucky: 0.89, real: 0.97}, {"current": 1.0, real: 0.95, once: 0.5}),
            row(4096, {"current": 4.0, lucky: 3.56, real: 3.9}, {"current": 4.0, real: 3.8, lucky: 3.9})]  # fmt: skip
    said = write_prefill_table(rows, table, 0.02)
    chosen = table.prefill[prefill_key(4096, 4096, 16, 1)][-1]
    assert chosen.shrink.block_k == real and "1024 tokens 1.0 -> 0.95 ms, 4096 tokens 4.0 -> 3.8 ms" in said[0]


def test_confirming_rounds_alternate_their_order_and_take_each_candidates_median():
    """`harness.confirm` times every candidate at every point once a round, every other round in reverse order, and
    `medians` takes each one's median: a candidate timed first in a drifting run is not charged the drift alone."""
    from bench.kernels.harness import confirm, medians

    calls = []

    def time_at(candidate, point):
        calls.append((candidate, point))
        return {"a": 1.0, "b": 2.0, "c": 3.0}[candidate] * point + 0.1 * len(calls)  # drifting upwards

    rounds = confirm(["a", "b", "c"], time_at, [1], rounds=3)
    assert [c for c, _ in calls] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert rounds == {"a": {1: [1.1, 1.6, 1.7]}, "b": {1: [2.2, 2.5, 2.8]}, "c": {1: [3.3, 3.4, 3.9]}}
    assert medians(rounds) == {"a": {1: 1.6}, "b": {1: 2.5}, "c": {1: 3.4}}
    calls.clear()
    confirm(["a", "b"], time_at, [1, 4], rounds=2)
    assert calls == [("a", 1), ("a", 4), ("b", 1), ("b", 4), ("b", 1), ("b", 4), ("a", 1), ("a", 4)]


def _planted_search(monkeypatch, ms_of):
    """bench.kernels.mixed_batch_plans' search with its GPU parts replaced: layers are labels, each candidate's time
    at an adapter count is ms_of(candidate, adapters), the current launch is the structural default's."""
    import bench.kernels.mixed_batch_plans as search

    def make_layer(k, heights, tokens, adapters, width, slots):
        return {"adapters": adapters, "N": sum(heights), "K": k, "width": width, "slices": len(heights)}

    def table_launch(layer):
        return default_prefill_ranges(layer["N"], layer["K"], layer["width"], layer["slices"])[0]

    monkeypatch.setattr(search, "make_layer", make_layer)
    monkeypatch.setattr(search, "reference", lambda layer: layer["adapters"])
    monkeypatch.setattr(search, "table_launch", table_launch)
    monkeypatch.setattr(search, "precompile", lambda layers, candidates: None)
    monkeypatch.setattr(search, "candidate_path", lambda layer, c: (c, layer["adapters"]))
    monkeypatch.setattr(search, "checked_ms", lambda path, want, label: ms_of(*path))
    monkeypatch.setattr(search, "graph_ms", lambda path: ms_of(*path))  # the confirming rounds' timings
    return search


def test_the_mixed_batch_search_chooses_on_its_confirming_rounds(monkeypatch):
    """A launch the search's rounds time 20% faster at every adapter count, but its confirming rounds as fast as the
    current launch, is not chosen; one the confirming rounds find faster is, with those rounds' times."""

    def lucky_in_rounds(c, adapters):
        return (10.0 + adapters) * (0.8 if c.expand.block_n == 256 else 1)

    search = _planted_search(monkeypatch, lucky_in_rounds)
    monkeypatch.setattr(search, "graph_ms", lambda path: 10.0 + path[1])
    row = search.search_point("o_proj", 1024, (4096,), 16, (1, 12), 8, 12, 4, 0.02)
    assert row["chosen"] == row["current"] and row["chosen_ms"] == {"1": 11.0, "12": 22.0}
    assert row["best"][0]["expand"]["block_n"] == 256 and len(row["confirmed"]) == 9

    monkeypatch.setattr(search, "graph_ms", lambda path: lucky_in_rounds(*path))
    row = search.search_point("o_proj", 1024, (4096,), 16, (1, 12), 8, 12, 4, 0.02)
    assert row["chosen"]["expand"]["block_n"] == 256 and row["chosen_ms"] == {"1": 8.8, "12": 17.6}
    assert row["confirmed"][0] == {**row["current"], "ms": {"1": 11.0, "12": 22.0},
                                   "rounds": {"1": [11.0] * 3, "12": [22.0] * 3}}  # fmt: skip


def test_the_mixed_batch_search_keeps_the_launch_best_over_every_adapter_count(monkeypatch, tmp_path):
    """The search times shrinks, then expands (and delta first in packed layers), then shrinks again at every adapter
    count, and keeps the launch of lowest mean time relative to the current one that is nowhere slower; writing it
    gives the decode bracket a range of its own and leaves every other batch size its launch."""
    import json

    def ms_of(c, adapters):
        ms = 10.0 + adapters  # the current launch: 11, 14, 22 ms at 1, 4, 12 adapters
        if c.shrink.split_k == 4 and c.shrink.num_warps == 2:
            ms -= 0.5 * adapters  # a shrink that serves many adapters better
        if c.expand.block_n == 128 and c.delta_first:
            ms -= 1.0
        if c.expand.block_n == 256:
            ms = ms - 3.0 if adapters == 12 else ms * 1.1  # faster with 12 adapters, slower with one: never kept
        return ms

    search = _planted_search(monkeypatch, ms_of)
    row = search.search_point("qkv_proj", 4096, (1024, 256, 256), 32, (1, 4, 12), 8, 12, 4, 0.02)
    chosen = search._candidate_from_json(row["chosen"])
    assert (chosen.shrink.split_k, chosen.shrink.num_warps) == (4, 2)
    assert (chosen.expand.block_n, chosen.delta_first) == (128, True)
    assert row["current_ms"] == {"1": 11.0, "4": 14.0, "12": 22.0}
    assert row["chosen_ms"] == {"1": 9.5, "4": 11.0, "12": 15.0}
    flat = _planted_search(monkeypatch, lambda c, adapters: 10.0 + adapters * (1.01 if c.delta_first else 1))
    kept = flat.search_point("o_proj", 1024, (4096,), 16, (1, 12), 8, 12, 4, 0.02)
    assert kept["chosen"] == kept["current"]  # nothing saves more than --min-gain: the current launch stays

    table = PlanTable("Test GPU", 132, {}, {})
    said = search.write_decode_ranges([row], table)
    ranges = table.prefill["out=1536 hidden=4096 width=8 slices=3"]
    default = default_prefill_ranges(1536, 4096, 8, 3)
    assert [r.from_tokens for r in ranges] == [1, 17, 33, 65]
    assert ranges[0] == default[0] and ranges[2] == replace_start(default[0], 33) and ranges[3] == default[1]
    assert ranges[1] == PrefillRange(17, chosen.shrink, chosen.expand, True)
    assert "17-32 tokens" in said[0] and "12 adapters 22.0 -> 15.0 ms" in said[0]
    for r in ranges:
        assert prefill_problems(r, 4096, 8, 3) == []
    assert PlanTable.from_json(table.to_json()).prefill == table.prefill

    (tmp_path / "mixed_batch_plans.json").write_text(json.dumps(
        {"environment": {"gpu": "Test GPU", "torch": "-", "triton": "-", "time": "-", "command": "-"}, "rows": [row]}
    ))  # fmt: skip
    text = open(search.report(str(tmp_path / "mixed_batch_plans.json"))).read()
    assert "| qkv_proj | 32 | 11.0000 / **9.5000** | 14.0000 / **11.0000** | 22.0000 / **15.0000** |" in text
    assert "| 32 | 12 | 22000.0 (2.00) | **15000.0** (1.58) | 0.682 |" in text


class _HostGone(Exception):
    """A host taken back in the middle of a search."""


def test_a_cut_mixed_batch_search_keeps_its_finished_points_and_layers_finish_it(monkeypatch, tmp_path):
    """The search writes each point to its results and the table as it finishes: when the host goes away mid-search
    the finished points stay, and --layers searches the projections left, adding to the same table."""
    import json
    import types

    import torch

    import bench.kernels.harness as harness

    search = _planted_search(monkeypatch, lambda c, adapters: 10.0 + adapters * (0.5 if c.shrink.split_k == 4 else 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CLI's GPU parts, for a CPU run
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(name="Test GPU"))
    monkeypatch.setattr(harness, "copy_bandwidth_gbs", lambda: 1.0)
    timed, real_point = [], search.search_point

    def cut_after(points):
        def point(*args):
            if len(timed) == points:
                raise _HostGone
            timed.append(args[:2])
            return real_point(*args)

        return point

    table_file = tmp_path / "table.json"
    table_file.write_text(PlanTable("Test GPU", 132, {}, {}).to_json())
    args = ["--tp", "4", "--width", "8", "--tokens", "16,32", "--adapters", "1,12", "--write-table", str(table_file)]
    monkeypatch.setattr(search, "search_point", cut_after(3))
    with pytest.raises(_HostGone):
        search.main([*args, "--out", str(tmp_path / "cut")])
    rows = json.loads((tmp_path / "cut" / "mixed_batch_plans.json").read_text())["rows"]
    assert [(r["layer"], r["tokens"]) for r in rows] == [("qkv_proj", 16), ("qkv_proj", 32), ("o_proj", 16)]
    table = load(str(table_file))
    qkv, o_proj = "out=1536 hidden=4096 width=8 slices=3", "out=4096 hidden=1024 width=8 slices=1"
    assert [r.from_tokens for r in table.prefill[qkv]] == [1, 17, 33, 65]
    assert [r.from_tokens for r in table.prefill[o_proj]] == [1, 17, 65]  # its 32-token bracket was not reached
    assert table.prefill[qkv][1].shrink.split_k == 4

    timed.clear()
    monkeypatch.setattr(search, "search_point", cut_after(99))
    assert search.main([*args, "--layers", "o_proj,down_proj", "--out", str(tmp_path / "rest")]) == 0
    assert [name for name, _ in timed] == ["o_proj", "o_proj", "down_proj", "down_proj"]
    table = load(str(table_file))
    assert [r.from_tokens for r in table.prefill[o_proj]] == [1, 17, 33, 65]
    assert "out=4096 hidden=3584 width=8 slices=1" in table.prefill  # down_proj searched
    assert "out=7168 hidden=4096 width=8 slices=2" not in table.prefill  # gate_up_proj not picked
    assert [r.from_tokens for r in table.prefill[qkv]] == [1, 17, 33, 65]  # the first run's points stay
    with pytest.raises(SystemExit):
        search.main([*args, "--layers", "o_proj,lm_head", "--out", str(tmp_path / "bad")])


def replace_start(r: PrefillRange, start: int) -> PrefillRange:
    return PrefillRange(start, r.shrink, r.expand, r.delta_first)


def test_the_pairs_sweep_confirms_the_tables_pair_and_its_fastest_challengers(monkeypatch):
    """`pairs_point`: every pairing is swept, then the table's pair (first in the sweep, whatever its time) and the
    CONFIRM_TOP fastest others are timed again; the row reports the table's pair's confirming time apart."""
    from dataclasses import asdict

    import torch

    import bench.kernels.fused_lora as fused_lora
    import vllm_bdlora.kernels.plans as plans
    from bench.kernels.harness import CONFIRM_TOP, confirm

    monkeypatch.setattr(plans, "cuda_table", lambda device: None)  # no GPU here: the interpreter's table
    layer = {"widths": torch.zeros(1), "weight": torch.zeros(4096, 1)}
    shrinks, expands = fused_lora.pair_candidates(1024, 4096, 16, 1, 4096)

    def sweep_ms(shrink, expand):  # the table's pair (both defaults) sweeps slowest, the others in sweep order
        if (shrink, expand) == (shrinks[0], expands[0]):
            return 2.0
        return 1.0 + 0.01 * (shrinks.index(shrink) + len(shrinks) * expands.index(expand))

    monkeypatch.setattr(fused_lora, "fused_paths", lambda layer, shrink, expand: [(shrink, expand)])
    monkeypatch.setattr(fused_lora, "checked_ms", lambda path, want, label: sweep_ms(*path))
    monkeypatch.setattr(fused_lora, "graph_ms", lambda path: 1.5 if path == (shrinks[0], expands[0]) else 1.4)
    again = []
    monkeypatch.setattr(fused_lora, "confirm", lambda keys, time_at, points: again.extend(keys) or
                        confirm(keys, time_at, points))  # fmt: skip
    row = fused_lora.pairs_point(layer, None, 1024, 4096, 16)
    assert len(row["pairs_all"]) == len(shrinks) * len(expands) and row["pairs_default_ms"] == 2.0
    fastest = sorted((sweep_ms(s, e), (s, e)) for s in shrinks for e in expands if (s, e) != (shrinks[0], expands[0]))
    expected = [(shrinks[0], expands[0])] + [pair for _, pair in fastest[:CONFIRM_TOP]]
    assert again == [(tuple(sorted(asdict(s).items())), tuple(sorted(asdict(e).items()))) for s, e in expected]
    assert row["pairs_default_confirmed_ms"] == 1.5 and len(row["pairs_confirmed"]) == CONFIRM_TOP + 1
    assert all(p["ms"] == 1.4 and p["ms_rounds"] == [1.4] * 3 for p in row["pairs_confirmed"][:CONFIRM_TOP])

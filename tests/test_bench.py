"""The benchmark suite's pieces: adapters in PEFT's formats, parameter counts, report logic, and one
small end-to-end sweep on CPU (the same code path the GPU sweeps take)."""

import csv
import json

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
    summary = (out / "summary.md").read_text()
    assert "| bdlora | 16 |" in summary and "command:" in summary
    assert (out / "plots" / "tp1_io16-8_adapters1.png").stat().st_size > 0
    assert torch.cuda.is_available() or "CPU only" in summary

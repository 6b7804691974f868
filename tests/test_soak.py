"""The reliability soak, CI-sized: 300 requests over 24 adapters through 4 slots and 8 CPU-cache entries, with each
worker keeping at most 2 MiB of adapters in memory (the rest spilled and read back), live unload/reload, every kind
of bad adapter, and a worker killed at the end (bench/soak.py; the committed run is bench/results/soak/)."""

import json

import pytest

from bench import soak


@pytest.mark.engine
def test_soak_answers_every_request_as_if_sent_alone(tmp_path):
    out = tmp_path / "out"
    status = soak.main(["--requests", "300", "--adapters", "24", "--churn-adapters", "2", "--concurrency", "8",
                        "--adapter-host-memory", "2MiB", "--workdir", str(tmp_path / "work"),
                        "--out", str(out)])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [] and status == 0, summary
    assert summary["errors"] == 0 and summary["mismatches"] == 0
    assert summary["completed_before_fault"] >= 250
    assert summary["churn"]["reloads"] > 0 and summary["churn"]["bad_loads"] > 0
    fault = summary["fault"]  # its health_polls: when each /health poll after the kill was sent and answered
    assert fault["exit_status"] == 1 and fault["unhealthy_after_s"] < 2, fault


def test_soak_fails_a_run_whose_adapter_load_got_no_answer_after_the_fault():
    report = {
        "errors": 0, "mismatches": 0, "rss_samples": [],
        "churn": {"reload_mismatches": 0, "bad_load_wrong_answers": []},
        "fault": {"exit_status": 1, "unhealthy_monotonic": 10.1, "killed_monotonic": 10.0},
    }  # fmt: skip
    assert soak.verdict(report, rss_growth_limit=0.05) == []
    report["fault"]["adapter_call_unanswered"] = True
    assert soak.verdict(report, rss_growth_limit=0.05) == [
        f"an adapter load or unload in flight got no answer in {soak.CHURN_ANSWER_TIMEOUT_S} s"
    ]

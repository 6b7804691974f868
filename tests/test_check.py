"""`vllm-bdlora check` says what the server says (test_server.py, test_server_guards.py), without an engine."""

import subprocess

import pytest

from bench.bad_adapters import BAD_ADAPTERS
from vllm_bdlora import tiny
from vllm_bdlora.serve.check import check_adapter
from vllm_bdlora.sizing import ModelShape


def check(*args):
    """`vllm-bdlora check ARGS` as a user runs it: (exit status, what it printed)."""
    proc = subprocess.run(["vllm-bdlora", "check", *map(str, args)], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout


@pytest.fixture
def check_here(capsys):
    """The same command's code in this process (vLLM imported once for the module, not per command)."""
    from vllm_bdlora.serve.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(["check", *map(str, args)])
        return code, capsys.readouterr().out

    return run


def test_served_adapters_pass_and_say_how_they_are_sharded(assets):
    code, out = check(f"bd64={assets['bd64']}", f"nb4={assets['bd64_nb4']}", f"std16={assets['std16']}",
                      f"dora={assets['bddora64']}", "--model", assets["model"], "--tp", 2, "--max-lora-rank", 64,
                      "--enable-dora")  # fmt: skip
    assert code == 0, out
    assert "bd64: OK, BD-LoRA nblocks=2, r=64: per-GPU width 32 of 32" in out
    assert "nb4: OK, BD-LoRA nblocks=4, r=64: per-GPU width 32 of 32" in out
    assert "std16: OK, standard LoRA, r=16: per-GPU width 16 of 32" in out
    assert "dora: OK, BD-DoRA nblocks=2" in out


@pytest.mark.parametrize("tp", [1, 2])
def test_what_a_worker_keeps_compares_with_the_dense_adapter_and_its_files(assets, tp, check_here):
    """A BD adapter's files hold its factors without their zeros; a worker keeps its shard's blocks (at TP=1 the
    whole adapter as one dense block), stock vLLM the dense adapter in every worker: all three in one unit."""
    shape = ModelShape.from_config(assets["model"])
    verdict = check_adapter("bd64", assets["bd64"], shape, tp, 64, dora=False)
    assert verdict.file_bytes < verdict.dense_bytes  # nblocks=2: the BD factors are half their dense size
    if tp == 1:
        assert verdict.host_bytes == verdict.dense_bytes
    else:
        assert verdict.host_bytes < verdict.dense_bytes
    code, out = check_here(f"bd64={assets['bd64']}", "--model", assets["model"], "--tp", tp, "--max-lora-rank", 64)
    line = next(line for line in out.splitlines() if line.startswith("host memory per admitted adapter"))
    assert line.count(" MiB") == 3 and "dense" in line and "without their zeros" in line, line


def test_a_gpu_memory_budget_is_told_as_slots_and_the_max_loras_a_server_sets_from_it(assets, check_here):
    """--gpu-memory: the slots a BD server's budget holds, and its --max-loras, one less (a slot kept for fills
    ahead), as `vllm serve --lora-gpu-memory` sets it; the slot's cost from the model's config."""
    from vllm_bdlora.sizing import slot_cost

    cost = slot_cost(ModelShape.from_config(assets["model"]), 64, 2, block_diagonal=True)
    code, out = check_here(f"bd64={assets['bd64']}", "--model", assets["model"], "--tp", 2, "--max-lora-rank", 64,
                           "--gpu-memory", 3 * cost.total + 1)  # fmt: skip
    assert code == 0, out
    line = next(line for line in out.splitlines() if "of LoRA GPU memory per GPU holds" in line)
    assert "holds 3 slot(s): --max-loras 2, the rest for fills ahead" in line, line


def test_refusals_name_the_fix_the_server_names(assets, tmp_path, check_here):
    other = tiny.make_tiny_llama(str(tmp_path / "wider"), hidden_size=256)
    code, out = check_here(f"wide={assets['std64']}", f"dora={assets['dora16']}",
                      f"foreign={tiny.make_adapter(other, str(tmp_path / 'foreign'), rank=8)}",
                      "--model", assets["model"], "--tp", 2, "--max-lora-rank", 64)  # fmt: skip
    assert code == 1
    assert "wide: REFUSED" in out and "start the server with --max-lora-rank 128" in out  # as test_server's
    assert "dora: REFUSED" in out and "serve it with --enable-dora" in out
    assert "foreign: REFUSED" in out
    assert "made for another base model: lora_A takes 256 inputs, this model's layer takes 128" in out
    code, out = check_here(assets["bd64"], "--model", assets["model"], "--tp", 2, "--max-lora-rank", 48)
    assert code == 1 and "is not one vLLM accepts" in out


@pytest.mark.parametrize("bad", [b for b in BAD_ADAPTERS if b.kind != "missing_path"], ids=lambda b: b.kind)
def test_every_bad_adapter_kind_is_refused_as_the_server_refuses_it(assets, tmp_path, bad):
    path = bad.make(assets["bd64"], tmp_path / bad.kind)
    verdict = check_adapter(bad.kind, path, ModelShape.from_config(assets["model"]), 2, 64, dora=False)
    text = "\n".join(verdict.problems)
    assert verdict.problems and all(fragment in text for fragment in bad.says), text


def test_kv_heads_are_replicated_past_their_number():
    shape = ModelShape(hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32)
    # TP=4 over 2 KV heads: ranks 0-1 hold KV head 0 (rows 0-31), ranks 2-3 head 1, as vLLM replicates them
    assert [shape.geometry("k_proj", 4, t).owned for t in range(4)] == [((0, 32),), ((0, 32),), ((32, 64),),
                                                                         ((32, 64),)]  # fmt: skip
    assert shape.geometry("o_proj", 4, 1).owned == ((32, 64),) and shape.geometry("down_proj", 2, 1).owned == (
        (128, 256),
    )

"""The CUDA graph capture range a BD-LoRA server asks vLLM for (vllm_bdlora/prefill_graphs.py), on vLLM's own
parsed engine arguments. The timing it buys is a benchmark's claim (bench/results/prefill/), not a test's."""

from __future__ import annotations

import logging

import pytest

from vllm_bdlora.config import BdLoraSettings
from vllm_bdlora.prefill_graphs import capture_prefills, prefill_capture_limit


@pytest.fixture(scope="module")
def parse():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_bdlora.plugin import register

    register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return lambda *flags: AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--enable-bdlora", *flags]))


ON = BdLoraSettings(enabled=True)


def test_a_bd_server_on_cuda_captures_prefills_up_to_the_setting_and_says_so(parse, caplog):
    engine_args = parse()
    assert engine_args.compilation_config.max_cudagraph_capture_size is None  # on this CPU machine: untouched
    with caplog.at_level(logging.INFO, logger="vllm.bdlora"):
        assert capture_prefills(engine_args, ON, on_cuda=True) == 2048
    assert engine_args.compilation_config.max_cudagraph_capture_size == 2048
    line = next(r.getMessage() for r in caplog.records if "capturing CUDA graphs" in r.getMessage())
    assert "up to 2048 tokens" in line and "prefill_graph_tokens" in line and "Graph capturing finished" in line
    assert "147 graph sizes in all" in line  # 1, 2, 4; 8-248 by 8; 256-2048 by 16


@pytest.mark.parametrize(
    "flags",
    [
        ("--compilation-config", '{"max_cudagraph_capture_size": 256}'),
        ("--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}'),
        ("--compilation-config", '{"cudagraph_mode": "NONE"}'),
        ("--enforce-eager",),
    ],
    ids=["own-ceiling", "own-sizes", "graphs-off", "eager"],
)
def test_the_users_own_graph_choices_are_kept(parse, flags):
    engine_args = parse(*flags)
    before = (engine_args.compilation_config.max_cudagraph_capture_size,
              engine_args.compilation_config.cudagraph_capture_sizes)  # fmt: skip
    assert capture_prefills(engine_args, ON, on_cuda=True) is None
    after = (engine_args.compilation_config.max_cudagraph_capture_size,
             engine_args.compilation_config.cudagraph_capture_sizes)  # fmt: skip
    assert after == before


def test_the_range_never_passes_the_largest_batch_and_zero_or_no_gpu_keep_vllms(parse):
    assert prefill_capture_limit(parse("--max-num-batched-tokens", "1024"), ON, on_cuda=True) == 1024
    assert prefill_capture_limit(parse(), BdLoraSettings(enabled=True, prefill_graph_tokens=0), on_cuda=True) is None
    assert prefill_capture_limit(parse(), ON, on_cuda=False) is None
    assert prefill_capture_limit(parse(), BdLoraSettings(enabled=False), on_cuda=True) is None


@pytest.mark.parametrize("value", [-1, True, "2048", 1.5])
def test_the_setting_must_be_a_token_count(value):
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        BdLoraSettings.from_additional_config({"bdlora": {"prefill_graph_tokens": value}})
    chosen = BdLoraSettings.from_additional_config({"bdlora": {"prefill_graph_tokens": 4096}})
    assert chosen.prefill_graph_tokens == 4096

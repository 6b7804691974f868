"""Runs `python -m bench.kernels.decode_lora ARGS` with the decode shrink's split as it was before 2b82496 (16
parts of the hidden dimension, 8 from 17 tokens unless hidden > 4096), so that the layer op's three-kernel path
can be timed before and after the split rule in one session:

    PYTHONPATH=$PWD python3 bench/results/kernels-h200-s22/old_shrink_rule.py --tp 1 --bd-rank 512 --out DIR

The expand reads the split from S's shape, so replacing `shrink_config` is all it takes."""

import runpy
import sys

import vllm_bdlora.kernels.fused_lora as fused_lora

current_shrink_config = fused_lora.shrink_config


def shrink_config_before_2b82496(tokens, hidden, width, slices=1):
    if tokens > 64:
        return current_shrink_config(tokens, hidden, width, slices)
    parts = max(1, min(16 if tokens <= 16 or hidden > 4096 else 8, hidden // 64))
    per_slice = 16 if width <= 16 else 32 if width <= 32 else 64
    return fused_lora.LaunchConfig(16, per_slice, fused_lora.shrink_hidden_step(hidden, parts), split_k=parts)


fused_lora.shrink_config = shrink_config_before_2b82496
sys.argv = ["bench.kernels.decode_lora", *sys.argv[1:]]
runpy.run_module("bench.kernels.decode_lora", run_name="__main__")

#!/bin/bash
# One many-adapter serving configuration on one GPU, old code against this checkout, alternated round by round (old
# first), the same benchmark code timing both: the old side's servers import vllm_bdlora from OLD_TREE (a `git
# archive` of an earlier commit's vllm_bdlora, put first on PYTHONPATH), the new side's from the installed wheel.
# The default configuration spills most adapters: Llama-3.1-8B shape, dummy weights, TP=1, 256 BD r'=8 adapters,
# 12 slots (512 MiB), 51 host entries (2 GiB), 1024/128 tokens, Zipf 1.0 at 8 requests/s and 48 distinct at 4 at a time.
#   bash bench/hosts/many_adapters_ab.sh OLD_TREE OUT [ROUNDS]     -> OUT/before-R, OUT/after-R (+ .log each)
# SHAPE_ARGS, LENGTHS and EXTRA (more server arguments) replace the configuration's, e.g. for a tiny model on CPU:
#   SHAPE_ARGS="--model-shape tiny --adapters 32 --rank 16 --gpu-memory 1MiB --host-memory 4MiB --dtype float32
#   --max-model-len 256 --max-num-seqs 8" LENGTHS=16/8 EXTRA=" --enforce-eager" bash ... OLD_TREE OUT 1
# WORKLOAD (one "POPULARITY ARRIVALS LENGTHS REQUESTS") replaces the two workloads, e.g. to compare the adapters' load
# (its time is in every summary) with a worker process of its own, as at TP > 1:
#   WORKLOAD="single concurrency:1 fixed:64/8 8" EXTRA=" --distributed-executor-backend mp --enforce-eager" ...
set -u
old=${1:?old tree holding vllm_bdlora}; out=${2:?out}; rounds=${3:-2}
shape_args=${SHAPE_ARGS:---model-shape llama-3.1-8b --adapters 256 --rank 4 --gpu-memory 512MiB --host-memory 2GiB --max-num-seqs 64 --max-model-len 2048}
lengths=${LENGTHS:-1024/128}
workloads=("zipf:1.0 poisson:8 fixed:$lengths 240" "distinct concurrency:4 fixed:$lengths 48")
[ -n "${WORKLOAD:-}" ] && workloads=("$WORKLOAD")
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    pythonpath=""; [ "$side" = before ] && pythonpath=$old
    echo "== $(date +%T) $side $round"
    # shellcheck disable=SC2086  # shape_args is a list of arguments
    PYTHONPATH=$pythonpath python3 -m bench.many_adapters --tp 1 --modes bdlora --distinct-files 16 $shape_args \
      --workloads "${workloads[@]}" \
      --extra-server-args="--compilation-config '{\"max_cudagraph_capture_size\":128}'${EXTRA:-}" \
      --workdir /tmp/many-adapters-ab --out "$out/$side-$round" > "$out/$side-$round.log" 2>&1
    echo "exit $? $(tail -n 2 "$out/$side-$round.log" | tr '\n' ' ' | cut -c1-300)"
  done
done

#!/bin/bash
# The many-adapter benchmark's GPU configuration (bench/README.md, "Many adapters"): Llama-3.1-8B shape, dummy
# weights, 1024 adapters (BD r'=32 in TP blocks against standard r=16: the paper's smallest pair, equal parameters at
# TP=4), the same 256 MiB of LoRA GPU memory per GPU and 16 GiB of host memory per worker for every mode, every mode's
# CUDA graphs captured up to the same 128 tokens (vLLM 0.26 on Hopper also needs fuse_allreduce_rms off at TP > 1).
#   bash bench/hosts/many_adapters.sh TP OUT [MODES] [RATE]     e.g. ... 4 /root/results/many-adapters-tp4
set -uo pipefail
tp=${1:?tp}; out=${2:?out}; modes=${3:-bdlora,nfs,slora}; rate=${4:-8}
mkdir -p "$out"
# One rank's admission stage by stage on this host, alone and beside a spinning reader (as a worker admits), first:
# it says what the load phase's per-adapter cost is made of.
python3 -m bench.admission_stages --adapters 8 --adapter-dir /root/admission-adapters --out "$out/admission-stages" \
  > "$out/admission-stages.log" 2>&1 || echo "admission stages exit $? (see $out/admission-stages.log)"
python3 -m bench.many_adapters --model-shape llama-3.1-8b --tp "$tp" --modes "$modes" --adapters 1024 --rank 16 \
  --gpu-memory 256MiB --host-memory 16GiB --max-num-seqs 64 --max-model-len 2048 \
  --workloads "single poisson:$rate fixed:1024/128 200" "zipf:1.0 poisson:$rate fixed:1024/128 200" \
              "distinct concurrency:16 fixed:1024/128 96" "distinct concurrency:1 fixed:1024/128 16" \
  --extra-server-args="--compilation-config '{\"pass_config\":{\"fuse_allreduce_rms\":false},\"max_cudagraph_capture_size\":128}'" \
  --workdir /root/many --out "$out" > "$out.log" 2>&1
status=$?
echo "many-adapters exit $status; $(tail -n 3 "$out.log")"
exit $status

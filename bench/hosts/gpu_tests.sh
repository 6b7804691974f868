#!/bin/bash
# The GPU tests spread over this host's GPUs: groups run in parallel, each on GPUs of its own (with fewer than four
# GPUs, one after another on what there is). Output per group in /root/results/gpu-tests/<group>.txt and one line
# per group (exit status, pytest's last line) in summary.txt. Run as a queue line:
#   bash bench/hosts/gpu_host.sh queue "run bash bench/hosts/gpu_tests.sh" ...
set -uo pipefail
out=/root/results/gpu-tests
mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
KERNELS=(tests/test_kernels_isolation.py tests/test_kernels_decode_lora.py tests/test_kernels_fused_lora.py
         tests/test_kernels_dora_compose.py -m gpu)
ENGINE_ONE=(tests/test_gpu_engine.py -k "not tp2 and not ray and not pp2")
ENGINE_TWO=(tests/test_gpu_engine.py -k "tp2 and not ray")
group() {  # NAME GPUS PYTEST-ARGS...
  local name=$1 devices=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$devices timeout 1500 python3 -m pytest "$@" -q -s -p no:cacheprovider \
    --basetemp="/root/pt-$name" > "$out/$name.txt" 2>&1
  echo "$name (GPUs $devices): exit $? | $(tail -n 1 "$out/$name.txt")" >> "$out/summary.txt"
}
if (( gpus >= 4 )); then
  group kernels 0 "${KERNELS[@]}" &
  group engine-one-gpu 1 "${ENGINE_ONE[@]}" &
  group engine-two-gpus 2,3 "${ENGINE_TWO[@]}" &
  wait
else
  all=$(seq -s, 0 $((gpus - 1)))
  group kernels 0 "${KERNELS[@]}"
  group engine-one-gpu 0 "${ENGINE_ONE[@]}"
  (( gpus >= 2 )) && group engine-two-gpus "$all" "${ENGINE_TWO[@]}"
fi
cat "$out/summary.txt"

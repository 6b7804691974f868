#!/bin/bash
# Session 29: program-role placement in the decode kernel, BDLORA_INTERLEAVE 0 (GEMV programs first, then the
# shrink's), 1 (shrink programs spread evenly among them), 2 (shrink programs first); rounds rotate the order.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
LINES=("--tp 1,2,4,8 --tokens 1,16 --adapters 1" "--tp 1,2,4,8 --tokens 1,16 --adapters 4 --slots 4")
for r in $(seq $1 $2); do
  case $((r % 3)) in 1) order="0 1 2";; 2) order="2 0 1";; 0) order="1 2 0";; esac
  for v in $order; do
    for i in 0 1; do
      echo "== $(date +%T) r$r v$v line$i"
      BDLORA_INTERLEAVE=$v PYTHONPATH=$PWD python3 -m bench.kernels.decode_lora ${LINES[$i]} \
        --out /root/s29b/line$i/v$v-r$r 2>&1 | tail -1
    done
  done
done
mkdir -p $OUT && tar czf $OUT/s29b.tgz -C /root s29b

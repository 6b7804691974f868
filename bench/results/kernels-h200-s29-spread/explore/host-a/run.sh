#!/bin/bash
# Session 29: TP=1 qkv_proj read 19.7 us (s24) and 21.3 (s28) on the same plan: old code (ec93e45) vs this
# checkout on one host, and the interleaved program roles (BDLORA_INTERLEAVE=1), rounds alternated.
set -u
mkdir -p /root/old && tar xzf .gpu/old-ec93e45.tgz -C /root/old
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
ARGS="--tp 1,2,4,8 --tokens 1,16 --adapters 1"
side() {
  case $1 in
    old) (cd /root/old && PYTHONPATH=/root/old python3 -m bench.kernels.decode_lora $ARGS --out /root/s29/old-r$2 2>&1 | tail -1) ;;
    i0|i1) BDLORA_INTERLEAVE=${1#i} PYTHONPATH=$PWD python3 -m bench.kernels.decode_lora $ARGS --out /root/s29/$1-r$2 2>&1 | tail -1 ;;
  esac
}
for r in $(seq ${1:-1} ${2:-3}); do
  case $((r % 3)) in 1) order="old i0 i1";; 2) order="i1 old i0";; 0) order="i0 i1 old";; esac
  for s in $order; do echo "== $(date +%T) r$r $s"; side $s $r; done
done
mkdir -p $OUT && tar czf $OUT/s29.tgz -C /root s29

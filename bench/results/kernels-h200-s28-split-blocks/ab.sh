#!/usr/bin/env bash
# A/B: qkv_proj at TP=2 as stream-K 64x128 (BDLORA_SK2=1) vs whole 32-column blocks (0); results under /root/sk
set -u
export PYTHONPATH=$PWD
mkdir -p /root/sk
for r in "$@"; do
  if (( r % 2 )); then order="0 1"; else order="1 0"; fi
  for e in $order; do
    echo "== $(date +%T) round $r exp $e"
    BDLORA_SK2=$e python3 -m bench.kernels.decode_lora --tp 2 --tokens 1,16 --adapters 1 --out /root/sk/one-e$e-r$r 2>&1 | tail -1
    BDLORA_SK2=$e python3 -m bench.kernels.decode_lora --tp 2 --tokens 1,4,16 --adapters 4 --slots 4 \
      --out /root/sk/four-e$e-r$r 2>&1 | tail -1
  done
done
mkdir -p "$OUT" && tar czf "$OUT/sk.tgz" -C /root sk

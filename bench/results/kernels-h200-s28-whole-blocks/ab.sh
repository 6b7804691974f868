#!/usr/bin/env bash
# A/B of whole-block plan tweaks: BDLORA_WB_EXP=0 (before) vs 1, same code, alternated; results under /root/wb
set -u
export PYTHONPATH=$PWD
mkdir -p /root/wb
for r in "$@"; do
  if (( r % 2 )); then order="0 1"; else order="1 0"; fi
  for e in $order; do
    echo "== $(date +%T) round $r exp $e"
    BDLORA_WB_EXP=$e python3 -m bench.kernels.decode_lora --tp 1,2,4,8 --tokens 1,16 --adapters 1 \
      --out /root/wb/8b-e$e-r$r 2>&1 | tail -1
    BDLORA_WB_EXP=$e python3 -m bench.kernels.decode_lora --model-shape llama-3.1-70b --tp 8 --tokens 1,16 \
      --adapters 1 --out /root/wb/70b-e$e-r$r 2>&1 | tail -1
  done
done
mkdir -p "$OUT" && tar czf "$OUT/wb.tgz" -C /root wb

#!/usr/bin/env bash
# A/B of the narrow stream-K plans' pipeline depth: BDLORA_NARROW_STAGES=4 (before) vs 3, same code, alternated.
# ns.sh ROUNDS... : each round runs both sides (order flips with the round's parity); results under /root/ns
set -u
export PYTHONPATH=$PWD
mkdir -p /root/ns
for r in "$@"; do
  if (( r % 2 )); then order="4 3"; else order="3 4"; fi
  for st in $order; do
    echo "== $(date +%T) round $r stages $st"
    BDLORA_NARROW_STAGES=$st python3 -m bench.kernels.decode_lora --tp 4,8 --tokens 1,16 --adapters 1 \
      --out /root/ns/8b-s$st-r$r 2>&1 | tail -1
    BDLORA_NARROW_STAGES=$st python3 -m bench.kernels.decode_lora --model-shape llama-3.1-70b --tp 8 --tokens 1,16 \
      --adapters 1 --out /root/ns/70b-s$st-r$r 2>&1 | tail -1
    BDLORA_NARROW_STAGES=$st python3 -m bench.kernels.decode_lora --tp 4 --tokens 1,4,16 --adapters 4 --slots 4 \
      --out /root/ns/8b4-s$st-r$r 2>&1 | tail -1
  done
done
mkdir -p "$OUT" && tar czf "$OUT/ns.tgz" -C /root ns

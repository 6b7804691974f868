#!/bin/bash
# One lent-GPU session, step by step (one `run` call per step, back to back; files under /root persist
# between calls while the host stays warm). See bench/hosts/README.md for the bundle copy steps before these.
#   bash bench/hosts/gpu_session.sh install            # vLLM 0.26 bundle (parts in /root/pkg) + our wheel
#   bash bench/hosts/gpu_session.sh kernels            # GPU kernel tests + kernel benchmarks -> $OUT/kernels
#   bash bench/hosts/gpu_session.sh sweep RANKS MODES  # TP=4 serving sweep (resumable) -> $OUT/tp4-8b
set -uo pipefail
OUT=${OUT:-/root/out}
STEP=${1:?step}
# vLLM 0.26 turns on FlashInfer's fused all-reduce + RMSNorm (a TP>1, Hopper-only inductor pass) by default;
# on these VMs it faults with an illegal address (see README.md), so serving keeps it off.
GRAPH_ARGS="--compilation-config '{\"pass_config\":{\"fuse_allreduce_rms\":false}}'"
case $STEP in
install)
  bash .gpu/install_bundle.sh /root/pkg && python3 -m pip install -q --no-index --no-deps .whl/*.whl
  python3 -c "import vllm, vllm_bdlora, peft; print('vllm', vllm.__version__, 'peft', peft.__version__)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
kernels)
  mkdir -p "$OUT/kernels"
  python3 -m pytest tests/test_kernels_dora_compose.py tests/test_kernels_fused_lora.py -q -p no:cacheprovider 2>&1 \
    | tail -15 | tee "$OUT/kernels/pytest.txt"
  python3 -m bench.kernels.dora_compose --out "$OUT/kernels" 2>&1 | tail -40
  python3 -m bench.kernels.fused_lora --out "$OUT/kernels" 2>&1 | tail -40 ;;  # needs the vLLM bundle for its baseline
sweep)
  RANKS=${2:-64}; MODES=${3:-base,bdlora,slora,nfs,bddora}; MINUTES=${4:-6}
  python3 -m bench.sweep --model-shape llama-3.1-8b --tp 4 --workdir /root/bench --out /root/results/tp4-8b \
    --modes "$MODES" --ranks "$RANKS" --io 1024/128 --concurrency 1,16,64 --adapters 1 --max-model-len 2048 \
    --start-timeout 420 --stop-after-minutes "$MINUTES" --extra-server-args "$GRAPH_ARGS" 2>&1 | grep -v "^\s*$" | tail -40
  mkdir -p "$OUT" && tar czf "$OUT/tp4-8b.tgz" -C /root/results tp4-8b ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac

#!/bin/bash
# A vLLM release's GPU checks on one four-GPU host, as three streams side by side, each on GPUs of its own, on the
# release that `gpu_host.sh install-release` put in its prefix (VLLM_RELEASE, e.g. 0.33.0):
#   GPU 0     serving at TP=1 (base, BD-LoRA, NFS-LoRA; 1024/128 at 1 and 16 concurrent), then vLLM's own LoRA
#             tests with the plugin registered and without it (bench/hosts/vllm_lora_suite.py)
#   GPU 1     the engine tests that need one GPU (BD, standard, DoRA and BD-DoRA against PEFT, both kernel paths,
#             CUDA graphs, the poisoned adapter, FP8, MoE), the patch and sharding tests, then the kernel tests
#   GPUs 2,3  the engine tests that need two GPUs, then serving at TP=2
# Results in /root/results/vllm-$VLLM_RELEASE/ (one log per step, summary.txt: a line per step with its exit
# status) and the sweeps' folders beside it. Run it as a queue line, then `watch`:
#   VLLM_RELEASE=0.33.0 bash bench/hosts/gpu_host.sh queue "run bash bench/hosts/release_check.sh"
# Step names as arguments run those steps alone, in their streams (e.g. `release_check.sh patching vllm-lora-suite
# serve-tp2`); the engine-test groups take 16 minutes each on an H100, the sweeps 4 minutes a mode.
set -uo pipefail
wanted=("$@")
release=${VLLM_RELEASE:?set VLLM_RELEASE to the installed release, e.g. 0.33.0}
out=${RESULTS_ROOT:-/root/results}/vllm-$release
mkdir -p "$out"
if (( $(nvidia-smi -L | wc -l) < 4 )); then echo "release_check.sh spreads its streams over four GPUs"; exit 2; fi
step() {  # NAME COMMAND...: one step of a stream, its output in $out/NAME.txt, its status in summary.txt
  local name=$1 started=$SECONDS
  shift
  if (( ${#wanted[@]} )) && [[ " ${wanted[*]} " != *" $name "* ]]; then return 0; fi
  "$@" > "$out/$name.txt" 2>&1
  local status=$?
  echo "$name: exit $status after $((SECONDS - started)) s | $(tail -n 1 "$out/$name.txt" | cut -c1-200)" >> "$out/summary.txt"
}
tests() {  # GPUS PYTEST-ARGS...: pytest on those GPUs; a case that hangs is stopped, the others still run
  local gpus=$1
  shift
  CUDA_VISIBLE_DEVICES=$gpus python3 -m pytest "$@" -q -s -p no:cacheprovider -o timeout=600 \
    --basetemp="/root/pt-${gpus/,/-}-$RANDOM"
}
serve() {  # TP GPUS: base, BD-LoRA and NFS-LoRA at 1 and 16 concurrent, 1024/128
  CUDA_VISIBLE_DEVICES=$2 OUT=/root/queue-out bash bench/hosts/gpu_host.sh sweep "$1" 64 base,bdlora,nfs 999 \
    --concurrency 1,16 --workdir "/root/bench-tp$1"
}
(
  step serve-tp1 serve 1 0
  step vllm-lora-suite python3 -m bench.hosts.vllm_lora_suite --vllm-source "/root/vllm-$release" \
    --out "$out/vllm-lora-suite" --gpus 0
) &
(
  step engine-one-gpu tests 1 tests/test_gpu_engine.py -k "not tp2 and not ray and not pp2"
  step patching tests 1 tests/test_patching.py tests/test_sharding.py
  step kernels tests 1 tests/test_kernels_isolation.py tests/test_kernels_decode_lora.py \
    tests/test_kernels_fused_lora.py tests/test_kernels_dora_compose.py -m gpu
) &
(
  step engine-two-gpus tests 2,3 tests/test_gpu_engine.py -k "tp2 and not ray"
  step serve-tp2 serve 2 2,3
) &
wait
python3 -c "import torch, triton, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', \
triton.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version())" > "$out/versions.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$out/versions.txt"
cat "$out/summary.txt"

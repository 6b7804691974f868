#!/bin/bash
# Session 29: GPU tests at the spread rule, then rounds of the spread A/B (BDLORA_SPREAD=0 turns it off)
set -u
nvidia-smi --query-gpu=name,driver_version,serial --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  mkdir -p $OUT
  PYTHONPATH=$PWD python3 -m pytest --noconftest -q -p no:cacheprovider tests/test_kernels_decode_lora.py tests/test_launch_math.py 2>&1 | tail -4 | tee $OUT/pytest-decode.txt
fi
bash bench/hosts/gpu_session.sh switch BDLORA_SPREAD $1 "--tp 1,2,4,8 --tokens 1,16 --adapters 1" \
  "--tp 1,2,4,8 --tokens 1,16 --adapters 4 --slots 4" "--model-shape llama-3.1-70b --tp 8 --tokens 1,16 --adapters 1" 2>&1 | grep -c "^=="

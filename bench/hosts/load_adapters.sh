#!/bin/bash
# How long loading many adapters over HTTP takes on one GPU, for BD-LoRA at each number of admission threads per
# worker (`admission_threads`) and for stock vLLM's loader reading the same bytes, one server after another on one
# host (`bench/many_adapters.py`'s load phase: 16 `POST /v1/load_lora_adapter` at a time, timed until the last
# answers). The configuration of bench/results/admission/load-1024-adapters-tp1-h200: Llama-3.1-8B shape, dummy
# weights, TP=1 with the worker in a process of its own (`--distributed-executor-backend mp`, as every worker is at
# TP > 1), 16 distinct files hard-linked to 1,024 adapters, 24 GiB of host memory (nothing spilled), 512 MiB of LoRA
# GPU memory; BD r'=4 in one block against a standard r=4 adapter: the same 20 MiB per adapter.
#   bash bench/hosts/load_adapters.sh OUT ["THREADS ..."] [ADAPTERS]   -> OUT/bd-threads-N, OUT/stock (+ .log each)
# BD_RANK=R' (default 4) and the standard rank (the same) set the adapters' width: vLLM's smallest --max-lora-rank
# is 8, so R'=4 fills half of every BD slot (its slot image is twice its files' bytes, zeros included) and R'=8 all
# of it, as BD r'=32 in 4 blocks fills a slot at TP=4 (40 MiB per adapter: give it HOST_MEMORY=48GiB, so that
# nothing is spilled or dropped on either side).
# SIDES (default "bd stock") picks the sides; the BD side runs once per THREADS value (default "1 4 2").
# PROFILE_LOAD=1 has py-spy (installed from .whl) sample every server's processes while its adapters load:
# OUT/NAME/logs/load-profile-MODE-{all,gil}.txt (`python -m bench.sampled_stacks FILE` for a table per thread).
set -u
out=${1:?out}; threads=${2:-1 4 2}; adapters=${3:-1024}; bd_rank=${BD_RANK:-4}
common=(--tp 1 --distinct-files 16 --model-shape llama-3.1-8b --adapters "$adapters" --gpu-memory 512MiB
        --host-memory "${HOST_MEMORY:-24GiB}" --max-num-seqs 64 --max-model-len 2048 --workloads "single concurrency:1 fixed:64/8 8"
        --workdir /tmp/load-adapters${PROFILE_LOAD:+ --profile-load})
# A load runs no graph; the one request workload after it only checks that the server serves.
server_args=" --distributed-executor-backend mp --enforce-eager"
mkdir -p "$out"
run() {  # NAME ARGS...: one server's load, its log beside its results folder
  local name=$1; shift
  echo "== $(date +%T) $name"
  python3 -m bench.many_adapters "${common[@]}" "$@" --out "$out/$name" > "$out/$name.log" 2>&1
  echo "exit $? $(tail -n 2 "$out/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
for side in ${SIDES:-bd stock}; do
  case $side in
  bd)
    for n in $threads; do
      run "bd-threads-$n" --modes bdlora --rank $((bd_rank / 2)) \
        --extra-server-args="$server_args --additional-config '{\"bdlora\":{\"admission_threads\":$n}}'"
    done ;;
  stock) run stock --modes nfs --rank "$bd_rank" --extra-server-args="$server_args" ;;
  *) echo "unknown side $side (bd, stock)"; exit 2 ;;
  esac
done

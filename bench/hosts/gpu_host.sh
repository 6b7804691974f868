#!/bin/bash
# Serving and benchmarking on an offline GPU host, step by step (one remote call per step, back to back; files
# under /root persist between calls while the host stays up). See bench/hosts/README.md for the bundle steps.
#   bash bench/hosts/gpu_host.sh install            # vLLM 0.26 bundle (parts in /root/pkg) + our wheel
#   bash bench/hosts/gpu_host.sh kernels            # GPU kernel tests + kernel benchmarks -> $OUT/kernels
#   bash bench/hosts/gpu_host.sh tune               # fused kernels' launch configurations -> $OUT/kernels-tune
#   bash bench/hosts/gpu_host.sh ab OLD.tgz SIDES "BENCH ARGS" ...  # old code vs this checkout -> $OUT/ab.tgz
#   bash bench/hosts/gpu_host.sh switch VAR FIRST-LAST "DECODE_LORA ARGS" ...  # a decode-kernel change behind an
#     environment switch read in the code, VAR=0 (before) vs VAR=1, rounds FIRST..LAST alternated -> $OUT/switch.tgz
#     (tables: python -m bench.kernels.switch_table switch/)
#   bash bench/hosts/gpu_host.sh rounds OLD.tgz FIRST-LAST "MODULE ARGS" ...  # old code (a `git archive` of
#     vllm_bdlora and bench) vs this checkout, any kernel benchmark, rounds alternated -> $OUT/rounds.tgz
#     (tables: python -m bench.kernels.switch_table rounds/ --sides old,new; ab_table for bench.kernels.fused_lora)
#   bash bench/hosts/gpu_host.sh search-rounds FIRST-LAST "SEARCH" ... -- "TIMING" ...  # a plan-table search
#     and the table after it against the table before, as a table change is measured before it is committed:
#     each SEARCH line (a bench module that --write-table's into this checkout's table), then each TIMING line on
#     the tree as it was before the searches ("old") and after them ("new"), rounds alternated
#     -> $OUT/search-rounds.tgz (the searches' reports and writer's lines, the tables they wrote, the rounds)
#   bash bench/hosts/gpu_host.sh sweep TP RANKS MODES MINUTES [SWEEP ARGS]  # serving sweep (resumable)
#     -> $OUT/tp$TP-8b.tgz or -70b.tgz (profiler traces left out, their per-rank tables kept), e.g. for the TP=4 BS=64 question:
#     sweep 4 64 bdlora,bdfused 5 --concurrency 64 --prompts-per-concurrency 16 --profile-concurrency 64
#     SHAPE=llama-3.1-70b picks another model shape (results in tp$TP-70b).
#   bash bench/hosts/gpu_host.sh queue "[NAME=VALUE ...] SHAPE TP RANKS MODES [SWEEP ARGS]" ...   # sweeps in the
#     background, one after another; NAME=VALUE (e.g. CAPTURE_SIZE=1024) applies to that line's sweep alone; a
#     line's words are quoted as on a command line (--extra-server-args "--max-loras 4" is one argument);
#     a line "run COMMAND" runs COMMAND there instead (GPU tests, the soak: results under /root/results/NAME)
#   bash bench/hosts/gpu_host.sh watch SECONDS      # keep the host held (at most SECONDS: it returns when the
#     queue is done), then bring back /root/results (and the FlashInfer JIT cache and the compile caches, for
#     `install` on a later host)
#     A call that returns kills what it started, and a server start cut by the call's 10-minute limit is
#     lost; `queue` runs its sweeps one after another under setsid, which lives until the host
#     goes back, so no server start is wasted at call boundaries. Follow it with back-to-back `watch` calls
#     (the host is released after 30 s idle); the last one's SECONDS must end before the device budget does.
set -uo pipefail
# Where a step keeps what outlives a call (bundle parts, results, queue, caches): /root on the hosts; a dry run of
# the steps elsewhere (tests/test_host_scripts.py) points it at a folder of its own.
export HOST_ROOT=${HOST_ROOT:-/root}
OUT=${OUT:-$HOST_ROOT/out}
STEP=${1:?step}
# VLLM_RELEASE=0.33.0 runs every step on the release that `install-release 0.33.0` put in /opt/vllm-0.33.0 (its
# own prefix, ahead of the image's packages), so that one host serves two releases side by side.
PREFIX_ROOT=${PREFIX_ROOT:-/opt}
if [ -n "${VLLM_RELEASE:-}" ] && [ "$STEP" != install-release ]; then
  # shellcheck disable=SC1090  # written by install-release
  . "$PREFIX_ROOT/vllm-$VLLM_RELEASE/env.sh" || { echo "no $PREFIX_ROOT/vllm-$VLLM_RELEASE: run install-release $VLLM_RELEASE first"; exit 3; }
fi
# vLLM 0.26 turns on FlashInfer's fused all-reduce + RMSNorm (a TP>1, Hopper-only inductor pass) by default;
# on these VMs it faults with an illegal address (see README.md), so serving keeps it off.
# CAPTURE_SIZE=N also captures CUDA graphs for batches of up to N tokens (vLLM's default stops at 2 x --max-num-seqs,
# 128 here), e.g. to see how much of a 1024-token LoRA prefill is host time; its results go to a folder of their own.
# QUANTIZATION=fp8 serves every mode of a line over that quantized base (--quantization; results in -fp8 folders).
# RESULTS_TAG=NAME puts a line's results in a folder of their own too, e.g. for
#   "RESULTS_TAG=proj llama-3.1-8b 4 64 base,bdfused,nfs --lora-target-modules qkv_proj,o_proj,gate_up_proj,down_proj"
GRAPH_CONFIG='"pass_config":{"fuse_allreduce_rms":false}'${CAPTURE_SIZE:+,\"max_cudagraph_capture_size\":$CAPTURE_SIZE}
GRAPH_ARGS="--compilation-config '{$GRAPH_CONFIG}'${QUANTIZATION:+ --quantization $QUANTIZATION}"
SHAPE=${SHAPE:-llama-3.1-8b}
line_dir() { echo "$1" | tr -d ' -' | tr ',' '_'; }  # a benchmark argument line as a folder name
# vLLM's torch.compile cache and the Triton caches (Inductor's kernels inside it, the plugin's in ~/.triton/cache)
# of the servers started on this host. vLLM keys the compile cache by configuration, versions and model code, and
# documents copying it between machines of the same versions: on a later host it spares each server start the
# compile of its configuration (30-50 s of an 8B server's start, plus 13 s of the plugin's kernels). A call
# brings back files of up to 16 MiB, eight at most, so the caches come back as 15 MiB parts compile-cache-NN
# (each small enough to ride along with a 32 MiB bundle part's copy), or not at all when the compressed caches
# are over COMPILE_CACHE_MAX_MIB (75: five parts beside results.tgz and the FlashInfer cache, seven files; the
# caches of four TP=2 FP8 servers came to 63 MiB).
COMPILE_CACHE_DIRS=(.cache/vllm/torch_compile_cache .triton/cache)
bring_back_compile_caches() {
  local present=() dir size_mib limit_mib=${COMPILE_CACHE_MAX_MIB:-75}
  for dir in "${COMPILE_CACHE_DIRS[@]}"; do [ -d "$HOST_ROOT/$dir" ] && present+=("$dir"); done
  [ ${#present[@]} -gt 0 ] || return 0
  # Each watch call brings them back again (a call's $OUT starts empty); compress them again only when a server
  # has written to them since the last call's archive.
  if [ ! -e $HOST_ROOT/compile-cache.tgz ] || [ -n "$(cd $HOST_ROOT && find "${present[@]}" -newer compile-cache.tgz -print -quit)" ]; then
    tar czf $HOST_ROOT/compile-cache.tgz -C $HOST_ROOT "${present[@]}" || { rm -f $HOST_ROOT/compile-cache.tgz; return 0; }
  fi
  size_mib=$(( ($(stat -c %s $HOST_ROOT/compile-cache.tgz) + 1048575) / 1048576 ))
  if (( size_mib > limit_mib )); then
    echo "compile caches: $size_mib MiB compressed, over $limit_mib MiB: not brought back"
    return 0
  fi
  split -b 15M -d -a 2 $HOST_ROOT/compile-cache.tgz "$OUT/compile-cache-"
  echo "compile caches: $size_mib MiB compressed, in $(ls "$OUT"/compile-cache-?? | wc -l) part(s) compile-cache-NN"
}
# restore_flashinfer_cache SITE DIR: a FlashInfer JIT cache brought back by an earlier host's `watch` (copied to
# .gpu/ and carried to DIR like a bundle part) spares a fresh host's first server FlashInfer's compiles (~90 s of
# sampler on 0.26; sampler and the all-reduce kernels, minutes, on 0.33). Ninja rebuilds an object when a source is
# newer than the object's build-log entry, and the install has just written FlashInfer's (and tvm_ffi's) sources
# under SITE with today's mtimes: it rebuilt everything when the cache was simply unpacked. So the freshly
# installed sources are dated back first (checked with ninja 1.11). The cache's build files name the sources by
# absolute path, so it serves only an install at the same SITE as the host that built it.
restore_flashinfer_cache() {
  local site=$1 caches=("$2"/flashinfer-cache*.tgz) cache
  [ -e "${caches[0]}" ] || return 0
  find "$site/flashinfer" "$site/tvm_ffi" -exec touch -h -d 2020-01-01 {} + 2>/dev/null
  for cache in "${caches[@]}"; do
    tar xzf "$cache" -C $HOST_ROOT && echo "restored $cache (FlashInfer sources under $site dated back)"
  done
}
restore_compile_caches() {
  local parts=($HOST_ROOT/pkg/compile-cache-??)
  [ -e "${parts[0]}" ] || return 0
  if cat "${parts[@]}" | tar xz -C $HOST_ROOT; then
    echo "restored the compile caches of an earlier host (${#parts[@]} part(s)): $(cd $HOST_ROOT && du -sh "${COMPILE_CACHE_DIRS[@]}" 2>/dev/null | tr '\t\n' '  ')"
  else
    echo "the compile-cache parts in $HOST_ROOT/pkg did not unpack (one missing?): servers compile as on a fresh host"
  fi
}
case $STEP in
install)
  # A host taken back between the part calls comes back bare, so later parts land without the earlier ones: stop
  # here with what is there rather than let `queue` start sweeps that each fail on a missing vLLM.
  if ! { bash .gpu/install_bundle.sh $HOST_ROOT/pkg && python3 -m pip install -q --no-index --no-deps .whl/*.whl; }; then
    echo "install failed; $HOST_ROOT/pkg holds: $(ls $HOST_ROOT/pkg 2>/dev/null | tr '\n' ' ')"
    echo "it needs every part p00..pNN, bundle.md5 and the FlashInfer wheel there;"
    echo "this call must carry .gpu/install_bundle.sh and .whl"
    exit 1
  fi
  restore_flashinfer_cache "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" $HOST_ROOT/pkg
  restore_compile_caches
  # Wheels a run needs beyond the bundle (Ray, tblib) travel as parts w00..wNN of a tar holding the wheels and a
  # requirements.txt naming what to install; pip takes the rest of their needs from the host (README.md).
  if [ -e $HOST_ROOT/pkg/w00 ]; then
    mkdir -p $HOST_ROOT/wheels && cat $HOST_ROOT/pkg/w?? | tar x -C $HOST_ROOT/wheels \
      && python3 -m pip install -q --no-index --find-links $HOST_ROOT/wheels -r $HOST_ROOT/wheels/requirements.txt \
      && echo "installed from wheels: $(tr '\n' ' ' < $HOST_ROOT/wheels/requirements.txt)" || exit 1
  fi
  python3 -c "import vllm, vllm_bdlora, peft; print('vllm', vllm.__version__, 'peft', peft.__version__)"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
install-release)
  # install-release VERSION: the bundle of `python -m bench.hosts.bundle pack` (parts pNN and bundle.md5 copied
  # to /root/pkg/vllm-VERSION, one call per part) unpacked into /opt/vllm-VERSION, with this checkout's wheel
  # (.whl) and an env.sh that puts the prefix ahead of the image: its own torch, Triton, NCCL and vLLM; the
  # image's other CUDA libraries (bench/hosts/releases/vllm-VERSION.json says which and why).
  VERSION=${2:?release, e.g. 0.33.0}; parts=$HOST_ROOT/pkg/vllm-$VERSION; prefix=$PREFIX_ROOT/vllm-$VERSION
  [ -e "$parts/bundle.md5" ] || { echo "no $parts/bundle.md5; $parts holds: $(ls "$parts" 2>/dev/null | tr '\n' ' ')"; exit 1; }
  want=$(cut -d' ' -f1 "$parts/bundle.md5")
  got=$(cat "$parts"/p?? | md5sum | cut -d' ' -f1)
  [ "$want" = "$got" ] || { echo "bundle md5 $got, want $want: a part is missing or cut ($(ls "$parts" | tr '\n' ' '))"; exit 1; }
  rm -rf "$prefix" && mkdir -p "$prefix"
  cat "$parts"/p?? | xz -dc -T0 | tar x -C "$prefix" || { echo "unpacking the bundle failed"; exit 1; }
  # The release's own tests (`bench.hosts.bundle tests`), for bench/hosts/vllm_lora_suite.py
  if [ -e "$parts/tests.tar.xz" ]; then tar xJf "$parts/tests.tar.xz" -C $HOST_ROOT && echo "vLLM's tests in $HOST_ROOT/vllm-$VERSION"; fi
  restore_flashinfer_cache "$prefix" "$parts"
  rm -rf "/tmp/plugin-$VERSION"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/plugin-$VERSION .whl/*.whl \
    && cp -a /tmp/plugin-$VERSION/. "$prefix/" || { echo "installing .whl into $prefix failed"; exit 1; }
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # the prefix's copy of a CUDA library where one travelled (NCCL), else the image's
  libs=""
  for lib in "$site"/nvidia/*/lib "$prefix"/nvidia/*/lib; do
    name=$(basename "$(dirname "$lib")")
    [[ $lib == "$site"/* && -d $prefix/nvidia/$name/lib ]] || libs+="$lib:"
  done
  cat > "$prefix/env.sh" <<ENV
export PYTHONPATH=$prefix\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$prefix/bin:\$PATH
# CUDA libraries: those that travelled (the prefix's nvidia/, also on torch's RPATH), the image's others
export LD_LIBRARY_PATH=${libs}\${LD_LIBRARY_PATH:-}
# the image's cuDNN is a minor release older than torch's pin; it exports every symbol torch imports
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
ENV
  # shellcheck disable=SC1091
  . "$prefix/env.sh"
  python3 -c "import torch, triton, vllm, vllm_bdlora; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version(), \
'gpus', torch.cuda.device_count())" || exit 1 ;;
kernels)
  mkdir -p "$OUT/kernels"
  python3 -m pytest tests/test_kernels_dora_compose.py tests/test_kernels_fused_lora.py -q -p no:cacheprovider 2>&1 \
    | tail -15 | tee "$OUT/kernels/pytest.txt"
  python3 -m bench.kernels.launch_overhead --out "$OUT/kernels" 2>&1 | cut -c1-400 | tail -6
  python3 -m bench.kernels.lora_breakdown --out "$OUT/kernels" 2>&1 | cut -c1-300 | tail -3
  python3 -m bench.kernels.fused_lora --out "$OUT/kernels" 2>&1 | cut -c1-300 | tail -60 ;;  # baseline needs vLLM
tune)  # launch configurations of the fused kernels around the defaults (compiles many variants: minutes)
  python3 -m bench.kernels.fused_lora --out "$OUT/kernels-tune" --tune --adapters 1 --tokens 1,16,64,1024,4096,8192 \
    2>&1 | cut -c1-300 | tail -40 ;;
ab)  # old code beside this checkout through the layer op, the same benchmark code timing both sides
  # ab OLD.tgz "old1 new1" "--tp 1 --tokens 1024,4096" ...: OLD.tgz a `git archive` of the old vllm_bdlora; every
  # side runs every argument line -> /root/ab/SIDE/`line_dir LINE`, then all of
  # /root/ab as $OUT/ab.tgz: a call's $OUT starts empty and comes back only a few folders deep, so results that
  # must outlive the call (old1 one call, new1 the next) live under /root. Tables: python -m bench.kernels.ab_table
  OLD=${2:?old vllm_bdlora tgz}; SIDES=${3:?sides}; shift 3
  if [ ! -d $HOST_ROOT/old/vllm_bdlora ]; then mkdir -p $HOST_ROOT/old && tar xzf "$OLD" -C $HOST_ROOT/old && cp -r bench $HOST_ROOT/old/; fi
  for side in $SIDES; do
    tree=$PWD; [[ $side == old* ]] && tree=$HOST_ROOT/old
    for args in "$@"; do
      echo "== $(date +%T) $side $args"
      (cd "$tree" && python3 -m bench.kernels.fused_lora $args --paths layer_op \
        --out "$HOST_ROOT/ab/$side/$(line_dir "$args")" 2>&1 | cut -c1-200 | tail -2)
    done
  done
  mkdir -p "$OUT" && tar czf "$OUT/ab.tgz" -C $HOST_ROOT ab ;;
switch)  # switch VAR FIRST-LAST "ARGS" ...: every ARGS line of bench.kernels.decode_lora with VAR=0 and VAR=1, round r
  # running 0 then 1 (odd r) or 1 then 0 (even r) so drift hits both -> /root/switch/V-rR/LINE; all of /root/switch
  # (earlier calls' rounds too) as $OUT/switch.tgz. Kernel tests and timings need only torch + Triton: no bundle.
  VAR=${2:?environment variable the change reads}; ROUNDS=${3:?rounds, e.g. 1-4}; shift 3
  for r in $(seq "${ROUNDS%-*}" "${ROUNDS#*-}"); do
    if (( r % 2 )); then order="0 1"; else order="1 0"; fi
    for v in $order; do
      for args in "$@"; do
        echo "== $(date +%T) round $r $VAR=$v $args"
        env "$VAR=$v" PYTHONPATH="$PWD" python3 -m bench.kernels.decode_lora $args \
          --out "$HOST_ROOT/switch/$v-r$r/$(line_dir "$args")" 2>&1 | tail -1
      done
    done
  done
  mkdir -p "$OUT" && tar czf "$OUT/switch.tgz" -C $HOST_ROOT switch ;;
rounds)  # rounds OLD.tgz FIRST-LAST "MODULE ARGS" ...: every line (a bench module, e.g. bench.kernels.decode_lora,
  # and its arguments) with the old tree and with this checkout, round r old then new (odd r) or new then old (even
  # r), so drift hits both -> /root/rounds/SIDE-rR/LINE (SIDE old or new); all of /root/rounds as $OUT/rounds.tgz.
  # Each tree runs its own benchmark code. Kernel timings need only torch + Triton: no bundle.
  OLD=${2:?old tree tgz}; ROUNDS=${3:?rounds, e.g. 1-2}; shift 3; lines=("$@")
  if [ ! -d $HOST_ROOT/old/vllm_bdlora ]; then mkdir -p $HOST_ROOT/old && tar xzf "$OLD" -C $HOST_ROOT/old; fi
  for r in $(seq "${ROUNDS%-*}" "${ROUNDS#*-}"); do
    if (( r % 2 )); then order="old new"; else order="new old"; fi
    for side in $order; do
      tree=$PWD; [ "$side" = old ] && tree=$HOST_ROOT/old
      for line in "${lines[@]}"; do
        read -r module args <<< "$line"
        echo "== $(date +%T) round $r $side $line"
        # shellcheck disable=SC2086  # args: the line's own words
        (cd "$tree" && PYTHONPATH="$tree" python3 -m "$module" $args --out "$HOST_ROOT/rounds/$side-r$r/$(line_dir "${module##*.} $args")" \
          2>&1 | tail -1 | cut -c1-300)
      done
    done
  done
  mkdir -p "$OUT" && tar czf "$OUT/rounds.tgz" -C $HOST_ROOT rounds ;;
search-rounds)
  ROUNDS=${2:?rounds, e.g. 1-2}; shift 2; searches=(); timings=(); after_separator=0
  for line in "$@"; do
    if [ "$line" = -- ]; then after_separator=1
    elif (( after_separator )); then timings+=("$line")
    else searches+=("$line"); fi
  done
  if (( ! ${#searches[@]} || ! ${#timings[@]} )); then
    echo "search-rounds FIRST-LAST \"SEARCH\" ... -- \"TIMING\" ...: give search lines, then --, then timing lines"
    exit 2
  fi
  work=$HOST_ROOT/search-rounds; rm -rf "$work"; mkdir -p "$work/searches" "$work/tables"
  tar czf "$work/before.tgz" vllm_bdlora bench  # the tree before the searches write its table: the old side
  for line in "${searches[@]}"; do
    read -r module args <<< "$line"
    name=$(line_dir "${module##*.} $args")
    echo "== $(date +%T) search $line"
    # shellcheck disable=SC2086  # args: the line's own words
    python3 -m "$module" $args --out "$work/searches/$name" > "$work/searches/$name.log" 2>&1
    echo "== $(date +%T) exit $?"; grep -v "^{" "$work/searches/$name.log" | tail -40  # the writer's lines
  done
  cp vllm_bdlora/kernels/configs/*.json "$work/tables/"
  HOST_ROOT=$work OUT=$work bash "$0" rounds "$work/before.tgz" "$ROUNDS" "${timings[@]}"
  mkdir -p "$OUT" && tar czf "$OUT/search-rounds.tgz" --exclude=before.tgz --exclude=old --exclude=rounds.tgz \
    -C "$HOST_ROOT" search-rounds ;;
sweep)
  TP=${2:-4}; RANKS=${3:-64}; MODES=${4:-base,bdlora,slora,nfs,bddora}; MINUTES=${5:-6}
  RESULTS=tp$TP-${SHAPE##*-}${QUANTIZATION:+-$QUANTIZATION}${CAPTURE_SIZE:+-graphs$CAPTURE_SIZE}${RESULTS_TAG:+-$RESULTS_TAG}${VLLM_RELEASE:+-vllm$VLLM_RELEASE}
  # Cache sizes before and after: the first TP>1 server on a fresh host stalls ~90 s after graph capture,
  # whatever the mode, while /root/.cache/flashinfer grows from 12 KB to 8 MB (FlashInfer JIT; README.md).
  du -sh $HOST_ROOT/.cache/* $HOST_ROOT/.triton 2>/dev/null | tr '\n' ' '; echo "<- caches before"
  ${PYTHON:-python3} -m bench.sweep --model-shape "$SHAPE" --tp "$TP" --workdir $HOST_ROOT/bench --out "$HOST_ROOT/results/$RESULTS" \
    --modes "$MODES" --ranks "$RANKS" --io 1024/128 --concurrency 1,16,64 --adapters 1 --max-model-len 2048 \
    --start-timeout 420 --stop-after-minutes "$MINUTES" --extra-server-args "$GRAPH_ARGS" "${@:6}" 2>&1 \
    | grep -v "^\s*$" | tail -40
  du -sh $HOST_ROOT/.cache/* $HOST_ROOT/.triton 2>/dev/null | tr '\n' ' '; echo "<- caches after"
  mkdir -p "$OUT" && tar czf "$OUT/$RESULTS.tgz" --exclude='*.pt.trace.json*' -C $HOST_ROOT/results "$RESULTS" ;;
queue)
  shift
  # Sweep lines serve vLLM; a queue of `run` lines alone (kernel benchmarks and tests, which need only torch and
  # Triton) runs on a bare host, no bundle installed.
  sweeps=0; for line in "$@"; do [[ $line == "run "* ]] || sweeps=1; done
  if (( sweeps )) && ! python3 -c "import vllm, vllm_bdlora" 2> /dev/null; then
    echo "no vLLM or vllm_bdlora on this host: copy the bundle parts and run install first (README.md)"; exit 3
  fi
  printf '%s\n' "$@" > $HOST_ROOT/queue.plan
  # A line may start with NAME=VALUE settings for its sweep alone (CAPTURE_SIZE=1024 llama-3.1-8b 2 64 ...). A sweep
  # line is split into words as the shell splits a command line (eval), so a quoted sweep argument stays one word.
  setsid nohup bash -c 'while read -r line; do
      echo "== $(date +%T) $line"
      if [[ $line == "run "* ]]; then bash -c "${line#run }" < /dev/null; echo "== $(date +%T) exit $?"; continue; fi
      eval "set -- $line"; settings=()
      while [[ $1 == *=* ]]; do settings+=("$1"); shift; done
      env "${settings[@]}" SHAPE=$1 OUT=$HOST_ROOT/queue-out bash bench/hosts/gpu_host.sh sweep "$2" "$3" "$4" 999 "${@:5}" < /dev/null
    done < $HOST_ROOT/queue.plan; echo "== $(date +%T) queue done"' > $HOST_ROOT/queue.log 2>&1 < /dev/null &
  sleep 2; cat $HOST_ROOT/queue.log ;;
watch)
  # A host released between calls (30 s idle) comes back bare: say so at once rather than sleep on it (sleeping on
  # a bare host once cost 9 minutes of device time).
  if [ ! -e $HOST_ROOT/queue.log ]; then echo "no $HOST_ROOT/queue.log: this is a fresh host; bring-up and queue again"; exit 3; fi
  # Up to SECONDS, but back as soon as the queue has finished: sleeping past its end costs device time for nothing.
  deadline=$(( $(date +%s) + ${2:-500} ))
  while (( $(date +%s) < deadline )) && ! grep -q "^== .* queue done" $HOST_ROOT/queue.log; do sleep 5; done
  date +%T; grep "^== " $HOST_ROOT/queue.log
  # A line that fails fast leaves no results folder; its reason is only in the queue's log.
  grep -iE "error|traceback|failed|no such|usage:" $HOST_ROOT/queue.log | grep -v "^== " | tail -8 | cut -c1-300
  for d in $HOST_ROOT/results/*/; do echo "-- $d"; tail -n +2 "$d/points.csv" 2>/dev/null | cut -d, -f1-12; \
    ls -t "$d"logs/server_*.log 2>/dev/null | head -1 | xargs -r tail -n 2 | cut -c1-200; done
  mkdir -p "$OUT" && tar czf "$OUT/results.tgz" --exclude='*.pt.trace.json*' -C $HOST_ROOT/results .
  if [ -d $HOST_ROOT/.cache/flashinfer ]; then tar czf "$OUT/flashinfer-cache.tgz" -C $HOST_ROOT .cache/flashinfer; fi
  bring_back_compile_caches ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac

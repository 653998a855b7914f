#!/usr/bin/env bash
# One entry point for a newcomer:
#   bash run.sh setup                      create .venv and install everything (idempotent)
#   bash run.sh test [pytest args]         run the whole test suite (no args: also tests/sglang_engine)
#   bash run.sh setup-sglang               create .venv-sglang, the SGLang engine's CPU test venv
#   bash run.sh test-sglang [pytest args]  run tests/sglang_engine in .venv-sglang
#   bash run.sh train RECIPE.toml [--flag value ...]   (USE_CURRENT_ENV=1: the python on PATH, no .venv)
#   bash run.sh demo                       train a tiny base that draws, then RL-teach it colours (CPU, minutes)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

gpu_count() {
  if have_gpu; then nvidia-smi -L | wc -l; else echo 0; fi
}

# A venv is current when its stamp (what was installed, as a hash) equals the wanted one.
venv_current() { [[ -x $1/bin/python && -f $1/.setup-stamp && "$(cat "$1/.setup-stamp")" == "$2" ]]; }

# A fresh venv at $1 with an up-to-date pip.
new_venv() { python3 -m venv "$1" && "$1/bin/python" -m pip install -q --upgrade pip >&2; }

setup() {
  # The stamp records what was installed; a changed setup.cfg reinstalls.
  local extras=${EXTRAS:-test,ocr}
  local want
  want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-$extras"
  venv_current "$VENV" "$want" && return 0
  echo "[setup] creating $VENV" >&2
  new_venv "$VENV"
  # torch first: a later package that merely asks for "torch" would otherwise
  # pull a multi-GB CUDA build onto a machine that has no GPU.
  if [[ -n ${TORCH_SPEC:-} ]]; then
    "$PY" -m pip install -q "$TORCH_SPEC" >&2
  elif have_gpu; then
    "$PY" -m pip install -q "torch>=2.11" >&2
  else
    "$PY" -m pip install -q "torch==2.13.0" >&2 \
      || "$PY" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu >&2
  fi
  "$PY" -m pip install -q -e ".[${extras}]" >&2
  echo "$want" > "$VENV/.setup-stamp"
  echo "[setup] done: $("$PY" -c 'import torch, diffusers, transformers, peft; print("torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__, "peft", peft.__version__)')" >&2
}

SGL_VENV=${SGL_VENV:-$ROOT/.venv-sglang}
SGL_PY=$SGL_VENV/bin/python

setup_sglang() {
  # The CPU test venv of the SGLang engine (tests/sglang_engine), next to .venv; idempotent like
  # setup(). A GPU user installs the real thing instead: pip install .[sglang]
  local want t0=$SECONDS
  want="$(cat setup.cfg pyproject.toml requirements/sglang-cpu.txt | sha256sum | cut -c1-16)"
  venv_current "$SGL_VENV" "$want" && return 0
  echo "[setup-sglang] creating $SGL_VENV" >&2
  # About 7 GB once installed (torch 2.14.1 comes with its CUDA libraries), and as much again
  # in downloads while pip runs; nothing is cached, so the downloads go when it ends.
  local free_gb
  free_gb=$(df -Pk "$(dirname "$SGL_VENV")" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gb" -lt 12 ]; then
    echo "[setup-sglang] warning: ${free_gb} GB free on the disk of $SGL_VENV; creating it needs about 12 GB." >&2
    echo "[setup-sglang] free some space, or point SGL_VENV at a larger disk, if pip fails with 'No space left on device'." >&2
  fi
  new_venv "$SGL_VENV"
  # torch first, at sglang 0.5.23's own pin. The project's CPU torch 2.13 cannot run it:
  # sglang imports torchvision unconditionally, and the torchvision build for torch 2.13
  # on the package index is a CUDA one that fails to import next to a CPU torch.
  "$SGL_PY" -m pip install -q --no-cache-dir "torch==2.14.1" "torchvision==0.29.1" >&2
  "$SGL_PY" -m pip install -q --no-cache-dir -e ".[test]" >&2
  # sglang and what its diffusion runtime imports, --no-deps: see the file's header
  "$SGL_PY" -m pip install -q --no-cache-dir --no-deps -r requirements/sglang-cpu.txt >&2
  echo "$want" > "$SGL_VENV/.setup-stamp"
  echo "[setup-sglang] done in $((SECONDS - t0)) s, $(du -sh "$SGL_VENV" | cut -f1): $("$SGL_PY" -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)' 2>/dev/null)" >&2
}

nproc_default() {
  local n; n=$(gpu_count)
  if [[ $n -gt 0 ]]; then echo "$n"; else echo 2; fi
}

usage() { sed -n '2,8p' "$ROOT/run.sh" | sed 's/^# \{0,1\}//'; }

# The world the ranks will form: NPROC per node times torchrun's --nnodes when TORCHRUN_ARGS fixes
# it; empty when it is elastic (a range), so preflight checks the recipe's own world instead.
launch_world() {
  local nodes=1
  if [[ " ${TORCHRUN_ARGS:-} " =~ [[:space:]]--nnodes[=[:space:]]+([^[:space:]]+) ]]; then
    nodes=${BASH_REMATCH[1]}
    [[ $nodes =~ ^[0-9]+$ ]] || return 0
  fi
  echo $((NPROC * nodes))
}

# Config and preflight, once, in one process, before torchrun starts: a bad launch then prints its
# list of problems and exits 2, instead of a traceback per rank and torchrun's exit 1. Preflight
# loads no weights, so a good launch pays one short process start. --help / --version /
# --preflight-only are answered by this one process too, and nothing is launched.
launch_check() {  # python recipe [trainer flags]
  local py=$1 recipe=$2 world a status=0
  shift 2
  world=$(launch_world)
  for a in "$@"; do
    if [[ $a == -h || $a == --help || $a == --version || $a == --preflight-only ]]; then
      env ${world:+WORLD_SIZE=$world} "$py" -m trainer.train --config "$recipe" "$@" || status=$?
      exit "$status"
    fi
  done
  # FLOWGRPO_LAUNCH_CHECK: this check also creates the compile cache, private, so that one someone
  # else planted stops the launch with exit 2 (trainer/train.py)
  env ${world:+WORLD_SIZE=$world} FLOWGRPO_LAUNCH_CHECK=1 "$py" -m trainer.train --config "$recipe" "$@" \
    --preflight-only --quiet || exit $?
}

if [[ $# -eq 0 ]]; then
  usage >&2
  exit 2
fi
cmd=$1
shift
case $cmd in
  setup)
    setup ;;
  setup-sglang)
    setup_sglang ;;
  test)
    setup
    if [[ $# -gt 0 || ${SGLANG_TESTS:-1} == 0 ]]; then
      exec "$PY" -m pytest "$@"
    fi
    # the whole suite: the main venv's, then the SGLang engine's in its own venv
    "$PY" -m pytest
    setup_sglang
    exec "$SGL_PY" -m pytest tests/sglang_engine ;;
  test-sglang)
    setup_sglang
    exec "$SGL_PY" -m pytest tests/sglang_engine "$@" ;;
  train)
    [[ $# -ge 1 ]] || { echo "usage: bash run.sh train RECIPE.toml [--flag value ...]" >&2; exit 2; }
    recipe=$1; shift
    if [[ $recipe == -* ]]; then
      echo "usage: bash run.sh train RECIPE.toml [--flag value ...]: the recipe comes first (bash run.sh train RECIPE.toml --help lists every flag)" >&2
      exit 2
    fi
    NPROC=${NPROC:-$(nproc_default)}
    if [[ ${USE_CURRENT_ENV:-0} == 1 ]]; then
      # a cluster image or a checkout shared by several nodes: never pip-install at launch
      py=${PYTHON:-python3}
      "$py" -c 'import torch, diffusers, transformers, peft' 2>/dev/null || {
        echo "USE_CURRENT_ENV=1: $py cannot import torch, diffusers, transformers and peft; install the project there (pip install -e .) or unset USE_CURRENT_ENV to use .venv" >&2; exit 2; }
      launch_check "$py" "$recipe" "$@"
      exec "$py" -m torch.distributed.run --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} -m trainer.train --config "$recipe" "$@"
    fi
    setup
    launch_check "$PY" "$recipe" "$@"
    exec "$VENV/bin/torchrun" --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} -m trainer.train --config "$recipe" "$@" ;;
  demo)
    setup
    exec bash "$ROOT/tools/demo.sh" "$@" ;;
  help|-h|--help)
    usage ;;
  *)
    { echo "unknown command '$cmd'; use one of: setup, test, setup-sglang, test-sglang, train, demo"; usage; } >&2
    exit 2 ;;
esac

#!/usr/bin/env bash
# SGLang's CUDA path on a GPU machine with torch 2.11 and no package index.
#
#   bash tests/gpu/sglang_cuda.sh fetch [DIR]     with a package index: the wheels, in two parts
#                                                 (DIR/part1, DIR/part2; DIR default .sgl-carry)
#   bash tests/gpu/sglang_cuda.sh install [DIR]   on the GPU machine: the carried wheels it lacks,
#                                                 into $SGL_SITE (default /tmp/sgl-site)
#   bash tests/gpu/sglang_cuda.sh check           on the GPU machine: sgl_kernel's two CUDA ops
#                                                 against PyTorch, and the engine's contract
#   bash tests/gpu/sglang_cuda.sh test [DTYPE..]  on the GPU machine: tests/sglang_engine on CUDA
#                                                 (fp32 then bf16 by default; torch_sdpa attention)
#
# install and check expect the project's own dependencies importable there already (diffusers
# and the rest, e.g. from carried wheels on PYTHONPATH). Then: export PYTHONPATH=$SGL_SITE:
# $PYTHONPATH and build the engine with SGLangEngine(..., attention_backend="torch_sdpa").
#
# Status: fetch and the carried set's install were checked on an x86-64 CPU machine (two parts
# of 38 and 39 MB, 125 packages, no duplicates); install and check have not run on a GPU yet.
#
# Why these pieces:
# - sglang 0.5.23 is the only release with every extension point the engine uses
#   (post_training.rollout_hooks, post_training.flow_rollout_controller, platforms.plugins):
#   0.5.17, 0.5.18 and 0.5.20 have none of the three, 0.5.21 and 0.5.22 one. It pins
#   torch==2.14.1 and sglang-kernel==0.4.10, a binary linked against torch 2.14's C++ symbols.
# - On CUDA its diffusion runtime takes two ops from sgl_kernel for the Qwen-Image DiT (rmsnorm,
#   fused_add_rmsnorm in runtime/layers/layernorm.py). sglang-kernel 0.4.5 (the pin of sglang
#   0.5.16 / 0.5.17, which pin torch==2.11.0) has both and is built for torch 2.11.
# - Of its 1.2 GB, 1.1 GB is FlashAttention 3 (flash_ops.abi3.so); with attention_backend
#   "torch_sdpa" nothing loads it. The Blackwell build (sm100/) and two attention libraries
#   for other models (infllm, flashmla) are left out too: 15 MB compressed remain.
#   sgl_kernel/__init__ loads only sm90/common_ops and spatial_ops; FA3, FlashMLA and InfLLM
#   load at their first call (sgl_kernel.flash_attn, flash_mla, infllm_v2._loader; sglang's
#   kernels/ops/attention/flash_attention_v3.py imports FA3 inside a function).
# - Not known until it runs on a GPU: which backends sglang.kernels.ops.diffusion picks for the
#   Qwen-Image DiT's fused ops on sm90. Most are Triton; some are JIT (apache-tvm-ffi, built at
#   the first call, which may need nvcc) or CuTe-DSL (nvidia-cutlass-dsl, not carried).
# - opencv is imported only by video and 3D stages; imageio-ffmpeg (a 68 MB ffmpeg binary) is
#   imported at start-up and called only to write videos, so a small stand-in takes its place.
#   tests/sglang_engine passes on CPU with cv2 unimportable and that stand-in.
# - pip installs with --no-deps: sglang's own metadata would pull torch 2.14.1.
set -euo pipefail
cd "$(dirname "$0")/../.."

SGLANG_VERSION=0.5.23
KERNEL_VERSION=0.4.5
PY=${PY:-python3}
SGL_SITE=${SGL_SITE:-/tmp/sgl-site}
#: the wheels beyond requirements/sglang-cpu.txt that sglang imports and a bare torch image lacks
EXTRA="pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5
httpx2==2.16.2 httpcore2==2.16.2 lazy-importer==0.1.0 truststore==0.10.5"
#: requirements/sglang-cpu.txt entries not carried: the machine's own triton; opencv and imageio-ffmpeg (above)
SKIP='^(triton|opencv-python-headless|imageio-ffmpeg)=='

fetch() {
  local dir=${1:-.sgl-carry} tmp
  tmp=$(mktemp -d)
  mkdir -p "$dir/part1" "$dir/part2"
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
  for n in 17 24 26 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$dir/part1" "sglang==$SGLANG_VERSION"
  grep -v '^#' requirements/sglang-cpu.txt | grep -v '^$' | grep -v '^sglang==' | grep -Ev "$SKIP" > "$tmp/req.txt"
  tr ' ' '\n' <<<"$EXTRA" | grep -v '^$' >> "$tmp/req.txt"
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$dir/part2" -r "$tmp/req.txt"
  # sglang-kernel, without what the Qwen-Image DiT never loads
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "sglang-kernel==$KERNEL_VERSION"
  (cd "$tmp" && unzip -q sglang_kernel-*.whl 'sgl_kernel/*' -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' \
     'sgl_kernel/infllm_ops*.so' 'sgl_kernel/flashmla_ops.abi3.so')
  tar -C "$tmp" -czf "$dir/part2/sgl_kernel-$KERNEL_VERSION-sm90.tar.gz" sgl_kernel
  rm -rf "$tmp"
  echo "[fetch] $(du -sh "$dir/part1" | cut -f1) in $dir/part1, $(du -sh "$dir/part2" | cut -f1) in $dir/part2" \
       "(one carry each: a call carries at most 64 MiB with the working tree)"
}

install() {
  local dir=${1:-.sgl-carry} whl name
  mkdir -p "$SGL_SITE"
  local todo=()
  for whl in "$dir"/part*/*.whl; do
    [ -e "$whl" ] || continue
    name=$(basename "$whl" | cut -d- -f1)
    # a distribution the machine has already stays the machine's
    if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
      continue
    fi
    todo+=("$whl")
  done
  if [ ${#todo[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SGL_SITE" "${todo[@]}"
  fi
  for tgz in "$dir"/part*/sgl_kernel-*.tar.gz; do
    [ -e "$tgz" ] && tar -C "$SGL_SITE" -xzf "$tgz"
  done
  if [ ! -d "$SGL_SITE/imageio_ffmpeg" ] && ! "$PY" -c "import imageio_ffmpeg" 2>/dev/null; then
    mkdir -p "$SGL_SITE/imageio_ffmpeg"
    cat > "$SGL_SITE/imageio_ffmpeg/__init__.py" <<'EOF'
"""Stand-in for imageio-ffmpeg: SGLang imports it at start-up and calls it only to write videos."""
__version__ = "0.0.0+stand-in"


def get_ffmpeg_exe():
    raise RuntimeError("imageio-ffmpeg is not installed here: video output is unavailable")
EOF
  fi
  # SGLang finds the trainer's plugin only through an installed distribution's entry points
  # (importlib.metadata): a dist-info with setup.cfg's entry point, beside the wheels
  "$PY" - "$SGL_SITE" <<'EOF'
import configparser, pathlib, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
group = "sglang.multimodal_gen.plugins"
entry = cfg["options.entry_points"][group].strip()
dist = pathlib.Path(sys.argv[1]) / "flowgrpo_trainer-0.0.0.dist-info"
dist.mkdir(parents=True, exist_ok=True)
(dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowgrpo-trainer\nVersion: 0.0.0\n")
(dist / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")
print(f"[install] entry point {group}: {entry}")
EOF
  echo "[install] ${#todo[@]} wheels into $SGL_SITE"
}

suite() {
  # tests/sglang_engine on this GPU, once per dtype given (default: fp32 then bf16), with torch_sdpa
  local dtypes=("$@")
  [ $# -gt 0 ] || dtypes=(fp32 bf16)
  local rc=0 dt
  for dt in "${dtypes[@]}"; do
    echo "== tests/sglang_engine on cuda, $dt"
    SGLANG_TEST_DEVICE=cuda SGLANG_TEST_DTYPE=$dt SGLANG_TEST_ATTENTION_BACKEND=${SGLANG_TEST_ATTENTION_BACKEND:-torch_sdpa} \
      PYTHONPATH="$SGL_SITE:$PWD:${PYTHONPATH:-}" "$PY" -m pytest -q -rs -s -p no:cacheprovider tests/sglang_engine \
      -o 'norecursedirs=.*' > "/tmp/sglang-suite-$dt.log" 2>&1 || rc=1
    grep '^\[diffs\]' "/tmp/sglang-suite-$dt.log" | sort | uniq -c | sort -rn | head -12 || true
    grep -v '^\[diffs\]' "/tmp/sglang-suite-$dt.log" | tail -25
  done
  return $rc
}

check() {
  PYTHONPATH="$SGL_SITE:$PWD:${PYTHONPATH:-}" "$PY" - <<'EOF'
import torch

import sgl_kernel
from sgl_kernel import fused_add_rmsnorm, rmsnorm

print("torch", torch.__version__, "sgl_kernel", sgl_kernel.__version__, torch.cuda.get_device_name())
x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
r = torch.randn_like(x)
w = torch.rand(3072, device="cuda", dtype=torch.bfloat16) + 0.5
eps = 1e-6


def ref(t):
    t = t.float()
    return (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)


print("rmsnorm max abs vs torch:", (rmsnorm(x, w, eps).float() - ref(x).float()).abs().max().item())
xa, ra = x.clone(), r.clone()
fused_add_rmsnorm(xa, ra, w, eps)  # in place: ra = x + r, xa = rmsnorm(x + r)
print("fused_add_rmsnorm max abs vs torch:", (xa.float() - ref(x + r).float()).abs().max().item(),
      "residual exact:", torch.equal(ra, x + r))

from trainer.engine.sglang_engine import check_sglang_contract

check_sglang_contract()
print("engine contract: ok")
EOF
}

case "${1:-}" in
  fetch) shift; fetch "$@" ;;
  install) shift; install "$@" ;;
  check) check ;;
  test) shift; suite "$@" ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# GPU checks of the tiny model on CUDA in bf16 (not part of CI, which has no GPU):
#   1. tools/sample.py: the native engine samples 3 prompts x 4 candidates;
#   2. tests/dist/cuda_smoke.py: update + offload + full / adapter / merged sync;
#   3. the real training loop for 3 rollouts with --fsdp-debug-fingerprint ([logp parity]).
# Usage: bash tests/gpu/smoke.sh OUT_DIR [NPROC]
# Wheels for packages the machine lacks (e.g. diffusers) are taken from .whl/ when present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${1:?usage: smoke.sh OUT_DIR [NPROC]}; NPROC=${2:-1}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! $PY -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
W=$(mktemp -d)
$PY tools/make_tiny_model.py --output "$W/tiny" >/dev/null
$PY - "$W" <<'PY'
import json, sys
from trainer.rewards.color import color_prompts
w = sys.argv[1]
with open(f"{w}/prompts.jsonl", "w") as f:
    for i, p in enumerate(color_prompts(8)):
        f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n")
with open(f"{w}/three.jsonl", "w") as f:
    for i, p in enumerate(color_prompts(3)):
        f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"s{i}"}}) + "\n")
PY
echo "== 1. sample.py on cuda bf16"
$PY tools/sample.py --model-path "$W/tiny" --prompt-data "$W/three.jsonl" --output "$W/samples" \
  --n-samples-per-prompt 4 --device cuda --dtype bf16 \
  --sampling-config '{"height":64,"width":64,"num_inference_steps":8,"eta":0.7,"sde_indices":[1,3,5]}'
echo "pngs: $(find "$W/samples" -name '*.png' | wc -l) sidecars: $(find "$W/samples" -name '*.safetensors' | wc -l)" | tee "$OUT/sample.txt"
echo "== 2. cuda_smoke.py, $NPROC process(es)"
$PY -m torch.distributed.run --nproc-per-node "$NPROC" tests/dist/cuda_smoke.py --out "$OUT/smoke" 2>&1 | tail -20
echo "== 3. the training loop on cuda bf16, $NPROC process(es)"
$PY -m torch.distributed.run --nproc-per-node "$NPROC" -m trainer.train --config configs/tiny_cpu_demo.toml \
  --model-path "$W/tiny" --prompt-data "$W/prompts.jsonl" --eval-prompt-data demo "$W/three.jsonl" \
  --actor-num-gpus-per-node "$NPROC" --rollout-batch-size 4 --n-samples-per-prompt 4 --micro-batch-size 2 \
  --num-rollout 3 --eval-interval 2 --n-samples-per-eval-prompt 2 --reward-scorer-path color --reward-component-weights '{"color": 1.0, "named_color": null}' --fsdp-param-dtype bf16 --fsdp-master-dtype fp32 --weight-sync-wire-dtype bf16 \
  --fsdp-activation-checkpointing --fsdp-debug-fingerprint --offload-train --offload-rollout \
  --artifact-root "$W/run/artifacts" --save "$W/run/ckpt" --tensorboard-dir "$W/run/tb" 2>&1 \
  | grep -E "logp parity|fingerprint|rollout [0-9]|summary|Error|error|Traceback" | tee "$OUT/loop.txt"
$PY - "$W/run/tb" "$OUT/loop_metrics.json" <<'PY'
import json, sys
from trainer.metrics import read_scalars
s = read_scalars(sys.argv[1])
json.dump({k: v for k, v in s.items()}, open(sys.argv[2], "w"), indent=1)
print({k: [round(x, 5) for _, x in v] for k, v in s.items() if k.startswith(("perf/mem", "train/ratio", "debug/", "perf/step", "perf/sync"))})
PY

#!/usr/bin/env bash
# The offline demo: a tiny random-weight Qwen-Image-shaped pipeline learns a prompt-dependent
# colour reward with FlowGRPO on 2 CPU processes (gloo). Run through `bash run.sh demo`.
#
#   bash run.sh demo                      fresh run under runs/demo (EXP_DIR overrides)
#   bash run.sh demo --num-rollout 20     any training flag overrides the recipe
#   bash run.sh demo --resume             continue the last run from its newest checkpoint
#
# Steps: build the tiny model (tools/make_tiny_model.py), build the prompt set with the data
# tools (prepare_data.py -> inspect_data.py), train (configs/tiny_cpu_demo.toml),
# then print where everything is and the reward's first-vs-last figures, and draw the curve.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
export EXP_DIR=${EXP_DIR:-runs/demo}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=${NPROC:-2}

resume=0
args=()
for a in "$@"; do
  if [[ $a == --resume ]]; then resume=1; else args+=("$a"); fi
done

mkdir -p "$EXP_DIR"
if [[ ! -f $EXP_DIR/tiny-qwen-image/model_index.json ]]; then
  echo "[demo] building the tiny model in $EXP_DIR/tiny-qwen-image"
  "$PY" tools/make_tiny_model.py --output "$EXP_DIR/tiny-qwen-image" --seed 0 --vae-output-gain 8 >/dev/null
fi
if [[ ! -f $EXP_DIR/data/demo_train.jsonl ]]; then
  echo "[demo] building the prompt set in $EXP_DIR/data"
  mkdir -p "$EXP_DIR/data"
  # Train on every palette colour once ("a red ball", ...), so each rollout sees the same mix of
  # colours and the mean reward is comparable across rollouts; evaluate on the same colours on
  # another subject ("a red cube", ...): does the policy generalise from the colour word?
  "$PY" - "$EXP_DIR/data" <<'PY'
import sys
from trainer.rewards.color import color_palette, color_prompts
n = len(color_palette())
prompts = color_prompts(2 * n)
open(f"{sys.argv[1]}/train.txt", "w").write("\n".join(prompts[:n]) + "\n")
open(f"{sys.argv[1]}/eval.txt", "w").write("\n".join(prompts[n:]) + "\n")
PY
  "$PY" tools/prepare_data.py --source prompts --input "$EXP_DIR/data/train.txt" --task t2i \
    --output "$EXP_DIR/data/demo_train.jsonl" --id-prefix demo_train
  "$PY" tools/prepare_data.py --source prompts --input "$EXP_DIR/data/eval.txt" --task t2i \
    --output "$EXP_DIR/data/demo_eval.jsonl" --id-prefix demo_eval
  "$PY" tools/inspect_data.py --train "$EXP_DIR/data/demo_train.jsonl" --eval "$EXP_DIR/data/demo_eval.jsonl"
fi

if [[ $resume == 1 ]]; then
  args+=(--load "$EXP_DIR/checkpoints")
else
  rm -rf "$EXP_DIR/artifacts" "$EXP_DIR/checkpoints" "$EXP_DIR/tensorboard"
fi

echo "[demo] training: torchrun --nproc-per-node $NPROC -m trainer.train --config configs/tiny_cpu_demo.toml ${args[*]:-}"
start=$(date +%s)
set +e
"$(dirname "$PY")/torchrun" --nproc-per-node "$NPROC" -m trainer.train --config configs/tiny_cpu_demo.toml \
  "${args[@]}" 2>&1 | tee "$EXP_DIR/train.log" | grep --line-buffered -vE "Warning|warn\(|_register_pre_backward_hook|^\s*$|Loading weights"
status=${PIPESTATUS[0]}
set -e
[[ $status == 0 ]] || { echo "[demo] training failed (exit $status); the full log is $EXP_DIR/train.log" >&2; exit "$status"; }

"$PY" tools/plot_rewards.py --tensorboard-dir "$EXP_DIR/tensorboard" --output "$EXP_DIR/reward_curve.png" >/dev/null
"$PY" - "$EXP_DIR" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
from pathlib import Path
exp, seconds = Path(sys.argv[1]), int(sys.argv[2])
summary = None
for line in (exp / "train.log").read_text().splitlines():
    if line.startswith('{"summary"'):
        summary = json.loads(line)
if summary is None:
    sys.exit("[demo] no summary line in the training log")
print(f"\n[demo] done in {seconds} s")
for comp, s in summary["summary"].items():
    w = min(5, s["rollouts"])
    print(f"[demo] reward/{comp}_mean: first {w} rollouts {s['first_mean']:.4f} -> last {w} rollouts "
          f"{s['last_mean']:.4f} (change {s['last_mean'] - s['first_mean']:+.4f}; within-group std "
          f"{s['group_std_first']:.4f} -> {s['group_std_last']:.4f})")
print(f"[demo] TensorBoard:  tensorboard --logdir {summary['tensorboard_dir']}")
print(f"[demo] images:       {summary['artifact_root']}/t2i/rollout_*/ (eval: {summary['artifact_root']}/eval/t2i/)")
print(f"[demo] checkpoints:  {summary['save']}  (continue with: bash run.sh demo --resume --num-rollout N)")
print(f"[demo] reward curve: {exp / 'reward_curve.png'}")
PY

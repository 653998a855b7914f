#!/usr/bin/env bash
# The offline demo: a tiny Qwen-Image pipeline that draws the shape its prompt names, in a random
# one of six colours, learns with FlowGRPO on 2 CPU processes (gloo) to paint it the colour the
# prompt names (red or green).
# Run through `bash run.sh demo`.
#
#   bash run.sh demo                      fresh run under runs/demo (EXP_DIR overrides)
#   bash run.sh demo --num-rollout 20     any training flag overrides the recipe
#   bash run.sh demo --resume             continue the last run from its newest checkpoint
#   bash run.sh demo --algorithm nft      the same demo trained with DiffusionNFT
#                                         (configs/tiny_cpu_demo_nft.toml, outputs in $EXP_DIR/nft;
#                                         the base model and the prompt files are shared)
#   BASE_SEED=1 bash run.sh demo          another base model (tools/make_demo_base.py --seed; default
#                                         0): how well the demo learns depends on the base (README)
#
# Steps: train the base model once (tools/make_demo_base.py, cached in $EXP_DIR/demo-base),
# build the prompt set with the data tools (prepare_data.py -> inspect_data.py), post-train
# (configs/tiny_cpu_demo.toml), then draw the reward curves, the before/after grid of the
# held-out prompts and the TensorBoard probe slider, and print the figures and where things are.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
export EXP_DIR=${EXP_DIR:-runs/demo}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=${NPROC:-2}

resume=0
algorithm=flowgrpo
args=()
take_algorithm=0
for a in "$@"; do
  if [[ $take_algorithm == 1 ]]; then algorithm=$a; take_algorithm=0
  elif [[ $a == --algorithm ]]; then take_algorithm=1
  elif [[ $a == --algorithm=* ]]; then algorithm=${a#--algorithm=}
  elif [[ $a == --resume ]]; then resume=1
  else args+=("$a"); fi
done
case $algorithm in
  flowgrpo) CONFIG=configs/tiny_cpu_demo.toml; RUN_DIR=$EXP_DIR ;;
  nft) CONFIG=configs/tiny_cpu_demo_nft.toml; RUN_DIR=$EXP_DIR/nft ;;
  *) echo "demo: error: --algorithm must be flowgrpo or nft, got '$algorithm'" >&2; exit 2 ;;
esac

mkdir -p "$EXP_DIR"
t_all=$SECONDS
# One thread (tools/make_demo_base.py --threads says why); a cached base returns at once.
"$PY" tools/make_demo_base.py --output "$EXP_DIR/demo-base" --seed "${BASE_SEED:-0}" --rebuild --threads "${BASE_THREADS:-1}" \
  2> >(grep --line-buffered -E "^\[demo-base\]|rror" >&2)
t_base=$((SECONDS - t_all))
if [[ ! -f $EXP_DIR/data/demo_train.jsonl ]]; then
  echo "[demo] building the prompt set in $EXP_DIR/data"
  mkdir -p "$EXP_DIR/data"
  # Train on each colour on two of the three shapes, evaluate on the pairs left out ("a red
  # circle", "a green square"): the policy must learn the colour word, not a shape-colour pairing.
  "$PY" - "$EXP_DIR/data" <<'PY'
import sys
from tools.make_demo_base import demo_prompts
train, held_out = demo_prompts()
open(f"{sys.argv[1]}/train.txt", "w").write("\n".join(train) + "\n")
open(f"{sys.argv[1]}/eval.txt", "w").write("\n".join(held_out) + "\n")
PY
  "$PY" tools/prepare_data.py --source prompts --input "$EXP_DIR/data/train.txt" --task t2i \
    --output "$EXP_DIR/data/demo_train.jsonl" --id-prefix demo_train
  "$PY" tools/prepare_data.py --source prompts --input "$EXP_DIR/data/eval.txt" --task t2i \
    --output "$EXP_DIR/data/demo_eval.jsonl" --id-prefix demo_eval
  "$PY" tools/inspect_data.py --train "$EXP_DIR/data/demo_train.jsonl" --eval "$EXP_DIR/data/demo_eval.jsonl"
fi

mkdir -p "$RUN_DIR"
if [[ $resume == 1 ]]; then
  args+=(--load "$RUN_DIR/checkpoints")
else
  rm -rf "$RUN_DIR/artifacts" "$RUN_DIR/checkpoints" "$RUN_DIR/tensorboard"
fi

echo "[demo] training: torchrun --nproc-per-node $NPROC -m trainer.train --config $CONFIG ${args[*]:-}"
t_train=$SECONDS
set +e
"$(dirname "$PY")/torchrun" --nproc-per-node "$NPROC" -m trainer.train --config "$CONFIG" \
  "${args[@]}" 2>&1 | tee "$RUN_DIR/train.log" | grep --line-buffered -vE "Warning|warn\(|_register_pre_backward_hook|^\s*$|Loading weights"
status=${PIPESTATUS[0]}
set -e
[[ $status == 0 ]] || { echo "[demo] training failed (exit $status); the full log is $RUN_DIR/train.log" >&2; exit "$status"; }
t_train=$((SECONDS - t_train))

# the trained reward and the share of shapes in the named colour, both on their 0-1 scale
"$PY" tools/plot_rewards.py --tensorboard-dir "$RUN_DIR/tensorboard" --output "$RUN_DIR/reward_curve.png" \
  --series reward/named_color_mean --y-range 0 1 >/dev/null
"$PY" tools/plot_rewards.py --tensorboard-dir "$RUN_DIR/tensorboard" --output "$RUN_DIR/color_match_curve.png" \
  --series reward/color_match_mean --y-range 0 1 >/dev/null
"$PY" tools/demo_grid.py --config "$CONFIG" --output "$RUN_DIR/before_after.png" 2>/dev/null \
  | sed 's/^demo_grid:/[demo]/'
if [[ -d $EXP_DIR/tensorboard && -d $EXP_DIR/nft/tensorboard ]]; then
  # both algorithms have run from the same base: the side-by-side figure and table
  "$PY" tools/compare_runs.py --run flowgrpo "$EXP_DIR/tensorboard" --run nft "$EXP_DIR/nft/tensorboard" \
    --component named_color --eval-set held_out --output "$EXP_DIR/algorithms.png" | sed 's/^/[demo] /'
fi
"$PY" - "$RUN_DIR" "$t_base" "$t_train" "$((SECONDS - t_all))" <<'PY'
import json, sys
from pathlib import Path
exp, t_base, t_train, total = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
summary = None
for line in (exp / "train.log").read_text().splitlines():
    if line.startswith('{"summary"'):
        summary = json.loads(line)
if summary is None:
    sys.exit("[demo] no summary line in the training log")
print(f"\n[demo] done in {total} s (base model {t_base} s, post-training {t_train} s)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
runs = sorted(p for p in Path(summary["tensorboard_dir"]).iterdir() if p.is_dir())
ea = EventAccumulator(str(runs[-1]), size_guidance={"scalars": 0})
ea.Reload()
for comp in summary["summary"]:
    train = [e.value for e in ea.Scalars(f"reward/{comp}_mean")]
    w = min(5, len(train))
    line = (f"[demo] {comp}: training rollout 0 (the base) {train[0]:.3f} -> last {w} rollouts "
            f"{sum(train[-w:]) / w:.3f} ({sum(train[-w:]) / w - train[0]:+.3f})")
    tag = f"eval/held_out/{comp}_mean"
    if tag in ea.Tags()["scalars"]:
        ev = ea.Scalars(tag)
        line += f"; held-out eval at rollout {ev[0].step} {ev[0].value:.3f} -> rollout {ev[-1].step} {ev[-1].value:.3f}"
    print(line)
print(f"[demo] TensorBoard:  tensorboard --logdir {summary['tensorboard_dir']}  (slider: images, probes/held_out)")
print(f"[demo] images:       {summary['artifact_root']}/t2i/rollout_*/ (eval: {summary['artifact_root']}/eval/t2i/)")
print(f"[demo] checkpoints:  {summary['save']}  (continue with: bash run.sh demo --resume --num-rollout N, plus --algorithm nft for the nft run)")
print(f"[demo] reward curve: {exp / 'reward_curve.png'}, {exp / 'color_match_curve.png'}")
print(f"[demo] before/after: {exp / 'before_after.png'}  (held-out prompts: base model left, post-trained right)")
PY

#!/usr/bin/env bash
# The product path at real Qwen-Image width on one GPU, from disk, end to end (not part of CI):
#   build   a random-weight pipeline at real width (tests/gpu/make_real_width_model.py: the full
#           text encoder, the DiT at full width with $LAYERS blocks) and a PickScore-shaped CLIP-H,
#           written in diffusers / transformers format, plus prompt files;
#   train   `bash run.sh train configs/qwen_image_t2i_lora_1gpu.toml` for 5 rollouts with a
#           checkpoint, --fsdp-debug-fingerprint on;
#   resume  the same with --load for 2 more rollouts;
#   export  tools/export_checkpoint.py as a PEFT adapter and as a merged pipeline, both --verify;
#           diffusers loads both (QwenImagePipeline.from_pretrained / load_lora_adapter);
#           tools/sample.py samples the merged export;
#   resident  the same recipe without offload (both sides resident) for 3 rollouts;
#   speed   (speed-resident / speed-offload: one of them) the product path with the speed options
#           (SPEED_FLAGS, default the compiled FP8 rollout + --fsdp-compile) for SPEED_ROLLOUTS (10)
#           rollouts, then tools/bench.py at the same depth and options, and the two steady steps
#           side by side with their stage split (tests/gpu/compare_product_bench.py); then the
#           bench again with new prompts of varied lengths every rollout (--text-tokens-spread
#           $SPREAD, default 30; 0 leaves it out) beside the same product run (UNIFORM=0 leaves out
#           the first bench, whose prompts all have the bench's fixed length); SPEED_PARTS (default
#           "product bench") runs one part only, so that the two fit separate device calls: "bench"
#           reads the product run an earlier call left in $RUNS;
#   compile-resume  the resident recipe with the speed options and a fresh --compile-cache-dir for
#           2 rollouts, then resumed for 2 more: the first step of each (what a resume pays to compile);
#   report  the runs' TensorBoard scalars as JSON.
# Usage: bash tests/gpu/real_width.sh OUT_DIR PHASE [PHASE ...]   (phases run in the order given)
# Env: WORK (default /tmp/rw: model, data, runs), LAYERS (DiT blocks, default 30), SHAPE (real |
# tiny: the same flow with the tiny model, on CPU or GPU), NUM_ROLLOUT (5), RESUME_ROLLOUT (7),
# TRAIN_FLAGS (added to every training launch, e.g. "--rollout-engine-class-path sglang
# --sglang-attention-backend torch_sdpa" for the SGLang engine; its packages on PYTHONPATH).
# Wheels for packages the machine lacks (e.g. diffusers) are taken from .whl/ when present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${1:?usage: real_width.sh OUT_DIR PHASE [PHASE ...]}; shift
mkdir -p "$OUT"
WORK=${WORK:-/tmp/rw}; LAYERS=${LAYERS:-30}; SHAPE=${SHAPE:-real}
NUM_ROLLOUT=${NUM_ROLLOUT:-5}; RESUME_ROLLOUT=${RESUME_ROLLOUT:-7}
PY=${PYTHON:-python3}
if ! $PY -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export MODEL=$WORK/qwen-image PICKSCORE=$WORK/pickscore DATA=$WORK/data RUNS=$WORK/runs
# run.sh trains in the machine's own Python environment (nothing to install, no network)
export USE_CURRENT_ENV=${USE_CURRENT_ENV:-1} PYTHON=$PY

if [[ $SHAPE == real ]]; then
  GEOM=(--micro-batch-size 8)
else  # the tiny model: 64x64, and the colour-free PickScore CLIP of 32x32
  GEOM=(--micro-batch-size 4 --sampling-config
        '{"height":64,"width":64,"num_inference_steps":12,"eta":0.7,"sde_type":"sde","sde_indices":[3,4,5],"sde_resample_per_rollout":true,"num_sde_steps":3,"sde_pool":[1,2,3,4,5],"driver_xt":true,"sample_id_mode":"metadata"}'
        --fsdp-param-dtype fp32 --weight-sync-wire-dtype fp32)
fi

train() {  # train NAME LOG NUM_ROLLOUT [flags...]: one run of the 1-device recipe, its log $OUT/LOG.log
  local name=$1 logname=$2 n=$3 rc=0; shift 3
  local t0=$SECONDS
  NPROC=1 bash run.sh train configs/qwen_image_t2i_lora_1gpu.toml \
    --model-path "$MODEL" --reward-model-path "$PICKSCORE" \
    --prompt-data "$DATA/train.jsonl" --eval-prompt-data probe "$DATA/eval.jsonl" \
    --eval-interval 5 --num-rollout "$n" --save-interval 5 ${DEBUG_FLAGS---fsdp-debug-fingerprint} \
    --artifact-root "$RUNS/$name/artifacts" --save "$RUNS/$name/checkpoints" \
    --tensorboard-dir "$RUNS/$name/tensorboard" "${GEOM[@]}" ${TRAIN_FLAGS:-} "$@" >> "$OUT/$logname.log" 2>&1 || rc=$?
  grep -E "logp parity|fingerprint|loaded the|resumed|Traceback|Error|error:|^\[rollout|failed" "$OUT/$logname.log" | tail -30 || true
  echo "[$logname] exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$logname.log"
  return $rc
}

for phase in "$@"; do
  t0=$SECONDS
  echo "== $phase"
  case $phase in
    build)
      df -h /tmp "$WORK" 2>/dev/null | tee "$OUT/disk.txt" || true
      free -g | tee -a "$OUT/disk.txt" || true
      mkdir -p "$WORK" "$DATA"
      $PY tests/gpu/make_real_width_model.py --shape "$SHAPE" --num-layers "$([[ $SHAPE == real ]] && echo "$LAYERS" || echo 2)" \
        --output "$MODEL" --pickscore-output "$PICKSCORE" | tee "$OUT/build.json"
      $PY - "$DATA" <<'PY'
import json, random, sys
d = sys.argv[1]
rng = random.Random(0)
things = ["a red fox", "an old lighthouse", "a bowl of ramen", "a glass robot", "a snowy forest",
          "a city street at night", "a wooden sailboat", "a field of sunflowers", "a vintage car",
          "a cat on a windowsill", "a mountain lake", "a cup of coffee", "a dragon made of paper"]
styles = ["oil painting", "studio photograph", "watercolor", "isometric render", "35mm film still",
          "pencil sketch", "cinematic lighting", "soft morning light", "ultra detailed", "pastel colours"]
colours = ["red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple"]
def prompt():  # ~100-130 bytes: about the bench's 128 text tokens with the byte-level tokenizer
    # every prompt names a colour, so the speed phase can score with the bench's colour scorer
    p = rng.choice(things) + ", " + rng.choice(colours) + " palette, " + ", ".join(rng.sample(styles, 4))
    while len(p) < 100:
        p += ", " + rng.choice(styles)
    return p
for name, n in (("train", 64), ("eval", 4)):
    with open(f"{d}/{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": prompt(), "metadata": {"task": "t2i", "sample_id": f"{name}{i}"}}) + "\n")
PY
      du -sh "$MODEL" "$PICKSCORE" | tee -a "$OUT/disk.txt"; df -h "$WORK" | tee -a "$OUT/disk.txt" ;;
    train)
      train offload offload "$NUM_ROLLOUT" ;;
    resume)
      train offload resume "$RESUME_ROLLOUT" --load "$RUNS/offload/checkpoints"
      ls -R "$RUNS/offload/checkpoints" | head -40 > "$OUT/checkpoints.txt" ;;
    export)
      EXP=${EXPORT_DIR:-$WORK/export}
      rm -rf "$EXP"; mkdir -p "$EXP"
      $PY tools/export_checkpoint.py --save-dir "$RUNS/offload/checkpoints" --form adapter --base-model-path "$MODEL" \
        --output-dir "$EXP/adapter" --verify 2>&1 | tail -3 | tee "$OUT/export.txt"
      t1=$SECONDS
      $PY tools/export_checkpoint.py --save-dir "$RUNS/offload/checkpoints" --form merged \
        --base-model-path "$MODEL" --components symlink --output-dir "$EXP/merged" --verify 2>&1 | tail -3 | tee -a "$OUT/export.txt"
      echo "merged export + verify: $((SECONDS - t1)) s" | tee -a "$OUT/export.txt"
      $PY - "$EXP" "$MODEL" <<'PY' 2>&1 | grep -v Warning | tee -a "$OUT/export.txt"
import sys, time, torch
from diffusers import QwenImagePipeline
exp, base = sys.argv[1], sys.argv[2]
dt = torch.bfloat16 if torch.cuda.is_available() else torch.float32
t = time.perf_counter()
merged = QwenImagePipeline.from_pretrained(f"{exp}/merged", torch_dtype=dt)
print(f"diffusers loads the merged export: {type(merged).__name__}, "
      f"{sum(p.numel() for p in merged.transformer.parameters()) / 1e9:.2f} B DiT parameters, {time.perf_counter() - t:.1f} s")
del merged
t = time.perf_counter()
pipe = QwenImagePipeline.from_pretrained(base, torch_dtype=dt)
pipe.transformer.load_lora_adapter(f"{exp}/adapter", weight_name="adapter_model.safetensors",
                                   prefix="base_model.model")
n = sum(1 for k in pipe.transformer.state_dict() if "lora_" in k)
assert n > 0, "the adapter export loaded no LoRA tensor into the DiT"
print(f"diffusers load_lora_adapter takes the adapter export: {n} LoRA tensors in the DiT, {time.perf_counter() - t:.1f} s")
PY
      $PY tools/sample.py --model-path "$EXP/merged" --prompt-data "$DATA/eval.jsonl" --output "$WORK/samples" \
        --n-samples-per-prompt 2 --overwrite 2>&1 | tail -3 | tee -a "$OUT/export.txt"
      echo "sample.py on the merged export: $(find "$WORK/samples" -name '*.png' | wc -l) PNGs" | tee -a "$OUT/export.txt"
      cp "$(find "$WORK/samples" -name '*.png' | sort | head -1)" "$OUT/sample0.png" 2>/dev/null || true
      rm -rf "$EXP" ;;
    resident)
      train resident resident 3 --offload-train false --offload-rollout false ;;
    speed|speed-resident|speed-offload)
      # The product path with the speed options beside the bench at the same depth, options,
      # per-GPU share and reward (the bench's colour scorer; PickScore's cost is in the train
      # phase's figures), on the same machine: steady rollouts only (no checkpoint, no eval),
      # no debug fingerprint, the artifact writer at its default.
      SPEED=${SPEED_FLAGS---rollout-compile --rollout-precision fp8 --fsdp-compile}
      COLOUR=(--reward-scorer-path trainer.rewards.color.ColorScorer --reward-model-path none
              --reward-required-components color --reward-component-weights '{"pickscore": null, "color": 1.0}'
              --save-interval 1000 --eval-interval 1000)
      bench_beside() {  # bench_beside MODE NAME [bench flags...]: the bench at the speed run's depth and
        # options (its step alone: the phases the comparison does not read are skipped, the eager
        # rollout where a speed option is timed against nothing), then the two side by side
        local mode=$1 name=$2; shift 2
        local skip=(dit checksum merged replay update adapter offload); [[ -n $SPEED ]] && skip+=(eager)
        $PY tools/bench.py --shape "$SHAPE" --num-layers "$([[ $SHAPE == real ]] && echo "$LAYERS" || echo 2)" $SPEED \
          "$@" --iters 1 --skip "${skip[@]}" --out "$OUT/bench-speed-$name.jsonl" \
          > "$OUT/bench-speed-$name.log" 2>&1 || { tail -20 "$OUT/bench-speed-$name.log"; exit 1; }
        $PY tests/gpu/compare_product_bench.py "$RUNS/speed-$mode/tensorboard" "$OUT/bench-speed-$name.jsonl" \
          | tee "$OUT/product-vs-bench-$name.txt"
      }
      modes=(resident offload); [[ $phase == speed-* ]] && modes=("${phase#speed-}")
      parts=" ${SPEED_PARTS:-product bench} "
      for mode in "${modes[@]}"; do
        off=(); [[ $mode == resident ]] && off=(--offload-train false --offload-rollout false)
        if [[ $parts == *" product "* ]]; then
          rm -rf "$RUNS/speed-$mode"
          DEBUG_FLAGS="" train "speed-$mode" "speed-$mode" "${SPEED_ROLLOUTS:-10}" "${off[@]}" $SPEED "${COLOUR[@]}"
          # the run's series, for the record (compare_product_bench reads the run, or this file)
          $PY -c 'import json, sys; from trainer.metrics import read_scalars; json.dump(read_scalars(sys.argv[1]), open(sys.argv[2], "w"))' \
            "$RUNS/speed-$mode/tensorboard" "$OUT/scalars-speed-$mode.json"
        fi
        [[ $parts == *" bench "* ]] || continue
        boff=(); [[ $mode == offload ]] && boff=(--offload)
        # UNIFORM=0 leaves out the bench with its fixed-length prompts
        if [[ ${UNIFORM:-1} != 0 ]]; then bench_beside "$mode" "$mode" "${boff[@]}"; fi
        # the bench again with prompts of varied lengths, new every rollout, as the product path's
        # (SPREAD=0 leaves it out): how much of the gap the text lengths are
        if [[ ${SPREAD:-30} != 0 ]]; then
          bench_beside "$mode" "$mode-spread" "${boff[@]}" --text-tokens-spread "${SPREAD:-30}"
        fi
      done ;;
    compile-resume)
      # What a resumed run pays to compile: the resident recipe with the speed options and a fresh
      # --compile-cache-dir for 2 rollouts (a checkpoint after the second), then resumed for 2 more
      # with the same cache; the first step of each run side by side.
      SPEED=${SPEED_FLAGS---rollout-compile --rollout-precision fp8 --fsdp-compile}
      COLOUR=(--reward-scorer-path trainer.rewards.color.ColorScorer --reward-model-path none
              --reward-required-components color --reward-component-weights '{"pickscore": null, "color": 1.0}'
              --eval-interval 1000)
      CACHE=$WORK/compile-cache; rm -rf "$CACHE" "$RUNS/compile-resume"
      common=(--offload-train false --offload-rollout false $SPEED "${COLOUR[@]}" --compile-cache-dir "$CACHE")
      DEBUG_FLAGS="" train compile-resume compile-resume 2 "${common[@]}" --save-interval 2
      DEBUG_FLAGS="" train compile-resume compile-resume 4 "${common[@]}" --save-interval 1000 \
        --load "$RUNS/compile-resume/checkpoints"
      du -sh "$CACHE" | tee "$OUT/compile-resume.txt"
      $PY - "$RUNS/compile-resume/tensorboard" <<'PY' | tee -a "$OUT/compile-resume.txt"
import sys
from trainer.metrics import read_scalars
s = read_scalars(sys.argv[1])
steps = dict(sorted(s.get("perf/step_time", [])))
print("step time per rollout (s):", {k: round(v, 1) for k, v in steps.items()})
print(f"first step, fresh cache: {steps.get(0, float('nan')):.1f} s; first step after the resume, warm cache: "
      f"{steps.get(2, float('nan')):.1f} s")
# each rollout's stages, the graphs it compiled and the seconds torch.compile spent on them,
# dynamo's tracing apart (the rest: AOTAutograd and inductor, or loading their output from the
# cache). A later step may still meet a new prompt length, and the last one holds the run's
# final eval and checkpoint: not a steady step
for key in ("perf/rollout_time", "perf/train_time", "perf/rollout_new_graphs", "perf/actor_new_graphs",
            "perf/rollout_compile_time", "perf/rollout_compile_trace_time", "perf/actor_compile_time",
            "perf/actor_compile_trace_time"):
    print(f"{key}:", {k: round(v, 1) for k, v in sorted(s.get(key, []))})
PY
      ;;
    report)
      $PY - "$RUNS" "$OUT/scalars.json" <<'PY'
import json, sys
from pathlib import Path
from trainer.metrics import read_scalars
runs, out = Path(sys.argv[1]), sys.argv[2]
res = {r.name: read_scalars(r / "tensorboard") for r in sorted(runs.iterdir()) if (r / "tensorboard").is_dir()}
json.dump(res, open(out, "w"), indent=1)
for name, s in res.items():
    print(name, {k: [round(v, 3) for _, v in vals] for k, vals in sorted(s.items())
                 if k.startswith(("perf/", "debug/", "train/ratio", "train/lr", "train/policy_version"))})
PY
      ;;
    *) echo "unknown phase $phase (build, train, resume, export, resident, speed, speed-resident, speed-offload, compile-resume, report)" >&2; exit 2 ;;
  esac
  echo "== $phase done in $((SECONDS - t0)) s"
done

"""The SGLang engine beside the native engine on one device, in one process, from one model directory.

    python tools/bench_sglang.py --model-path /tmp/rw/qwen-image --output bench/results/h200x1-sglang.jsonl \\
        --attention-backend torch_sdpa

Both engines load the same Qwen-Image directory (a real download, or the random-weight pipeline of
tests/gpu/make_real_width_model.py) and sample the same requests: --prompts x --group-size
candidates at --height x --width, --steps steps of which --trained-steps are SDE steps (the
validated recipe's per-GPU share by default: 4 x 8 at 384x384, 12 steps, 3 trained). In order:

1. the native engine, eager: rollout_images_per_s (variant "native"), its peak memory;
2. the same engine with --rollout-compile's regional compilation ("native+compile");
3. the SGLang engine ("sglang"): images/s, peak memory, and release_memory / resume_memory timed;
4. the replay: the trainer's own replay (QwenImageAdapter.replay_transition through the diffusers
   transformer, as the actor runs it, in the engines' dtype) of each engine's recorded log-probs:
   replay_logp_max_abs_err per engine, the on-policy gap a training run with that engine has;
5. speed ratios: sglang / native, sglang / native+compile (same process, same requests).

Each figure is one JSON line (tools/bench.py's Reporter) printed and appended to --output.
The native engine is freed before the SGLang one is built, so one device holds one engine at a
time, plus the replay's transformer at the end.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_sglang.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, type=Path, help="a Qwen-Image diffusers directory")
    p.add_argument("--output", type=Path, default=None, help="append the JSON lines here")
    p.add_argument("--device", default=None, help="unset: cuda when available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="unset: bf16 on cuda, fp32 on cpu")
    p.add_argument("--attention-backend", default=None,
                   help="SGLang's attention backend (e.g. torch_sdpa where sglang-kernel's FA3 library is absent)")
    p.add_argument("--height", type=int, default=384)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--trained-steps", type=int, default=3, help="SDE steps: 3, 4, 5, ... (the recipe's eval set)")
    p.add_argument("--eta", type=float, default=0.7)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--text-tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=2, help="timed rollouts after one warm-up rollout")
    p.add_argument("--skip-compile", action="store_true", help="no native+compile variant")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tools.bench import Reporter, build_requests, make_prompts, timed
    from trainer.engine.native import NativeEngine
    from trainer.engine.sglang_engine import SGLangEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    sde = list(range(3, 3 + args.trained_steps))
    sampling = parse_sampling_config({"height": args.height, "width": args.width, "num_inference_steps": args.steps,
                                      "eta": args.eta, "sde_type": "sde", "sde_indices": sde})
    geometry = {"height": args.height, "width": args.width, "steps": args.steps, "trained_steps": args.trained_steps,
                "prompts": args.prompts, "group_size": args.group_size, "text_tokens": args.text_tokens,
                "dtype": str(dtype).replace("torch.", ""), "model": args.model_path.name}
    rep = Reporter(args.output, device, geometry)
    adapter = QwenImageAdapter()
    ips: dict[str, float] = {}
    trajectories = {}

    def peak(phase: str, variant: str) -> None:
        if device.type == "cuda":
            rep.emit(f"peak_mem_{phase}", torch.cuda.max_memory_allocated(device) / 1e9, "GB", variant=variant)
            torch.cuda.reset_peak_memory_stats(device)

    def time_rollouts(engine, variant: str, prompts: list[str]):
        reqs = lambda k: build_requests(engine, adapter, sampling, prompts, args.group_size, sde, args.seed, k)  # noqa: E731
        with timed(device) as t:
            engine.generate(reqs(0))
        rep.emit("rollout_first_s", t[0], "s", variant=variant)
        secs, traj = [], None
        for k in range(args.iters):
            with timed(device) as t:
                traj = engine.generate(reqs(1 + k))
            secs.append(t[0])
        sec = sum(secs) / len(secs)
        rep.emit("rollout_s", sec, "s", variant=variant, candidates=len(traj))
        rep.emit("rollout_images_per_s", len(traj) / sec, "images/s", variant=variant)
        ips[variant] = len(traj) / sec
        peak("rollout", variant)
        return traj.without_images()

    def free() -> None:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    # 1-2. the native engine, eager then compiled
    with timed(device) as t:
        native = NativeEngine(str(args.model_path), device=device, dtype=dtype, adapter=adapter)
    rep.emit("build_engine_s", t[0], "s", variant="native")
    enc = native.prompt_encoder
    prompts = make_prompts(args.prompts, native.tokenizer, enc.template, enc.template_start_idx, args.text_tokens)
    trajectories["native"] = time_rollouts(native, "native", prompts)
    if not args.skip_compile:
        native.enable_speedups(compile_blocks=True)
        time_rollouts(native, "native+compile", prompts)
    del native
    free()

    # 3. the SGLang engine, its release / resume
    with timed(device) as t:
        sg = SGLangEngine(str(args.model_path), device=device, dtype=dtype, attention_backend=args.attention_backend)
    rep.emit("build_engine_s", t[0], "s", variant="sglang")
    trajectories["sglang"] = time_rollouts(sg, "sglang", prompts)
    with timed(device) as t:
        sg.release_memory()
    released = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
    rep.emit("release_memory_s", t[0], "s", variant="sglang", allocated_after_gb=released)
    with timed(device) as t:
        sg.resume_memory()
    rep.emit("resume_memory_s", t[0], "s", variant="sglang")
    del sg
    free()

    # 4. the trainer's replay of each engine's recorded log-probs
    actor = adapter.load_train_model(str(args.model_path), dtype=dtype).to(device).eval()
    for variant, traj in trajectories.items():
        gaps = []
        with torch.no_grad():
            for col in range(traj.num_steps):
                got = adapter.replay_transition(actor, traj, col)
                gaps.append((got.float().cpu() - traj.log_probs[:, col].float().cpu()).abs())
        gap = torch.stack(gaps, 1)
        rep.emit("replay_logp_max_abs_err", float(gap.max()), "nats", variant=variant, mean_abs=float(gap.mean()))
    peak("replay", "replay")

    # 5. ratios from this process
    for other in ("native", "native+compile"):
        if other in ips:
            rep.emit("sglang_speed_ratio", ips["sglang"] / ips[other], "ratio", against=other)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

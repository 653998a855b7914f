"""Wan2.1 text-to-video at real shape with random weights: diffusers' WanPipeline rollout speed
and the LoRA replay's memory and speed at micro-batch 1, on one GPU.

What it measures (one JSON line per figure, the bench/results format):

  rollout   WanPipeline.__call__ with random prompt embeddings (UMT5 width 4096, 512 tokens; the
            text encoder is not run), true CFG at --guidance, --steps flow-matching Euler steps
            (shift 3.0), output_type="latent": videos/s of the DiT loop; then one VAE decode of
            a latent (fp32, as FlowGRPO keeps the VAE) timed on its own.
  engine    this project's NativeEngine with the Wan adapter on the SAME transformer and VAE in the
            same process (prompt embeddings random as above, the text encoder not run): the
            rollout at FlowGRPO's Wan SDE on every step but the last, CFG in one two-row forward,
            videos/s with the VAE decode and without it (the DiT loop, comparable to WanPipeline's
            latent output row for row: `ratio_per_dit_row`); then the bf16 replay vs sampler gap
            (the adapter's replay of recorded columns at the rollout's batch and at micro-batch 1,
            max |log-prob difference|), and, with LoRA in, the adapter's replay of one transition
            at micro-batch 1 (forward + backward, activation checkpointing): `replay_transition_ours`.
  replay    one trained transition at micro-batch 1 as the replay runs it: the conditional and
            unconditional rows in one DiT forward (2 rows under CFG), LoRA (rank --lora-rank on
            to_q / to_k / to_v / to_out.0 of every attention, FlowGRPO's Wan set), loss on the
            fp32 output, backward; with activation checkpointing (diffusers'
            enable_gradient_checkpointing) and, when it fits, without. Peak memory and
            seconds per transition.

    python tools/bench_wan.py --size 1.3b --geometry 33x240x416 --geometry 81x480x832 \
        --out bench/results/h200x1-wan21.jsonl
    python tools/bench_wan.py --tiny   # the tiny configuration on the CPU: checks the script only

Nothing is downloaded; weights are random (speed and memory do not depend on their values).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.tiny_wan import (  # noqa: E402
    TINY_WAN_TRANSFORMER_CONFIG,
    TINY_WAN_VAE_CONFIG,
    WAN21_SCHEDULER_CONFIG,
    WAN21_T2V_1_3B_TRANSFORMER_CONFIG,
    WAN21_T2V_14B_TRANSFORMER_CONFIG,
    WAN21_VAE_CONFIG,
)
from trainer.video import candidate_noise_shape, token_count  # noqa: E402

SIZES = {"1.3b": WAN21_T2V_1_3B_TRANSFORMER_CONFIG, "14b": WAN21_T2V_14B_TRANSFORMER_CONFIG,
         "tiny": TINY_WAN_TRANSFORMER_CONFIG}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def parse_geometry(text: str) -> tuple[int, int, int]:
    try:
        f, h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--geometry {text!r}: expected FRAMESxHEIGHTxWIDTH, e.g. 81x480x832")
    candidate_noise_shape(f, h, w)  # the validity rules, with their message
    return f, h, w


def emit(out, rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gb(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def time_backward(model, step, iters: int, device) -> tuple[str, float | None]:
    """("ok", the fastest of `iters` timed calls of step() after one warm-up) or ("oom", None) when
    the device runs out of memory; step() runs a forward and its backward through `model`, whose
    gradients are dropped after every call."""
    import torch

    reset_peak(device)
    times = []
    try:
        for _ in range(iters + 1):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        return "ok", min(times[1:])
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return "oom", None


def build_transformer(size: str, dtype, device, seed: int = 0):
    """WanTransformer3DModel of `size` (SIZES) built on `device` in `dtype`, diffusers' own init
    seeded by `seed` (the same seed gives the same weights on one device type), eval mode."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = WanTransformer3DModel(**SIZES[size])
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def build_vae(size: str, device, seed: int = 2):
    """AutoencoderKLWan in fp32 on `device`: Wan2.1's VAE (both published sizes share it), or the
    tiny one for size "tiny"; diffusers' init seeded by `seed`."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoencoderKLWan(**(TINY_WAN_VAE_CONFIG if size == "tiny" else WAN21_VAE_CONFIG)).eval()


def real_param_counts(size: str) -> tuple[int, int]:
    """(DiT, VAE) parameters of the published `size`, counted on the meta device (the UMT5 encoder
    is not built: the bench's prompt embeddings are random)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from tools.bench import meta_param_count

    return (meta_param_count(lambda: WanTransformer3DModel(**SIZES[size])),
            meta_param_count(lambda: AutoencoderKLWan(**WAN21_VAE_CONFIG)))


def wan_forward_flops(cfg: dict, video_tokens: int, text_tokens: int, batch: int = 1) -> float:
    """FLOPs of one WanTransformer3DModel forward over `batch` rows (matmuls only, multiply-add = 2
    FLOPs; Wan2.1 text-to-video: no image embedder, one timestep per row).

        F = batch * [ 2 * (P_video * N + P_text * T + P_sample) + 4 * L * d * (N^2 + N * T) ]

    d = heads * head_dim, L = num_layers, N = video tokens (F' * H'/2 * W'/2), T = text tokens
    (the UMT5 window, 512). P_video: per block self-attention q/k/v/out (4 d^2), cross-attention
    q and out (2 d^2), the FFN (2 d ffn_dim), plus the patch embedding (in_channels * prod(patch)
    * d) and proj_out (d * out_channels * prod(patch)); P_text: per block the cross-attention's
    k/v (2 d^2), plus the text embedder (text_dim * d + d^2); P_sample: the time embedder
    (freq_dim * d + d^2) and time_proj (6 d^2). Attention: Q K^T and P V, 2 N^2 d each for the
    self-attention and 2 N T d each for the cross-attention, per block."""
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    n_layers, ffn = int(cfg["num_layers"]), int(cfg["ffn_dim"])
    patch = 1
    for v in cfg["patch_size"]:
        patch *= int(v)
    out_channels = int(cfg.get("out_channels") or cfg["in_channels"])
    p_video = n_layers * (6 * d * d + 2 * d * ffn) + int(cfg["in_channels"]) * patch * d + d * out_channels * patch
    p_text = n_layers * 2 * d * d + int(cfg["text_dim"]) * d + d * d
    p_sample = int(cfg["freq_dim"]) * d + d * d + 6 * d * d
    n, t = int(video_tokens), int(text_tokens)
    linear = 2.0 * (p_video * n + p_text * t + p_sample)
    attention = 4.0 * n_layers * d * (n * n + n * t)
    return float(batch) * (linear + attention)


def bench_replay(model, geometry, args, device, dtype, base: dict) -> None:
    import torch

    f, h, w = geometry
    shape = candidate_noise_shape(f, h, w, channels=model.config.in_channels)
    rows = 2 if args.guidance > 1 else 1
    text_len, text_dim = args.text_tokens, model.config.text_dim
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(rows, *shape, generator=g).to(device, dtype)
    t = torch.full((rows,), 500.0, device=device)
    ctx = torch.randn(rows, text_len, text_dim, generator=g).to(device, dtype)

    def step():
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
        out.float().square().mean().backward()

    for checkpointing in (True, False):
        if checkpointing:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        status, secs = time_backward(model, step, args.iters, device)
        emit(args.out, {**base, "figure": "replay_transition", "value": secs, "unit": "s",
                        "geometry": f"{f}x{h}x{w}", "rows": rows, "activation_checkpointing": checkpointing,
                        "tokens": token_count(shape), "peak_gb": peak_gb(device), "status": status})


def bench_rollout(model, geometry, args, device, dtype, base: dict) -> float:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    f, h, w = geometry
    model.disable_gradient_checkpointing()
    vae = build_vae("tiny" if args.tiny else args.size, device)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=model,
                       scheduler=FlowMatchEulerDiscreteScheduler(**WAN21_SCHEDULER_CONFIG))
    pipe.set_progress_bar_config(disable=True)
    b = args.rollout_batch
    g = torch.Generator(device="cpu").manual_seed(3)
    emb = torch.randn(b, args.text_tokens, model.config.text_dim, generator=g).to(device, dtype)
    neg = torch.randn(b, args.text_tokens, model.config.text_dim, generator=g).to(device, dtype)
    kw = dict(prompt_embeds=emb, negative_prompt_embeds=neg if args.guidance > 1 else None, height=h, width=w,
              num_frames=f, num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="latent")
    with torch.no_grad():
        pipe(**{**kw, "num_inference_steps": 1})  # warm-up
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        latents = pipe(**kw).frames
        sync(device)
        dt = time.perf_counter() - t0
    rate = b / dt
    emit(args.out, {**base, "figure": "rollout_videos_per_s", "value": round(b / dt, 4), "unit": "videos/s",
                    "geometry": f"{f}x{h}x{w}", "steps": args.steps, "guidance": args.guidance, "batch": b,
                    "seconds": round(dt, 3), "peak_gb": peak_gb(device), "path": "diffusers WanPipeline, latent out"})
    with torch.no_grad():
        one = latents[:1].to(torch.float32)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        video = vae.decode(one, return_dict=False)[0]
        sync(device)
        dt = time.perf_counter() - t0
    emit(args.out, {**base, "figure": "vae_decode", "value": round(dt, 3), "unit": "s", "geometry": f"{f}x{h}x{w}",
                    "frames_out": int(video.shape[2]), "dtype": "fp32", "peak_gb": peak_gb(device)})
    del pipe, vae, latents, video
    return rate


class _RandomPrompts:
    """encode(prompts, device, max_sequence_length) -> {"prompt_embeds": [B, T, D]}: a fixed random
    embedding per prompt (seeded by the prompt), standing in for UMT5-XXL as the WanPipeline row's
    random prompt_embeds do."""

    def __init__(self, tokens: int, dim: int, dtype):
        self.tokens, self.dim, self.dtype = tokens, dim, dtype

    def __call__(self, prompts, device, max_sequence_length):
        import zlib

        import torch

        rows = [torch.randn(self.tokens, self.dim, generator=torch.Generator().manual_seed(zlib.crc32(p.encode())))
                for p in prompts]
        return {"prompt_embeds": torch.stack(rows).to(device, self.dtype)}


def build_wan_engine(model, vae, device, dtype, text_tokens: int, max_batch_size: int = 0):
    """NativeEngine with the Wan adapter over `model` and `vae` (kept in fp32, as FlowGRPO keeps
    it), the flow-matching Euler scheduler of Wan2.1 (shift 3.0), and random prompt embeddings of
    `text_tokens` tokens at the DiT's text_dim in place of UMT5-XXL (nothing to encode: the text
    encoder is an Identity)."""
    import torch

    from trainer.engine.native import NativeEngine
    from trainer.models.wan import WanAdapter

    scheduler = dict(WAN21_SCHEDULER_CONFIG, _class_name="FlowMatchEulerDiscreteScheduler")
    engine = NativeEngine.from_modules(model, vae, torch.nn.Identity(), None, scheduler, device=device, dtype=dtype,
                                       adapter=WanAdapter(), max_sequence_length=text_tokens,
                                       max_batch_size=max_batch_size)
    engine.vae = engine.vae.to(torch.float32)
    engine.prompt_encoder = _RandomPrompts(text_tokens, model.config.text_dim, dtype)
    return engine


def bench_engine(model, geometry, args, device, dtype, base: dict, vae=None):
    """The native engine's rollout on `model` (and a VAE of the run's configuration), its figures,
    and the trajectory it sampled (for the replay figures)."""
    import torch

    from trainer.sampling import parse_sampling_config

    f, h, w = geometry
    if vae is None:
        vae = build_vae("tiny" if args.tiny else args.size, device)
    engine = build_wan_engine(model, vae, device, dtype, args.text_tokens)
    adapter = engine.adapter

    def requests(n: int, steps: int):
        cfg = parse_sampling_config({"height": h, "width": w, "num_frames": f, "num_inference_steps": steps,
                                     "guidance_scale": args.guidance, "negative_prompt": "", "cfg_renorm": False,
                                     "sde_type": "wan", "eta": 1.0, "sde_indices": list(range(steps - 1))})
        sigmas = engine.sigma_schedule(h, w, steps)
        return [adapter.build_rollout_request(f"prompt {i // 4}", group_index=i // 4, slot=i % 4,
                                              sample_id=f"g{i // 4}:s{i % 4}", sampling=cfg,
                                              sde_indices=list(range(steps - 1)), sigmas=sigmas,
                                              generation_seed=11) for i in range(n)]

    b = args.rollout_batch
    engine.generate(requests(1, 2))  # warm-up
    rates = {}
    real_decode = adapter.decode
    traj = None
    for decode in (True, False):
        if not decode:  # the DiT loop alone, as WanPipeline's latent output
            adapter.decode = lambda vae_, latents, geometry_: torch.zeros(latents.shape[0], f, 3, 1, 1)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(requests(b, args.steps))
        sync(device)
        dt = time.perf_counter() - t0
        adapter.decode = real_decode
        traj = out if decode else traj
        rates[decode] = b / dt
        emit(args.out, {**base, "figure": "engine_rollout_videos_per_s", "value": round(b / dt, 4), "unit": "videos/s",
                        "geometry": f"{f}x{h}x{w}", "steps": args.steps, "trained_steps": args.steps - 1,
                        "guidance": args.guidance, "batch": b, "seconds": round(dt, 3), "peak_gb": peak_gb(device),
                        "decode": decode, "path": "native engine (trainer.models.wan), sde_type wan"})
    if args.diffusers_rate.get(geometry):
        ratio = rates[False] / args.diffusers_rate[geometry]
        emit(args.out, {**base, "figure": "ratio_per_dit_row", "value": round(ratio, 3),
                        "unit": "x", "geometry": f"{f}x{h}x{w}",
                        "what": "native engine DiT loop (no decode) / WanPipeline latent output, same modules"})
    cols = sorted({0, (traj.num_steps - 1) // 2, traj.num_steps - 1})
    with torch.no_grad():
        for name, rows in (("rollout_batch", traj), ("micro_batch_1", traj[0:1])):
            gap = max(float((adapter.replay_transition(model, rows, c).float().cpu()
                             - rows.log_probs[:, c]).abs().max()) for c in cols)
            emit(args.out, {**base, "figure": "replay_vs_sampler_max_abs", "value": gap, "unit": "nats",
                            "geometry": f"{f}x{h}x{w}", "replay_rows": name, "columns": cols,
                            "rows_per_forward": len(rows) * (2 if args.guidance > 1 else 1)})
    return traj.without_images()


def bench_replay_ours(model, traj, geometry, args, device, base: dict) -> None:
    """The adapter's replay of one recorded transition at micro-batch 1 (both CFG rows in one
    forward), forward + backward through the LoRA, activation checkpointing on."""
    from trainer.models.wan import WanAdapter

    adapter = WanAdapter()
    f, h, w = geometry
    model.enable_gradient_checkpointing()
    one = traj[0:1]
    status, secs = time_backward(model, lambda: adapter.replay_transition(model, one, 0).sum().backward(),
                                 args.iters, device)
    emit(args.out, {**base, "figure": "replay_transition_ours", "value": secs, "unit": "s", "geometry": f"{f}x{h}x{w}",
                    "rows": 2 if args.guidance > 1 else 1, "activation_checkpointing": True,
                    "peak_gb": peak_gb(device), "status": status, "path": "WanAdapter.replay_transition"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    p.add_argument("--geometry", type=parse_geometry, action="append",
                   help="FRAMESxHEIGHTxWIDTH (frames 4k+1, sizes multiples of 16); repeatable")
    p.add_argument("--what", default="replay,rollout,engine", help="comma list of replay, rollout, engine")
    p.add_argument("--steps", type=int, default=20, help="rollout denoising steps (FlowGRPO's Wan recipe: 20)")
    p.add_argument("--guidance", type=float, default=4.5, help="true CFG scale (FlowGRPO's Wan recipe: 4.5)")
    p.add_argument("--rollout-batch", type=int, default=4, help="videos per WanPipeline call")
    p.add_argument("--lora-rank", type=int, default=32, help="FlowGRPO's Wan recipe: 32 (alpha 64)")
    p.add_argument("--text-tokens", type=int, default=512, help="UMT5 window (WanPipeline and FlowGRPO: 512)")
    p.add_argument("--iters", type=int, default=2, help="timed replay iterations after one warm-up")
    p.add_argument("--tiny", action="store_true", help="the tiny configuration on the CPU in fp32 (a script check)")
    p.add_argument("--out", default=None, help="JSON lines file to append to")
    args = p.parse_args(argv)

    import torch
    from peft import LoraConfig

    if args.tiny:
        args.size, device, dtype = "tiny", torch.device("cpu"), torch.float32
        args.geometry = args.geometry or [(5, 32, 32)]
        args.text_tokens, args.rollout_batch, args.steps = 16, 1, 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        args.geometry = args.geometry or [(33, 240, 416)]
    model = build_transformer(args.size, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    what = {w.strip() for w in args.what.split(",") if w.strip()}
    base = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "world_size": 1,
            "model": f"Wan2.1-T2V-{args.size}", "params": n_params, "dtype": str(dtype).replace("torch.", ""),
            "weights": "random"}
    args.diffusers_rate = {}
    if "rollout" in what:
        for geometry in args.geometry:
            args.diffusers_rate[geometry] = bench_rollout(model, geometry, args, device, dtype, base)
    trajectories = {}
    if "engine" in what:
        for geometry in args.geometry:
            trajectories[geometry] = bench_engine(model, geometry, args, device, dtype, base)
    if "replay" in what:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, init_lora_weights="gaussian",
                                     target_modules=LORA_TARGETS))
        n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
        model.train()
        for geometry in args.geometry:
            bench_replay(model, geometry, args, device, dtype, {**base, "lora_rank": args.lora_rank,
                                                                "lora_params": n_lora})
            if geometry in trajectories:
                bench_replay_ours(model, trajectories[geometry], geometry, args, device,
                                  {**base, "lora_rank": args.lora_rank, "lora_params": n_lora})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

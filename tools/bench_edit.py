"""Time an editing family's rollout against diffusers' own edit pipeline on the same modules.

    python tools/bench_edit.py                                        (smoke test: the tiny shape, CPU)
    python tools/bench_edit.py --shape real --height 384 --width 384 --steps 10 --guidance-scale 4 \\
        --prompts 6 --group-size 16 --output bench/results/h200x1-qwen-image-edit.jsonl
    python tools/bench_edit.py --family flux_kontext --shape real --height 512 --width 512 --steps 6 \\
        --guidance-scale 2.5 --text-tokens 128 --prompts 2 --group-size 21 \\
        --output bench/results/h200x1-flux-kontext.jsonl

One process, random weights (nothing is read from disk), built on the meta device from the
bench's configs and materialised on the device:

    --family qwen_image_edit   Qwen-Image's DiT (with the 2511 variant's zero_cond_t), VAE and
                               Qwen2.5-VL-7B (text model AND vision tower) from tools/bench.py, and
                               the processor of Qwen-Image-Edit-2509's config
                               (tools/tiny_qwen_image_edit.py); against QwenImageEditPlusPipeline
                               with true CFG (--guidance-scale, default 4)
    --family flux_kontext      FLUX.1-dev's DiT, VAE, CLIP-L and T5-XXL from tools/bench_flux.py
                               (FLUX.1-Kontext-dev's configs equal them); against
                               FluxKontextPipeline with the embedded guidance (--guidance-scale,
                               default 2.5: Kontext-dev's published setting; the pipeline's own
                               call defaults are 28 steps and 3.5) and the T5 window --text-tokens

Sources are random-noise PNGs of --source-size, one per prompt. The defaults at --shape real are
the family's recipe (configs/qwen_image_edit_i2i_lora_8gpu.toml: 384 px, 10 steps;
configs/flux1kontext_i2i_lora_8gpu.toml: 512 px, 6 steps, T5 window 128). Figures (tools/bench.py's
JSON lines, the geometry naming the family):

    edit_rollout_images_per_s     NativeEngine.generate over prompts x group-size candidates
                                  (each source read and VAE-encoded once, CFG in one forward)
    edit_diffusers_images_per_s   the stock pipeline's __call__ on the engine's own modules, one
                                  call per prompt with num_images_per_prompt = group size and the
                                  source at the output size (Qwen: its VAE_IMAGE_SIZE set to height
                                  x width; Kontext: max_area = height x width, _auto_resize off)
    edit_rollout_speedup          the ratio of the two
    edit_replay_transitions_per_s the adapter's replay of every trained column (no grad) on the engine's DiT
    edit_replay_logp_gap          max |replay - sampler| log-prob in the run's dtype (0 in fp32)
    peak_mem_<phase>              CUDA only

The update, sync and the whole step are tools/bench.py's (its phases time the DiT's update
whatever its conditioning; the edit sequence is twice a text-to-image one at the same size).
--shape real is refused before anything is allocated when its parameters cannot fit.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer and tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.cli import tool_parser  # noqa: E402


def build_edit_engine(shape: str, device: torch.device, dtype: torch.dtype, max_batch_size: int, seed: int = 0,
                      variant: str = "2511"):
    """NativeEngine with the Qwen-Image-Edit adapter over a random `shape` pipeline on `device`."""
    from diffusers import QwenImageTransformer2DModel

    from tools import bench
    from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG, build_tokenizer
    from tools.tiny_qwen_image_edit import (REAL_EDIT_IMAGE_PROCESSOR_CONFIG, TINY_EDIT_IMAGE_PROCESSOR_CONFIG,
                                            edit_transformer_config)
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image_edit import QwenImageEditAdapter
    from trainer.models.qwen_vl_processor import ImagePromptProcessor, build_image_processor

    tokenizer = build_tokenizer()
    cfg = edit_transformer_config(bench.shape_configs(shape)[0], variant)
    transformer = bench.materialise(lambda: QwenImageTransformer2DModel(**cfg), device, dtype, seed,
                                    f"{shape} edit transformer")
    vae = bench.build_vae(shape, device, dtype, seed + 1)
    text_encoder = bench.build_text_encoder(shape, tokenizer, device, dtype, seed + 2)
    processor = ImagePromptProcessor(build_image_processor(
        REAL_EDIT_IMAGE_PROCESSOR_CONFIG if shape == "real" else TINY_EDIT_IMAGE_PROCESSOR_CONFIG), tokenizer)
    return NativeEngine.from_modules(transformer, vae, text_encoder, processor, QWEN_IMAGE_SCHEDULER_CONFIG,
                                     device=device, dtype=dtype, max_batch_size=max_batch_size,
                                     adapter=QwenImageEditAdapter())


def build_kontext_engine(shape: str, device: torch.device, dtype: torch.dtype, max_batch_size: int,
                         max_sequence_length: int, seed: int = 0):
    """NativeEngine with the FLUX.1-Kontext adapter over a random FLUX.1 `shape` pipeline on
    `device` (tools/bench_flux.py's modules: Kontext-dev is FLUX.1-dev's architecture)."""
    from tools.bench_flux import build_flux_engine
    from trainer.models.flux_kontext import FluxKontextAdapter

    return build_flux_engine(shape, device, dtype, max_batch_size, max_sequence_length, seed,
                             adapter=FluxKontextAdapter())


def real_param_counts(family: str) -> tuple[int, int]:
    """(DiT, the other modules) parameters of `family`'s real shape, counted on the meta device."""
    if family == "flux_kontext":
        from tools.bench_flux import real_param_counts as flux_counts

        return flux_counts()
    from tools.bench import real_param_counts as qwen_counts

    return qwen_counts()


def write_sources(directory: Path, n: int, size: int, seed: int = 0) -> list[str]:
    """`n` random-noise RGB PNGs of size x size under `directory` (distinct files: n conditions)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        path = directory / f"source_{i}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def edit_requests(engine, sampling, sources: list[str], group_size: int, instruction: str) -> list:
    """prompts x group_size RolloutRequests, group g editing sources[g]."""
    import dataclasses

    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [dataclasses.replace(engine.adapter.build_rollout_request(
        f"<image> {instruction}", group_index=g, slot=s, sample_id=f"g{g}:s{s}", sampling=sampling,
        sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=7), media=[src])
        for g, src in enumerate(sources) for s in range(group_size)]


#: the family defaults (shape-independent): the recipe's guidance, noise level and T5 window
FAMILY_DEFAULTS = {"qwen_image_edit": {"guidance_scale": 4.0, "eta": 1.0, "real": (384, 10)},
                   "flux_kontext": {"guidance_scale": 2.5, "eta": 0.9, "real": (512, 6)}}
#: the tiny shape's size and steps, any family
TINY_DEFAULTS = (32, 4)


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser("bench_edit", __doc__)
    p.add_argument("--family", choices=tuple(FAMILY_DEFAULTS), default="qwen_image_edit",
                   help="the editing family timed against its diffusers pipeline")
    p.add_argument("--shape", choices=("tiny", "real"), default="tiny", help="module sizes (real: the family's)")
    p.add_argument("--variant", choices=("2509", "2511"), default="2511",
                   help="qwen_image_edit only; 2511: the DiT's zero_cond_t")
    p.add_argument("--height", type=int, default=None,
                   help="output (and source-condition) height; tiny 32, real 384 (qwen_image_edit) / 512 "
                        "(flux_kontext)")
    p.add_argument("--width", type=int, default=None, help="output width; the height's defaults")
    p.add_argument("--source-size", type=int, default=None, help="side of the random source PNGs (default: height)")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps; tiny 4, real 10 (qwen_image_edit) / 6 (flux_kontext)")
    p.add_argument("--trained-steps", type=int, nargs="+", default=[1], help="the recorded SDE steps")
    p.add_argument("--guidance-scale", type=float, default=None,
                   help="qwen_image_edit: true CFG (> 1: both branches; default 4); flux_kontext: the embedded "
                        "guidance (default 2.5)")
    p.add_argument("--text-tokens", type=int, default=128,
                   help="flux_kontext: the T5 window (max_sequence_length) of both rollouts; must be 1-512")
    p.add_argument("--prompts", type=int, default=2, help="records (one source each) per rollout")
    p.add_argument("--group-size", type=int, default=2, help="candidates per record")
    p.add_argument("--engine-batch-size", type=int, default=0, help="candidates per DiT forward (<= 0: all)")
    p.add_argument("--iters", type=int, default=1, help="timed repetitions after one warm-up")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--skip-diffusers", action="store_true", help="do not time the stock pipeline")
    p.add_argument("--output", type=Path, default=None, help="JSONL file the figures are appended to")
    p.add_argument("--rollout-compile", action="store_true",
                   help="after the eager rollout and the stock pipeline, compile the engine's DiT blocks and time "
                        "its rollout again (edit_rollout_images_per_s and edit_rollout_speedup with variant=...)")
    p.add_argument("--rollout-precision", choices=("default", "fp8"), default="default",
                   help="fp8: the same, with the DiT blocks' linears in FP8 (fast accumulation), as the trainer's "
                        "--rollout-precision fp8 --fp8-fast-accum")
    p.add_argument("--profile", type=Path, default=None,
                   help="also profile one more rollout of each side (torch.profiler) and write their kernel tables, "
                        "sorted by device time, to this text file; the timed figures are taken before it")
    args = p.parse_args(argv)
    size, steps = FAMILY_DEFAULTS[args.family]["real"] if args.shape == "real" else TINY_DEFAULTS
    args.height = args.height or size
    args.width = args.width or size
    args.steps = args.steps or steps
    args.source_size = args.source_size or args.height
    if args.guidance_scale is None:
        args.guidance_scale = FAMILY_DEFAULTS[args.family]["guidance_scale"]
    for name in ("prompts", "group_size", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.text_tokens <= 512:
        p.error(f"--text-tokens must be 1-512 (T5's window in the FLUX pipelines), got {args.text_tokens}")
    return args


def edit_sampling(args):
    """The rollout's SamplingConfig: Qwen-Image-Edit with true CFG against the negative prompt " ",
    Kontext with its embedded guidance and no negative."""
    from trainer.sampling import parse_sampling_config

    config = {"height": args.height, "width": args.width, "num_inference_steps": args.steps,
              "guidance_scale": args.guidance_scale, "eta": FAMILY_DEFAULTS[args.family]["eta"], "sde_type": "sde",
              "sde_indices": sorted(set(args.trained_steps))}
    if args.family == "qwen_image_edit":
        config["negative_prompt"] = " "
    return parse_sampling_config(config)


@contextlib.contextmanager
def stock_pipeline(args, engine, sources: list[str], instruction: str):
    """Yields a callable running the family's diffusers pipeline once per source (num_images_per_prompt
    = group size) on the engine's own modules, the source at the output size."""
    from trainer.models.edit_source import open_source_image, resized_source

    pipe = engine.prompt_encoder.pipe
    pipe.set_progress_bar_config(disable=True)
    if args.family == "flux_kontext":
        images = [resized_source(open_source_image(p), args.height, args.width) for p in sources]

        def run():
            for g, im in enumerate(images):
                pipe(image=im, prompt=instruction, height=args.height, width=args.width,
                     max_area=args.height * args.width, _auto_resize=False, guidance_scale=args.guidance_scale,
                     num_inference_steps=args.steps, num_images_per_prompt=args.group_size,
                     max_sequence_length=args.text_tokens, output_type="pt",
                     generator=torch.Generator().manual_seed(g))
        yield run
        return
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus

    images = [open_source_image(p) for p in sources]
    saved = edit_plus.VAE_IMAGE_SIZE
    edit_plus.VAE_IMAGE_SIZE = args.height * args.width  # the source at the output size, as ours

    def run():
        for g, im in enumerate(images):
            pipe(image=[im], prompt=instruction, negative_prompt=" ", true_cfg_scale=args.guidance_scale,
                 height=args.height, width=args.width, num_inference_steps=args.steps,
                 num_images_per_prompt=args.group_size, output_type="pt", generator=torch.Generator().manual_seed(g))
    try:
        yield run
    finally:
        edit_plus.VAE_IMAGE_SIZE = saved


def kernel_table(run, device: torch.device, title: str, rows: int = 30) -> str:
    """The kernels of one call of `run` under torch.profiler: the total device (or CPU) time by
    class of kernel (attention, GEMM, the rest), then the `rows` costliest by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    classes = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for e in prof.key_averages():
        if device.type == "cuda" and e.device_type.name != "CUDA":
            continue
        t = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        name = e.key.lower()
        kind = ("attention" if any(k in name for k in ("flash", "fmha", "attention", "sdpa")) else
                "gemm" if any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "aten::addmm", "aten::mm",
                                                "aten::bmm")) else "other")
        classes[kind] += t / 1e6
    head = ", ".join(f"{k} {v:.3f} s" for k, v in classes.items())
    return f"== {title}: device time by class: {head}\n" + prof.key_averages().table(sort_by=sort, row_limit=rows) + "\n"


def main(argv=None) -> int:
    from tools import bench

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.shape == "real":
        dit, rest = real_param_counts(args.family)
        need = (dit + rest) * (torch.finfo(dtype).bits // 8)  # the engine's modules only: no actor here
        have, where = bench.available_bytes(device.type)
        if need > have:
            print(f"bench_edit: --family {args.family} --shape real needs ~{need / 1e9:.0f} GB, {where} has "
                  f"{have / 1e9:.0f} GB free; run it on a GPU machine", file=sys.stderr)
            return 2
    sampling = edit_sampling(args)
    geometry = {"family": args.family, "shape": args.shape, "height": args.height, "width": args.width,
                "source_size": args.source_size, "steps": args.steps, "trained_steps": list(sampling.sde_indices),
                "guidance_scale": args.guidance_scale, "prompts": args.prompts, "group_size": args.group_size,
                "dtype": str(dtype).replace("torch.", "")}
    if args.family == "qwen_image_edit":
        geometry["variant"] = args.variant
        engine = build_edit_engine(args.shape, device, dtype, args.engine_batch_size, variant=args.variant)
    else:
        geometry["text_tokens"] = args.text_tokens
        engine = build_kontext_engine(args.shape, device, dtype, args.engine_batch_size, args.text_tokens)
    rep = bench.Reporter(args.output, device, geometry)
    n = args.prompts * args.group_size
    instruction = "make the square red"
    with tempfile.TemporaryDirectory(prefix="bench-edit-") as tmp:
        sources = write_sources(Path(tmp), args.prompts, args.source_size)
        requests = edit_requests(engine, sampling, sources, args.group_size, instruction)
        traj = engine.generate(requests)  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.iters):
            with bench.timed(device) as t:
                traj = engine.generate(requests)
            times.append(t[0])
        ours = n / (sum(times) / len(times))
        rep.emit("edit_rollout_images_per_s", ours, "images/s", conditions_encoded=engine.last_stats["prompts_encoded"],
                 sources_encoded=engine.last_stats["sources_encoded"])
        rep.phase_memory("edit_rollout")

        if not args.skip_diffusers:
            with stock_pipeline(args, engine, sources, instruction) as stock, torch.no_grad():
                stock()  # warm-up
                times = []
                for _ in range(args.iters):
                    with bench.timed(device) as t:
                        stock()
                    times.append(t[0])
                theirs = n / (sum(times) / len(times))
                rep.emit("edit_diffusers_images_per_s", theirs, "images/s")
                rep.emit("edit_rollout_speedup", ours / theirs, "x")
                rep.phase_memory("edit_diffusers")
                if args.profile:
                    tables = [kernel_table(lambda: engine.generate(requests), device, "engine rollout"),
                              kernel_table(stock, device, "diffusers pipeline")]
                    args.profile.write_text("".join(tables))

        if args.rollout_compile or args.rollout_precision != "default":
            # after the stock pipeline, which shares the engine's modules and must see them eager
            variant = "+".join((["fp8"] if args.rollout_precision == "fp8" else [])
                               + (["compile"] if args.rollout_compile else []))
            engine.enable_speedups(compile_blocks=args.rollout_compile, precision=args.rollout_precision,
                                   fp8_fast_accum=args.rollout_precision == "fp8")
            with bench.timed(device) as t:
                traj = engine.generate(requests)  # warm-up: the compiles
            rep.emit("edit_rollout_warmup_s", t[0], "s", variant=variant)
            times = []
            for _ in range(args.iters):
                with bench.timed(device) as t:
                    traj = engine.generate(requests)
                times.append(t[0])
            fast = n / (sum(times) / len(times))
            rep.emit("edit_rollout_images_per_s", fast, "images/s", variant=variant)
            rep.emit("edit_rollout_speedup", fast / ours, "x", variant=variant, against="eager")
            if not args.skip_diffusers:
                rep.emit("edit_rollout_speedup", fast / theirs, "x", variant=variant, against="diffusers")
            rep.phase_memory(f"edit_rollout_{variant}")
            if args.profile:
                with args.profile.open("a") as f:
                    f.write(kernel_table(lambda: engine.generate(requests), device, f"engine rollout, {variant}"))

        with torch.no_grad():
            engine.adapter.replay_transitions(engine.transformer, traj)  # warm-up
            with bench.timed(device) as t:
                logp = engine.adapter.replay_transitions(engine.transformer, traj)
        rep.emit("edit_replay_transitions_per_s", traj.log_probs.numel() / t[0], "transitions/s")
        rep.emit("edit_replay_logp_gap", float((logp.cpu() - traj.log_probs).abs().max()), "nats")
        rep.phase_memory("edit_replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

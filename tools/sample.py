"""Sample a prompt file with a model (or a checkpoint's LoRA) and write the rollout artifacts.

    python tools/sample.py --model-path DIR --prompt-data FILE.jsonl --output-dir OUT \\
        [--n-samples-per-prompt K] [--sampling-config JSON] [--lora PATH] [--generation-seed N]

Runs exactly the training rollout path (the native engine, the model family's adapter, the
rollout driver) on one process and writes, per prompt, one trajectory sidecar and K PNGs under
OUT/<task>/rollout_<id>/ -- the quickest way to look at what a model or a checkpoint
produces. Prompt lines are the training schema:
{"prompt": "...", "metadata": {"task": "t2i", "sample_id": "..."}}.

The sampling config must name trained SDE steps (the sidecar records them); without
--sampling-config the family's recipe geometry is used: for Qwen-Image 384x384, 12 steps, eta
0.7, sde_indices [1, 3, 5]; for FLUX.1 (--model-adapter-path trainer.models.flux.FluxAdapter)
512x512, 6 steps, embedded guidance 3.5, eta 0.9, sde_indices [1, 2, 3, 4].
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, existing_file, run_tool, tool_parser  # noqa: E402

DEFAULT_SAMPLING = {"height": 384, "width": 384, "num_inference_steps": 12, "guidance_scale": 1.0,
                    "eta": 0.7, "sde_type": "sde", "sde_indices": [1, 3, 5]}


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("sample", __doc__)
    p.add_argument("--model-path", required=True, type=existing_dir, help="local diffusers pipeline directory")
    p.add_argument("--model-adapter-path", default=None,
                   help="dotpath of the model family's adapter class (unset: the family model_index.json "
                        "names, e.g. trainer.models.sd3.SD3Adapter for a StableDiffusion3Pipeline; "
                        "trainer.models.qwen_image.QwenImageAdapter otherwise)")
    p.add_argument("--prompt-data", required=True, type=existing_file, help="JSONL prompt file (training schema)")
    p.add_argument("--output-dir", "--output", "--artifact-root", dest="output_dir", required=True,
                   help="artifact root; files go to OUTPUT_DIR/<task>/rollout_<id>/")
    p.add_argument("--n-samples-per-prompt", type=int, default=1, help="candidates per prompt (>= 1)")
    p.add_argument("--sampling-config", default=None,
                   help="JSON object of --sampling-config keys (must name trained SDE steps); unset: the "
                        "family's recipe geometry (FLUX.1: 512x512, 6 steps, guidance 3.5), for Qwen-Image "
                        f"{json.dumps(DEFAULT_SAMPLING)}".replace("%", "%%"))
    p.add_argument("--lora", default=None, type=existing_dir,
                   help="PEFT adapter directory to sample with (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--generation-seed", type=int, default=1234, help="base seed of every candidate's noise")
    p.add_argument("--task", "--generation-task", dest="task", default="t2i",
                   help="generation task (names the artifact subdirectory)")
    p.add_argument("--rollout-id", type=int, default=0, help="rollout id of the output directory (>= 0)")
    p.add_argument("--device", default=None, help="cpu / cuda / cuda:N (unset: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16 / fp32 (unset: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--engine-batch-size", "--max-batch-size", dest="engine_batch_size", type=int, default=8,
                   help="candidates per DiT forward (<= 0: all)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUTPUT_DIR/<task>/rollout_<id> directory instead of refusing")
    return p


def read_prompts(path: str, task: str) -> list[dict]:
    """The prompt file as [{"prompt", "metadata"}], validated by the trainer's reader."""
    from trainer.data import PromptDataset

    return [rec.to_dict() for rec in PromptDataset.from_jsonl(path, task=task)]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from trainer.artifacts import ArtifactError
    from trainer.data import DataError

    return run_tool("sample", lambda: _sample(args), (DataError, ArtifactError))


def _sample(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.n_samples_per_prompt < 1:
        raise ToolError(f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    if args.rollout_id < 0:
        raise ToolError(f"--rollout-id must be >= 0, got {args.rollout_id}")
    if not (Path(args.model_path) / "model_index.json").is_file():
        raise ToolError(f"--model-path {args.model_path} has no model_index.json: pass a diffusers pipeline "
                        "directory (e.g. one written by save_pretrained or tools/make_tiny_model.py)")

    from trainer import artifacts
    from trainer.config import adapter_for_model_dir
    from trainer.dotpath import import_dotpath
    from trainer.engine.native import NativeEngine
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    try:
        adapter = import_dotpath(args.model_adapter_path or adapter_for_model_dir(args.model_path),
                                 "--model-adapter-path")()
    except ValueError as e:  # the message names the flag and the dotpath
        raise ToolError(str(e)) from None
    try:  # unset: the family's own recipe geometry (an adapter's sampling_defaults), else DEFAULT_SAMPLING
        sampling = parse_sampling_config(args.sampling_config if args.sampling_config is not None
                                         else getattr(adapter, "sampling_defaults", DEFAULT_SAMPLING))
    except ValueError as e:  # the message names --sampling-config and the key
        raise ToolError(str(e)) from None
    prompts = read_prompts(args.prompt_data, args.task)
    target = artifacts.rollout_dir(args.output_dir, args.task, args.rollout_id)
    if target.exists() and any(target.iterdir()) and not args.overwrite:
        raise ToolError(f"{target} already holds artifacts; choose another --output-dir / --rollout-id or pass "
                        "--overwrite")

    t0 = time.perf_counter()
    engine = NativeEngine(args.model_path, device=args.device, dtype=args.dtype, max_batch_size=args.engine_batch_size,
                          adapter=adapter)
    lora_hash = None
    if args.lora:
        from trainer.engine.base import WeightSyncError

        try:
            cfg = engine.load_lora_dir(args.lora)
        except (OSError, ValueError, WeightSyncError) as e:  # the message names the adapter file
            raise ToolError(f"--lora {args.lora}: {e}") from None
        lora_hash = f"lora:{Path(args.lora).resolve()}"
        print(f"loaded LoRA {args.lora} (rank {cfg['rank']}, alpha {cfg['alpha']})")
    t_load = time.perf_counter() - t0
    out = generate_rollout(engine, adapter, prompts, rollout_id=args.rollout_id, sampling=sampling,
                           group_size=args.n_samples_per_prompt, generation_seed=args.generation_seed,
                           artifact_root=args.output_dir, task=args.task, retention=0,
                           weight_manifest_hash=lora_hash)
    n_png = len(list(out.artifact_dir.glob("*.png")))
    n_side = len(list(artifacts.iter_sidecars(out.artifact_dir)))
    print(f"wrote {n_png} PNGs and {n_side} sidecars to {out.artifact_dir} "
          f"(load {t_load:.1f}s, sample {out.stats['perf/rollout_time']:.1f}s, trained steps {out.sde_indices})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sample a prompt file with a model (or a checkpoint's LoRA) and write the rollout artifacts.

    python tools/sample.py --model-path DIR --prompt-data FILE.jsonl --output-dir OUT \\
        [--n-samples-per-prompt K] [--sampling-config JSON] [--sampling-config.KEY VALUE ...]
        [--lora PATH] [--generation-seed N]

Runs exactly the training rollout path (the native engine, the model family's adapter, the
rollout driver) on one process and writes, per prompt, one trajectory sidecar and K PNGs under
OUT/<task>/rollout_<id>/ -- the quickest way to look at what a model or a checkpoint
produces. Prompt lines are the training schema:
{"prompt": "...", "metadata": {"task": "t2i", "sample_id": "..."}}; for an image-editing family
(Qwen-Image-Edit) {"prompt": "<image> make it red", "images": ["src.png"], "metadata": {"task":
"i2i", ...}}, each record's images being the sources its candidates edit.

The sampling config must name trained SDE steps (the sidecar records them). It starts from the
family's recipe geometry: for Qwen-Image 384x384, 12 steps, eta 0.7, sde_indices [1, 3, 5]; for
FLUX.1 512x512, 6 steps, embedded guidance 3.5, eta 0.9, sde_indices [1, 2, 3, 4]; for Wan
(t2v) FlowGRPO's video recipe, 33 frames of 240x416, 20 steps, CFG 4.5 with the empty negative
prompt, sde_type "wan", sde_indices [0] (minutes a video on a CPU, however small the model: a
tiny model wants e.g. '{"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4}').
The keys of --sampling-config (a JSON object) and of --sampling-config.KEY VALUE replace that
geometry's one by one, as the trainer's do over a recipe (null removes a key); a new
num_inference_steps without trained-step keys keeps the default trained steps it still has
([1, 3, 5] at 4 steps: [1, 3]). The tool prints the geometry it samples, and where each value
came from, before the model loads. A geometry the model cannot draw
(larger than an SD3 DiT's position-embedding table, not a multiple of the VAE's scale factor) is
refused before the model loads, naming the largest size it supports.

--lora takes a PEFT adapter directory (flowgrpo-export --form adapter writes one) or a LoRA
run's checkpoint: an iter_<N> directory, or the --save directory (its newest committed
iteration of --task), whose adapter is read from the checkpoint as the export reads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, existing_file, run_tool, script_name, tool_parser  # noqa: E402

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
    p.add_argument("--media-root", default=None, type=existing_dir,
                   help="directory whose files the prompt file may also name as source images, beside its own "
                        "directory (a path outside both, symlinks followed, is refused; '/' allows any file)")
    p.add_argument("--output-dir", "--output", "--artifact-root", dest="output_dir", required=True,
                   help="artifact root; files go to OUTPUT_DIR/<task>/rollout_<id>/")
    p.add_argument("--n-samples-per-prompt", type=int, default=1, help="candidates per prompt (>= 1)")
    p.add_argument("--sampling-config", default=None,
                   help="JSON object of --sampling-config keys, merged over the family's recipe geometry (FLUX.1: "
                        f"512x512, 6 steps, guidance 3.5; Qwen-Image and SD3: {json.dumps(DEFAULT_SAMPLING)}; "
                        "Wan (t2v): 33 frames of 240x416, 20 steps, guidance 4.5, sde_type wan, sde_indices [0], "
                        "minutes a video on a CPU: for a tiny model pass e.g. "
                        '{"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4}); '
                        "one key at a time: --sampling-config.num_inference_steps 10".replace("%", "%%"))
    p.add_argument("--lora", default=None, type=existing_dir,
                   help="LoRA to sample with: a PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors), or a LoRA run's checkpoint (an iter_<N> directory, or the "
                        "--save directory: its newest committed iteration)")
    p.add_argument("--generation-seed", type=int, default=1234, help="base seed of every candidate's noise")
    p.add_argument("--task", "--generation-task", dest="task", default=None,
                   help="generation task (names the artifact subdirectory; the prompt file's records must be of "
                        "it); unset: the family's: i2i for an image-editing family (each record's images are its "
                        "sources), t2v for a video family such as Wan2.1, else t2i")
    p.add_argument("--rollout-id", type=int, default=0, help="rollout id of the output directory (>= 0)")
    p.add_argument("--device", default=None, help="cpu / cuda / cuda:N (unset: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16 / fp32 (unset: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--engine-batch-size", "--max-batch-size", dest="engine_batch_size", type=int, default=8,
                   help="candidates per DiT forward (<= 0: all)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUTPUT_DIR/<task>/rollout_<id> directory instead of refusing")
    return p


def read_prompts(path: str, task: str, media_root: str | None = None) -> list:
    """The prompt file's records (trainer.data.PromptRecord), validated by the trainer's reader, its source
    images confined to its directory (or --media-root) and their headers checked, so a bad source
    is refused before the model loads. ToolError listing every unusable source."""
    from trainer.data import PromptDataset
    from trainer.models.edit_source import source_file_problems

    ds = PromptDataset.from_jsonl(path, task=task, media_root=media_root)
    bad = source_file_problems(ds)
    if bad:
        raise ToolError(f"{len(bad)} source image(s) no rollout can use: {'; '.join(bad[:10])}"
                        f"{'; ...' if len(bad) > 10 else ''}; fix or drop those records (tools/inspect_data.py "
                        "--decode-media checks them)")
    return ds.records


def split_dict_keys(argv: list[str], flag: str) -> tuple[list[str], dict]:
    """(argv without the `--<flag>.KEY VALUE` / `--<flag>.KEY=VALUE` tokens, {KEY: VALUE}); values
    are JSON when they parse, as the trainer's command line reads them (config.dict_key_value)."""
    from trainer.config import dict_key_value

    rest, keys = [], {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith(f"--{flag}."):
            rest.append(tok)
            continue
        key, eq, value = tok[len(flag) + 3:].partition("=")
        if not eq:
            if i >= len(argv) or not key:
                raise ToolError(f"{tok} needs a value (e.g. --{flag}.num_inference_steps 10)")
            value, i = argv[i], i + 1
        keys[key] = dict_key_value(value)
    return rest, keys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, sampling_keys = split_dict_keys(argv, "sampling-config")
    except ToolError as e:
        print(f"{script_name('sample')}: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.sampling_keys = sampling_keys
    from trainer.artifacts import ArtifactError
    from trainer.data import DataError

    return run_tool("sample", lambda: _sample(args), (DataError, ArtifactError))


def sampling_geometry(args: argparse.Namespace, adapter) -> dict:
    """The family's recipe geometry with --sampling-config's keys, then --sampling-config.KEY's,
    merged over it (config.merge_dict_flag: the trainer's rule for a dict flag over a recipe)."""
    from trainer.config import merge_sampling_config as merge_dict_flag  # trained steps follow the step count

    geometry = dict(getattr(adapter, "sampling_defaults", DEFAULT_SAMPLING))
    if args.sampling_config is not None:
        try:
            given = json.loads(args.sampling_config)
        except json.JSONDecodeError as e:
            raise ToolError(f"--sampling-config is not valid JSON ({e}); pass a JSON object such as "
                            '\'{"num_inference_steps": 12, "eta": 0.7}\'') from None
        if not isinstance(given, dict):
            raise ToolError(f"--sampling-config must be a JSON object (a dict of keys), got {type(given).__name__}")
        geometry = merge_dict_flag(geometry, given)
    return merge_dict_flag(geometry, args.sampling_keys)


def describe_geometry(args: argparse.Namespace, adapter, sampling) -> str:
    """One line saying what will be sampled and which values are the family's defaults (the
    flags did not set them): the defaults are a real recipe's, which on a tiny model or a CPU can
    take minutes where the user expected seconds."""
    given = set(args.sampling_keys)
    if args.sampling_config is not None:
        given |= set(json.loads(args.sampling_config))
    defaults = getattr(adapter, "sampling_defaults", DEFAULT_SAMPLING)
    shape = f"{sampling.height} x {sampling.width}"
    if args.task == "t2v":
        shape = f"{sampling.num_frames} frames of {shape}"
    taken = sorted(k for k in defaults if k not in given)
    origin = (f"the family's defaults for {', '.join(taken)} (--sampling-config sets them)" if taken
              else "all from --sampling-config")
    return (f"sampling {shape}, {sampling.num_inference_steps} steps, guidance {sampling.guidance_scale}, "
            f"{args.n_samples_per_prompt} per prompt: {origin}")


def lora_source(path: str, task: str) -> tuple[str, int | None] | None:
    """Where --lora's weights are: None for a PEFT adapter directory, else (save dir, iteration or
    None for the newest) of a checkpoint. ToolError, before anything loads, for anything else."""
    d = Path(path)
    # a two-expert model's (Wan2.2 A14B) adapter export: one adapter directory per transformer
    if (d / "adapter_config.json").is_file() or (d / "transformer_2" / "adapter_config.json").is_file():
        check_adapter_configs(path)
        return None
    tail = d.name[len("iter_"):]
    if d.name.startswith("iter_") and tail.isdigit():
        if d.parent.name != task:
            raise ToolError(f"--lora {path} is a checkpoint of task {d.parent.name!r}, not --task {task}")
        return str(d.parent.parent), int(tail)
    if (d / task).is_dir() and any(p.name.startswith("iter_") for p in (d / task).iterdir()):
        return str(d), None
    raise ToolError(f"--lora {path} is neither a PEFT adapter directory (adapter_config.json + "
                    "adapter_model.safetensors) nor a LoRA checkpoint (an iter_<N> directory, or a --save directory "
                    f"holding {task}/iter_*); write an adapter with `flowgrpo-export --form adapter --save-dir SAVE "
                    "--iteration N --output-dir DIR`, or pass the checkpoint itself")


def check_adapter_configs(path: str) -> None:
    """ToolError naming the file, the field and the fix unless every adapter_config.json that
    NativeEngine.load_lora_dir would read from the adapter directory `path` (its own, or those of
    transformer/ and transformer_2/ for a two-expert export) passes read_adapter_config: before the
    model loads and before the engine allocates the adapter."""
    from trainer.core.adapter_config import ADAPTER_CONFIG, AdapterConfigError, read_adapter_config

    d = Path(path)
    experts = [d / "transformer", d / "transformer_2"]
    for part in experts if all((p / ADAPTER_CONFIG).is_file() for p in experts) else [d]:
        try:
            read_adapter_config(part)
        except FileNotFoundError:
            raise ToolError(f"--lora {path}: {part / ADAPTER_CONFIG} does not exist; a two-expert adapter has "
                            "transformer/ and transformer_2/ each with its adapter_config.json") from None
        except AdapterConfigError as e:
            raise ToolError(f"--lora {path}: {e}") from None


def adapter_from_checkpoint(save_dir: str, iteration: int | None, task: str, adapter_path: str, out: Path) -> Path:
    """The checkpoint's LoRA as a PEFT adapter directory under `out`, written by the export's own
    code (tools/export_checkpoint.py --form adapter): small, and read without the base model."""
    from tools.export_checkpoint import ExportError, contract_mode, export_checkpoint, find_checkpoint
    from trainer.checkpoint import CONTRACT

    try:
        d, found = find_checkpoint(save_dir, task, iteration)
        try:
            full = contract_mode(json.loads((d / CONTRACT).read_text())) == "full"
        except (OSError, ValueError):
            full = False  # the export names a missing or damaged contract
        if full:
            raise ToolError(f"--lora {d} is a full fine-tune checkpoint, not a LoRA one: export it with "
                            f"`flowgrpo-export --form merged --save-dir {save_dir} --iteration {found} --output-dir DIR` "
                            "and pass DIR as --model-path")
        export_checkpoint(save_dir, task, iteration, out, form="adapter", model_adapter_path=adapter_path)
    except ExportError as e:
        raise ToolError(f"--lora: {e}") from None
    return out


def _sample(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.n_samples_per_prompt < 1:
        raise ToolError(f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    if args.rollout_id < 0:
        raise ToolError(f"--rollout-id must be >= 0, got {args.rollout_id}")
    if not (Path(args.model_path) / "model_index.json").is_file():
        raise ToolError(f"--model-path {args.model_path} has no model_index.json: pass a diffusers pipeline "
                        "directory (e.g. one written by save_pretrained or tools/make_tiny_model.py)")
    from trainer.models.wan import read_model_index

    try:  # a broken index would pick the wrong family, or one expert of two, without a word
        read_model_index(args.model_path)
    except ValueError as e:
        raise ToolError(str(e)) from None

    from trainer import artifacts
    from trainer.config import adapter_for_model_dir
    from trainer.dotpath import import_dotpath
    from trainer.engine.native import NativeEngine
    from trainer.models.base import geometry_problems
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    adapter_path = args.model_adapter_path or adapter_for_model_dir(args.model_path)
    try:
        adapter = import_dotpath(adapter_path, "--model-adapter-path")()
    except ValueError as e:  # the message names the flag and the dotpath
        raise ToolError(str(e)) from None
    # the family's task (an adapter's generation_task), as preflight pairs them in training
    args.task = args.task or getattr(adapter, "generation_task", "t2i")
    try:
        sampling = parse_sampling_config(sampling_geometry(args, adapter))
    except ValueError as e:  # the message names --sampling-config and the key
        raise ToolError(str(e)) from None
    problems = geometry_problems(adapter, args.model_path, sampling.height, sampling.width)
    if args.task == "t2v":  # a video family: the frame count's rule too, before the model loads
        from trainer.video import video_geometry_problems

        problems += video_geometry_problems(sampling.num_frames, sampling.height, sampling.width)
    if problems:
        raise ToolError("\n".join(problems))
    print(describe_geometry(args, adapter, sampling), flush=True)
    checkpoint = lora_source(args.lora, args.task) if args.lora else None
    prompts = read_prompts(args.prompt_data, args.task, args.media_root)
    target = artifacts.rollout_dir(args.output_dir, args.task, args.rollout_id)
    if target.exists() and any(target.iterdir()) and not args.overwrite:
        raise ToolError(f"{target} already holds artifacts; choose another --output-dir / --rollout-id or pass "
                        "--overwrite")

    with tempfile.TemporaryDirectory(prefix="sample-lora-") as tmp:
        lora_dir = args.lora
        if checkpoint is not None:
            lora_dir = str(adapter_from_checkpoint(*checkpoint, args.task, adapter_path, Path(tmp) / "adapter"))
        t0 = time.perf_counter()
        engine = NativeEngine(args.model_path, device=args.device, dtype=args.dtype,
                              max_batch_size=args.engine_batch_size, adapter=adapter)
        lora_hash = None
        if lora_dir:
            from trainer.engine.base import WeightSyncError

            try:
                cfg = engine.load_lora_dir(lora_dir)
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
    n_video = len(list(out.artifact_dir.glob("*.webp")))
    n_side = len(list(artifacts.iter_sidecars(out.artifact_dir)))
    media = f"{n_video} videos (animated WebP)" if n_video else f"{n_png} PNGs"
    print(f"wrote {media} and {n_side} sidecars to {out.artifact_dir} "
          f"(load {t_load:.1f}s, sample {out.stats['perf/rollout_time']:.1f}s, trained steps {out.sde_indices})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

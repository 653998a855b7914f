"""Evaluate the base model, checkpoints and exports on named prompt sets with pinned settings.

    python tools/evaluate.py --model-path BASE_DIR --eval-prompt-data held_out held_out.jsonl \\
        --candidate trained runs/x/checkpoints --candidate export exports/x --scorer color \\
        --sampling-config '{"height": 32, "width": 32, "num_inference_steps": 8}' \\
        --n-samples-per-prompt 8 --output-dir evals/x
    torchrun --nproc-per-node N tools/evaluate.py ...      # the same report, N ranks sharing the work

    python tools/evaluate.py --config configs/tiny_cpu_demo.toml --candidate trained runs/demo/checkpoints \\
        --output-dir runs/demo/eval          # a training recipe's eval settings, its scorers included

The base (--model-path) is always evaluated, as candidate "base"; each --candidate NAME PATH adds
one set of weights: a diffusers pipeline directory (a merged export, or any other model), a PEFT
adapter directory (flowgrpo-export --form adapter) loaded over the base, or a run's checkpoint: a
--save directory (its newest committed iteration of --task) or one iter_<N> directory of it (that
iteration). A LoRA checkpoint is read as its adapter, a full fine-tune one as its merged export over
--model-path, both through flowgrpo-export's own code.

Every candidate samples every prompt of every set exactly as the trainer's eval does
(trainer.rollout.generate_rollout with eval=True: the fixed trained steps, candidate seed
--generation-seed + prompt x K + sample), so a score depends only on (weights, prompt, sample, seed)
and the report is the same on any world size. Each --scorer ('name' or 'name=/model/dir', as
--eval-reward-scorers) scores every image. The report gives per set, candidate and component the
mean with a 95% bootstrap interval over prompts (--bootstrap-seed: deterministic), the paired win
rate against the base (same prompt, same seed), and per-prompt scores.

Writes OUTPUT_DIR/report.json (every setting the numbers depend on, the summary, every score),
OUTPUT_DIR/report.md with one PNG grid per set and candidate (a row per prompt: the base's samples,
then the candidate's with the same seeds; an edit's source first; a video as a frame strip), and
OUTPUT_DIR/artifacts/<candidate>/<set>/ (every sample's PNG, a video's animated WebP, named
group_<prompt line>_sample_<sample>: flowgrpo-score --prompt-data SET.jsonl rescores them). The
directory is built beside OUTPUT_DIR and renamed into place when complete; an existing non-empty
OUTPUT_DIR is refused unless --overwrite.

    python tools/evaluate.py --compare evals/run_a/report.json evals/run_b/report.json --output-dir evals/a_vs_b

compares two reports made with equal settings (refused otherwise): each candidate's mean and
interval in both, and the paired win rate of the second's candidate over the first's of the same
name, written to OUTPUT_DIR/compare.md and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, existing_file, output_dir, run_tool, tool_parser  # noqa: E402

#: a candidate's or a set's name becomes part of a file name
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BASE = "base"


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("evaluate", __doc__)
    p.add_argument("--config", type=existing_file, default=None,
                   help="a training recipe (TOML) whose eval settings are the defaults: --model-path, the adapter, the "
                        "task, --eval-prompt-data, --media-root, the sampling config (the ODE path for --algorithm "
                        "nft), --n-samples-per-eval-prompt, --generation-seed, --engine-batch-size and its scorers "
                        "(--reward-scorer-path with its options, and --eval-reward-scorers); a flag given here wins")
    p.add_argument("--model-path", type=existing_dir, help="the base: a local diffusers pipeline directory")
    p.add_argument("--model-adapter-path", default=None,
                   help="dotpath of the model family's adapter class (unset: the family model_index.json names)")
    p.add_argument("--eval-prompt-data", nargs="+", metavar="NAME PATH",
                   help="named prompt sets: NAME PATH [NAME PATH ...], JSONL in the training schema, as the trainer's "
                        "flag; names are 1-64 letters, digits, '_', '-' or '.'")
    p.add_argument("--media-root", default=None, type=existing_dir,
                   help="directory whose files the prompt files may also name as source images, beside their own "
                        "directories ('/' allows any file)")
    p.add_argument("--candidate", nargs=2, action="append", default=[], metavar=("NAME", "PATH"),
                   help="weights to evaluate against the base: a pipeline directory, a PEFT adapter directory, a "
                        "--save directory (newest iteration) or an iter_<N> directory; repeatable")
    p.add_argument("--scorer", action="append", default=[], metavar="NAME[=MODEL_DIR]",
                   help="a scorer short name or dotpath, with its model directory when it needs one (as "
                        "--eval-reward-scorers); repeatable, at least one")
    p.add_argument("--sampling-config", default=None,
                   help="JSON object of --sampling-config keys over the family's recipe geometry, as flowgrpo-sample; "
                        "one key at a time: --sampling-config.num_inference_steps 10")
    p.add_argument("--n-samples-per-prompt", type=int, default=None,
                   help="samples (seeds) per prompt, >= 1 (unset: the recipe's --n-samples-per-eval-prompt, else 4)")
    p.add_argument("--generation-seed", type=int, default=None,
                   help="base seed: sample s of prompt g draws from seed + g x K + s, as the trainer's eval (unset: "
                        "the recipe's, else 1234)")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap's resampling")
    p.add_argument("--bootstrap-resamples", type=int, default=1000, help="bootstrap resamples, >= 100")
    p.add_argument("--task", "--generation-task", dest="task", default=None,
                   help="generation task (unset: the family's: i2i for an editing family, t2v for video, else t2i)")
    p.add_argument("--device", default=None, help="cpu / cuda (unset: cuda if available); a rank uses its local GPU")
    p.add_argument("--dtype", default=None, help="bf16 / fp32 (unset: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--engine-batch-size", type=int, default=None,
                   help="candidates per DiT forward (<= 0: all; unset: the recipe's, else 8); recorded, since a batch's "
                        "floats differ from another batch's in the last bits: the trainer's eval at one rank matches "
                        "with its --engine-batch-size")
    p.add_argument("--reward-batch-size", type=int, default=16, help="images per scorer call, >= 1")
    p.add_argument("--output-dir", "--output", dest="output_dir", required=True,
                   help="the report's directory (refused when it exists and is not empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report in --output-dir")
    p.add_argument("--compare", nargs=2, metavar=("REPORT_A", "REPORT_B"), type=existing_file,
                   help="compare two report.json files instead of evaluating")
    return p


def main(argv=None) -> int:
    from tools.sample import split_dict_keys

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, sampling_keys = split_dict_keys(argv, "sampling-config")
    except ToolError as e:
        print(f"flowgrpo-eval: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.sampling_keys = sampling_keys
    from trainer.artifacts import ArtifactError
    from trainer.data import DataError

    if args.compare:
        return run_tool("evaluate", lambda: _compare(args), (ValueError,))
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    rc = run_tool("evaluate", lambda: _evaluate(args), (DataError, ArtifactError))
    if torchrun:  # torchrun's gloo ranks can abort in interpreter teardown: leave the way the trainer does
        from trainer.distributed import shutdown_and_exit

        shutdown_and_exit(rc)
    return rc


# ---------------------------------------------------------------------------------------------
# checks: everything knowable before a model loads

def check_output(path: str, overwrite: bool) -> None:
    output_dir("--output-dir", path)
    p = Path(path)
    if p.is_symlink():
        raise ToolError(f"--output-dir {path} is a symbolic link; give a real directory path")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise ToolError(f"--output-dir {path} already holds files (an earlier report?); choose another directory or "
                        "pass --overwrite to replace it")


def eval_set_pairs(values: list[str] | None) -> list[tuple[str, str]]:
    if not values:
        raise ToolError("--eval-prompt-data is required: NAME PATH [NAME PATH ...] (e.g. held_out prompts.jsonl)")
    if len(values) % 2:
        raise ToolError(f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values")
    pairs = list(zip(values[::2], values[1::2]))
    for name, path in pairs:
        if not NAME_RE.match(name):
            raise ToolError(f"--eval-prompt-data name {name!r} must be 1-64 letters, digits, '_', '-' or '.', starting "
                            "with a letter or digit (it names files of the report)")
        if not Path(path).is_file():
            raise ToolError(f"--eval-prompt-data {name}: {path} is not a file")
    return pairs


def load_sets(pairs: list[tuple[str, str]], task: str, media_root: str | None) -> dict:
    """{name: PromptDataset} through the trainer's reader (media confined to each file's directory
    or --media-root), every source image's header checked."""
    from trainer.data import load_eval_sets
    from trainer.models.edit_source import source_file_problems

    sets = load_eval_sets(pairs, task=task, media_root=media_root)
    bad = [p for ds in sets.values() for p in source_file_problems(ds)]
    if bad:
        raise ToolError(f"{len(bad)} source image(s) no rollout can use: {'; '.join(bad[:10])}; fix or drop those "
                        "records (flowgrpo-inspect-data --decode-media checks them)")
    return sets


def classify_candidate(name: str, path: str, task: str) -> dict:
    """{"kind": base / pipeline / adapter / checkpoint, "path", "save_dir", "iteration"} of one
    --candidate; ToolError naming it for anything else."""
    from tools.sample import lora_source

    if not NAME_RE.match(name) or name == BASE:
        raise ToolError(f"--candidate name {name!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a "
                        f"letter or digit, and not {BASE!r} (the base model's)")
    if not Path(path).is_dir():
        raise ToolError(f"--candidate {name}: {path} is not a directory")
    if (Path(path) / "model_index.json").is_file():
        return {"kind": "pipeline", "path": str(Path(path).resolve()), "iteration": None}
    try:
        ckpt = lora_source(path, task)
    except ToolError as e:
        raise ToolError(f"--candidate {name}: {str(e).removeprefix('--lora ')}; or pass a pipeline directory "
                        "(model_index.json)") from None
    if ckpt is None:
        return {"kind": "adapter", "path": str(Path(path).resolve()), "iteration": None}
    return {"kind": "checkpoint", "path": str(Path(path).resolve()), "save_dir": ckpt[0], "iteration": ckpt[1]}


def resolve_candidate(name: str, source: dict, base_path: str, task: str, adapter_path: str, tmp: Path):
    """The Candidate to load: a checkpoint becomes its adapter (LoRA) or its merged export (full
    fine-tune) under `tmp`, written by flowgrpo-export's code."""
    from tools.export_checkpoint import ExportError, contract_mode, export_checkpoint, find_checkpoint
    from trainer.checkpoint import CONTRACT
    from trainer.evaluation import Candidate

    if source["kind"] == "pipeline":
        return Candidate(name, source["path"], None, source)
    if source["kind"] == "adapter":
        return Candidate(name, base_path, source["path"], source)
    try:
        d, found = find_checkpoint(source["save_dir"], task, source["iteration"])
        source = {**source, "iteration": found}
        try:
            full = contract_mode(json.loads((d / CONTRACT).read_text())) == "full"
        except (OSError, ValueError):
            full = False  # the export names a missing or damaged contract
        out = tmp / name
        export_checkpoint(source["save_dir"], task, found, out, form="merged" if full else "adapter",
                          model_adapter_path=adapter_path, base_model_path=base_path if full else None)
    except ExportError as e:
        raise ToolError(f"--candidate {name}: {e}") from None
    return Candidate(name, str(out), None, source) if full else Candidate(name, base_path, str(out), source)


# ---------------------------------------------------------------------------------------------

def _evaluate(args: argparse.Namespace) -> int:
    import logging

    from tools.sample import check_adapter_configs, sampling_geometry

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    recipe = recipe_defaults(args) if args.config else None
    if args.model_path is None:
        raise ToolError("--model-path is required: the base model's pipeline directory")
    if not (Path(args.model_path) / "model_index.json").is_file():
        raise ToolError(f"--model-path {args.model_path} has no model_index.json: pass a diffusers pipeline directory")
    for flag, value in (("n_samples_per_prompt", 4), ("generation_seed", 1234), ("engine_batch_size", 8)):
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.n_samples_per_prompt < 1:
        raise ToolError(f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    if args.bootstrap_resamples < 100:
        raise ToolError(f"--bootstrap-resamples must be >= 100, got {args.bootstrap_resamples}")
    if args.reward_batch_size < 1:
        raise ToolError(f"--reward-batch-size must be >= 1, got {args.reward_batch_size}")
    if not args.scorer and recipe is None:
        raise ToolError("--scorer is required (repeatable): a shipped short name such as color or pickscore=/models/"
                        "PickScore_v1, or a scorer dotpath")
    names = [n for n, _ in args.candidate]
    if len(set(names)) != len(names):
        raise ToolError(f"--candidate names must be unique, got {names}")
    check_output(args.output_dir, args.overwrite)
    pairs = eval_set_pairs(args.eval_prompt_data)

    from trainer.config import adapter_for_model_dir, unknown_scorer_name
    from trainer.dotpath import import_dotpath
    from trainer.models.base import geometry_problems
    from trainer.rewards.watch import parse_eval_scorers
    from trainer.sampling import parse_sampling_config

    try:
        scorers = parse_eval_scorers(args.scorer)
    except ValueError as e:
        raise ToolError(str(e).replace("--eval-reward-scorers", "--scorer")) from None
    if not scorers:  # --config without --scorer: the recipe's, built as the trainer builds them
        scorers = recipe_scorers(recipe)
    for scorer, model_dir in scorers[1:] if not args.scorer else scorers:
        why = unknown_scorer_name("--scorer", scorer)
        if why:
            raise ToolError(why)
        if model_dir is not None and not Path(model_dir).is_dir():
            raise ToolError(f"--scorer {scorer}={model_dir}: {model_dir} is not a directory")
    adapter_path = args.model_adapter_path or adapter_for_model_dir(args.model_path)
    try:
        adapter = import_dotpath(adapter_path, "--model-adapter-path")()
    except ValueError as e:
        raise ToolError(str(e)) from None
    args.task = args.task or getattr(adapter, "generation_task", "t2i")
    try:
        sampling = parse_sampling_config(sampling_geometry(args, adapter) if recipe is None
                                         else recipe_sampling(args, recipe))
    except ValueError as e:
        raise ToolError(str(e)) from None
    problems = geometry_problems(adapter, args.model_path, sampling.height, sampling.width)
    if args.task == "t2v":
        from trainer.video import video_geometry_problems

        problems += video_geometry_problems(sampling.num_frames, sampling.height, sampling.width)
    if problems:
        raise ToolError("\n".join(problems))
    sources = [classify_candidate(n, p, args.task) for n, p in args.candidate]
    for s in sources:
        if s["kind"] == "adapter":
            check_adapter_configs(s["path"])
    sets = load_sets(pairs, args.task, args.media_root)
    return _run(args, adapter, adapter_path, sampling, scorers, sources, sets, recipe)


def recipe_defaults(args: argparse.Namespace):
    """The recipe of --config (trainer.config.load_config, as the trainer reads it), its eval
    settings filled into every flag left unset; ToolError naming the file when it does not load."""
    from trainer.config import load_config

    try:
        cfg = load_config(["--config", args.config])
    except (ValueError, OSError, SystemExit) as e:
        raise ToolError(f"--config {args.config}: {e}") from None
    for flag, value in (("model_path", cfg.model.model_path), ("model_adapter_path", cfg.model.model_adapter_path),
                        ("task", cfg.model.generation_task), ("media_root", cfg.rollout.media_root),
                        ("n_samples_per_prompt", cfg.eval.n_samples_per_eval_prompt),
                        ("generation_seed", cfg.rollout.generation_seed),
                        ("engine_batch_size", int(cfg.rollout.engine_batch_size or 0)),
                        # the engine samples in the dtype the actor replays in (trainer.loop)
                        ("dtype", cfg.fsdp.fsdp_param_dtype)):
        if getattr(args, flag) is None and value is not None:
            setattr(args, flag, value)
    if args.eval_prompt_data is None and cfg.eval.eval_prompt_data:
        args.eval_prompt_data = [str(x) for pair in cfg.eval.eval_prompt_data for x in pair]
    if args.model_path is not None and not Path(args.model_path).is_dir():
        raise ToolError(f"--config {args.config}: its model-path {args.model_path} is not a directory")
    return cfg


def recipe_sampling(args: argparse.Namespace, cfg) -> dict:
    """The recipe's sampling config with --sampling-config's keys, then --sampling-config.KEY's,
    merged over it; the deterministic ODE path under --algorithm nft, as the trainer's eval."""
    from trainer.config import merge_sampling_config
    from trainer.sampling import parse_sampling_config

    geometry = dict(cfg.rollout.sampling_config or {})
    if args.sampling_config is not None:
        try:
            given = json.loads(args.sampling_config)
        except json.JSONDecodeError as e:
            raise ToolError(f"--sampling-config is not valid JSON ({e})") from None
        if not isinstance(given, dict):
            raise ToolError("--sampling-config must be a JSON object")
        geometry = merge_sampling_config(geometry, given)
    geometry = merge_sampling_config(geometry, args.sampling_keys)
    if cfg.grpo.algorithm == "nft":
        from trainer.nft import ode_rollout_sampling

        return ode_rollout_sampling(parse_sampling_config(geometry)).to_dict()
    return geometry


def build_managers(scorers, recipe, device, batch_size: int) -> list:
    """One RewardManager per scorer. recipe: the --config recipe whose scorers these are
    (recipe_scorers): the trained one built from its reward section (runtime, endpoint, scorer
    options) and the held-out ones as the trainer builds them; None: each --scorer in this
    process."""
    from trainer.rewards.manager import RewardManager, reward_manager_from_config

    runtime = "colocate" if device.type == "cuda" else "cpu"
    try:
        if recipe is not None:
            return [reward_manager_from_config(recipe.reward, device, batch_size=batch_size)] + [
                reward_manager_from_config(recipe.reward, device, scorer_path=name, model_path=path,
                                           batch_size=batch_size) for name, path in scorers[1:]]
        return [RewardManager(runtime, name, path, device, batch_size=batch_size) for name, path in scorers]
    except (ValueError, TypeError, OSError) as e:
        raise ToolError(f"--scorer: {e}") from None


def recipe_scorers(cfg) -> list[tuple[str, str | None]]:
    """The recipe's scorers: its trained one, then its --eval-reward-scorers."""
    from trainer.rewards.watch import parse_eval_scorers

    trained = cfg.reward.reward_scorer_path or f"remote:{cfg.reward.reward_endpoint}"
    return [(trained, cfg.reward.reward_model_path)] + parse_eval_scorers(cfg.reward.eval_reward_scorers)


def _run(args, adapter, adapter_path, sampling, scorers, sources, sets, recipe=None) -> int:
    """Inputs checked: load and evaluate each candidate on every rank, then rank 0 writes."""
    import shutil

    import torch
    import torch.distributed as dist

    from trainer.cli import quiet_third_party
    from trainer.core.files import follow_umask, fsync_tree
    from trainer.distributed import init_distributed
    from trainer.engine.native import NativeEngine
    from trainer.evaluation import Candidate, Settings, build_report, evaluate_candidate, write_report
    from trainer.loop import engine_options, git_revision

    quiet_third_party(load=True)
    # a recipe's engine options change the samples (the text window, FP8, compiled blocks): the trainer's
    options = {} if recipe is None else {k: v for k, v in engine_options(recipe.rollout, recipe.fsdp.fp8_fast_accum).items()
                                         if k != "attention_backend"}  # the SGLang engine's only
    env_before = dict(os.environ)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    info = init_distributed(device_type.split(":")[0])
    target = Path(args.output_dir).absolute()
    staging = None
    try:
        settings = Settings(task=args.task, sampling=sampling, n_samples=args.n_samples_per_prompt,
                            generation_seed=args.generation_seed, scorers=tuple(scorers),
                            engine_batch_size=args.engine_batch_size,
                            engine_dtype=args.dtype or ("bf16" if info.device.type == "cuda" else "fp32"),
                            engine_options=options, bootstrap_seed=args.bootstrap_seed, bootstrap_resamples=args.bootstrap_resamples)
        # one staging directory for all ranks (rank 0 names it): renamed into place when complete
        box = [None]
        if info.rank == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            box[0] = tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent)
        dist.broadcast_object_list(box, src=0)
        staging = Path(box[0])
        managers = build_managers(scorers, recipe if not args.scorer else None, info.device, args.reward_batch_size)
        results = {}
        candidates = [Candidate(BASE, str(Path(args.model_path).resolve()), None, {"kind": "base", "path": None,
                                                                                     "iteration": None})]
        with tempfile.TemporaryDirectory(prefix="evaluate-") as tmp:
            candidates += [resolve_candidate(n, s, args.model_path, args.task, adapter_path, Path(tmp))
                           for (n, _), s in zip(args.candidate, sources)]
            for cand in candidates:
                engine = NativeEngine(cand.model_path, device=info.device, dtype=args.dtype,
                                      max_batch_size=args.engine_batch_size, adapter=adapter, **options)
                if cand.lora_dir:
                    engine.load_lora_dir(cand.lora_dir)
                results[cand.name] = evaluate_candidate(engine, adapter, managers, sets, settings,
                                                        staging / "artifacts" / cand.name, info.rank, info.world_size)
                del engine
                if info.rank == 0:
                    print(f"flowgrpo-eval: {cand.name}: " + "; ".join(
                        f"{s}: " + ", ".join(f"{c} {_mean_text(v)}" for c, v in sorted(r["scores"].items()))
                        for s, r in results[cand.name].items()), flush=True)
        if info.rank == 0:
            report = build_report(settings, sets, candidates, results,
                                  {"model_path": str(Path(args.model_path).resolve()), "model_adapter_path": adapter_path,
                                   "device_type": info.device.type, "world_size": info.world_size,
                                   "git_revision": git_revision()})
            write_report(staging, report, sets, candidates, results)
            follow_umask(staging)
            fsync_tree(staging)
            if target.exists():  # checked before anything ran; --overwrite was given
                shutil.rmtree(target)
            staging.rename(target)
            staging = None
            print(f"flowgrpo-eval: wrote {target / 'report.json'}, {target / 'report.md'} and its grids")
        dist.barrier()
        return 0
    finally:
        if staging is not None and info.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # in-process: leave no process group or its variables
            if dist.is_initialized():
                dist.destroy_process_group()
            for k in set(os.environ) - set(env_before):
                del os.environ[k]


def _mean_text(v) -> str:
    """The mean of a score table's finite entries, or a note that none was finite."""
    finite = v[v == v]
    return f"{float(finite.mean()):.4f}" if finite.size else "not scored (NaN everywhere)"


def _compare(args: argparse.Namespace) -> int:
    from trainer.core.files import atomic_writer
    from trainer.evaluation import comparable, compare_reports

    check_output(args.output_dir, args.overwrite)
    reports = []
    for path in args.compare:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ToolError(f"--compare {path}: not a readable report.json ({e})") from None
        if not isinstance(reports[-1], dict) or "settings" not in reports[-1]:
            raise ToolError(f"--compare {path}: not a flowgrpo-eval report.json")
    problems = comparable(*reports)
    if problems:
        raise ToolError("the two reports cannot be compared number for number: " + "; ".join(problems)
                        + "; evaluate both with the same settings")
    labels = [Path(p).parent.name or Path(p).name for p in args.compare]
    if labels[0] == labels[1]:
        labels = ["A", "B"]
    page = compare_reports(*reports, *labels)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_writer(out / "compare.md") as f:
        f.write(page.encode())
    print(page)
    print(f"flowgrpo-eval: wrote {out / 'compare.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""End to end: the real training loop under torchrun (2 gloo processes) on the tiny model.

One uninterrupted run of 4 rollouts is compared with a run of 2 rollouts resumed with --load
for 2 more: the weights, policy version, lr step and the images sampled after the resume must
be identical, and with an EMA (evaluated with --eval-use-ema) the EMA too. The same runs check
the artifacts, the TensorBoard series, the checkpoints and the export of the EMA.
A last test starts two single-process torchrun "nodes" on 127.0.0.1 (multi-node launch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers.launch import ROOT, free_port
from tests.workers.recipes import TINY_GEOMETRY, TINY_SAMPLING

# The reference's Monitoring series (those that exist on CPU: no perf/mem_* without CUDA).
EXPECTED_SERIES = [
    "train/loss", "train/ratio_mean", "train/ratio_std", "train/ratio_min", "train/ratio_max",
    "train/clip_fraction", "train/approx_kl", "train/grad_norm", "train/lr", "train/optimizer_steps",
    "train/optimizer_skips", "train/num_microbatches", "train/policy_version", "train/weight_sync_tensors",
    "train/weight_sync_gb", "train/weight_sync_failures", "train/checkpoint_failures",
    "reward/color_mean", "reward/color_std", "reward/color_min", "reward/color_max",
    "reward/advantage_mean", "reward/advantage_std", "reward/num_groups", "reward/group_std_mean",
    "reward/degenerate", "reward/score_time", "reward/score_samples_per_s",
    "perf/train_transitions_per_s", "perf/train_samples_per_s",
    "perf/rollout_time", "perf/reward_time", "perf/train_time", "perf/sync_time", "perf/step_time",
    "perf/watch_time", "perf/watch_stats_time", "perf/end_update_time", "perf/gc_time", "perf/gc_full_collections",
    "eval/demo/color_mean", "eval/other/color_mean",
    # beyond the reference: the trained (weighted) reward, eval spreads, rollout throughput
    "reward/weighted_total_mean", "reward/weighted_total_std", "reward/color_group_std_mean",
    "eval/demo/color_std", "eval/demo/weighted_total_mean", "perf/rollout_images_per_s",
    "perf/rollout_images_per_s_per_gpu", "perf/rollout_encode_time", "perf/rollout_denoise_time",
    "perf/rollout_decode_time",
    # the reward-hacking watch, and a held-out scorer computed only at eval
    "reward/stat_dark_fraction", "reward/stat_group_diversity", "reward/stat_jpeg_bytes_per_pixel",
    "reward/hacking_suspect", "reward/watch_trained_rise", "eval/demo/jpeg_compressibility_mean",
]

PROMPTS = ["a red ball", "a green cube", "a blue cup", "a yellow hat", "a purple box", "a cyan kite"]


def _write_prompts(path: Path, prompts: list[str], prefix: str) -> Path:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"{prefix}{i}"}}) + "\n")
    return path


def _recipe(tmp: Path, model_dir: Path, mode: str, extra: str = "") -> Path:
    """A 2-rank recipe of the tiny model at `model_dir`; `extra` is more top-level TOML (e.g. the
    model adapter of another family)."""
    train = _write_prompts(tmp / "train.jsonl", PROMPTS, "t")
    evalf = _write_prompts(tmp / "eval.jsonl", ["a white ball", "a black cube"], "e")
    evalg = _write_prompts(tmp / "eval2.jsonl", ["an orange kite"], "o")
    lora = mode == "lora"
    ema = mode == "full-ema"
    # the full-FT runs also hand the device back and forth (--offload-train / --offload-rollout),
    # through the resume and the checkpoints written between the sync and the actor's offload
    text = f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 2
generation-task = "t2i"
model-path = "{model_dir}"
prompt-data = "{train}"
eval-prompt-data = ["demo", "{evalf}", "other", "{evalg}"]
eval-interval = 2
n-samples-per-eval-prompt = 2
eval-reward-scorers = ["jpeg_compressibility"]
hacking-baseline-rollouts = 1
{TINY_GEOMETRY}
{extra}
fsdp-trainable-mode = "{'lora' if lora else 'full'}"
{'ema-decay = 0.9' if ema else ''}
{'ema-update-interval = 3' if ema else ''}
{'eval-use-ema = true' if ema else ''}
{'lora-rank = 4' if lora else ''}
{'lora-alpha = 8' if lora else ''}
{'lora-adapter-mode = true' if lora else ''}
{'fsdp-master-dtype = "fp32"' if lora else ''}
{'' if lora else 'offload-train = true'}
{'' if lora else 'offload-rollout = true'}
eps-clip = 1e-3
lr = 1e-3
weight-decay = 0.0
reward-runtime = "cpu"
reward-scorer-path = "color"
save-interval = 1
artifact-retention-rollouts = 2

{TINY_SAMPLING}"""
    path = tmp / f"{mode}.toml"
    path.write_text(text)
    return path


def _train(recipe: Path, out: Path, *args: str, timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "trainer.train", "--config", str(recipe),
           "--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"),
           "--tensorboard-dir", str(out / "tb"), *args]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"training exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _check_watch_matches_the_pngs(rollout_dir: Path, scalars: dict, rollout: int, group_size: int) -> None:
    """The watch's statistics, computed on its worker thread while the update ran and gathered
    over both ranks, equal the synchronous computation on the rollout's PNGs (the same uint8
    pixels: the watch quantises as the PNG writer does), in candidate order."""
    import numpy as np
    from PIL import Image

    from trainer.rewards.watch import per_image_statistics, rollout_statistics

    pngs = sorted(rollout_dir.glob("*.png"))  # group_<g>_sample_<s>.png: the global candidate order
    assert len(pngs) == 8
    local = per_image_statistics([np.asarray(Image.open(p).convert("RGB")) for p in pngs])
    means, _ = rollout_statistics(local, group_size)
    for name, mean in means.items():
        logged = dict(scalars[f"reward/stat_{name}"])[rollout]
        assert logged == pytest.approx(mean, rel=1e-5, abs=1e-7), name


def _model_tensors(ckpt: Path, iteration: int, ema: bool = False, task: str = "t2i") -> dict[str, torch.Tensor]:
    from tools.export_checkpoint import load_checkpoint

    return dict(load_checkpoint(ckpt, task, iteration, ema=ema).tensors.items())


def _dcp_keys(ckpt: Path, iteration: int) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    fsdp = ckpt / "t2i" / f"iter_{iteration:07d}" / "fsdp"
    return set(FileSystemReader(str(fsdp)).read_metadata().state_dict_metadata)


def _state(ckpt: Path, iteration: int, task: str = "t2i") -> dict:
    return json.loads((ckpt / task / f"iter_{iteration:07d}" / "trainer_state.json").read_text())


def assert_resume_is_exact(a: Path, b: Path, iteration: int, rollouts, candidates: int, *, policy_version: int,
                           lr_steps: int, task: str = "t2i", media: str = "*.png") -> dict[str, torch.Tensor]:
    """Runs a (uninterrupted) and b (resumed) agree at checkpoint `iteration`: the same model
    tensors, policy version (`policy_version`), lr step (`lr_steps`) and rollout id, and the same
    `candidates` PNGs (files matching `media`), byte for byte, in each rollout of `rollouts`.
    Returns a's tensors."""
    ta, tb = _model_tensors(a / "ckpt", iteration, task=task), _model_tensors(b / "ckpt", iteration, task=task)
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    sa, sb = _state(a / "ckpt", iteration, task), _state(b / "ckpt", iteration, task)
    for key in ("policy_version", "lr_scheduler_steps", "rollout_id"):
        assert sa[key] == sb[key], key
    assert sa["policy_version"] == policy_version and sa["lr_scheduler_steps"] == lr_steps
    for rollout in rollouts:
        da = a / "artifacts" / task / f"rollout_{rollout:07d}"
        db = b / "artifacts" / task / f"rollout_{rollout:07d}"
        pngs = sorted(p.name for p in da.glob(media))
        assert len(pngs) == candidates and pngs == sorted(p.name for p in db.glob(media))
        for name in pngs:
            assert (da / name).read_bytes() == (db / name).read_bytes(), f"rollout {rollout} {name}"
    return ta


@pytest.mark.parametrize("mode", ["full", "lora", "full-ema"])
def test_loop_resume_is_exact(tmp_path, tiny_model_dir, mode):
    # the full-FT runs also evaluate the base model before rollout 0 (--eval-base)
    recipe = _recipe(tmp_path, tiny_model_dir, mode, extra="eval-base = true" if mode == "full" else "")
    a, b = tmp_path / "a", tmp_path / "b"
    log_a = _train(recipe, a, "--num-rollout", "4")
    _train(recipe, b, "--num-rollout", "2")
    log = _train(recipe, b, "--num-rollout", "4", "--load", str(b / "ckpt"))
    assert "continuing at rollout 2" in log
    assert ("base model eval:" in log_a) == (mode == "full") and "base model eval:" not in log  # not on a resume

    # same weights, policy version and lr step after rollout 3, and the resumed run sampled
    # exactly what the uninterrupted one sampled after the resume point
    ta = assert_resume_is_exact(a, b, 3, (2, 3), 8, policy_version=4, lr_steps=8)
    if mode == "lora":
        assert all("lora_" in n for n in ta), "a LoRA checkpoint stores only the adapter"
        contract = json.loads((a / "ckpt" / "t2i" / "iter_0000003" / "adapter_contract.json").read_text())
        assert contract["lora_rank"] == 4 and contract["lora_alpha"] == 8
        from trainer.metrics import read_scalars

        for run in (a, b):  # the adapter goes in before rollout 0 of a fresh run; a resume syncs it instead
            scalars = read_scalars(run / "tb")
            assert [k for k, _ in scalars["perf/adapter_install_time"]] == [0]
            assert [int(v) for _, v in scalars["train/policy_version"]] == [1, 2, 3, 4]

    keys = _dcp_keys(a / "ckpt", 3)
    if mode != "full-ema":  # EMA off: the checkpoint holds the model and the optimizer only
        assert {k.split(".")[0] for k in keys} == {"model", "optim"}
    else:
        _check_ema_resume_and_export(a, b, tmp_path, ta, keys)
    if mode != "full":
        return
    # artifacts: the reference layout, retention keeps 2 rollouts, eval under eval/<task>/
    rollouts = sorted(p.name for p in (a / "artifacts" / "t2i").iterdir())
    assert rollouts == ["rollout_0000002", "rollout_0000003"]
    assert sorted(p.name for p in (a / "artifacts" / "t2i" / "rollout_0000003").glob("*.safetensors")) == [
        "group_00000000.safetensors", "group_00000001.safetensors"]
    # two eval sets: one directory each, never overwriting each other
    for name, groups in (("demo", 2), ("other", 1)):
        sidecars = list((a / "artifacts" / "eval" / "t2i" / name / "rollout_0000003").glob("*.safetensors"))
        assert len(sidecars) == groups, name
        # each eval rollout's index names its files beside their prompts and scores (no advantage)
        index = (a / "artifacts" / "eval" / "t2i" / name / "rollout_0000003" / "index.jsonl").read_text()
        entries = [json.loads(line) for line in index.splitlines()]
        assert [e["group"] for e in entries] == list(range(groups)), name
        assert all(set(c) == {"slot", "file", "scores"} and "color" in c["scores"] for e in entries
                   for c in e["candidates"])
    # the training rollout's index: every PNG of the directory, under its group's prompt
    d = a / "artifacts" / "t2i" / "rollout_0000003"
    entries = [json.loads(line) for line in (d / "index.jsonl").read_text().splitlines()]
    assert sorted(c["file"] for e in entries for c in e["candidates"]) == sorted(p.name for p in d.glob("*.png"))
    assert all("advantage" in c for e in entries for c in e["candidates"]) and (d / "index.html").is_file()
    records = list((a / "artifacts" / "recipes").glob("full-*.json"))
    assert records and json.loads(records[0].read_text())["weight_sync_mode"] == "full"
    # checkpoints: COMMITTED, markers
    assert (a / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (a / "ckpt" / "t2i" / "iter_0000003" / "COMMITTED").is_file()
    # metrics: every series of the reference's Monitoring table that exists on CPU
    from trainer.metrics import read_scalars

    scalars = read_scalars(a / "tb")
    missing = [s for s in EXPECTED_SERIES if s not in scalars]
    assert not missing, missing
    assert [int(v) for _, v in scalars["train/policy_version"]] == [1, 2, 3, 4]
    _check_watch_matches_the_pngs(a / "artifacts" / "t2i" / "rollout_0000003", scalars, rollout=3, group_size=4)
    # the first update of every rollout starts at ratio 1: ratio_min <= 1 <= ratio_max
    for (_, lo), (_, hi) in zip(scalars["train/ratio_min"], scalars["train/ratio_max"]):
        assert lo <= 1.0 <= hi
    # the base model's eval (--eval-base) at step 0, then every eval; its images apart
    assert [s for s, _ in scalars["eval/demo/color_mean"]] == [0, 1, 3]
    assert len(list((a / "artifacts" / "eval_base" / "eval" / "t2i" / "demo" / "rollout_0000000").glob("*.png"))) == 4
    # TensorBoard beyond scalars: the run is named after the recipe (full.toml), rollout grids
    # every rollout, each eval prompt under one tag at every eval (the base at 0, rollouts 1 and
    # 3), whichever rank generated it (the demo set's second prompt is rank 1's), the per-prompt
    # table, and the reward / advantage histograms
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert [p.name for p in (a / "tb").iterdir()] == ["full"]
    acc = EventAccumulator(str(a / "tb" / "full"), size_guidance={"images": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("rollout/candidates")] == [0, 1, 2, 3]
    for tag in ("eval/demo/prompt_000", "eval/demo/prompt_001", "eval/other/prompt_000"):
        assert [e.step for e in acc.Images(tag)] == [0, 1, 3], tag
    assert "eval/demo/per_prompt/text_summary" in acc.Tags()["tensors"]
    for tag in ("reward/color_hist", "reward/weighted_total_hist", "reward/advantage_hist"):
        assert [e.step for e in acc.Histograms(tag)] == [0, 1, 2, 3], tag
    assert "full" in acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    # the progress bars stay out of a log file: no carriage-return frames in the captured output
    assert "\r" not in log_a


def _check_ema_resume_and_export(a: Path, b: Path, tmp: Path, live: dict[str, torch.Tensor], keys: set[str]) -> None:
    """The EMA after the resume equals the uninterrupted run's bit for bit; it is not the live
    weights; tools/export_checkpoint.py --ema writes it, and refuses a checkpoint without one."""
    from tools.export_checkpoint import export_checkpoint

    ema_keys = {k[len("ema."):] for k in keys if k.startswith("ema.")}
    assert ema_keys and all(f"model.{n}" in keys for n in ema_keys)
    ea, eb = _model_tensors(a / "ckpt", 3, ema=True), _model_tensors(b / "ckpt", 3, ema=True)
    assert ea.keys() == eb.keys() == live.keys()
    for name in ea:
        assert torch.equal(ea[name], eb[name]), name
    averaged = [n for n in ea if ea[n].dtype == torch.float32 and not torch.equal(ea[n], live[n].float())]
    assert len(averaged) >= len(ema_keys) // 2, "the EMA should lag the live weights"
    sa = _state(a / "ckpt", 3)
    assert sa["ema_decay"] == 0.9 and sa["ema_update_interval"] == 3

    info = export_checkpoint(a / "ckpt", "t2i", 3, tmp / "ema_export", form="merged", verify=True, ema=True)
    assert info["weights"] == "ema" and info["ema_decay"] == 0.9
    from safetensors.torch import load_file

    written: dict[str, torch.Tensor] = {}
    for f in (tmp / "ema_export" / "transformer").glob("*.safetensors"):
        written.update(load_file(f))
    name = averaged[0]
    assert torch.equal(written[name], ea[name].to(written[name].dtype))
    assert not torch.equal(written[name], live[name].to(written[name].dtype))


def test_two_nodes_on_loopback(tmp_path, tiny_model_dir):
    """torchrun --nnodes 2 with one process per "node", rendezvous on 127.0.0.1: a rollout and
    an update run across them."""
    recipe = _recipe(tmp_path, tiny_model_dir, "full")
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs = []
    for node in range(2):
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "trainer.train", "--config", str(recipe), "--num-rollout", "1",
               "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1",
               "--fsdp-load-wave-size", "1",  # engine and actor load one node after the other
               "--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"),
               "--tensorboard-dir", str(out / "tb")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-6000:]
    assert '"summary"' in outs[0]
    assert (tmp_path / "run" / "ckpt" / "t2i" / "iter_0000000" / "COMMITTED").is_file()

"""A newcomer's first hour with video and editing, through the commands the docs give: the sample
tool's video defaults, a partial --sampling-config, a mistyped scorer name, --load pointed at the
wrong level, and the warnings a Wan run prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_fsdp_view_warning_is_silenced_for_wans_roots_and_shown_for_other_modules():
    """FSDP2's "returned a view tensor" warning, as torch words it, for the root of each Wan model
    (one DiT, two experts) is silenced like the image families'; for a block, or any module not a
    root transformer, it still shows."""
    import warnings

    from trainer.loop import silence_known_harmless_warnings

    text = ("FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view (e.g., `x += y`) will "
            "silently drop the pre-backward hook and skip the all-gather, which can cause backward to fail or "
            "produce wrong gradients.")
    roots = ["FSDPWanTransformer3DModel", "FSDPWanExperts", "FSDPQwenImageTransformer2DModel"]
    others = ["FSDPWanTransformerBlock", "FSDPMyWanTransformer3DModelWrapper", "FSDPUNet3DConditionModel"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_harmless_warnings()
        for cls in roots + others:
            warnings.warn(text.format(cls), UserWarning)
    assert [str(w.message) for w in seen] == [text.format(cls) for cls in others]


def _run(args: list[str], cwd: Path, tool: str | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer.train ARGS` (or `python tools/<tool>.py ARGS`) as a user runs it."""
    cmd = [sys.executable, str(ROOT / "tools" / f"{tool}.py")] if tool else [sys.executable, "-m", "trainer.train"]
    return subprocess.run([*cmd, *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


def _t2i_argv(tmp: Path) -> list[str]:
    """A one-process t2i run that passes preflight (the model directory is never read there)."""
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "p.jsonl").write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "p0"}})
                                 + "\n")
    return ["--generation-task", "t2i", "--model-path", "model", "--prompt-data", "p.jsonl", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
            "--num-updates-per-batch", "1", "--micro-batch-size", "2", "--reward-runtime", "cpu",
            "--artifact-root", "artifacts", "--save", "ckpt",
            "--sampling-config", json.dumps({"num_inference_steps": 4, "sde_indices": [1, 2]})]


def test_a_mistyped_scorer_name_lists_the_short_names_and_the_closest(tmp_path):
    """`--reward-scorer-path color_edt`: exit 2, the closest short name and all of them, from the
    trainer's preflight and from the reward server (which builds the scorer the same way)."""
    res = _run(_t2i_argv(tmp_path) + ["--reward-scorer-path", "color_edt", "--preflight-only"], tmp_path)
    assert res.returncode == 2
    (line,) = [ln for ln in res.stderr.splitlines() if "color_edt" in ln]
    assert "did you mean 'color_edit'?" in line and "pickscore" in line and "video_ocr" in line, line
    res = _run(_t2i_argv(tmp_path) + ["--reward-scorer-path", "framewise",
                                      "--reward-frame-scorer", "pickscor", "--preflight-only"], tmp_path)
    assert res.returncode == 2 and "--reward-frame-scorer 'pickscor'" in res.stderr
    assert "did you mean 'pickscore'?" in res.stderr
    res = _run(["--reward-scorer-path", "color_edt", "--port", "0"], tmp_path, tool="reward_server")
    assert res.returncode == 2 and "did you mean 'color_edit'?" in res.stderr and "temporal_consistency" in res.stderr
    # a dotpath is not second-guessed, and a word far from every name lists them without a guess
    res = _run(_t2i_argv(tmp_path) + ["--reward-scorer-path", "zzqq", "--preflight-only"], tmp_path)
    assert res.returncode == 2 and "did you mean" not in res.stderr and "the short names: aesthetic" in res.stderr


def test_a_partial_sampling_config_keeps_the_trained_steps_its_step_count_has(tmp_path):
    """`--sampling-config '{"num_inference_steps": 4}'` over a recipe training steps [1, 3, 5]:
    the steps follow the new count ([1, 3]) instead of [5] being refused for a value the command
    line never set; steps the command line sets itself are still refused when they do not fit."""
    recipe = tmp_path / "r.toml"
    recipe.write_text('reward-scorer-path = "color"\n[sampling-config]\nheight = 64\nwidth = 64\n'
                      'num_inference_steps = 12\neta = 0.7\nsde_indices = [1, 3, 5]\n'
                      'sde_pool = [1, 2, 3, 4, 5]\nnum_sde_steps = 3\nsde_resample_per_rollout = true\n')
    argv = [a for a in _t2i_argv(tmp_path)]
    i = argv.index("--sampling-config")
    del argv[i:i + 2]
    res = _run(["--config", str(recipe), *argv, "--sampling-config", '{"num_inference_steps": 4}', "--preflight-only"],
               tmp_path)
    assert res.returncode == 0, res.stderr
    resolved = json.loads(res.stdout[:res.stdout.rindex("}") + 1])["rollout"]["sampling_config"]
    assert (resolved["num_inference_steps"], resolved["sde_indices"], resolved["sde_pool"],
            resolved["num_sde_steps"]) == (4, [1, 3], [1, 2, 3], 3)
    res = _run(["--config", str(recipe), *argv, "--sampling-config", '{"num_inference_steps": 4, "sde_indices": [5]}',
                "--preflight-only"], tmp_path)
    assert res.returncode == 2 and "'sde_indices': step indices [5] are outside [0, num_inference_steps=4)" in res.stderr


def test_the_sample_tool_states_its_video_defaults_and_follows_a_partial_config(tmp_path, tiny_model_dir):
    """tools/sample.py: --help lists the Wan family's defaults as the family declares them; a
    step count alone over Qwen-Image's defaults (sde_indices [1, 3, 5]) samples with [1, 3]; the
    tool says, before the model loads, what it samples and which values are the family's."""
    from trainer.models.wan import WanAdapter

    d = WanAdapter.sampling_defaults
    res = _run(["--help"], tmp_path, tool="sample")
    help_text = " ".join(res.stdout.split())
    assert (f"Wan (t2v): {d['num_frames']} frames of {d['height']}x{d['width']}, {d['num_inference_steps']} steps, "
            f"guidance {d['guidance_scale']}, sde_type {d['sde_type']}, sde_indices {d['sde_indices']}") in help_text
    assert "for a tiny model pass" in help_text

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i",
                                                                                      "sample_id": "p0"}}) + "\n")
    res = _run(["--model-path", str(tiny_model_dir), "--prompt-data", "p.jsonl", "--output-dir", "out", "--device",
                "cpu", "--sampling-config", '{"num_inference_steps": 4, "height": 32, "width": 32}'], tmp_path,
               tool="sample")
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("sampling 32 x 32, 4 steps, guidance 1.0, 1 per prompt: the family's defaults for eta, guidance_scale, "
            "sde_indices, sde_type") in res.stdout
    assert "trained steps [1, 3]" in res.stdout


def test_the_sample_tool_says_which_video_values_are_the_recipes(tmp_path):
    """On a Wan model the values the flags leave out are FlowGRPO's real recipe's: the tool says
    so, naming them, before the model loads (here the 20 steps and CFG 4.5 it kept)."""
    from tools.tiny_wan import build_tiny_wan_pipeline

    model = build_tiny_wan_pipeline(tmp_path / "wan", seed=0)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2v",
                                                                                      "sample_id": "v0"}}) + "\n")
    res = _run(["--model-path", str(model), "--prompt-data", "p.jsonl", "--output-dir", "out", "--device", "cpu",
                "--sampling-config", '{"height": 32, "width": 32, "num_frames": 5}'], tmp_path, tool="sample")
    assert res.returncode == 0, res.stderr[-2000:]
    first = res.stdout.splitlines()[0]
    assert first.startswith("sampling 5 frames of 32 x 32, 20 steps, guidance 4.5, 1 per prompt: the family's "
                            "defaults for cfg_renorm, eta, guidance_scale, negative_prompt, num_inference_steps, "
                            "sde_indices, sde_type"), first
    assert len(list((tmp_path / "out" / "t2v" / "rollout_0000000").glob("*.webp"))) == 1


def test_load_given_the_task_directory_gets_one_fix_that_works(tmp_path):
    """`--load <save>/<task>` with `--save <save>`: one problem, naming the checkpoint directory to
    pass instead (not also "--save <save>/<task>", which contradicted it); the fix it names passes."""
    it = tmp_path / "ckpt" / "t2i" / "iter_0000000"
    it.mkdir(parents=True)
    (it / "COMMITTED").write_text("")
    argv = _t2i_argv(tmp_path)
    argv[argv.index("--num-rollout") + 1] = "3"
    argv += ["--reward-scorer-path", "color", "--preflight-only"]
    res = _run(argv + ["--load", "ckpt/t2i"], tmp_path)
    assert res.returncode == 2
    problems = [ln for ln in res.stderr.splitlines() if ln.startswith("  - ")]
    assert problems == [f"  - --load ckpt/t2i is the task directory inside the checkpoint directory {tmp_path / 'ckpt'}: "
                        f"pass --load {tmp_path / 'ckpt'}, the --save directory of the run to resume (it reads "
                        "t2i/iter_* itself)"], problems
    res = _run(argv + ["--load", str(tmp_path / "ckpt")], tmp_path)
    assert res.returncode == 0, res.stderr

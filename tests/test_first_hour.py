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

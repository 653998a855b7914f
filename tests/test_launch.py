"""`bash run.sh` as a user meets it: usage and exit 2 for a missing or unknown subcommand, and a
`train` launch whose recipe or preflight is bad stops in one process, before torchrun starts,
with only the list of problems and exit 2."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "USE_CURRENT_ENV", "TORCHRUN_ARGS")}
    full.update(env or {})
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)


def current_venv(tmp_path: Path) -> Path:
    """A venv directory run.sh takes as set up (its stamp is the one `setup` writes) whose python
    is this interpreter, so the test never installs anything nor touches the real .venv; its
    torchrun fails loudly, so a test can tell whether run.sh got as far as launching."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "torchrun").write_text('#!/bin/sh\necho "torchrun was started" >&2\nexit 99\n')
    for f in ("python", "torchrun"):
        (venv / "bin" / f).chmod(0o755)
    digest = hashlib.sha256((ROOT / "setup.cfg").read_bytes() + (ROOT / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".setup-stamp").write_text(f"{digest[:16]}-test,ocr\n")
    return venv


def test_run_sh_without_or_with_an_unknown_subcommand_prints_usage_and_exits_2():
    none = run_sh()
    assert none.returncode == 2 and none.stdout == ""
    assert "bash run.sh train RECIPE.toml" in none.stderr
    bogus = run_sh("trian")
    assert bogus.returncode == 2
    assert bogus.stderr.startswith("unknown command 'trian'; use one of: setup, test, setup-sglang, test-sglang, "
                                   "train, demo") and "bash run.sh train RECIPE.toml" in bogus.stderr
    helped = run_sh("help")
    assert helped.returncode == 0 and "bash run.sh demo" in helped.stdout
    flags_first = run_sh("train", "--lr", "1e-4")
    assert flags_first.returncode == 2 and "the recipe comes first" in flags_first.stderr


def test_a_bad_train_launch_lists_its_problems_and_exits_2_before_torchrun(tmp_path):
    venv = current_venv(tmp_path)
    recipe = tmp_path / "bad.toml"
    recipe.write_text('num-rollout = 0\nreward-scorer-path = "color"\n')
    bad = run_sh("train", str(recipe), "--rollout-batch-size", "2", env={"VENV": str(venv), "NPROC": "2"})
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.splitlines()
    assert lines[0] == "Generative RL config validation failed:"
    assert "  - --model-path is required (an existing directory)" in lines
    assert "  - --num-rollout must be >= 1, got 0" in lines
    assert all(line.startswith("  - ") for line in lines[1:]), lines
    assert "torchrun was started" not in bad.stderr and "ChildFailedError" not in bad.stderr
    assert bad.stdout == ""

    # a missing recipe, under USE_CURRENT_ENV=1 as well: one line, exit 2, nothing launched
    missing = run_sh("train", str(tmp_path / "nope.toml"),
                     env={"USE_CURRENT_ENV": "1", "PYTHON": str(venv / "bin" / "python"), "NPROC": "2"})
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"config error: recipe {tmp_path / 'nope.toml'} does not exist"


def test_the_launch_check_sees_the_world_torchrun_will_start(tmp_path):
    """NPROC x --nnodes of TORCHRUN_ARGS is the world preflight checks; a good launch passes the
    check silently and goes on to torchrun."""
    venv = current_venv(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"prompt": "a red circle", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'model-path = "{model}"\nprompt-data = "{prompts}"\nnum-rollout = 1\n'
                      f'artifact-root = "{tmp_path / "artifacts"}"\nreward-scorer-path = "color"\n'
                      "rollout-batch-size = 3\nn-samples-per-prompt = 2\n"
                      '[sampling-config]\nheight = 32\nwidth = 32\nnum_inference_steps = 4\nsde_indices = [1, 2]\n')
    env = {"VENV": str(venv), "NPROC": "2", "TORCHRUN_ARGS": "--nnodes 2 --node-rank 0"}
    bad = run_sh("train", str(recipe), env=env)
    assert bad.returncode == 2, bad.stderr
    assert "6 candidates do not divide evenly over 4 ranks" in bad.stderr and "torchrun was started" not in bad.stderr
    good = run_sh("train", str(recipe), "--rollout-batch-size", "2", env=env)
    assert good.returncode == 99 and good.stderr.strip() == "torchrun was started", good.stderr

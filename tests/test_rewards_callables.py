"""A plain function as a scorer, named by its dotpath like a class: through the manager and the
advantages, through the reward server, its mistakes named, and through a short run of the real
loop on the tiny model (which also shows each scorer built once, at start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_rewards_remote import serving
from tests.workers.launch import ROOT
from tests.workers.recipes import TINY_GEOMETRY, TINY_SAMPLING
from tests.workers.scorers import COUNTING_LOG_ENV, redness
from trainer.config import RewardConfig
from trainer.rewards.base import FunctionScorer, ImageBatch, RewardError, build_scorer
from trainer.rewards.manager import RewardManager, reward_manager_from_config
from trainer.rewards.post_process import post_process

REDNESS = "tests.workers.scorers.redness"


def _images(reds: list[float]) -> list[np.ndarray]:
    """8x8 images whose red channel is each value (x 255), green and blue 0."""
    out = []
    for r in reds:
        a = np.zeros((8, 8, 3), dtype=np.uint8)
        a[..., 0] = round(r * 255)
        out.append(a)
    return out


def half_scored(images, prompts, metadata):
    """Scores the first half of a batch; None for the rest."""
    return [1.0 if i < len(prompts) // 2 else None for i in range(len(prompts))]


def as_dict(images, prompts, metadata):
    return {"a": [0.0] * len(prompts)}


def one_short(images, prompts, metadata):
    return [0.0] * (len(prompts) - 1)


def test_a_function_is_a_scorer_through_the_manager_and_the_advantages():
    manager = RewardManager("cpu", REDNESS, batch_size=4)
    assert isinstance(manager.scorer, FunctionScorer) and manager.components == ("redness",)
    reds = [0.1, 0.5, 0.9, 0.8, 0.4, 0.2]  # two groups of three
    out = manager.score(_images(reds), ["a red ball"] * 6)
    assert out.components["redness"].dtype == torch.float32
    # the manager's batches of 4 and 2 are reassembled in order
    torch.testing.assert_close(out.components["redness"], torch.tensor([round(r * 255) / 255 for r in reds]))
    res = post_process(_images(reds), ["a red ball"] * 6, group_size=3, manager=manager,
                       required_components=["redness"], component_weights={"redness": 1.0})
    adv = res.advantages.view(2, 3)
    assert adv[0].argsort().tolist() == [0, 1, 2] and adv[1].argsort().tolist() == [2, 1, 0]
    assert res.metrics["reward/redness_mean"] == pytest.approx(float(out.components["redness"].mean()))
    # from a run config, as the trainer builds it
    cfg = RewardConfig(reward_runtime="cpu", reward_scorer_path=REDNESS)
    from_cfg = reward_manager_from_config(cfg).score(_images(reds), ["a red ball"] * 6)
    torch.testing.assert_close(from_cfg.components["redness"], out.components["redness"])
    # the function is the one the dotpath names, called with the scorer protocol's arguments
    batch = ImageBatch(_images(reds))
    assert manager.scorer(batch, ["p"] * 6, [{}] * 6)["redness"].tolist() == pytest.approx(redness(batch, [], []))


def test_none_from_a_function_fails_its_group():
    manager = RewardManager("cpu", f"{__name__}.half_scored")
    out = manager.score(_images([0.5] * 4), ["p"] * 4)
    assert out.components["half_scored"][:2].tolist() == [1.0, 1.0] and torch.isnan(out.components["half_scored"][2:]).all()
    res = post_process(_images([0.5] * 4), ["p"] * 4, group_size=2, manager=manager,
                       required_components=["half_scored"])
    assert res.failed_groups == [1] and res.valid.tolist() == [True, True, False, False]


def test_a_function_scorers_mistakes_are_named():
    with pytest.raises(ValueError, match=r"is a function, which takes no --reward-model-path \(got /models/x\)"):
        build_scorer(REDNESS, "/models/x")
    with pytest.raises(TypeError, match="is a str, neither a scorer class nor a function"):
        build_scorer("tests.workers.scorers.COUNTING_LOG_ENV")
    with pytest.raises(RewardError, match="'as_dict' returned dict: a function returns one number per image"):
        RewardManager("cpu", f"{__name__}.as_dict").score(_images([0.5] * 2), ["p"] * 2)
    with pytest.raises(RewardError, match="returned 1 values for component 'one_short', expected 2"):
        RewardManager("cpu", f"{__name__}.one_short").score(_images([0.5] * 2), ["p"] * 2)


def test_the_reward_server_serves_a_function():
    imgs = _images([0.2, 0.7])
    local = RewardManager("cpu", REDNESS).score(imgs, ["p", "q"]).components["redness"]
    with serving(build_scorer(REDNESS)) as url:
        remote = RewardManager("remote", endpoint=url, remote_max_retries=0)
        assert remote.components == ("redness",)
        torch.testing.assert_close(remote.score(imgs, ["p", "q"]).components["redness"], local)


def _prompts(path: Path, prompts: list[str], prefix: str) -> Path:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"{prefix}{i}"}}) + "\n")
    return path


def test_a_run_trains_on_a_function_and_builds_each_scorer_once(tmp_path, tiny_model_dir):
    """Two rollouts of the real loop (one process) trained on the plain function `redness`, with
    a held-out class scorer at an eval after each: the function's component is what the run
    reports and logs, and the held-out scorer is built once, before any eval, then only called."""
    from trainer.metrics import read_scalars

    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 1
generation-task = "t2i"
model-path = "{tiny_model_dir}"
prompt-data = "{_prompts(tmp_path / 'train.jsonl', ['a red ball', 'a blue cube', 'a red hat'], 't')}"
eval-prompt-data = ["held", "{_prompts(tmp_path / 'eval.jsonl', ['a white ball'], 'e')}"]
eval-interval = 1
n-samples-per-eval-prompt = 2
eval-reward-scorers = ["tests.workers.scorers.CountingScorer"]
{TINY_GEOMETRY}
eps-clip = 1e-3
lr = 1e-3
reward-runtime = "cpu"
reward-scorer-path = "{REDNESS}"
num-rollout = 2
{TINY_SAMPLING}""")
    log = tmp_path / "counting.jsonl"
    out = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", COUNTING_LOG_ENV: str(log)}
    proc = subprocess.run([sys.executable, "-m", "trainer.train", "--config", str(recipe),
                           "--artifact-root", str(out / "artifacts"), "--tensorboard-dir", str(out / "tb")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"summary"'))
    assert list(summary["summary"]) == ["redness"] and summary["summary"]["redness"]["rollouts"] == 2
    scalars = read_scalars(out / "tb")
    assert [step for step, _ in scalars["reward/redness_mean"]] == [0, 1]
    assert all(np.isfinite(v) for _, v in scalars["reward/redness_mean"])
    assert [step for step, _ in scalars["eval/held/counted_mean"]] == [0, 1]
    assert [step for step, _ in scalars["eval/held/redness_mean"]] == [0, 1]  # the trained scorer scores eval too
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["built", "score", "score"], events
    assert events[0]["device"] == "cpu" and [e["images"] for e in events[1:]] == [2, 2]

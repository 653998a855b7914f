"""`python -m trainer.train`: --preflight-only exit codes and output, --help, and the
hand-over to the training loop."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from trainer import train
from trainer.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
LORA = ROOT / "configs" / "qwen_image_t2i_lora_8gpu.toml"


@pytest.fixture
def recipe_env(tmp_path, monkeypatch):
    """Point the LoRA recipe's MODEL_DIR / DATA_DIR / EXP_DIR at existing temp paths."""
    models, data = tmp_path / "models", tmp_path / "data" / "processed" / "t2i"
    (models / "Qwen-Image").mkdir(parents=True)
    (models / "PickScore_v1").mkdir()
    data.mkdir(parents=True)
    for name in ("pickapic_train", "pickapic_eval256"):
        (data / f"{name}.jsonl").write_text('{"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    env = {"MODEL_DIR": str(models), "DATA_DIR": str(tmp_path / "data"), "EXP_DIR": str(tmp_path / "exp")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "trainer.train", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)


def test_preflight_only_exit_codes_as_a_process(recipe_env):
    ok = _run(["--config", str(LORA), "--preflight-only"], recipe_env)
    assert ok.returncode == 0, ok.stderr
    body, _, last = ok.stdout.rstrip().rpartition("\n")
    assert last == "preflight ok"
    resolved = json.loads(body)
    assert resolved["optim"]["lr"] == 3e-4 and resolved["sync"]["weight_sync_mode"] == "adapter"
    assert resolved["model"]["model_path"] == recipe_env["MODEL_DIR"] + "/Qwen-Image"

    bad = _run(["--config", str(LORA), "--preflight-only", "--kl-coef", "0.1", "--micro-batch-size", "3"],
               {**recipe_env, "WORLD_SIZE": "8"})
    assert bad.returncode == 2
    assert "preflight ok" not in bad.stdout
    err = bad.stderr
    assert "Generative RL config validation failed:" in err
    assert "--kl-coef 0.1" in err and "--micro-batch-size 3 does not divide the 16 candidates" in err


def test_preflight_only_in_process(recipe_env, capsys):
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("preflight ok")


def test_world_size_comes_from_torchrun_env(recipe_env, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 2
    assert "torchrun started 2 ranks" in capsys.readouterr().err
    # only rank 0 prints
    monkeypatch.setenv("RANK", "1")
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_config_errors_exit_2(recipe_env, capsys, monkeypatch):
    assert train.main(["--config", str(LORA), "--eps-clp", "0.1", "--preflight-only"]) == 2
    assert "did you mean '--eps-clip'" in capsys.readouterr().err
    monkeypatch.delenv("MODEL_DIR")
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 2
    assert "MODEL_DIR is not set" in capsys.readouterr().err


def test_help_lists_flags(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--sampling-config" in out and "--num-updates-per-batch" in out


def test_a_present_loop_gets_the_config(recipe_env, monkeypatch):
    seen: list[RunConfig] = []
    recipes: list[str | None] = []
    fake = types.ModuleType("trainer.loop")
    fake.__spec__ = importlib.machinery.ModuleSpec("trainer.loop", None)
    fake.run = lambda cfg, recipe=None: seen.append(cfg) or recipes.append(recipe) or 0
    monkeypatch.setitem(sys.modules, "trainer.loop", fake)
    monkeypatch.setenv("WORLD_SIZE", "8")  # as torchrun would start the 8-GPU recipe
    assert train.main(["--config", str(LORA), "--lr", "1e-4"]) == 0
    assert len(seen) == 1 and seen[0].optim.lr == 1e-4
    assert recipes == [str(LORA)]
    assert train.main([f"--config={LORA}"]) == 0 and recipes[-1] == str(LORA)
    # a bad config never reaches the loop
    assert train.main(["--config", str(LORA), "--kl-coef", "1"]) == 2
    assert len(seen) == 2

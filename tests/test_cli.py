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
    # the 8-GPU recipe on 2 torchrun ranks: the same training, reported
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 0
    assert "the recipe names 8 ranks and this run has 2: the same training" in capsys.readouterr().err
    # a world it cannot be shared over is refused
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(["--config", str(LORA), "--preflight-only"]) == 2
    assert "do not divide evenly over 3 ranks (the recipe names 8)" in capsys.readouterr().err
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


DEMO = ROOT / "configs" / "tiny_cpu_demo.toml"


def _own_data(tmp_path: Path, model: Path) -> list[str]:
    """The demo recipe pointed at one's own model and data (its eval set stays the demo's)."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "a red circle", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    return ["--config", str(DEMO), "--model-path", str(model), "--prompt-data", str(prompts),
            "--artifact-root", str(tmp_path / "artifacts"), "--save", str(tmp_path / "ckpt"),
            "--tensorboard-dir", str(tmp_path / "tb"), "--preflight-only"]


def test_the_demo_recipe_is_reusable_without_its_eval_set(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """The demo's eval file exists only after the demo ran: the error names the way out, and
    `--eval-prompt-data none` drops the eval set together with the recipe's --eval-interval."""
    monkeypatch.setenv("EXP_DIR", str(tmp_path / "no-demo-here"))
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    argv = _own_data(tmp_path, tiny_model_dir)
    assert train.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Generative RL config validation failed:"
    assert len(err) == 2 and err[1].startswith("  - --eval-prompt-data held_out ") and \
        err[1].endswith("or pass --eval-prompt-data none to train without evaluation"), err
    assert train.main(argv + ["--eval-prompt-data", "none"]) == 0
    out = capsys.readouterr().out
    body, _, last = out.rstrip().rpartition("\n")
    assert last == "preflight ok"
    resolved = json.loads(body)
    assert resolved["eval"]["eval_prompt_data"] == [] and resolved["eval"]["eval_interval"] is None
    # --eval-interval 0 is no way to turn it off, and says which is
    assert train.main(argv + ["--eval-interval", "0"]) == 2
    assert "--eval-interval must be >= 1, got 0; to train without evaluation pass --eval-prompt-data none" in \
        capsys.readouterr().err


def test_num_rollout_is_a_total_on_resume(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """Resuming after rollouts 0-1 with --num-rollout 2 (or 1) would train nothing: refused at
    preflight, from the checkpoint directory's markers alone (nothing is loaded)."""
    monkeypatch.setenv("EXP_DIR", str(tmp_path))
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    it = tmp_path / "ckpt" / "t2i" / "iter_0000001"
    it.mkdir(parents=True)
    (it / "COMMITTED").write_text("1\n")
    argv = _own_data(tmp_path, tiny_model_dir) + ["--eval-prompt-data", "none", "--load", str(tmp_path / "ckpt")]
    assert train.main(argv + ["--num-rollout", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Generative RL config validation failed:" and len(err) == 2
    assert err[1].startswith(f"  - --num-rollout 2 is the run's total number of rollouts, and the checkpoint resumed "
                             f"from --load {tmp_path / 'ckpt'} (iteration 1) has already run rollouts 0-1 (2)")
    assert "Pass --num-rollout 4 to train 2 more" in err[1]
    assert train.main(argv + ["--num-rollout", "3"]) == 0
    capsys.readouterr()


def test_task_defaults_to_t2i_and_the_family_comes_from_model_index(tmp_path, monkeypatch, capsys,
                                                                    tiny_sd3_model_dir):
    """No --generation-task, no --model-adapter-path: t2i and the SD3 adapter, as the tools pick
    them; and a geometry the tiny SD3 DiT cannot draw is refused before anything loads, naming the
    largest size and the config it comes from."""
    monkeypatch.setenv("EXP_DIR", str(tmp_path))
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    argv = [a for a in _own_data(tmp_path, tiny_sd3_model_dir)] + ["--eval-prompt-data", "none"]
    assert train.main(argv) == 0  # the demo's 32 x 32 fits
    resolved = json.loads(capsys.readouterr().out.rstrip().rpartition("\n")[0])
    assert resolved["model"]["generation_task"] == "t2i"
    assert resolved["model"]["model_adapter_path"] == "trainer.models.sd3.SD3Adapter"
    assert train.main(argv + ["--sampling-config.height", "384", "--sampling-config.width", "33"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Generative RL config validation failed:" and len(err) == 3, err
    assert err[1] == (f"  - --sampling-config height 384 is more than --model-path {tiny_sd3_model_dir} can draw: "
                      "transformer/config.json's pos_embed_max_size 96 x patch_size 1 x vae/config.json's scale "
                      "factor 2 allow at most 192 pixels; use height <= 192")
    assert err[2].startswith("  - --sampling-config width 33 is not a multiple of 2 (vae/config.json's scale factor 2 "
                             "x transformer/config.json's patch_size 1")

"""tools/bench_edit.py on the tiny shape on CPU: every figure is emitted, the rollout encodes one
condition per source and CFG branch, diffusers' edit pipeline runs on the engine's own modules,
and the fp32 replay equals the sampler."""

from __future__ import annotations

import json


def test_bench_edit_tiny_emits_every_figure(tmp_path):
    from tools.bench_edit import main

    out = tmp_path / "edit.jsonl"
    assert main(["--prompts", "2", "--group-size", "2", "--steps", "2", "--output", str(out)]) == 0
    lines = {d["figure"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"edit_rollout_images_per_s", "edit_diffusers_images_per_s", "edit_rollout_speedup",
                          "edit_replay_transitions_per_s", "edit_replay_logp_gap"}
    assert lines["edit_rollout_images_per_s"]["conditions_encoded"] == 4.0  # 2 sources x (instruction, negative)
    assert all(d["value"] > 0 for k, d in lines.items() if k != "edit_replay_logp_gap")
    assert lines["edit_replay_logp_gap"]["value"] == 0.0
    speed = lines["edit_rollout_speedup"]["value"]
    ratio = lines["edit_rollout_images_per_s"]["value"] / lines["edit_diffusers_images_per_s"]["value"]
    assert abs(speed - ratio) < 1e-9 and lines["edit_rollout_speedup"]["geometry"]["family"] == "qwen_image_edit"


def test_bench_edit_refuses_bad_counts(capsys):
    import pytest

    from tools.bench_edit import main

    with pytest.raises(SystemExit) as e:
        main(["--prompts", "0"])
    assert e.value.code == 2 and "--prompts must be >= 1" in capsys.readouterr().err


def test_bench_family_qwen_image_edit_runs_every_phase_at_tiny_shape(tmp_path):
    """tools/bench.py --family qwen_image_edit on CPU at the tiny shape: the rollout edits one
    source per prompt (the DiT sees target + source tokens, the text the source's vision tokens),
    true CFG, and the LoRA replay, update, syncs and step run with the replay exact."""
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(root / "tools" / "bench.py"), "--family", "qwen_image_edit", "--shape", "tiny",
           "--device", "cpu", "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2",
           "--trained-steps", "2", "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2",
           "--dit-batches", "2", "--iters", "1", "--guidance-scale", "4", "--skip", "checksum", "offload",
           "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = {}
    for line in map(json.loads, out.read_text().splitlines()):
        assert isinstance(line["value"], float) and math.isfinite(line["value"]), line
        # 32 px / VAE 4 / 2 x 2 packing = 16 target tokens, and 16 of the source
        assert line["geometry"]["family"] == "qwen_image_edit" and line["geometry"]["image_tokens"] == 32
        figures[line["figure"]] = line
    assert {"dit_forward_s", "rollout_images_per_s", "replay_transitions_per_s_lora", "update_s_lora",
            "adapter_sync_s", "merged_sync_s", "step_s"} <= set(figures)
    assert figures["replay_logp_max_abs_err_lora"]["value"] == 0.0
    assert figures["rollout_s"]["geometry"]["sources_per_prompt"] == 1

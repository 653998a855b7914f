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

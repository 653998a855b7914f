"""tools/bench_edit.py on the tiny shape on CPU, for both editing families: every figure is
emitted, the rollout encodes one condition per source and CFG branch and VAE-encodes each source
once, diffusers' edit pipeline runs on the engine's own modules with the source at the output
size, and the fp32 replay equals the sampler; --shape real is refused before it allocates."""

from __future__ import annotations

import json
import re

import pytest

#: per family: (conditions, sources) the rollout of 2 records x 2 candidates encodes
ENCODED = {"qwen_image_edit": (4.0, 2.0),  # 2 sources x (instruction, negative); the VAE once a source
           "flux_kontext": (2.0, 2.0)}  # no true CFG: the instruction per source


@pytest.mark.parametrize("family", sorted(ENCODED))
def test_bench_edit_tiny_emits_every_figure(family, tmp_path, monkeypatch):
    from tools import bench_edit

    seq_lens = []

    def hooked(build):
        def wrapped(*args, **kwargs):
            engine = build(*args, **kwargs)
            engine.transformer.register_forward_hook(
                lambda m, a, kw, out: seq_lens.append(int(kw["hidden_states"].shape[1])), with_kwargs=True)
            return engine
        return wrapped

    monkeypatch.setattr(bench_edit, "build_edit_engine", hooked(bench_edit.build_edit_engine))
    monkeypatch.setattr(bench_edit, "build_kontext_engine", hooked(bench_edit.build_kontext_engine))
    out = tmp_path / "edit.jsonl"
    argv = ["--prompts", "2", "--group-size", "2", "--steps", "2", "--output", str(out)]
    assert bench_edit.main(argv + (["--family", family] if family != "qwen_image_edit" else [])) == 0
    lines = {d["figure"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"edit_rollout_images_per_s", "edit_diffusers_images_per_s", "edit_rollout_speedup",
                          "edit_replay_transitions_per_s", "edit_replay_logp_gap"}
    rollout = lines["edit_rollout_images_per_s"]
    assert (rollout["conditions_encoded"], rollout["sources_encoded"]) == ENCODED[family]
    assert all(d["value"] > 0 for k, d in lines.items() if k != "edit_replay_logp_gap")
    assert lines["edit_replay_logp_gap"]["value"] == 0.0
    speed = lines["edit_rollout_speedup"]["value"]
    ratio = lines["edit_rollout_images_per_s"]["value"] / lines["edit_diffusers_images_per_s"]["value"]
    assert abs(speed - ratio) < 1e-9 and all(d["geometry"]["family"] == family for d in lines.values())
    # every DiT call, ours, the stock pipeline's and the replay's, saw 32 px / VAE 8 (Qwen's 4 x 2
    # packing or FLUX's 8 x 2) = 16 target tokens and 16 of the source at the output size
    assert seq_lens and set(seq_lens) == {32}
    # warm-up + timed rollout (2 steps each), the stock pipeline (2 calls of 2 steps, twice; Qwen's
    # true CFG runs its two branches as two calls), the replay (warm-up + timed)
    stock = 2 * 2 * 2 * (2 if family == "qwen_image_edit" else 1)
    assert len(seq_lens) == 2 * 2 + stock + 2 * 1


@pytest.mark.parametrize("family", sorted(ENCODED))
def test_bench_edit_real_shape_is_refused_before_allocating(family, monkeypatch, capsys):
    from tools import bench, bench_edit

    def never(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(bench, "available_bytes", lambda device_type: (2 << 30, "this test's host"))
    monkeypatch.setattr(bench_edit, "build_edit_engine", never)
    monkeypatch.setattr(bench_edit, "build_kontext_engine", never)
    assert bench_edit.main(["--family", family, "--shape", "real", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"bench_edit: --family {family} --shape real needs ~" in err and "this test's host has 2 GB free" in err


def test_bench_edit_refuses_bad_counts(capsys):
    import pytest

    from tools.bench_edit import main

    with pytest.raises(SystemExit) as e:
        main(["--prompts", "0"])
    assert e.value.code == 2 and "--prompts must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen_image_edit", "flux_kontext"])
def test_bench_family_edit_runs_every_phase_at_tiny_shape(family, tmp_path):
    """tools/bench.py --family qwen_image_edit / flux_kontext on CPU at the tiny shape: the rollout
    edits one source per prompt (the DiT sees target + source tokens; Qwen's text also the source's
    vision tokens), true CFG (Qwen) or the embedded guidance (Kontext), and the LoRA replay,
    update, syncs and step run with the replay exact."""
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(root / "tools" / "bench.py"), "--family", family, "--shape", "tiny",
           "--device", "cpu", "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2",
           "--trained-steps", "2", "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2",
           "--dit-batches", "2", "--iters", "1", "--guidance-scale", "4" if family == "qwen_image_edit" else "2.5",
           "--skip", "checksum", "offload",
           "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if family == "qwen_image_edit":
        target = 16  # 32 px / VAE 4 / 2 x 2 packing
    else:
        from tools.bench_flux import flux_shape_configs

        vae_scale = 2 ** (len(flux_shape_configs("tiny")[1]["block_out_channels"]) - 1)
        target = (32 // vae_scale // 2) ** 2
    figures = {}
    for line in map(json.loads, out.read_text().splitlines()):
        assert isinstance(line["value"], float) and math.isfinite(line["value"]), line
        # the target's tokens, then as many of the source
        assert line["geometry"]["family"] == family and line["geometry"]["image_tokens"] == 2 * target
        figures[line["figure"]] = line
    assert {"dit_forward_s", "rollout_images_per_s", "replay_transitions_per_s_lora", "update_s_lora",
            "adapter_sync_s", "merged_sync_s", "step_s"} <= set(figures)
    # fp32: the replay's 1-row micro-batch against the rollout's 4-row batch. Whether their GEMMs
    # round alike depends on the kernels the CPU's BLAS picks for each shape: Qwen's matched to the
    # bit on one machine and differed by 6e-8 on another (AVX-512); FLUX's differ by ~1e-7
    assert figures["replay_logp_max_abs_err_lora"]["value"] <= 1e-6
    assert figures["rollout_s"]["geometry"]["sources_per_prompt"] == 1


def test_bench_edit_profile_writes_both_sides_kernel_tables(tmp_path):
    """--profile: one more rollout of the engine and of the stock pipeline under torch.profiler,
    each a table with its time by kernel class; the timed figures come first, unchanged in kind."""
    from tools import bench_edit

    out, prof = tmp_path / "edit.jsonl", tmp_path / "kernels.txt"
    assert bench_edit.main(["--prompts", "1", "--group-size", "2", "--steps", "2", "--output", str(out),
                            "--profile", str(prof)]) == 0
    text = prof.read_text()
    heads = [line for line in text.splitlines() if line.startswith("== ")]
    assert [h.split(":")[0] for h in heads] == ["== engine rollout", "== diffusers pipeline"]
    for h in heads:  # the DiT's linears land in the GEMM class, its SDPA in attention
        secs = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", h.split("by class: ")[1])}
        assert secs["gemm"] > 0 and secs["attention"] > 0
    assert "edit_rollout_speedup" in out.read_text()

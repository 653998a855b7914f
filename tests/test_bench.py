"""tools/bench.py on CPU: the FLOP model against counted FLOPs, the file-free model build, the
alternative column-sum reduction giving the checksum's exact bits, and one tiny end-to-end run
whose JSON lines must be well-formed and finite. No timing is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.bench import (CHECKSUM_WIDE_FOLD, REAL_TRANSFORMER_CONFIG, build_engine, build_text_encoder,
                         build_transformer, column_sums_wide, dit_forward_flops, dit_param_counts, profile_share,
                         replay_flops, shape_configs)
from trainer.core.checksum import CHECKSUM_PERIOD, column_sums, tensor_words, weights_checksum

ROOT = Path(__file__).resolve().parents[1]
P, K = CHECKSUM_PERIOD, CHECKSUM_WIDE_FOLD


def _classify(name: str) -> str:
    """Which FLOP-model bucket a DiT parameter belongs to, read from its module path."""
    if name.endswith("bias"):
        return "bias"
    if ".norm_" in name or name.startswith("txt_norm"):
        return "norm"
    if "_mod." in name or name.startswith(("time_text_embed", "norm_out")):
        return "sample"
    if ".add_" in name or ".to_add_out" in name or ".txt_mlp" in name or name.startswith("txt_in"):
        return "text"
    return "image"


@pytest.mark.parametrize("shape", ["tiny", "real"])
def test_param_split_matches_the_module(shape):
    """The analytic per-stream counts equal the module's own parameters, grouped by name (the
    real 20.43 B model is built on the meta device: no memory)."""
    from diffusers import QwenImageTransformer2DModel

    cfg = shape_configs(shape)[0]
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**cfg)
    counted = {"image": 0, "text": 0, "sample": 0, "bias": 0, "norm": 0}
    for name, p in model.named_parameters():
        counted[_classify(name)] += p.numel()
    want = dit_param_counts(cfg)
    assert counted == {k: want[k] for k in counted}
    assert sum(counted.values()) == want["total"]
    if shape == "real":
        assert want["total"] == pytest.approx(20.43e9, rel=1e-3)
        assert want["image"] == pytest.approx(6.8e9, rel=1e-2)


def test_real_vae_and_text_encoder_have_the_published_sizes():
    """On the meta device (no memory): Qwen2.5-VL-7B is 8.29 B parameters, Qwen-Image's VAE 127 M,
    and neither keeps a plain tensor attribute that to_empty would miss."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tools.bench import _meta_build, text_encoder_config
    from tools.make_tiny_model import build_tokenizer

    enc = _meta_build(lambda: Qwen2_5_VLForConditionalGeneration(text_encoder_config("real", build_tokenizer())),
                      torch.bfloat16)
    vae = _meta_build(lambda: AutoencoderKLQwenImage(**shape_configs("real")[1]), torch.bfloat16)
    assert sum(p.numel() for p in enc.parameters()) == pytest.approx(8.29e9, rel=2e-3)
    assert sum(p.numel() for p in vae.parameters()) == pytest.approx(126.9e6, rel=2e-3)
    assert vae.config.z_dim == 16 and len(vae.config.temperal_downsample) == 3  # 16 channels, 8x spatial
    assert all(p.dtype == torch.bfloat16 for p in enc.parameters())
    for module in (enc, vae):
        assert not [k for m in module.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)]


def test_forward_flops_match_counted_matmuls_at_tiny_shape():
    """FlopCounterMode over a real forward of the tiny DiT (math SDPA, so attention shows up as
    bmm) counts exactly the model's FLOPs, with unequal image and text lengths and batch 3."""
    from diffusers import QwenImageTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = shape_configs("tiny")[0]
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**cfg).eval()
    b, rows, cols, t = 3, 4, 6, 5
    x = torch.randn(b, rows * cols, cfg["in_channels"])
    e = torch.randn(b, t, cfg["joint_attention_dim"])
    with torch.no_grad(), FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(hidden_states=x, encoder_hidden_states=e, encoder_hidden_states_mask=torch.ones(b, t, dtype=torch.long),
              timestep=torch.full((b,), 0.5), img_shapes=[[(1, rows, cols)]] * b, return_dict=False)
    assert counter.get_total_flops() == dit_forward_flops(cfg, rows * cols, t, b)
    # and by hand: 2 * (weights x tokens) for the linears, 4 L^2 d per layer for attention
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    per_stream = cfg["num_layers"] * (4 * d * d + 2 * d * 4 * d)
    img = per_stream + cfg["in_channels"] * d + d * 4 * cfg["out_channels"]
    txt = per_stream + cfg["joint_attention_dim"] * d
    sample = cfg["num_layers"] * 12 * d * d + 256 * d + 3 * d * d
    attn = 4 * (rows * cols + t) ** 2 * d * cfg["num_layers"]
    assert dit_forward_flops(cfg, rows * cols, t, b) == b * (2 * (img * rows * cols + txt * t + sample) + attn)


def test_real_shape_forward_is_about_9_9_tflop():
    f = dit_forward_flops(REAL_TRANSFORMER_CONFIG, 576, 128, 1)
    assert f == pytest.approx(9.9e12, rel=0.01)
    assert dit_forward_flops(REAL_TRANSFORMER_CONFIG, 576, 128, 8) == pytest.approx(8 * f)
    model, hw = replay_flops(REAL_TRANSFORMER_CONFIG, 576, 128, transitions=8, checkpointing=True)
    assert model == pytest.approx(3 * 8 * f) and hw == pytest.approx(4 * 8 * f)
    assert replay_flops(REAL_TRANSFORMER_CONFIG, 576, 128, 8, checkpointing=False)[1] == pytest.approx(model)


def test_materialised_modules_match_a_normal_build():
    """Meta build + to_empty + random fill leaves no meta tensor, recomputes the rope tables
    (plain attributes) and the rotary inv_freq buffers exactly, and gives finite outputs."""
    from diffusers import QwenImageTransformer2DModel

    from tools.make_tiny_model import build_text_encoder as reference_text_encoder
    from tools.make_tiny_model import build_tokenizer

    cpu = torch.device("cpu")
    dit = build_transformer("tiny", cpu, torch.float32, seed=3)
    ref = QwenImageTransformer2DModel(**shape_configs("tiny")[0])
    assert torch.equal(dit.pos_embed.pos_freqs, ref.pos_embed.pos_freqs)
    assert torch.equal(dit.pos_embed.neg_freqs, ref.pos_embed.neg_freqs)
    again = build_transformer("tiny", cpu, torch.float32, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(dit.parameters(), again.parameters()))  # seeded: actor == engine

    tok = build_tokenizer()
    enc = build_text_encoder("tiny", tok, cpu, torch.float32)
    ref_enc = reference_text_encoder(tok)
    ref_buffers = dict(ref_enc.named_buffers())
    assert ref_buffers, "the reference text encoder should hold rotary buffers"
    for name, buf in enc.named_buffers():
        assert torch.equal(buf, ref_buffers[name]), name
    ids = tok("a red ball", return_tensors="pt")["input_ids"]
    out = enc(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert torch.isfinite(out).all()


def test_engine_is_the_native_engine_over_the_given_modules():
    from trainer.engine.native import NativeEngine

    engine = build_engine("tiny", torch.device("cpu"), torch.float32, max_batch_size=4)
    assert type(engine) is NativeEngine
    assert engine.vae_scale_factor == 4 and engine.latent_channels == 4
    cond = engine.encode_prompt("a red ball")
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    assert embeds.shape[1] == 16 and int(mask.sum()) == embeds.shape[0]


def assert_usage_error(argv: list[str], message: str, capsys) -> None:
    """tools/bench.py's parser refuses `argv` with exit 2 and `message` in its error."""
    from tools.bench import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def run_bench(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    """tools/bench.py as a fresh unlaunched process (no torchrun variables) on one thread: on a
    shared 2-core machine, two spinning OpenMP threads make tiny GEMMs ~10x slower."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_run_writes_well_formed_finite_figures(tmp_path):
    """One CPU run of the whole bench (LoRA, --full, --replay-variants, --profile-replay) at a tiny
    geometry."""
    out = tmp_path / "figures.jsonl"
    profile = tmp_path / "prof" / "replay.txt"
    step_profile = tmp_path / "prof" / "step.txt"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2",
           "--dit-batches", "2", "--iters", "1", "--text-tokens", "8", "--full", "--replay-variants",
           "--profile-replay", str(profile), "--profile-step", str(step_profile), "--out", str(out)]
    proc = run_bench(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines == printed
    figures = {}
    for line in lines:
        assert set(line) >= {"figure", "value", "unit", "device", "world_size", "geometry"}
        assert isinstance(line["value"], float) and math.isfinite(line["value"]), line
        assert line["world_size"] == 1 and line["device"].startswith("cpu")
        assert line["geometry"]["candidates"] == 4 and line["geometry"]["trained_steps"] == 2
        figures.setdefault(line["figure"], []).append(line)
    expected = {"matmul_tflops", "build_engine_s", "dit_forward_s", "dit_mfu", "rollout_s", "rollout_images_per_s",
                "rollout_mfu", "reward_s", "full_sync_s", "full_sync_noverify_s", "replay_transitions_per_s_full",
                "replay_mfu_full", "update_s_full", "merged_sync_s", "merged_sync_noverify_s",
                "replay_transitions_per_s_lora", "replay_mfu_lora", "update_s_lora", "adapter_sync_s",
                "actor_offload_s_lora", "actor_onload_s_lora", "engine_release_s", "engine_resume_s", "step_s",
                "replay_logp_max_abs_err_lora", "replay_logp_max_abs_err_full",
                "checksum_s", "checksum_gb_per_s", "checksum_alt_s", "checksum_alt_gb_per_s",
                "adapter_sync_per_tensor_s", "full_sync_noverify_per_tensor_s", "full_sync_noverify_flat_s",
                "replay_profile_s", "step_profile_s"}
    variants = ("noreshard", "ac_every2", "ac_none")
    expected |= {f"{fig}_lora_{v}" for v in variants
                 for fig in ("replay_transitions_per_s", "replay_mfu", "replay_logp_max_abs_err")}
    assert expected <= set(figures), expected - set(figures)
    # the two checksum reductions agree on the engine's DiT, and the figures say which is which
    assert [figures[n][0]["same_digest"] for n in ("checksum_s", "checksum_alt_s")] == [True, True]
    assert figures["checksum_alt_s"][0]["column_sums"] == "column_sums_wide"
    assert figures["checksum_s"][0]["gb"] == pytest.approx(
        figures["full_sync_s"][0]["gb"]) and figures["checksum_s"][0]["tensors"] == figures["full_sync_s"][0]["tensors"]
    modes = {n: figures[n][0]["gather_mode"] for n in ("adapter_sync_s", "adapter_sync_per_tensor_s", "full_sync_s",
                                                       "full_sync_noverify_per_tensor_s", "full_sync_noverify_flat_s")}
    assert modes == {"adapter_sync_s": "auto", "adapter_sync_per_tensor_s": "per_tensor", "full_sync_s": "auto",
                     "full_sync_noverify_per_tensor_s": "per_tensor", "full_sync_noverify_flat_s": "flat"}
    # each variant replays the engine's log-probs and says how it was built (the tiny DiT has 2 blocks)
    for v, (reshard, ac, blocks) in {"noreshard": (False, True, 2), "ac_every2": (True, True, 1),
                                     "ac_none": (True, False, 0)}.items():
        line = figures[f"replay_transitions_per_s_lora_{v}"][0]
        assert (line["reshard_after_forward"], line["activation_checkpointing"], line["checkpointed_blocks"]) == \
            (reshard, ac, blocks) and "oom" not in line
        assert line["value"] > 0
        assert figures[f"replay_logp_max_abs_err_lora_{v}"][0]["value"] < 1e-4
    # the profile table of one replay micro-batch, sorted by CPU time on a CPU run
    assert figures["replay_profile_s"][0]["path"] == str(profile)
    table = profile.read_text()
    assert "Name" in table and "CPU total" in table and "aten::" in table
    # one more step with each stage profiled: its op tables, and each stage's time split by kind
    (prof,) = figures["step_profile_s"]
    assert set(prof["stages"]) == {"rollout", "reward", "update", "sync"} and prof["path"] == str(step_profile)
    for name, stage in prof["stages"].items():
        assert stage["s"] > 0 and stage["gpu_idle_s"] is None, (name, stage)  # CPU: no device to idle
        assert sum(stage["shares"].values()) == pytest.approx(1.0) or stage["kernel_s"] == 0, (name, stage)
    assert prof["stages"]["update"]["kernel_s"] > 0 and prof["stages"]["update"]["shares"]["gemm"] > 0
    assert prof["value"] == pytest.approx(sum(stage["s"] for stage in prof["stages"].values()))
    sections = step_profile.read_text()
    assert all(f"== {name}: " in sections for name in prof["stages"]) and "aten::" in sections
    for name in ("rollout_images_per_s", "replay_transitions_per_s_lora", "dit_mfu", "step_s"):
        assert all(line["value"] > 0 for line in figures[name]), name
    # the fp32 replay through the actor reproduces the engine's log-probs (same seeded weights)
    assert figures["replay_logp_max_abs_err_lora"][0]["value"] < 1e-4
    step = figures["step_s"][0]
    assert set(step["stages"]) == {"rollout", "reward", "update", "sync"}
    assert sum(step["stages"].values()) <= step["value"] * 1.01
    # the garbage collector's pauses inside the step: a part of it, counted, never absent
    assert 0 <= step["gc_s"] < step["value"] and step["gc_full_collections"] >= 0
    assert step["alloc_retries"] is None  # CPU: no caching allocator
    assert figures["update_s_lora"][0]["optimizer_steps"] == 2.0
    # tiny geometry: 32 px / VAE factor 4 / patch 2 -> 4 x 4 image tokens
    assert figures["dit_mfu"][0]["geometry"]["image_tokens"] == 16
    assert figures["dit_mfu"][0]["tflop_per_forward"] == pytest.approx(
        dit_forward_flops(shape_configs("tiny")[0], 16, step["geometry"]["text_tokens"], 2) / 1e12)


#: a cheap tiny geometry shared by the step tests below
_TINY_STEP = ["--shape", "tiny", "--device", "cpu", "--height", "32", "--width", "32", "--steps", "3",
              "--sde-pool", "1", "2", "--trained-steps", "2", "--prompts", "2", "--group-size", "2",
              "--micro-batch", "1", "--num-updates", "2", "--dit-batches", "2", "--iters", "1", "--text-tokens", "8"]

#: every figure the default invocation prints at _TINY_STEP (no --full / --replay-variants / speed options):
#: the names stay these when other steps are asked for elsewhere
DEFAULT_FIGURES = {"actor_offload_s_lora", "actor_onload_s_lora", "adapter_sync_per_tensor_s", "adapter_sync_s",
                   "build_engine_s", "checksum_alt_gb_per_s", "checksum_alt_s", "checksum_gb_per_s", "checksum_s",
                   "dit_forward_s", "dit_mfu", "engine_release_s", "engine_resume_s", "matmul_tflops",
                   "merged_sync_noverify_s", "merged_sync_s", "replay_logp_max_abs_err_lora", "replay_mfu_lora",
                   "replay_transitions_per_s_lora", "reward_s", "rollout_first_s", "rollout_images_per_s",
                   "rollout_logp_gap_mean", "rollout_mfu", "rollout_replay_kl", "rollout_s", "step_s",
                   "update_s_lora"}


def test_default_invocation_prints_the_same_figure_names(tmp_path):
    """Without --algorithms / --old-logprob-source the bench prints exactly the figures it always did,
    one FlowGRPO step_s (now tagged with its algorithm and pi_old source) and no on-policy line."""
    out = tmp_path / "default.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_STEP, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {line["figure"] for line in lines} == DEFAULT_FIGURES
    (step,) = [line for line in lines if line["figure"] == "step_s"]
    assert (step["algorithm"], step["old_logprob_source"]) == ("flowgrpo", "replay")
    assert set(step["stages"]) == {"rollout", "reward", "update", "sync"}


def test_both_algorithms_and_both_old_logprob_sources_in_one_process(tmp_path):
    """--algorithms flowgrpo nft --old-logprob-source replay rollout under an FP8 rollout: a step_s per
    FlowGRPO source and one for nft, each split into the same stages, and beside each FlowGRPO step
    its on-policy figures: the anchored first update's ratio exactly 1, the recorded-log-prob one off
    1 by no more than the rollout-to-replay gap the actor measured (FP8 makes that gap non-zero)."""
    out = tmp_path / "steps.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_STEP, "--rollout-precision", "fp8",
                      "--skip", "dit", "checksum", "merged", "replay", "offload",
                      "--algorithms", "flowgrpo", "nft", "--old-logprob-source", "replay", "rollout",
                      "--nft-timestep-fraction", "0.5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [line for line in lines if line["figure"] == "step_s"]
    assert [(s["algorithm"], s.get("old_logprob_source")) for s in steps] == \
        [("flowgrpo", "replay"), ("flowgrpo", "rollout"), ("nft", None)]
    for s in steps:
        assert set(s["stages"]) == {"rollout", "reward", "update", "sync"}, s["stages"]
        assert all(math.isfinite(v) and v > 0 for v in s["stages"].values())
        assert s["value"] >= sum(s["stages"].values()) * 0.99, s  # the parts fit inside the whole
        assert s["candidates"] == 4 and s["update"]["optimizer_steps"] == 2.0
    nft = steps[2]
    # the old policy's soft update ran with the step: decay = 4 optimizer steps (the warm-up's 2 + 2) x 0.001
    assert nft["update"]["nft_old_decay"] == pytest.approx(0.004) and math.isfinite(nft["update"]["old_deviation"])
    # the FlowGRPO actor stepped in the update phase already (eager engine: no warm-up step); the
    # fresh nft actor gets one
    assert [line["algorithm"] for line in lines if line["figure"] == "step_first_s"] == ["nft"]

    onpolicy = {line["old_logprob_source"]: line for line in lines if line["figure"] == "step_onpolicy"}
    assert set(onpolicy) == {"replay", "rollout"}
    anchored, recorded = onpolicy["replay"], onpolicy["rollout"]
    assert anchored["value"] == 0.0 and anchored["first_update_ratio_mean"] == 1.0
    assert anchored["rollout_logprob_gap_max"] is None
    gap = recorded["rollout_logprob_gap_max"]
    # the ratio is an fp32 exp near 1, rounded to within an fp32 ulp of 1.0 (1.19e-7)
    assert 0 < gap < 1 and 0 < recorded["value"] <= math.expm1(gap) + 1.2e-7
    assert math.isfinite(recorded["first_update_ratio_mean"]) and recorded["first_update_ratio_mean"] != 1.0
    for line in onpolicy.values():
        # FP8 rounding in the sampler: a small positive KL and log-prob gap on the step's own rows
        assert 0 < line["sampler_replay_kl"] < 1e-2 and 0 < line["sampler_replay_gap_max_abs"] < 1
        assert line["first_update_ratio_min"] <= line["first_update_ratio_mean"] <= line["first_update_ratio_max"]


def test_fp8_replay_precision_gives_the_gradient_figure_and_keeps_the_first_ratio(tmp_path):
    """--replay-precision fp8: the LoRA gradient of one micro-batch against the compute dtype's on the
    same actor and batch (a few percent apart, never identical), and the step's anchored first update
    still at ratio exactly 1 with the FP8 base in the anchor and the replay alike."""
    out = tmp_path / "fp8_replay.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_STEP, "--replay-precision", "fp8",
                      "--skip", "dit", "checksum", "merged", "replay", "offload", "--old-logprob-source", "replay",
                      "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {line["geometry"]["replay_precision"] for line in lines} == {"fp8"}
    (grad,) = [line for line in lines if line["figure"] == "replay_fp8_grad_rel_diff"]
    assert 0 < grad["value"] < 0.2 and grad["cosine"] > 0.98 and grad["lora_b_nonzero"] is True
    assert grad["grad_norm_fp8"] > 0 and grad["grad_norm_default"] > 0 and 0 < grad["logp_max_abs_diff"] < 0.1
    (onpolicy,) = [line for line in lines if line["figure"] == "step_onpolicy"]
    assert onpolicy["value"] == 0.0 and onpolicy["first_update_ratio_mean"] == 1.0


def test_skip_fp8_grad_leaves_out_only_the_gradient_comparison(tmp_path):
    """--skip fp8_grad: --replay-precision fp8-dgrad (FP8 input gradients too) without the gradient
    comparison (which needs room for two more micro-batch gradients); the replay figures still time
    the FP8 replay."""
    out = tmp_path / "fp8_nograd.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_STEP, "--replay-precision",
                      "fp8-dgrad", "--skip", "dit", "checksum", "merged", "update", "adapter", "offload", "step",
                      "fp8_grad", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    figures = {line["figure"] for line in lines}
    assert "replay_fp8_grad_rel_diff" not in figures and "replay_transitions_per_s_lora" in figures
    assert {line["geometry"]["replay_precision"] for line in lines} == {"fp8-dgrad"}


def test_gemms_and_rollout_profile_account_for_every_block_linear(tmp_path):
    """--gemms times every linear of the blocks at the rollout's rows (M = candidates x the tokens
    the layer sees), once per distinct shape and variant, and dit_gemms_s is their sum over one
    forward; --profile-rollout writes the op table of one FP8 DiT forward and splits its time;
    --optimizers times one AdamW step both ways."""
    out = tmp_path / "gemms.jsonl"
    profile = tmp_path / "rollout_profile.txt"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_STEP, "--rollout-precision", "fp8",
                      "--gemms", "--profile-rollout", str(profile), "--optimizers",
                      "--skip", "checksum", "merged", "replay", "update", "adapter", "offload", "step",
                      "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    gemms = [line for line in lines if line["figure"] == "gemm_tflops"]
    sums = {line["variant"]: line for line in lines if line["figure"] == "dit_gemms_s"}
    geometry = gemms[0]["geometry"]
    candidates, image_tokens, text_tokens = (geometry[k] for k in ("candidates", "image_tokens", "text_tokens"))
    # the tiny block's 14 linears (2 modulations, 4 + 4 attention projections, 2 + 2 MLP layers), 2 blocks
    layers = [name for line in gemms if line["variant"] == "bf16" for name in line["layers"]]
    assert len(layers) == len(set(layers)) == 14 and sums["bf16"]["linears"] == 14
    rows_of = {line["layers"][0]: line["m"] for line in gemms}
    assert rows_of["attn.to_q"] == candidates * image_tokens
    assert rows_of["attn.add_q_proj"] == candidates * text_tokens
    assert rows_of["img_mod.1"] == candidates  # one modulation row per DiT row
    for variant in ("bf16", "fp8_rowwise", "fp8_rowwise_fast_accum", "fp8_rowwise_quantized", "fp8_tensorwise"):
        timed = [line for line in gemms if line["variant"] == variant]
        assert sum(len(line["layers"]) for line in timed) == 14, variant
        assert all(line["per_forward"] == 2 * len(line["layers"]) and line["value"] > 0 for line in timed)
        assert sums[variant]["value"] == pytest.approx(sum(line["seconds"] * line["per_forward"] for line in timed))
        assert sums[variant]["ratio_to_bf16"] == pytest.approx(sums["bf16"]["value"] / sums[variant]["value"])
        # fp32 on CPU: exact but for summation order; FP8 by its rounding (CPU ignores fast accumulation);
        # the tensorwise GEMM's unit scales over rowwise-quantized operands are timed, not compared
        errors = [line["max_rel_error"] for line in timed]
        if variant == "fp8_tensorwise":
            assert errors == [None] * len(timed)
        else:
            assert all(e < (1e-5 if variant == "bf16" else 0.1) for e in errors), (variant, errors)
            assert variant == "bf16" or all(e > 1e-4 for e in errors), (variant, errors)
        if variant.startswith("fp8_rowwise"):  # the FP8 operands' own product: summation order only on CPU
            assert all(line["max_rel_error_dequantized"] < 1e-5 for line in timed), variant
    # the quantization alone: one figure per distinct FP8 GEMM input, 12 FP8 linears a block (the
    # modulations' 3072-wide outputs pass too; the tiny widths are multiples of 16)
    quants = [line for line in lines if line["figure"] == "quantize_s"]
    fp8_layers = [name for line in gemms if line["variant"] == "fp8_rowwise" for name in line["layers"]]
    assert sorted(n for line in quants for n in line["layers"]) == sorted(fp8_layers)
    assert len({(line["m"], line["k"]) for line in quants}) == len(quants)
    for line in quants:
        assert line["value"] > 0 and line["copy_s"] > 0 and line["compiled"] is False  # eager on CPU
        # fp32 on CPU: 4 bytes read, 1 written a value, and a 4-byte scale a row
        assert line["bytes"] == line["m"] * line["k"] * 5 + 4 * line["m"]
        assert line["gb_per_s"] == pytest.approx(line["bytes"] / line["value"] / 1e9)
    (qsum,) = [line for line in lines if line["figure"] == "dit_quantize_s"]
    assert qsum["value"] == pytest.approx(sum(line["value"] * line["per_forward"] for line in quants))
    assert qsum["linears"] == sum(line["per_forward"] for line in gemms if line["variant"] == "fp8_rowwise")
    (prof,) = [line for line in lines if line["figure"] == "dit_profile_s"]
    assert prof["variant"] == "fp8" and prof["rows"] == candidates and prof["path"] == str(profile)
    assert sum(prof["shares"].values()) == pytest.approx(1.0)
    assert prof["shares"]["gemm"] > 0 and prof["shares"]["quantize"] > 0  # the eager FP8 path's amax / clamp
    assert "aten::_scaled_mm" in profile.read_text()
    # --optimizers: AdamW's two implementations over the LoRA actor's tensors, fused within rounding of foreach
    steps = {line["implementation"]: line for line in lines if line["figure"] == "optimizer_step_s"}
    assert steps.keys() == {"foreach", "fused"} and all(line["value"] > 0 for line in steps.values())
    assert steps["foreach"]["tensors"] == steps["fused"]["tensors"] > 0
    assert 0 <= steps["fused"]["max_abs_diff_to_foreach"] < 1e-6


def test_a_compiled_bench_refuses_a_compile_cache_others_can_write_before_anything_is_built(
        tmp_path, capsys, monkeypatch):
    import os

    import tools.bench as bench
    import trainer.distributed

    def built(*a, **k):
        raise AssertionError("the run went on past the cache's check")

    monkeypatch.setattr(trainer.distributed, "init_distributed", built)
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / "k.py").write_text("x = 1\n")
    os.chmod(cache / "k.py", 0o666)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--fsdp-compile"]) == 2
    err = capsys.readouterr().err
    assert f"load compiled kernels from TORCHINDUCTOR_CACHE_DIR {cache}" in err and "k.py is writable" in err


@pytest.mark.parametrize("kernel, share", [
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2", "gemm"),  # cuBLAS FP8 GEMM
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_gelu_3", "quantize"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_add_mul_7", "other"),  # rope before attention
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_view_2", "other"),  # RMS norm
    ("void at::native::elementwise_kernel<128, 2>", "other"),
    ("aten::_scaled_mm", "gemm"), ("aten::amax", "quantize"), ("aten::gelu", "other"),
])
def test_profile_shares_go_by_what_a_kernel_does_not_what_its_fused_name_mentions(kernel, share):
    """Inductor names a kernel after every op it fuses, so a quantization kernel's name holds
    "scaled_mm" and a rope kernel's "attention": neither may count as a GEMM or attention."""
    assert profile_share(kernel) == share


@pytest.mark.parametrize("argv, message", [
    (["--algorithms", "nft", "--old-logprob-source", "rollout"], "add flowgrpo to --algorithms"),
    (["--algorithms", "nft", "--guidance-scale", "4"], "--algorithms nft samples CFG-free"),
    (["--nft-timestep-fraction", "0"], "--nft-timestep-fraction must be in (0, 1]"),
    (["--family", "sd3", "--text-tokens-spread", "8"], "--text-tokens-spread varies Qwen-Image's prompt lengths"),
    (["--text-tokens", "16", "--text-tokens-spread", "16"], "--text-tokens-spread must be in [0, --text-tokens = 16)"),
    (["--text-tokens-spread", "-1"], "--text-tokens-spread must be in [0"),
])
def test_step_and_prompt_options_that_do_not_fit_are_usage_errors(argv, message, capsys):
    assert_usage_error(argv, message, capsys)


def test_spread_prompts_have_the_drawn_lengths_and_change_every_rollout():
    """--text-tokens-spread: each rollout's prompts encode to exactly the lengths drawn for it, the
    lengths stay within the spread, and another rollout brings other lengths and other prompts."""
    from tools.bench import make_prompts, spread_lengths

    engine = build_engine("tiny", torch.device("cpu"), torch.float32, max_batch_size=4)
    enc = engine.prompt_encoder
    drawn = {r: spread_lengths(6, 64, 16, r, seed=0) for r in range(4)}
    assert all(48 <= t <= 64 for lengths in drawn.values() for t in lengths)
    assert len({tuple(v) for v in drawn.values()}) > 1 and drawn[0] == spread_lengths(6, 64, 16, 0, seed=0)
    seen = set()
    for r in (0, 1):
        prompts = make_prompts(6, engine.tokenizer, enc.template, enc.template_start_idx, drawn[r], salt=f" take {r}")
        assert [int(engine.encode_prompt(p)["prompt_embeds"].shape[0]) for p in prompts] == drawn[r]
        assert not seen & set(prompts)
        seen |= set(prompts)


def test_tiny_run_with_spread_prompt_lengths_stays_on_policy(tmp_path):
    """Prompts of different lengths in one rollout (the masked path) and new lengths every
    rollout: the step's first update still has ratio 1 and the replay equals the sampler."""
    out = tmp_path / "spread.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "1",
           "--prompts", "3", "--group-size", "2", "--micro-batch", "2", "--num-updates", "1", "--iters", "1",
           "--text-tokens", "64", "--text-tokens-spread", "16", "--old-logprob-source", "replay",
           "--skip", "dit", "checksum", "merged", "replay", "update", "adapter", "offload", "--out", str(out)]
    proc = run_bench(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = {line["figure"]: line for line in map(json.loads, out.read_text().splitlines())}
    onpolicy = figures["step_onpolicy"]
    assert onpolicy["geometry"]["text_tokens_spread"] == 16
    assert onpolicy["first_update_ratio_mean"] == 1.0 and onpolicy["sampler_replay_gap_max_abs"] < 1e-5


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")
def test_parallelize_checkpoints_only_every_kth_block():
    """activation_checkpointing_every=k wraps blocks 0, k, 2k, ... and no others; the output and
    the gradients are those of checkpointing every block."""
    from diffusers import QwenImageTransformer2DModel
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from tests.dist.tiny import LATENT_HW, make_batch, one_rank_mesh, replay
    from trainer.actor import parallelize
    from trainer.core.modules import repeated_blocks

    def build(**kw):
        torch.manual_seed(0)
        model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=5,
                                            attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                            axes_dims_rope=(8, 4, 4))
        return parallelize(model, mesh, **kw)

    def wrapped(model):
        return [i for i, b in enumerate(repeated_blocks(model)) if isinstance(b, CheckpointWrapper)]

    assert LATENT_HW == 4
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        every1 = build(activation_checkpointing=True)
        every2 = build(activation_checkpointing=True, activation_checkpointing_every=2)
        assert wrapped(every1) == [0, 1, 2, 3, 4]
        assert wrapped(every2) == [0, 2, 4]
        assert wrapped(build(activation_checkpointing=True, activation_checkpointing_every=3)) == [0, 3]
        assert wrapped(build(activation_checkpointing=False, activation_checkpointing_every=2)) == []
        with pytest.raises(ValueError, match="activation_checkpointing_every"):
            build(activation_checkpointing=True, activation_checkpointing_every=0)
        batch = make_batch(2, seed=1)
        grads = []
        for model in (every1, every2):
            loss = replay(model, batch).sum()
            loss.backward()
            # the last block's text-stream outputs are discarded: its text weights get no gradient
            grads.append([(n.replace("._checkpoint_wrapped_module", ""),
                           None if p.grad is None else p.grad.full_tensor().clone())
                          for n, p in model.named_parameters()])
        assert [n for n, _ in grads[0]] == [n for n, _ in grads[1]]
        assert sum(g is not None for _, g in grads[0]) > len(grads[0]) // 2
        assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for (_, a), (_, b) in zip(*grads))
    finally:
        next(gen, None)


def test_the_step_actor_checkpoints_every_kth_block_as_asked(capsys):
    """--activation-checkpointing-every k reaches the actor the replay, update and step phases
    build and the hardware-FLOP count's checkpointed fraction; k < 1 is a usage error."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from tests.dist.tiny import one_rank_mesh
    from tools.bench import build_actor, checkpointed_fraction, parse_args
    from trainer.core.modules import repeated_blocks

    assert_usage_error([*_TINY_STEP, "--activation-checkpointing-every", "0"],
                       "--activation-checkpointing-every must be >= 1", capsys)
    for argv, every, fraction in (([], 1, 1.0), (["--activation-checkpointing-every", "2"], 2, 0.6),
                                  (["--no-activation-checkpointing"], None, 0.0)):
        args = parse_args([*_TINY_STEP, *argv])
        assert checkpointed_fraction({"num_layers": 5}, args) == fraction
        gen = one_rank_mesh()
        mesh = next(gen)
        try:
            actor = build_actor(args, "lora", mesh, torch.device("cpu"), torch.float32)
            blocks = repeated_blocks(actor.model)
            assert len(blocks) == 2  # the tiny DiT: every block, or only block 0 of the two
            want = [] if every is None else list(range(0, 2, every))
            assert [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)] == want
        finally:
            next(gen, None)


def test_a_stage_peak_is_its_own_and_the_phase_peak_still_covers_it(tmp_path, monkeypatch):
    """Reporter.stage_peak: each stage's figure is the peak of its own work, whatever came before;
    the phase's peak (peak_gb, peak_mem_<phase>) is still the highest of all. A fake allocator
    stands in for CUDA's counters."""
    from tools.bench import Reporter

    mem = {"now": 0, "peak": 0}

    def alloc(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mem.update(peak=mem["now"]))
    rep = Reporter(tmp_path / "f.jsonl", torch.device("cuda"), {"shape": "tiny"})
    peaks = {}
    alloc(50e9)  # the phase so far (the actor's build)
    with rep.stage_peak("rollout", peaks):
        alloc(30e9)
        alloc(-30e9)
    with rep.stage_peak("update", peaks):
        alloc(10e9)
        alloc(-10e9)
    assert peaks == {"rollout": 80.0, "update": 60.0}
    assert rep.peak_gb() == 80.0
    monkeypatch.setattr("tools.bench.device_name", lambda device: "fake")
    rep.phase_memory("step")
    line = json.loads((tmp_path / "f.jsonl").read_text().splitlines()[-1])
    assert line["figure"] == "peak_mem_step" and line["value"] == 80.0
    assert rep.peak_floor == 0 and rep.peak_gb() == 50.0  # the next phase starts from what is held


def test_replay_variant_out_of_memory_is_a_null_figure(tmp_path):
    """A variant whose build runs out of device memory gives its figure with value null and
    oom: true, and the bench carries on."""
    from types import SimpleNamespace

    from tools.bench import Reporter, replay_variant

    rep = Reporter(tmp_path / "f.jsonl", torch.device("cpu"), {"shape": "tiny"})
    built = []

    def build():
        built.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    c = SimpleNamespace(rep=rep, device=torch.device("cpu"))
    replay_variant(c, "ac_none", build, batch={}, replay_fn=None, checkpointing=0.0, activation_checkpointing=False)
    assert built == [1]
    line = json.loads((tmp_path / "f.jsonl").read_text())
    assert line["figure"] == "replay_transitions_per_s_lora_ac_none"
    assert line["value"] is None and line["oom"] is True and line["activation_checkpointing"] is False

    def other_error():
        raise RuntimeError("not a memory problem")

    with pytest.raises(RuntimeError, match="not a memory problem"):
        replay_variant(c, "ac_every2", other_error, batch={}, replay_fn=None, checkpointing=0.5)


def test_scorers_mode_times_every_scorer_at_tiny_shape(tmp_path):
    """--scorers builds each scorer's architecture in memory at random weights and times score()."""
    out = tmp_path / "scorers.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--scorers", "--shape", "tiny", "--device", "cpu",
           "--height", "48", "--width", "40", "--score-images", "4", "--iters", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")] == lines
    assert sorted(line["scorer"] for line in lines) == ["aesthetic", "clipscore", "hpsv21", "pickscore"]
    for line in lines:
        assert line["figure"] == "score_images_s" and line["images"] == 4 and line["device"].startswith("cpu")
        assert math.isfinite(line["value"]) and line["value"] > 0 and 0 < line["params"] < 10_000_000


@pytest.mark.parametrize("n", [0, 1, P - 1, P, P + 5, P * K - 1, P * K, P * K + 1, 3 * P * K + 2 * P + 17, 1_000_003])
def test_column_sums_wide_equals_column_sums_on_random_words(n):
    g = torch.Generator().manual_seed(n)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
    want, got = column_sums(words), column_sums_wide(words)
    assert got.dtype == want.dtype == torch.int32 and got.shape == (P,)
    assert torch.equal(got, want)


def test_column_sums_wide_wraps_like_column_sums():
    """Sums that overflow int32 wrap modulo 2^32 in both (every word the maximum)."""
    words = torch.full((2 * P * K + 3,), 2 ** 31 - 1, dtype=torch.int32)
    assert torch.equal(column_sums_wide(words), column_sums(words))
    assert int(column_sums(words)[0]) == ((2 * K + 1) * (2 ** 31 - 1) + 2 ** 31) % 2 ** 32 - 2 ** 31


def test_checksum_with_the_wide_reduction_is_the_same_digest():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(P * K + 999, generator=g)), ("b", torch.randn(300, 700, generator=g).bfloat16()),
             ("c", torch.randn(3, generator=g).half()), ("d", torch.randn(2 * P * K, generator=g))]
    assert weights_checksum(named, column_sums_wide) == weights_checksum(named)
    changed = [(n, t.clone()) for n, t in named]
    changed[0][1][P * K + 5] += 1.0  # an element in the remainder past the wide rows
    assert weights_checksum(changed, column_sums_wide) != weights_checksum(named)
    assert tensor_words(named[1][1]).numel() == 300 * 700 // 2


def test_tiny_run_with_true_cfg_counts_both_rows(tmp_path):
    """--guidance-scale 4: the rollout and the replay run two DiT rows per candidate, the replay
    still reproduces the sampler's log-prob, and the figures record the guidance."""
    out = tmp_path / "cfg.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2", "--iters", "1",
           "--text-tokens", "8", "--guidance-scale", "4", "--skip", "dit", "checksum", "merged", "offload",
           "--out", str(out)]
    proc = run_bench(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = {line["figure"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert figures["rollout_images_per_s"]["geometry"]["guidance_scale"] == 4.0
    assert figures["replay_logp_max_abs_err_lora"]["value"] < 1e-4
    assert figures["rollout_mfu"]["value"] > 0 and figures["replay_mfu_lora"]["value"] > 0


def test_tiny_run_with_fp8_and_the_diffusers_comparison(tmp_path):
    """--rollout-precision fp8 --compare diffusers: the eager engine, diffusers' pipeline on the
    same modules, then the FP8 engine, in one process; the ratios and the FP8 gap are figures."""
    out = tmp_path / "fp8.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "2", "--num-updates", "2", "--iters", "1",
           "--text-tokens", "8", "--rollout-precision", "fp8", "--compare", "diffusers", "--dit-batches", "2",
           "--skip", "checksum", "merged", "offload", "replay", "update", "--out", str(out)]
    proc = run_bench(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(line["figure"], line.get("variant")): line["value"] for line in lines}
    assert by[("rollout_images_per_s", "eager")] > 0 and by[("rollout_images_per_s", "fp8")] > 0
    assert by[("dit_mfu", "eager")] > 0 and by[("dit_mfu", "fp8")] > 0
    ratio = by[("rollout_vs_diffusers", "eager")]
    assert ratio == pytest.approx(by[("rollout_images_per_s", "eager")] / by[("compare_diffusers_images_per_s", None)])
    assert by[("rollout_speedup", "fp8")] > 0
    # FP8 rounding is visible as a gap between the engine's and the actor's transitions, and small
    assert 0 < by[("rollout_replay_kl", "fp8")] < 1e-2
    assert math.isfinite(by[("step_s", None)])


# ---------------------------------------------------------------- --family sd3


def test_sd3_flop_model_counts_the_tiny_dits_forward_exactly():
    """FlopCounterMode over a real forward of the tiny SD3.5 DiT (a dual-attention block, a
    context_pre_only last block; math SDPA) counts exactly the FLOP model's figure."""
    from diffusers import SD3Transformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tools.bench_sd3 import sd3_forward_flops, transformer_config

    cfg = transformer_config("tiny")
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**cfg).eval()
    b, h, w, t = 3, 6, 10, 7
    with torch.no_grad(), FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(hidden_states=torch.randn(b, cfg["in_channels"], h, w),
              encoder_hidden_states=torch.randn(b, t, cfg["joint_attention_dim"]),
              pooled_projections=torch.randn(b, cfg["pooled_projection_dim"]), timestep=torch.full((b,), 500.0),
              return_dict=False)
    assert counter.get_total_flops() == sd3_forward_flops(cfg, h * w, t, b)


def test_sd35_medium_shape_is_2_24_b_parameters_and_2_2_tflop_per_forward():
    from diffusers import SD3Transformer2DModel

    from tools.bench_sd3 import REAL_SD3_TRANSFORMER_CONFIG, sd3_forward_flops, sd3_param_counts

    with torch.device("meta"):
        model = SD3Transformer2DModel(**REAL_SD3_TRANSFORMER_CONFIG)
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(2.24e9, rel=0.01)  # diffusers' count; Stability quotes "2.5 B"
    # the matmul weights are all but the norms, biases and embeddings' tables
    assert sd3_param_counts(REAL_SD3_TRANSFORMER_CONFIG)["total_matmul"] == pytest.approx(total, rel=0.01)
    f = sd3_forward_flops(REAL_SD3_TRANSFORMER_CONFIG, 1024, 77 + 128, 1)  # 512x512, FlowGRPO's text window
    assert f == pytest.approx(2.22e12, rel=0.01)


def _fake_flowgrpo_checkout(root):
    """A stand-in with FlowGRPO's layout and call signature (not its code): the stock pipeline
    call, returning (images, latents list, log-prob list) as pipeline_with_logprob does."""
    patch = root / "flow_grpo" / "diffusers_patch"
    patch.mkdir(parents=True)
    (patch / "sd3_pipeline_with_logprob.py").write_text(
        "import torch\n"
        "CALLS = []\n"
        "def pipeline_with_logprob(self, prompt, negative_prompt, height, width, num_inference_steps,\n"
        "                          guidance_scale, output_type, max_sequence_length, noise_level, generator):\n"
        "    CALLS.append(len(prompt))\n"
        "    images = self(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,\n"
        "                  num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,\n"
        "                  output_type=output_type, max_sequence_length=max_sequence_length,\n"
        "                  generator=generator).images\n"
        "    return images, [images], [torch.zeros(len(prompt))] * num_inference_steps\n")
    return root


def test_sd3_tiny_bench_with_the_flowgrpo_phase(tmp_path):
    """The whole --family sd3 bench on CPU at the tiny shape, with true CFG and the FlowGRPO
    phase run against a stand-in checkout: every figure finite, the replay exact, the FlowGRPO
    function called on every candidate, its time and the ratio reported."""
    checkout = _fake_flowgrpo_checkout(tmp_path / "flow_grpo")
    out = tmp_path / "sd3.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--family", "sd3", "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2", "--dit-batches", "2",
           "--iters", "1", "--guidance-scale", "4.5", "--skip", "checksum", "offload",
           "--flowgrpo-path", str(checkout), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = {}
    for line in map(json.loads, out.read_text().splitlines()):
        assert isinstance(line["value"], float) and math.isfinite(line["value"]), line
        assert line["geometry"]["family"] == "sd3" and line["geometry"]["image_tokens"] == 256
        figures[line["figure"]] = line
    assert {"dit_forward_s", "dit_mfu", "rollout_images_per_s", "rollout_mfu", "flowgrpo_rollout_s",
            "flowgrpo_vs_native", "replay_transitions_per_s_lora", "replay_mfu_lora", "adapter_sync_s",
            "merged_sync_s", "step_s"} <= set(figures)
    assert figures["replay_logp_max_abs_err_lora"]["value"] == 0.0
    assert figures["flowgrpo_rollout_s"]["candidates"] == 4
    ratio = figures["flowgrpo_vs_native"]
    assert ratio["value"] == pytest.approx(ratio["native_rollout_s"] / ratio["flowgrpo_rollout_s"])


def test_flowgrpo_path_is_checked():
    from tools.bench_sd3 import import_flowgrpo_rollout

    with pytest.raises(ValueError, match="--flowgrpo-path .*sd3_pipeline_with_logprob.py"):
        import_flowgrpo_rollout(ROOT / "docs")


def test_the_default_shape_is_the_tiny_one():
    """`flowgrpo-bench` with no arguments must not build a 20 B model on whatever host it runs on."""
    from tools.bench import parse_args

    args = parse_args([])
    assert (args.shape, args.height, args.width) == ("tiny", 64, 64)
    real = parse_args(["--shape", "real"])
    assert (real.shape, real.height, real.width) == ("real", 384, 384)


@pytest.mark.parametrize("family, need_gb", [("qwen_image", 197.1), ("sd3", 40.6), ("flux", 115.1)])
def test_a_real_shape_that_cannot_fit_is_refused_before_anything_is_allocated(family, need_gb, monkeypatch, capsys):
    """The estimate comes from the shape on the meta device: the engine (DiT, VAE, text encoders)
    and the actor's DiT, here in fp32 on CPU, against 16 GB said to be available."""
    import tools.bench as bench

    monkeypatch.setattr(bench, "available_bytes", lambda device_type: (16 * 10**9, "available on this host"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main(["--family", family, "--shape", "real", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench: error: --shape real --family {family} needs at least "
                                               f"{need_gb} GB for its parameters alone")
    assert "but 16.0 GB is available on this host" in err[0] and "Use --shape tiny (the default)" in err[0]


def test_memory_estimate_counts_every_rank_on_a_host_and_one_shard_on_a_gpu():
    from tools.bench import memory_estimate, real_param_counts

    dit, rest = real_param_counts()
    assert (dit, rest) == (20_430_401_088, pytest.approx(8.42e9, rel=2e-3))
    # one H200 in bf16: about 98.6 GB of parameters, under its 141 GB
    assert memory_estimate(dit, rest, 2, "cuda", 1) / 1e9 == pytest.approx(98.6, abs=0.1)
    assert memory_estimate(100, 10, 2, "cuda", 4) == (100 + 10 + 25) * 2
    assert memory_estimate(100, 10, 4, "cpu", 2) == (2 * 110 + 100) * 4


# ---------------------------------------------------------------------------------------------
# --family wan (Wan2.1 text-to-video)

def test_wan_flop_model_counts_the_tiny_dits_forward_exactly():
    """wan_forward_flops against two independent counts of a real tiny WanTransformer3DModel
    forward (2 latent frames of 4 x 6, 5 text tokens, batch 3): FlopCounterMode's (math SDPA, so
    attention shows up as bmm), and one made from the module's own weights, each charged to the
    tokens it multiplies as read from its name (the cross-attention's k / v and the text embedder
    see text tokens, the time embedder one row per sample, everything else the video tokens)."""
    from diffusers import WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tools.bench_wan import wan_forward_flops
    from tools.tiny_wan import TINY_WAN_TRANSFORMER_CONFIG as cfg

    torch.manual_seed(0)
    model = WanTransformer3DModel(**cfg).eval()
    b, f, h, w, t = 3, 2, 4, 6, 5
    n = f * (h // 2) * (w // 2)  # patch (1, 2, 2)
    with torch.no_grad(), FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(hidden_states=torch.randn(b, cfg["in_channels"], f, h, w), timestep=torch.full((b,), 500.0),
              encoder_hidden_states=torch.randn(b, t, cfg["text_dim"]), return_dict=False)
    assert counter.get_total_flops() == wan_forward_flops(cfg, n, t, b)

    by_weights = 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
            continue
        if ".attn2.to_k" in name or ".attn2.to_v" in name or "text_embedder" in name:
            rows = t
        elif "time_embedder" in name or "time_proj" in name:
            rows = 1
        else:
            rows = n
        by_weights += 2 * module.weight.numel() * rows
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = cfg["num_layers"] * (4 * n * n * d + 4 * n * t * d)  # self- and cross-attention, QK^T and PV
    assert wan_forward_flops(cfg, n, t, b) == b * (by_weights + attention)


def test_wan_published_sizes_and_flops_per_forward():
    """The published configurations on the meta device: 1.42 B / 14.29 B DiT parameters, the 127 M
    VAE; one forward at 81 x 480 x 832 (32,760 video tokens, 512 text tokens) is 283 TFLOP (1.3B)
    and 1.68 PFLOP (14B), attention included."""
    from tools.bench_wan import SIZES, real_param_counts, wan_forward_flops

    dit, vae = real_param_counts("1.3b")
    assert 1.40e9 < dit < 1.44e9 and 126e6 < vae < 128e6
    assert 14.2e9 < real_param_counts("14b")[0] < 14.4e9
    assert wan_forward_flops(SIZES["1.3b"], 32760, 512) / 1e12 == pytest.approx(283.0, abs=0.1)
    assert wan_forward_flops(SIZES["14b"], 32760, 512) / 1e12 == pytest.approx(1678.4, abs=0.1)
    # the linears: under 2 x parameters x video tokens, since the cross-attention's k / v (141 M of
    # the 1.42 B) and the text embedder see only the 512 text tokens
    linear = wan_forward_flops(SIZES["1.3b"], 32760, 512) - 4 * 30 * 1536 * (32760 ** 2 + 32760 * 512)
    assert 0.85 < linear / (2 * dit * 32760) < 0.9


#: the tiny Wan at 5 x 32 x 32 (2 latent frames of 4 x 4: 8 video tokens), 8 text tokens
_TINY_WAN = ["--family", "wan", "--shape", "tiny", "--device", "cpu", "--frames", "5", "--height", "32", "--width",
             "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2", "--prompts", "2", "--group-size",
             "2", "--micro-batch", "1", "--num-updates", "2", "--dit-batches", "2", "--iters", "1",
             "--text-tokens", "8"]


def _figures(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in map(json.loads, path.read_text().splitlines()):
        out.setdefault(line["figure"], []).append(line)
    return out


def test_wan_runs_every_phase_and_both_steps_at_tiny_shape(tmp_path):
    """--family wan on CPU in fp32: the rollout draws videos (decoded, scored frame by frame), the
    LoRA replay reproduces the sampler, and the FlowGRPO and nft steps run with their stages; the
    anchored first update's ratio is exactly 1 and the sampler-replay gap ~0; the figures carry
    the frames and the Wan FLOP model."""
    from tools.bench_wan import wan_forward_flops
    from tools.tiny_wan import TINY_WAN_TRANSFORMER_CONFIG

    out = tmp_path / "wan.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_WAN, "--skip", "checksum", "offload",
                      "--algorithms", "flowgrpo", "nft", "--old-logprob-source", "replay", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = _figures(out)
    for lines in figures.values():
        for line in lines:
            assert line["value"] is None or math.isfinite(line["value"]), line
            g = line["geometry"]
            assert (g["family"], g["frames"], g["latent_frames"], g["image_tokens"]) == ("wan", 5, 2, 8)
    assert {"dit_forward_s", "rollout_s", "rollout_images_per_s", "reward_s", "replay_transitions_per_s_lora",
            "update_s_lora", "adapter_sync_s", "merged_sync_s", "step_s", "step_onpolicy"} <= set(figures)
    assert figures["rollout_images_per_s"][0]["unit"] == "videos/s"
    assert figures["reward_s"][0]["scorer"].startswith("framewise color")
    assert figures["replay_logp_max_abs_err_lora"][0]["value"] < 1e-5
    dit = figures["dit_mfu"][0]
    assert dit["tflop_per_forward"] == pytest.approx(wan_forward_flops(TINY_WAN_TRANSFORMER_CONFIG, 8, 8, 2) / 1e12)
    assert dit["value"] > 0

    steps = figures["step_s"]
    assert [s["algorithm"] for s in steps] == ["flowgrpo", "nft"]
    for s in steps:
        assert s["value"] > 0 and set(s["stages"]) == {"rollout", "reward", "update", "sync"}
        assert all(v > 0 for v in s["stages"].values())
        assert s["value"] >= sum(s["stages"].values()) * 0.99
        assert s["candidates"] == 4 and s["update"]["optimizer_steps"] == 2.0
    (onpolicy,) = figures["step_onpolicy"]
    assert onpolicy["value"] == 0.0 and onpolicy["first_update_ratio_mean"] == 1.0
    assert onpolicy["sampler_replay_gap_max_abs"] < 1e-5 and onpolicy["sampler_replay_kl"] < 1e-9


def test_skip_eager_keeps_the_speed_options_rollout_and_the_step(tmp_path):
    """--skip eager with --rollout-precision fp8 (true CFG): no eager figure and no speedup ratio,
    but the fp8 rollout, the update and the step all run. (The tiny Wan is 24 wide: no linear is
    FP8-eligible, and enable_speedups_s says so.)"""
    out = tmp_path / "wan_fp8.jsonl"
    proc = run_bench([sys.executable, str(ROOT / "tools" / "bench.py"), *_TINY_WAN, "--guidance-scale", "4.5",
                      "--rollout-precision", "fp8", "--skip", "eager", "dit", "checksum", "merged", "replay",
                      "offload", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = _figures(out)
    assert not [line for lines in figures.values() for line in lines if line.get("variant") == "eager"]
    assert "rollout_speedup" not in figures
    assert [line["variant"] for line in figures["rollout_s"]] == ["fp8"]
    assert figures["enable_speedups_s"][0]["fp8_linears"] == 0
    (step,) = figures["step_s"]
    assert step["value"] > 0 and set(step["stages"]) == {"rollout", "reward", "update", "sync"}
    assert step["geometry"]["guidance_scale"] == 4.5


@pytest.mark.parametrize("argv, message", [
    (["--frames", "5"], "--frames 5: --family qwen_image draws images"),
    (["--family", "sd3", "--frames", "9"], "--family sd3 draws images"),
    (["--family", "wan", "--frames", "6"], "frames 6 is not of the form 4k+1"),
    (["--family", "wan", "--frames", "0"], "--frames: frames must be an integer >= 1"),
    (["--family", "wan", "--height", "40"], "height 40 is not a multiple of 16"),
    (["--wan-size", "14b"], "--wan-size picks the Wan2.1 model of --family wan"),
    (["--family", "wan", "--shape", "real", "--num-layers", "4"], "--family wan builds the published sizes"),
    (["--skip", "eager"], "--skip eager leaves out the eager rollout"),
    (["--skip", "eager", "--rollout-compile", "--compare", "diffusers"], "--compare's ratios are against the eager"),
])
def test_video_and_skip_eager_flags_that_do_not_fit_are_usage_errors(argv, message, capsys):
    assert_usage_error(argv, message, capsys)


def test_wan_defaults_are_flowgrpos_geometry_at_the_real_shape():
    from tools.bench import parse_args

    real = parse_args(["--family", "wan", "--shape", "real"])
    assert (real.frames, real.height, real.width, real.text_tokens, real.wan_size) == (33, 240, 416, 512, "1.3b")
    tiny = parse_args(["--family", "wan"])
    assert (tiny.frames, tiny.height, tiny.width) == (5, 32, 32)
    assert parse_args([]).frames == 1 and parse_args([]).text_tokens == 128


def test_a_14b_wan_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch, capsys):
    """The 14B DiT twice (engine and actor) and the VAE in fp32: 114.8 GB against 16 GB available."""
    import tools.bench as bench

    monkeypatch.setattr(bench, "available_bytes", lambda device_type: (16 * 10**9, "available on this host"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main(["--family", "wan", "--wan-size", "14b", "--shape", "real", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "bench: error: --shape real --family wan needs at least 114.8 GB" in err


def test_until_steady_stops_at_the_first_step_that_compiled_nothing():
    """The bench's warm-up and timed steps (phase_step): a step that compiled graphs is followed by
    another, up to the limit; without a CompileWatch one step runs."""
    from tools.bench import until_steady

    class Watch:
        def __init__(self, counts):
            self.counts = list(counts)

        def new_graphs(self):
            return self.counts.pop(0)

    ran = []
    out = list(until_steady(lambda i: ran.append(i) or f"step {i}", Watch([6, 2, 0, 5]), 4))
    assert ran == [0, 1, 2]
    assert out == [(0, "step 0", 6, False), (1, "step 1", 2, False), (2, "step 2", 0, True)]
    # the limit: the last try is the result whatever it compiled
    assert [(i, n, last) for i, _, n, last in until_steady(lambda i: i, Watch([3, 3, 3]), 2)] == [
        (0, 3, False), (1, 3, True)]
    assert [(i, n, last) for i, _, n, last in until_steady(lambda i: i, None, 3)] == [(0, None, True)]


def test_the_product_comparison_takes_only_rollouts_that_compiled_nothing():
    """tests/gpu/compare_product_bench.py: the product path's steady rollouts leave out the first
    ones, every one that compiled a graph in the engine or the actor, and the last one."""
    from tests.gpu.compare_product_bench import steady, steady_rollouts

    scalars = {"perf/step_time": [(k, 10.0 - k) for k in range(8)],
               "perf/rollout_new_graphs": [(0, 7), (1, 2), (2, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0)],
               "perf/actor_new_graphs": [(0, 6), (1, 4), (2, 2), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]}
    rollouts = steady_rollouts(scalars, skip_first=2)
    assert rollouts == {4, 5, 6}
    assert steady(scalars["perf/step_time"], rollouts) == [6.0, 5.0, 4.0]
    # without the graph series (no compiled blocks): every rollout past the first ones but the last
    assert steady_rollouts({"perf/step_time": scalars["perf/step_time"]}, skip_first=2) == {2, 3, 4, 5, 6}


def test_the_product_comparison_reads_a_stored_run_and_says_whether_it_is_within_5_percent(tmp_path, capsys):
    """compare_product_bench.py on the scalars a speed phase saved as JSON (no event files): the
    steady median against the bench's step_s, the verdict, and the per-rollout GC figures."""
    from tests.gpu.compare_product_bench import main

    steps = [30.0, 12.0, 7.4, 7.6, 7.5, 14.0]
    scalars = {"perf/step_time": [[k, v] for k, v in enumerate(steps)],
               "perf/rollout_time": [[k, v / 2] for k, v in enumerate(steps)],
               "perf/gc_time": [[k, 0.5 if k < 2 else 0.001] for k in range(6)]}
    run = tmp_path / "scalars-speed-resident.json"
    run.write_text(json.dumps(scalars))
    bench = tmp_path / "bench.jsonl"

    def verdict(bench_step: float) -> str:
        bench.write_text(json.dumps({"figure": "step_s", "value": bench_step, "stages": {"rollout": 3.6}}) + "\n")
        assert main([str(run), str(bench)]) == 0
        out = capsys.readouterr().out
        assert "perf/gc_time" in out and "{0: 0.5, 1: 0.5, 2: 0.001" in out
        return next(line for line in out.splitlines() if line.startswith("steady step"))

    assert verdict(7.3).endswith(": within 5%") and "product 7.5 s" in verdict(7.3)  # median of rollouts 2-4
    assert verdict(7.0).endswith(": NOT within 5%")


def test_the_step_phase_times_each_fp8_replay_variant_on_one_actor(tmp_path):
    """--replay-fp8-variants: one step per entry on the same actor and FP8 engine, each line naming
    its variant; linked layers only with sharing keep or on (16 LoRA bases, 28 with the MLPs and
    modulation), none mismatched, their own weights freed only with on (fp8-dgrad), and the first
    ratio of every variant within the FP8 sampler's rounding; a third field :fast switches the
    engine's and the actor's FP8 forward GEMMs to fast accumulation for its step alone. A variant
    with sharing on before another is refused (its freed weights could not switch back), unless
    the other differs in its accumulation alone."""
    out = tmp_path / "figures.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "2", "--num-updates", "2", "--iters", "1",
           "--text-tokens", "8", "--rollout-precision", "fp8", "--replay-precision", "fp8-dgrad",
           "--replay-fp8-variants", "lora-base:off", "lora-base:keep:fast", "frozen:off", "frozen:on",
           "frozen:on:fast",
           "--old-logprob-source", "rollout", "--skip", "dit", "checksum", "merged", "replay", "update", "offload",
           "eager", "adapter", "fp8_grad", "--profile-step", str(tmp_path / "step.txt"), "--out", str(out)]
    proc = run_bench(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [line for line in lines if line["figure"] == "step_s"]
    profiles = [line["path"] for line in lines if line["figure"] == "step_profile_s"]  # one per variant
    assert profiles == [str(tmp_path / f"step-{v}.txt") for v in ("lora-base-off-full", "lora-base-keep-fast",
                                                                   "frozen-off-full", "frozen-on-full",
                                                                   "frozen-on-fast")]
    assert all(Path(p).read_text().startswith("== rollout: ") for p in profiles)
    got = [(s["replay_fp8_layers"], s["replay_fp8_sharing"], s["replay_fp8_shared_layers"],
            s["replay_fp8_mismatched_layers"], s["replay_fp8_released_layers"]) for s in steps]
    assert got == [("lora-base", "off", 0, 0, 0), ("lora-base", "keep", 16, 0, 0), ("frozen", "off", 0, 0, 0),
                   ("frozen", "on", 28, 0, 28), ("frozen", "on", 28, 0, 28)], got
    assert steps[-1]["replay_fp8_released_gb"] == steps[-2]["replay_fp8_released_gb"] > 0
    # the tiny DiT's blocks: 28 FP8 linears in the engine; the actor's FP8 layers of the variant
    assert [s["fp8_accum"] for s in steps] == ["full", "fast", "full", "full", "fast"]
    assert [s["fp8_fast_accum_layers"] for s in steps] == [{"engine": 0, "actor": 0}, {"engine": 28, "actor": 16},
                                                           {"engine": 0, "actor": 0}, {"engine": 0, "actor": 0},
                                                           {"engine": 28, "actor": 28}]
    onpolicy = [line for line in lines if line["figure"] == "step_onpolicy"]
    assert [(o["replay_fp8_layers"], o["replay_fp8_sharing"]) for o in onpolicy] == [g[:2] for g in got]
    assert all(0 <= o["value"] < 1e-2 for o in onpolicy), onpolicy
    bad = run_bench(cmd[:cmd.index("--replay-fp8-variants") + 1] + ["frozen:maybe"])
    assert bad.returncode == 2 and "--replay-fp8-variants frozen:maybe: each entry is LAYERS:SHARING[:ACCUM]" in bad.stderr
    bad = run_bench(cmd[:cmd.index("--replay-fp8-variants") + 1] + ["frozen:keep:slow"])
    assert bad.returncode == 2 and "ACCUM one of ('full', 'fast')" in bad.stderr
    bad = run_bench(cmd[:cmd.index("--replay-fp8-variants") + 1] + ["frozen:on", "frozen:on:fast", "frozen:keep"])
    assert bad.returncode == 2 and "frozen:on: with --replay-precision fp8-dgrad, sharing on frees" in bad.stderr

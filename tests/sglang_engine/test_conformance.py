"""The SGLang engine against the native engine on the tiny model (CPU, fp32): the same requests
give the same trajectories, the trainer's replay reproduces each engine's recorded log-probs, a
weight update (full and LoRA) changes both engines identically, release/resume round-trips.

Measured on the 2-core CPU machine (tiny model, 64x64, 6 steps): the two engines' latents,
images, prompt embeddings and log-probs differ by <= 1e-6 (different DiT implementations of
the same math: SGLang fuses the text q/k/v projection and uses its own norm/modulation ops).
The replay (the trainer's QwenImageAdapter.replay_transition through a separately loaded
diffusers transformer) matches each engine's recorded log-probs. The engines run where
tests/sglang_engine/devices.py says (CPU fp32 unless SGLANG_TEST_DEVICE / _DTYPE set another),
which also holds the tolerances per dtype and their reasons (fp32: 1e-5; bf16: its rounding).
Each comparison prints its measured differences ("[diffs]"; pytest -s shows them).
"""

from __future__ import annotations

import pytest
import torch

from trainer.engine.base import RolloutEngine, WeightSyncError
from trainer.engine.native import NativeEngine, _normalize_lora_config
from trainer.engine.sglang_engine import SGLangEngine
from trainer.models.qwen_image import QwenImageAdapter
from trainer.sampling import parse_sampling_config
from trainer.core.manifest import build_manifest

from tests.sglang_engine.devices import DEVICE, DTYPE, REPLAY_TOL, native_kwargs, sglang_kwargs, tol

PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]
KEYS = ("latents", "next_latents", "log_probs", "images", "prompt_embeds", "prompt_embeds_mask")


def sampling_for(sde_type="sde", eta=0.7, sde_indices=(1, 2, 4)):
    return parse_sampling_config({"height": 64, "width": 64, "num_inference_steps": 6, "eta": eta,
                                  "sde_type": sde_type, "sde_indices": list(sde_indices)})


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    sg = SGLangEngine(str(tiny_model_dir), **sglang_kwargs())
    na = NativeEngine(str(tiny_model_dir), **native_kwargs(max_batch_size=8))
    return na, sg


@pytest.fixture(scope="module")
def adapter():
    return QwenImageAdapter()


def make_requests(adapter, engine, sampling, prompts=PROMPTS, group_size=2, seed=7):
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"prompt:{g}:sample:{s}",
                                          sampling=sampling, sde_indices=list(sampling.sde_indices), sigmas=sigmas,
                                          generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(group_size)]


def max_diff(a, b, key):
    return (getattr(a, key).float() - getattr(b, key).float()).abs().max().item()


def assert_same_outputs(a, b, tol_override=None):
    assert len(a) == len(b)
    assert a.sample_ids == b.sample_ids and a.sde_indices == b.sde_indices
    for k in ("sigmas", "sigmas_next", "timesteps"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    for k in KEYS:
        assert getattr(a, k).shape == getattr(b, k).shape and getattr(a, k).dtype == getattr(b, k).dtype, k
    diffs = {k: max_diff(a, b, k) for k in KEYS}
    bound = {k: tol(k) if tol_override is None else tol_override for k in KEYS}
    print(f"[diffs] {DEVICE} {DTYPE}: " + ", ".join(f"{k} {d:.2e}" for k, d in diffs.items()))
    assert all(diffs[k] <= bound[k] for k in KEYS), (diffs, bound)
    return diffs


def test_engine_satisfies_protocol(engines):
    assert isinstance(engines[1], RolloutEngine)


def test_sglang_keeps_every_module_resident(engines):
    """The engine moves its modules itself (release_memory / resume_memory): SGLang's own
    component offload, which it turns on by default for image generation on a GPU, stays off."""
    from trainer.engine.sglang_engine import RESIDENT_ARGS

    args = engines[1].server_args
    assert set(RESIDENT_ARGS) == {"dit_cpu_offload", "text_encoder_cpu_offload", "image_encoder_cpu_offload",
                                  "vae_cpu_offload"}
    for name in RESIDENT_ARGS:
        assert getattr(args, name) is False, (name, getattr(args, name))


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("dance", 0.3)])
def test_same_requests_same_trajectories(engines, adapter, sde_type, eta):
    na, sg = engines
    sampling = sampling_for(sde_type, eta)
    reqs = make_requests(adapter, na, sampling)
    a, b = na.generate(reqs), sg.generate(reqs)
    assert_same_outputs(a, b)
    adapter.validate_trajectory(b)
    assert b.images.shape == (4, 3, 64, 64) and b.latents.shape == (4, 3, 64, 16)
    assert b.sde_type == sde_type and b.eta == eta and (b.policy_versions == sg.policy_version).all()
    # the candidates of a group differ (distinct sample ids drive x_T and the step noise)
    assert (b.images[0] - b.images[1]).abs().max() > 1e-3
    # adjacent trained steps 1 and 2 chain exactly; the trajectory is the engine's own
    assert torch.equal(b.next_latents[0, 0], b.latents[0, 1])


def test_driver_sigmas_are_used_verbatim(engines, adapter):
    """A schedule SGLang would never compute itself (reversed spacing) is still the one it steps on."""
    na, sg = engines
    sampling = sampling_for()
    reqs = make_requests(adapter, na, sampling, prompts=PROMPTS[:1], group_size=1)
    custom = [1.0, 0.9, 0.75, 0.6, 0.4, 0.1, 0.0]
    for r in reqs:
        r.sigmas = list(custom)
    a, b = na.generate(reqs), sg.generate(reqs)
    assert_same_outputs(a, b)
    assert torch.equal(b.sigmas[0], torch.tensor([custom[i] for i in (1, 2, 4)], dtype=torch.float32))
    assert torch.equal(b.sigmas_next[0], torch.tensor([custom[i] for i in (2, 3, 5)], dtype=torch.float32))


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("dance", 0.3)])
def test_replay_reproduces_each_engines_logprobs(engines, adapter, tiny_model_dir, sde_type, eta):
    sampling = sampling_for(sde_type, eta)
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=DTYPE).to(DEVICE)
    for engine in engines:
        batch = engine.generate(make_requests(adapter, engines[0], sampling))
        with torch.no_grad():
            for col in range(batch.num_steps):
                got = adapter.replay_transition(actor, batch, col)
                print(f"[diffs] replay {type(engine).__name__} col {col}: "
                      f"{(got.float().cpu() - batch.log_probs[:, col].float().cpu()).abs().max().item():.2e}")
                torch.testing.assert_close(got.cpu(), batch.log_probs[:, col].cpu(), atol=REPLAY_TOL, rtol=0)


def _perturbed_state(tiny_model_dir, seed=3, scale=0.05):
    from trainer.models.qwen_image import load_qwen_image_transformer

    model = load_qwen_image_transformer(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, (p + scale * torch.randn(p.shape, generator=g)).detach()) for n, p in model.named_parameters()], \
        [(n, p.detach().clone()) for n, p in model.named_parameters()]


def test_full_weight_update_changes_both_engines_identically(engines, adapter, tiny_model_dir):
    na, sg = engines
    reqs = make_requests(adapter, na, sampling_for(), prompts=PROMPTS[:1])
    before = sg.generate(reqs)
    assert sg.get_weights_checksum() == na.get_weights_checksum()
    c0 = sg.get_weights_checksum()
    new, orig = _perturbed_state(tiny_model_dir)
    try:
        manifest = build_manifest("full", new, version=1)
        for e in engines:
            e.update_weights_from_tensors(new, manifest)
            e.commit_weight_version(1)
        assert sg.get_weights_checksum() == na.get_weights_checksum() != c0
        a, b = na.generate(reqs), sg.generate(reqs)
        assert_same_outputs(a, b)
        assert int(b.policy_versions[0]) == 1
        assert (b.images[0] - before.images[0]).abs().max() > 1e-3  # the update took effect
        # checked like the native engine's: an unknown name / a bad shape copies nothing
        bad = [("not_a_param.weight", torch.zeros(2))]
        with pytest.raises(WeightSyncError, match="does not have"):
            sg.update_weights_from_tensors(bad, build_manifest("full", bad, 2))
        name, t = new[0]
        wrong = [(name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))]
        with pytest.raises(WeightSyncError, match="shape mismatch"):
            sg.update_weights_from_tensors(wrong, build_manifest("full", wrong, 2))
        assert sg.get_weights_checksum() == na.get_weights_checksum()
    finally:
        manifest = build_manifest("full", orig, version=0)
        for e in engines:
            e.update_weights_from_tensors(orig, manifest)
            e.commit_weight_version(0)
    assert sg.get_weights_checksum() == c0
    assert_same_outputs(before, sg.generate(reqs), tol_override=0)


def test_text_qkv_rows_land_in_sglangs_fused_projection(engines, tiny_model_dir):
    """SGLang fuses add_q/k/v_proj into to_added_qkv: a diffusers-named update writes its row block."""
    _, sg = engines
    params = dict(sg.transformer.named_parameters())
    fused = params["transformer_blocks.0.attn.to_added_qkv.weight"]
    k = sg._view("transformer_blocks.0.attn.add_k_proj.weight")
    rows = k.shape[0]
    assert torch.equal(fused.data[rows:2 * rows], k)
    assert k.data_ptr() == fused.data[rows:2 * rows].data_ptr()  # a view, not a copy


def test_building_an_engine_leaves_the_process_as_it_was(tiny_model_dir, monkeypatch):
    """SGLang's worker is written to own its process; inside a trainer rank the engine puts back
    the env variables, thread count, TF32 / reduced-precision switches, logging and title."""
    import logging
    import os

    import setproctitle

    from trainer.engine.sglang_engine import _numerics_state

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else SGLang leaves the thread count alone
    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.set_num_threads(1)
    root = logging.getLogger()
    before = (_numerics_state(), torch.get_num_threads(), setproctitle.getproctitle(), list(root.handlers),
              root.level)
    sg = SGLangEngine(str(tiny_model_dir), **sglang_kwargs(attention_backend="torch_sdpa"))
    after = (_numerics_state(), torch.get_num_threads(), setproctitle.getproctitle(), list(root.handlers),
             root.level)
    assert after == before
    assert os.environ["RANK"] == "5" and "WORLD_SIZE" not in os.environ
    # the attention backend reaches SGLang's configuration (a GPU without FlashAttention's library
    # runs its DiT through torch SDPA)
    assert str(sg.server_args.attention_backend).lower() == "torch_sdpa"


def test_lora_update_changes_both_engines_identically(tiny_model_dir, adapter):
    # fresh engines: an engine that holds LoRA refuses full syncs for the rest of its life
    sg = SGLangEngine(str(tiny_model_dir), **sglang_kwargs())
    na = NativeEngine(str(tiny_model_dir), **native_kwargs(max_batch_size=8))
    reqs = make_requests(adapter, na, sampling_for(), prompts=PROMPTS[:1])
    before = sg.generate(reqs)
    c0 = sg.get_weights_checksum()
    cfg = {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)}
    g = torch.Generator().manual_seed(11)
    shapes = sg._lora_shapes(_normalize_lora_config(cfg))
    for version in (1, 2):  # install, then replace
        lora = [(n, 0.2 * torch.randn(s, generator=g)) for n, s in sorted(shapes.items())]
        manifest = build_manifest("adapter", lora, version)
        for e in (na, sg):
            e.set_lora_tensors(lora, manifest, cfg)
            e.commit_weight_version(version)
        assert sg.holds_lora() and na.holds_lora()
        assert sg.get_weights_checksum() == na.get_weights_checksum() != c0
        a, b = na.generate(reqs), sg.generate(reqs)
        diffs = assert_same_outputs(a, b)
        assert (b.images[0] - before.images[0]).abs().max() > 1e-3
    # the adapter must be complete, and a full sync is refused once an adapter is installed
    with pytest.raises(WeightSyncError, match="lacks"):
        sg.set_lora_tensors(lora[1:], build_manifest("adapter", lora[1:], 3), cfg)
    full = [(n, sg._view(n).clone()) for n in list(sg._index)[:2]]
    with pytest.raises(WeightSyncError, match="LoRA"):
        sg.update_weights_from_tensors(full, build_manifest("full", full, 3))
    assert diffs["images"] <= tol("images")


def test_peft_adapter_directory_loads_identically(tiny_model_dir, adapter, tmp_path):
    """load_lora_dir (tools/sample.py --lora) on both engines: a peft save_pretrained directory."""
    from peft import LoraConfig, get_peft_model

    model = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["attn.to_q", "attn.to_v"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    sg = SGLangEngine(str(tiny_model_dir), **sglang_kwargs())
    na = NativeEngine(str(tiny_model_dir), **native_kwargs())
    c0 = sg.get_weights_checksum()
    assert sg.load_lora_dir(tmp_path / "adapter") == na.load_lora_dir(tmp_path / "adapter")
    assert sg.get_weights_checksum() == na.get_weights_checksum() != c0
    reqs = make_requests(adapter, na, sampling_for(), prompts=PROMPTS[:1], group_size=1)
    assert_same_outputs(na.generate(reqs), sg.generate(reqs))


def test_release_resume_round_trips(engines, adapter):
    _, sg = engines
    reqs = make_requests(adapter, sg, sampling_for(), prompts=PROMPTS[:1])
    before = sg.generate(reqs)
    c0 = sg.get_weights_checksum()
    sg.release_memory()
    assert not any(sg.memory_state().values())
    with pytest.raises(RuntimeError, match="released"):
        sg.generate(reqs)
    with pytest.raises(WeightSyncError, match="released"):
        sg.update_weights_from_tensors([], build_manifest("full", [], 0))
    sg.resume_memory(("weights",))
    assert all(sg.memory_state().values())
    assert sg.get_weights_checksum() == c0
    assert_same_outputs(before, sg.generate(reqs), tol_override=0)
    with pytest.raises(ValueError, match="unknown memory tag"):
        sg.release_memory(("kv_cache",))


@pytest.mark.skipif(DEVICE.startswith("cuda") and torch.cuda.device_count() < 2,
                    reason="two ranks on CUDA need two GPUs (rank 1 runs on cuda:1)")
def test_two_ranks_under_torchrun(tiny_model_dir, tmp_path):
    """Each of 2 gloo ranks runs its own in-process SGLang engine inside the trainer's process
    group: outputs match the native engine on the rank, the rank's torchrun env variables are
    intact, and the group's collectives still work afterwards."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("dist_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), str(worker), str(tiny_model_dir), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world"] == 2 and res["env_restored"]
        assert res["max_diff"] <= tol("latents")
    # both ranks gathered the same tensors, and the ranks sampled different candidates
    assert results[0]["gathered_logps"] == results[1]["gathered_logps"]
    assert results[0]["gathered_logps"][0] != results[0]["gathered_logps"][1]
    assert results[0]["checksum"] == results[1]["checksum"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

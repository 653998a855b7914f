"""The rollout's speed options on CPU: FP8 linears (--rollout-precision fp8) and regional
compilation of the engine's and the actor's repeated blocks (--rollout-compile, --fsdp-compile).

The compile tests run torch.compile with the "eager" backend: dynamo traces and guards the
blocks exactly as with inductor (what decides recompiles, module names, and whether LoRA and
FSDP2 hooks still work), without inductor's codegen time. The GPU figures are
tools/bench.py's (docs/PERFORMANCE.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.dist.tiny import make_batch, make_cfg, one_rank_mesh, replay, tiny_transformer
from tests.test_engine import make_requests
from trainer.core.fp8 import E4M3_MAX, FP8Linear, convert_to_fp8, fp8_linear, quantize_rowwise
from trainer.core.manifest import WeightSyncError, build_manifest
from trainer.core.modules import COMPILED_BLOCK_GRAPH_LIMIT, compiled_graphs, repeated_blocks
from trainer.core.names import model_name
from trainer.engine.native import NativeEngine
from trainer.host_arena import HostArena
from trainer.models.qwen_image import QwenImageAdapter
from trainer.sampling import parse_sampling_config

SAMPLING = parse_sampling_config({"height": 64, "width": 64, "num_inference_steps": 4, "eta": 0.7,
                                  "sde_type": "sde", "sde_indices": [1, 2]})
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


@pytest.fixture
def eager_compile(monkeypatch):
    from trainer.core import modules

    monkeypatch.setitem(modules.REGIONAL_COMPILE_KWARGS, "backend", "eager")
    yield
    torch._dynamo.reset()


def test_rowwise_quantization_error_is_e4m3_rounding():
    torch.manual_seed(0)
    t = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = q.float() * scale
    # 3 mantissa bits: relative error <= 2^-4 for normal values, absolute <= 2^-10 * scale below
    bound = torch.maximum(t.abs() * 2.0 ** -4, scale * 2.0 ** -9)
    assert (back - t).abs().le(bound).all()
    torch.testing.assert_close(back.abs().amax(dim=1), t.abs().amax(dim=1), rtol=1e-6, atol=0)  # 448 * scale
    assert torch.equal(back[5], torch.zeros(64)) and scale[5].item() == 1.0  # an all-zero row
    assert q.float().abs().max() <= E4M3_MAX


def test_fp8_linear_is_the_gemm_of_the_dequantized_operands():
    torch.manual_seed(1)
    lin = nn.Linear(64, 32)
    x = torch.randn(3, 5, 64)
    want = lin(x)
    convert_to_fp8(nn.Sequential(lin))
    assert isinstance(lin, FP8Linear) and lin.weight_fp8.dtype == torch.float8_e4m3fn
    xq, xs = quantize_rowwise(x.reshape(-1, 64))
    emulated = (xq.float() * xs) @ (lin.weight_fp8.float() * lin.weight_scale.t()).t() + lin.bias
    got = fp8_linear(x, lin.weight_fp8, lin.weight_scale, lin.bias)
    torch.testing.assert_close(got, emulated.reshape(3, 5, 32), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(x), got)
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.08  # FP8 rounding is there, and only that
    # the FP8 copy follows a new weight only when asked
    with torch.no_grad():
        lin.weight.mul_(2)
    stale = lin(x)
    lin.requantize()
    assert not torch.equal(lin(x), stale)
    torch.testing.assert_close(lin(x) - lin.bias, 2 * (stale - lin.bias), rtol=1e-5, atol=1e-5)


def _record_scaled_mm(monkeypatch) -> list[bool]:
    """torch._scaled_mm wrapped to record each call's use_fast_accum (CPU computes the same either way)."""
    calls: list[bool] = []
    real = torch._scaled_mm

    def scaled_mm(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


def test_fast_accumulation_reaches_every_fp8_forward_gemm_and_never_the_input_gradient(monkeypatch):
    """--fp8-fast-accum: the rollout's FP8Linear and the replay's frozen FP8 layers (fp8-dgrad too,
    linked to the engine's copy or not) ask _scaled_mm for fast accumulation in their forward
    GEMM; the FP8 input gradient never does; set_fp8_fast_accum switches both ways and
    restore_frozen_linears forgets it."""
    from trainer.core.fp8 import (FP8DgradFrozenLinear, convert_frozen_to_fp8, restore_frozen_linears,
                                  set_fp8_fast_accum, share_fp8_weights)

    torch.manual_seed(0)
    engine = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    actor = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)).requires_grad_(False)
    actor.load_state_dict(engine.state_dict())
    assert convert_to_fp8(engine) == 2 and set_fp8_fast_accum(engine, True) == 2
    assert convert_frozen_to_fp8(list(actor), fp8_dgrad=True) == 2 and set_fp8_fast_accum(actor, True) == 2
    assert all(isinstance(m, FP8DgradFrozenLinear) and m.fp8_fast_accum for m in actor)
    x = torch.randn(4, 32, requires_grad=True)
    calls = _record_scaled_mm(monkeypatch)
    with torch.no_grad():
        y_engine = engine(x)
    assert calls == [True, True]
    calls.clear()
    actor(x).sum().backward()
    assert calls == [True, True, False, False]  # two forward GEMMs, then the input gradients (full accumulation)
    assert share_fp8_weights(dict(actor.named_children()), dict(engine.named_children())) == (2, 0)
    calls.clear()
    y_linked = actor(x)
    assert calls == [True, True] and torch.equal(y_linked, y_engine)  # the linked replay is the sampler's GEMM
    assert set_fp8_fast_accum(engine, False) == 2 and set_fp8_fast_accum(actor, False) == 2
    calls.clear()
    with torch.no_grad():
        assert torch.equal(engine(x), y_engine)  # CPU: the same numbers either way
        actor(x)
    assert calls == [False] * 4
    set_fp8_fast_accum(actor, True)
    assert restore_frozen_linears(actor) == 2
    assert not any("fp8_fast_accum" in vars(m) for m in actor)
    convert_frozen_to_fp8(list(actor))
    assert not any(m.fp8_fast_accum for m in actor)  # converted again: full accumulation unless asked


def test_the_engine_takes_fast_accumulation_with_fp8_only(tiny_model_dir):
    """NativeEngine(fp8_fast_accum=True) flags each FP8 linear of its blocks; without FP8 it names the
    flag; engine_options passes --fp8-fast-accum only to an FP8 rollout."""
    from trainer.loop import engine_options

    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, precision="fp8", fp8_fast_accum=True)
    fp8 = [m for m in eng.transformer.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.fp8_fast_accum for m in fp8) and eng.fp8_fast_accum
    with pytest.raises(ValueError, match="--fp8-fast-accum.*--rollout-precision fp8"):
        NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, fp8_fast_accum=True)
    flags = SimpleNamespace(rollout_compile=False, rollout_precision="fp8", max_sequence_length=None,
                            sglang_attention_backend=None)
    assert engine_options(flags, True) == {"precision": "fp8", "fp8_fast_accum": True}
    assert engine_options(flags) == {"precision": "fp8"}
    assert engine_options(SimpleNamespace(**{**vars(flags), "rollout_precision": "default"}), True) == {}


def test_fp8_engine_quantizes_the_blocks_and_keeps_fp8_through_syncs(tiny_model_dir, monkeypatch):
    from tests.test_engine import lora_actor
    from trainer.weight_sync import iter_sync_tensors

    adapter = QwenImageAdapter()
    ref = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, precision="fp8")
    fp8 = [m for m in eng.transformer.modules() if isinstance(m, FP8Linear)]
    in_blocks = sum(isinstance(m, FP8Linear) for b in repeated_blocks(eng.transformer) for m in b.modules())
    assert fp8 and len(fp8) == in_blocks  # the blocks only: embedders and the output projection stay
    assert type(eng.transformer.proj_out) is nn.Linear
    assert eng.get_weights_checksum() == ref.get_weights_checksum()  # the parameters are untouched

    reqs = make_requests(adapter, eng, SAMPLING, prompts=["a red ball", "dog"], group_size=2)
    a, b = ref.generate(reqs), eng.generate(reqs)
    assert torch.isfinite(b.log_probs).all() and not torch.equal(a.latents, b.latents)
    assert ((b.images - a.images).abs().mean() < 0.05).item()  # the same images, up to FP8 rounding

    # a full sync re-quantizes exactly the layers it wrote
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    named = [(n, p.detach().clone()) for n, p in actor.named_parameters()]
    eng.update_weights_from_tensors(named, build_manifest("full", named, 1))
    for m in fp8:
        q, s = quantize_rowwise(m.weight)
        assert torch.equal(m.weight_fp8.float(), q.float()) and torch.equal(m.weight_scale, s.reshape(1, -1))

    # LoRA wraps the FP8 layers; its tensors are cast to the engine dtype and the FP8 copies stay FP8
    eng2 = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, precision="fp8")
    arena = eng2._host_arenas["transformer"] = HostArena(pin=False)  # as a GPU engine's first release leaves it
    arena.slices([4096])
    lora = lora_actor(adapter, tiny_model_dir, rank=4, alpha=8)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    tensors = list(iter_sync_tensors(lora, "adapter", wire_dtype=None))
    eng2.set_lora_tensors(tensors, build_manifest("adapter", tensors, 1),
                          {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)})
    fp8_2 = [m for m in eng2.transformer.modules() if isinstance(m, FP8Linear)]
    assert all(m.weight_fp8.dtype == torch.float8_e4m3fn for m in fp8_2)
    # with LoRA in, the base is frozen: the FP8 layers' own weights are freed, the FP8 copies stay
    assert eng2.fp8_weights_dropped == len(fp8_2) == len(fp8) and all(m.weight is None for m in fp8_2)
    assert not any(".base_layer.weight" in n for n, _ in eng2.transformer.named_parameters())
    assert arena.nbytes == 0 and "transformer" not in eng2._host_arenas  # no host memory kept for them
    # what freeing them changes in a rollout: nothing (an engine that keeps them samples the same bits)
    monkeypatch.setattr(FP8Linear, "drop_weight", lambda self: None)
    kept = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, precision="fp8")
    kept.set_lora_tensors(tensors, build_manifest("adapter", tensors, 1),
                          {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)})
    assert all(m.weight is not None for m in kept.transformer.modules() if isinstance(m, FP8Linear))
    got, want = eng2.generate(reqs), kept.generate(reqs)
    assert torch.isfinite(got.log_probs).all()
    assert torch.equal(got.latents, want.latents) and torch.equal(got.log_probs, want.log_probs)
    # and the engine moves to the host and back without them, and refuses what would need them
    eng2.release_memory()
    eng2.resume_memory()
    assert torch.equal(eng2.generate(reqs).latents, got.latents)
    with pytest.raises(WeightSyncError, match="LoRA"):
        eng2.update_weights_from_tensors(named, build_manifest("full", named, 2))
    with pytest.raises(RuntimeError, match="dropped"):
        fp8_2[0].requantize()
    # FP8 cannot come after LoRA (it would quantize the adapter's own linears)
    ref.set_lora_tensors(tensors, build_manifest("adapter", tensors, 1),
                         {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)})
    with pytest.raises(ValueError, match="after LoRA"):
        ref.enable_speedups(precision="fp8")


def test_a_fresh_lora_run_hands_the_engine_its_adapter_before_the_first_rollout(tiny_model_dir):
    """Trainer.install_adapter: a fresh run with adapter syncs installs its adapter (still zero) at
    policy version 0 before anything samples, so an FP8 engine frees its bf16 block weights before
    rollout 0 and samples exactly what it sampled without the adapter; a resumed run (its resume
    sync does this) and a full sync leave the engine alone."""
    from types import SimpleNamespace as NS

    from tests.test_engine import lora_actor
    from trainer.loop import Trainer
    from trainer.weight_sync import WeightSyncer

    adapter = QwenImageAdapter()
    lora = lora_actor(adapter, tiny_model_dir, rank=4, alpha=8)
    with torch.no_grad():  # as peft initialises it: the policy is the base
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.zero_()
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, precision="fp8")
    reqs = make_requests(adapter, eng, SAMPLING, prompts=["a red ball", "dog"], group_size=2)
    base = eng.generate(reqs)
    cfg = {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)}

    def refuse(*args, **kwargs):
        raise AssertionError("no sync expected")

    for start, kind in ((2, "adapter"), (0, "full"), (0, "merged")):
        run = NS(start_rollout=start, syncer=NS(kind=kind, sync=refuse), actor=NS(model=lora), engine=eng,
                 load_metrics={})
        Trainer.install_adapter(run)
        assert run.load_metrics == {} and eng.fp8_weights_dropped == 0
    syncer = WeightSyncer("adapter", wire_dtype=None, name_map=adapter.weight_name_map, lora_config=cfg)
    run = NS(start_rollout=0, syncer=syncer, actor=NS(model=lora), engine=eng, load_metrics={})
    Trainer.install_adapter(run)
    assert syncer.policy_version == eng.policy_version == 0 and syncer.failures == 0
    assert run.load_metrics["perf/adapter_install_time"] > 0
    fp8 = [m for m in eng.transformer.modules() if isinstance(m, FP8Linear)]
    assert fp8 and eng.fp8_weights_dropped == len(fp8) and all(m.weight is None for m in fp8)
    got = eng.generate(reqs)
    assert torch.equal(got.latents, base.latents) and torch.equal(got.log_probs, base.log_probs)
    assert (got.policy_versions == 0).all()


def test_compiled_engine_equals_eager_and_compiles_once_per_geometry(tiny_model_dir, eager_compile):
    adapter = QwenImageAdapter()
    ref = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, compile_blocks=True)
    reqs = make_requests(adapter, eng, SAMPLING, prompts=["a red ball", "dog"], group_size=2)
    first = eng.generate(reqs)
    assert eng.last_stats["new_graphs"] > 0  # compiled on the first rollout
    again = eng.generate(make_requests(adapter, eng, SAMPLING, prompts=["a red ball", "dog"], group_size=2, seed=8))
    assert eng.last_stats["new_graphs"] == 0  # the same shapes: the next rollout reuses the graphs
    want = ref.generate(reqs)
    assert torch.equal(first.latents, want.latents) and torch.equal(first.log_probs, want.log_probs)
    assert not torch.equal(again.latents, first.latents)
    assert eng.get_weights_checksum() == ref.get_weights_checksum()  # compile wraps, names stay


def test_compiled_blocks_rotate_in_real_arithmetic_and_eager_keeps_diffusers_rope(tiny_model_dir, monkeypatch):
    """Qwen-Image's rope is a complex multiply, which inductor leaves to eager kernels outside its
    fused ones: compiled blocks trace it in real arithmetic instead (the same bits in eager, fp32
    and bf16), and an uncompiled call still runs diffusers' own function."""
    from diffusers.models.transformers import transformer_qwenimage as qwen_dit
    from trainer.core import modules
    from trainer.models.qwen_image import install_compiled_rope, rotary_real

    # diffusers' own function for this test (an earlier compile in the process installed the
    # real form already); whatever was there comes back after it
    original = getattr(qwen_dit.apply_rotary_emb_qwen, "original", qwen_dit.apply_rotary_emb_qwen)
    monkeypatch.setattr(qwen_dit, "apply_rotary_emb_qwen", original)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 96, 3, 128, generator=g)
    freqs = torch.polar(torch.ones(96, 64), 100 * torch.rand(96, 64, generator=g))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(rotary_real(x.to(dtype), freqs), original(x.to(dtype), freqs, use_real=False))

    graphs = []

    def recorded(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    def rope(t, f):
        return qwen_dit.apply_rotary_emb_qwen(t, f, use_real=False) * 2

    try:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(rope, backend=recorded)(x, freqs), 2 * original(x, freqs, use_real=False))
        assert any("view_as_complex" in op for op in graphs[-1])  # diffusers' form: a complex multiply
        assert install_compiled_rope() and not install_compiled_rope()  # once per process
        assert torch.equal(qwen_dit.apply_rotary_emb_qwen(x, freqs, use_real=False), original(x, freqs, use_real=False))
        torch._dynamo.reset()
        assert torch.equal(torch.compile(rope, backend=recorded)(x, freqs), 2 * original(x, freqs, use_real=False))
        assert not any("view_as_complex" in op for op in graphs[-1])

        # the engine's compiled blocks trace the real form, and sample what the eager engine does
        monkeypatch.setitem(modules.REGIONAL_COMPILE_KWARGS, "backend", recorded)
        graphs.clear()
        adapter = QwenImageAdapter()
        eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, compile_blocks=True)
        ref = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
        reqs = make_requests(adapter, eng, SAMPLING, prompts=["a red ball"], group_size=2)
        got, want = eng.generate(reqs), ref.generate(reqs)
        assert graphs and not any("view_as_complex" in op for ops in graphs for op in ops)
        assert torch.equal(got.latents, want.latents) and torch.equal(got.log_probs, want.log_probs)
    finally:
        torch._dynamo.reset()


#: how far (nats, max abs) a rollout through inductor-compiled blocks may sit from the eager
#: replay of its own transitions, fp32 on CPU (measured 1.2e-7); docs/PERFORMANCE.md gives the
#: bf16 figures of an H200 (6e-6 compiled, 3.1e-5 FP8 + compiled)
COMPILED_LOGP_TOLERANCE_FP32 = 1e-6


def test_inductor_compiled_rollout_is_within_the_stated_tolerance_of_the_replay(tiny_model_dir):
    """The real compiler (inductor, not the eager backend of the other tests) reorders and fuses
    floating-point work, so the compiled sampler is not bit-equal to the eager replay: its
    log-probs must stay within COMPILED_LOGP_TOLERANCE_FP32, and its latents as close."""
    torch._dynamo.reset()
    try:
        adapter = QwenImageAdapter()
        sampling = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 3, "eta": 0.7,
                                          "sde_type": "sde", "sde_indices": [1, 2]})
        ref = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
        eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, compile_blocks=True)
        reqs = make_requests(adapter, eng, sampling, prompts=["a red ball"], group_size=2)
        got = eng.generate(reqs)
        assert eng.last_stats["new_graphs"] > 0
        replayed = adapter.replay_transitions(ref.transformer, got)
        gap = float((got.log_probs - replayed).abs().max())
        assert 0 <= gap <= COMPILED_LOGP_TOLERANCE_FP32, gap
        want = ref.generate(reqs)
        assert float((got.latents - want.latents).abs().max()) < 1e-5
    finally:
        torch._dynamo.reset()


def test_compiled_actor_keeps_names_and_starts_at_ratio_one(eager_compile):
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        from trainer.actor import Actor
        from tests.dist.tiny import ADAPTER

        torch._dynamo.config.recompile_limit = 8  # dynamo's default: the compiled actor must raise it
        plain = Actor(tiny_transformer(), mesh, make_cfg("lora", fsdp__fsdp_master_dtype="fp32"),
                      device=torch.device("cpu"), adapter=ADAPTER)
        actor = Actor(tiny_transformer(), mesh, make_cfg("lora", fsdp__fsdp_master_dtype="fp32",
                                                         fsdp__fsdp_compile=True),
                      device=torch.device("cpu"), adapter=ADAPTER)
        names = [model_name(n) for n, _ in actor.model.named_parameters()]
        assert any("_orig_mod" in n for n, _ in actor.model.named_parameters())
        # a step's block variants (anchor, grad replay, recompute, modes) fit under dynamo's limit
        assert torch._dynamo.config.recompile_limit >= COMPILED_BLOCK_GRAPH_LIMIT
        assert names == [model_name(n) for n, _ in plain.model.named_parameters()]
        batch = make_batch(4)
        m_plain = plain.train_step(batch, ADV, replay)
        m = actor.train_step(batch, ADV, replay)
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
        # the eager backend runs the same kernels: the compiled actor's update is the plain one's
        assert m["train/loss"] == m_plain["train/loss"] and m["train/grad_norm"] == m_plain["train/grad_norm"]
    finally:
        next(gen, None)


#: the tiny tokenizer has one token per byte, so these prompts' text lengths all differ
VARYING = ["red", "a blue cube", "two green balls", "a small yellow cone on a table", "cat", "a shiny grey torus",
           "an old brown box", "pink"]
SMALL = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 2, "eta": 0.7,
                               "sde_type": "sde", "sde_indices": [1]})


def test_compiled_engine_stops_compiling_after_warm_up_whatever_the_prompt_lengths(tiny_model_dir, eager_compile):
    """text_conditioning trims each batch to its longest prompt, and drops the mask when every
    row has that length: with fixed shapes each new length was a new graph, until dynamo's limit.
    With dynamic=None a warm-up that shows two lengths and batch sizes, masked and not, leaves
    graphs that serve any later length."""
    adapter = QwenImageAdapter()
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, compile_blocks=True)
    ref = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    start = compiled_graphs()  # the counter is the process's: other tests' graphs are in it
    warm_up = [(VARYING[0:2], 2), (VARYING[2:4], 1), ([VARYING[4]], 2), ([VARYING[5]], 1)]  # masked x 2, mask-free x 2
    for prompts, group in warm_up:
        eng.generate(make_requests(adapter, eng, SMALL, prompts=prompts, group_size=group))
    graphs = compiled_graphs()
    assert 0 < graphs - start <= 8, graphs - start  # per block kind: masked / mask-free, each static then dynamic
    later = [([VARYING[6], VARYING[3]], 2), ([VARYING[7]], 2), (VARYING[1:4], 1), ([VARYING[2], VARYING[6]], 1)]
    for prompts, group in later:
        reqs = make_requests(adapter, eng, SMALL, prompts=prompts, group_size=group, seed=11)
        got = eng.generate(reqs)
        assert eng.last_stats["new_graphs"] == 0, (prompts, group)
    want = ref.generate(reqs)  # the dynamic-shape graph computes what the eager blocks do
    assert torch.equal(got.latents, want.latents) and torch.equal(got.log_probs, want.log_probs)
    assert compiled_graphs() == graphs


def varied_text_batch(n: int, lengths: list[int], seed: int):
    """make_batch with prompt_embeds of the longest length and a mask giving row i lengths[i] tokens."""
    b = make_batch(n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + 3  # trailing padding every row masks: text_conditioning trims it
    b.conditions["prompt_embeds"] = torch.randn(n, width, b.prompt_embeds.shape[-1], generator=g)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, t in enumerate(lengths):
        mask[i, :t] = 1
    b.conditions["prompt_embeds_mask"] = mask
    return b


def test_compiled_actor_stops_compiling_after_warm_up_whatever_the_text_lengths(eager_compile):
    """The actor's compiled, checkpointed blocks over micro-batches of 2 whose text lengths vary
    (masked when the two differ, mask-free when equal), through the loop's own replay: after
    three warm-up steps no step compiles a graph, and each step's first update still has ratio 1.
    With fixed shapes every step compiled 4-6 more graphs (32 after six steps)."""
    from trainer.actor import Actor
    from trainer.loop import make_replay_fn
    from tests.dist.tiny import ADAPTER

    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        actor = Actor(tiny_transformer(), mesh,
                      make_cfg("lora", fsdp__fsdp_master_dtype="fp32", fsdp__fsdp_compile=True,
                               fsdp__fsdp_activation_checkpointing=True, grpo__micro_batch_size=2),
                      device=torch.device("cpu"), adapter=ADAPTER)
        replay_fn = make_replay_fn(ADAPTER)
        # update 0 replays rows 0-1 with grad; rows 2-3 get a no_grad anchor pass, then update 1:
        # each (grad mode, masked or not) variant sees two text lengths in the three warm-up steps
        steps = [[7, 3, 5, 5], [9, 9, 12, 8], [4, 15, 11, 11],
                 [6, 6, 13, 2], [17, 10, 3, 3], [20, 20, 14, 6]]
        new = []
        for i, lengths in enumerate(steps):
            before = compiled_graphs()
            actor.train_step(varied_text_batch(4, lengths, seed=i), ADV, replay_fn)
            new.append(compiled_graphs() - before)
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
        assert new[0] > 0 and sum(new) <= 16, new  # the bound COMPILED_BLOCK_GRAPH_LIMIT's comment states
        assert new[3:] == [0, 0, 0], new
    finally:
        next(gen, None)


def test_a_resumed_run_compiles_the_dynamic_graph_at_once(tmp_path, monkeypatch):
    """use_compile_profile names the run (from --save) for torch.compile's profile-guided dynamic
    shapes: a later process of the same run compiles a function whose input length varied with
    that length dynamic from its first call (1 graph, then none for new lengths), where a run
    without the name compiles a static graph first and a dynamic one on the next length (2). A
    cache directory that others can write leaves the profile off."""
    import torch._dynamo.pgo as pgo
    import torch.compiler

    from trainer.core.modules import CompileWatch
    from trainer.loop import RunError, use_compile_cache, use_compile_profile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cc"))
    use_compile_cache(str(tmp_path / "cc"))
    saved = torch.compiler.config.job_id  # a config module: restored by hand, not by monkeypatch
    torch.compiler.config.job_id = None

    def cfg(save, compiled=True):
        return SimpleNamespace(rollout=SimpleNamespace(rollout_compile=False),
                               fsdp=SimpleNamespace(fsdp_compile=compiled),
                               checkpoint=SimpleNamespace(save=save))

    assert use_compile_profile(cfg(str(tmp_path / "run"), compiled=False)) is None
    assert use_compile_profile(cfg(None)) is None and torch.compiler.config.job_id is None

    def graphs_per_call(lengths):
        """A fresh process's view: dynamo's caches and the in-memory profile dropped."""
        torch._dynamo.reset()
        pgo.reset_code_state()

        def block(x):
            return (x * 2).sum(-1)

        fn = torch.compile(block, backend="eager", dynamic=None)
        watch, out = CompileWatch(), []
        for n in lengths:
            fn(torch.ones(3, n))
            out.append(watch.new_graphs())
        return out

    try:
        job = use_compile_profile(cfg(str(tmp_path / "run")))
        assert job.startswith("flowgrpo-") and torch.compiler.config.job_id == job
        assert graphs_per_call([5, 7]) == [1, 1]  # the run's first process: static, then dynamic
        assert list((tmp_path / "cc" / "dynamo").glob("code_state_*.pkl"))  # the profile, in the cache
        assert graphs_per_call([9, 11]) == [1, 0]  # its resume: dynamic from the start
        torch.compiler.config.job_id = None
        assert use_compile_profile(cfg(str(tmp_path / "other"))) != job  # another run: its own profile
        assert graphs_per_call([9, 11]) == [1, 1]
        # the profile is a pickle dynamo loads, the kernels beside it code inductor imports: a
        # compiling run stops on a cache that others can write into, profile or not
        torch.compiler.config.job_id = None
        (tmp_path / "cc").chmod(0o755)  # others may search it now (the run creates it 0700)
        (tmp_path / "cc" / "dynamo").chmod(0o777)
        with pytest.raises(RunError, match="is writable by group or others"):
            use_compile_profile(cfg(str(tmp_path / "run")))
        assert torch.compiler.config.job_id is None
        (tmp_path / "cc" / "dynamo").chmod(0o700)
        torch.compiler.config.job_id = "set-by-the-user"  # as TORCH_COMPILE_JOB_ID would: kept as it is
        assert use_compile_profile(cfg(str(tmp_path / "run"))) == "set-by-the-user"
    finally:
        torch.compiler.config.job_id = saved
        torch._dynamo.reset()
        pgo.reset_code_state()


def test_compile_watch_counts_graphs_and_reports_the_recompile_limit():
    """The loop's perf/*_new_graphs, perf/*_compile_time and its warning when dynamo gives up on a
    function (which then runs eagerly without any other sign)."""
    from types import SimpleNamespace

    from trainer.core.modules import CompileWatch
    from trainer.loop import Trainer

    torch._dynamo.reset()
    # dynamo's own patch: pytest's monkeypatch restores the option through an alias and leaves
    # torch._dynamo.config.recompile_limit unreadable for every later test
    patch = torch._dynamo.config.patch(recompile_limit=2)
    patch.__enter__()
    try:
        fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        watch = CompileWatch()
        loop = SimpleNamespace(_compile_watch=watch)
        m: dict[str, float] = {}
        fn(torch.ones(2))
        Trainer._count_graphs(loop, m, "actor")
        assert m["perf/actor_new_graphs"] == 1.0
        # the graph's compile took time, its tracing part of it
        assert 0 < m["perf/actor_compile_trace_time"] <= m["perf/actor_compile_time"]
        fn(torch.ones(2))
        Trainer._count_graphs(loop, m, "actor")
        assert m == {"perf/actor_new_graphs": 0.0, "perf/actor_compile_time": 0.0,
                     "perf/actor_compile_trace_time": 0.0}  # same shape: the graph is reused, nothing compiled
        assert watch.limit_warning() is None
        for n in (3, 4, 5):  # a new fixed shape each call: past the limit of 2
            fn(torch.ones(n))
        Trainer._count_graphs(loop, m, "actor")
        assert m["perf/actor_new_graphs"] == 1.0  # the third shape was not compiled
        Trainer._count_graphs(loop, m, None)  # marks moved, nothing written
        assert m["perf/actor_new_graphs"] == 1.0
        msg = watch.limit_warning()
        assert msg is not None and "recompile limit (2)" in msg and "TORCH_LOGS=recompiles" in msg
        assert watch.limit_warning() is None  # reported once
    finally:
        patch.__exit__(None, None, None)
        torch._dynamo.reset()

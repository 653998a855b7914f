"""--replay-precision fp8 / fp8-dgrad on CPU: the frozen base GEMM of the actor's LoRA layers in FP8
(the same rowwise-scaled math the FP8 rollout runs, on CPU's _scaled_mm), its input gradient through
the unquantized weight (fp8) or an FP8 GEMM (fp8-dgrad), the anchor == replay guarantee (first ratio
exactly 1), the gradients' distance from the default precision on the tiny model, and preflight's
refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.dist.tiny import ADAPTER, make_batch, make_cfg, one_rank_mesh, replay, tiny_transformer
from tests.test_preflight import base, problems  # noqa: F401,F811  (base is a fixture)
from trainer.actor import Actor
from trainer.core.fp8 import (FP8DgradFrozenLinear, FP8FrozenLinear, fp8_input_grad, fp8_linear, frozen_fp8_linear,
                               quantize_rowwise)
from trainer.train_model import (FP8_FROZEN_MIN_ROWS, apply_lora, frozen_block_linears, local_shard, lora_base_layers,
                                  set_replay_precision)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture(scope="module")
def mesh():
    yield from one_rank_mesh()


def test_frozen_fp8_gemm_forward_is_the_rollouts_fp8_linear_and_backward_uses_the_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 48, generator=g)
    b = torch.randn(32, generator=g)
    x = torch.randn(3, 5, 48, generator=g, requires_grad=True)
    y = frozen_fp8_linear(x, w, b)
    q, s = quantize_rowwise(w)
    assert torch.equal(y, fp8_linear(x.detach(), q, s.reshape(1, -1), b))  # the rollout's FP8 GEMM, bit for bit
    assert torch.equal(y, frozen_fp8_linear(x.detach(), w, b))             # deterministic: anchor == replay
    assert not torch.equal(y, nn.functional.linear(x, w, b))                # and it is FP8, not the fp32 GEMM
    assert (y - nn.functional.linear(x, w, b)).abs().max() < 0.1 * y.abs().max()
    gy = torch.randn(3, 5, 32, generator=g)
    y.backward(gy)
    assert torch.allclose(x.grad, gy @ w, rtol=1e-6, atol=1e-6)  # dL/dx through the unquantized weight
    with pytest.raises(RuntimeError, match="frozen weights"):
        frozen_fp8_linear(x, w.requires_grad_(True), b)


def test_fp8_dgrad_is_the_gemm_of_the_dequantized_operands():
    """fp8-dgrad: dL/dx is one FP8 GEMM over the forward's FP8 weight Wq (per output channel
    scales s) and dL/dy * s quantized per row, i.e. the exact product of the two dequantized
    operands, and off the unquantized product by FP8 rounding only. The forward is fp8's, bit for
    bit, and a layer reading a shared FP8 copy computes the same input gradient."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 48, generator=g)
    b = torch.randn(32, generator=g)
    x = torch.randn(3, 5, 48, generator=g, requires_grad=True)
    y = frozen_fp8_linear(x, w, b, fp8_dgrad=True)
    assert torch.equal(y, frozen_fp8_linear(x.detach(), w, b))
    gy = torch.randn(3, 5, 32, generator=g) * torch.logspace(-6, 2, 5)[None, :, None]  # tokens of any scale
    y.backward(gy)
    wq, ws = quantize_rowwise(w)
    gq, gs = quantize_rowwise(gy.reshape(-1, 32) * ws.reshape(1, -1))
    emulated = ((gq.float() * gs) @ wq.float()).reshape(3, 5, 48)
    torch.testing.assert_close(x.grad, emulated, rtol=1e-5, atol=0)
    assert torch.equal(x.grad, fp8_input_grad(gy, wq, ws))
    shared = x.detach().clone().requires_grad_(True)
    y_shared = frozen_fp8_linear(shared, w, b, fp8_dgrad=True, quantized=SimpleNamespace(weight_fp8=wq, weight_scale=ws))
    assert torch.equal(y_shared, y)
    y_shared.backward(gy)
    assert torch.equal(shared.grad, x.grad)
    exact = gy @ w
    rel = ((x.grad - exact).norm(dim=-1) / exact.norm(dim=-1))
    assert (rel > 1e-4).all() and (rel < 0.08).all()  # FP8 rounding on every token, whatever its scale


def test_set_replay_precision_swaps_only_the_blocks_lora_base_layers():
    model = tiny_transformer()
    apply_lora(model, ADAPTER.lora_target_modules, rank=4, alpha=8)
    names = [n for n, _ in model.named_parameters()]
    bases = lora_base_layers(model)
    assert len(bases) == 2 * len(ADAPTER.lora_target_modules)  # 2 blocks x 8 attention projections
    assert set_replay_precision(model, "fp8") == len(bases)
    assert all(type(m) is FP8FrozenLinear for m in bases)
    # the embedders and the final projection keep their GEMM; the parameters keep their names
    assert type(model.proj_out) is nn.Linear and type(model.img_in) is nn.Linear
    assert [n for n, _ in model.named_parameters()] == names
    assert set_replay_precision(model, "fp8-dgrad") == len(bases)
    assert all(type(m) is FP8DgradFrozenLinear for m in bases)
    assert set_replay_precision(model, "fp8") == len(bases) and all(type(m) is FP8FrozenLinear for m in bases)
    assert set_replay_precision(model, "default") == 0 and all(type(m) is nn.Linear for m in bases)
    with pytest.raises(ValueError, match="--replay-precision must be one of"):
        set_replay_precision(model, "fp4")
    with pytest.raises(ValueError, match="--replay-precision fp8 found no LoRA-wrapped linear"):
        set_replay_precision(tiny_transformer(), "fp8")


def test_replay_fp8_layers_frozen_adds_the_blocks_other_frozen_linears():
    """--replay-fp8-layers frozen: the LoRA bases and every other frozen block linear (the tiny DiT's
    MLPs and modulation) in FP8, the latter with the row floor; the embedders and the adapters'
    own linears keep their GEMM; "default" turns every one back."""
    model = tiny_transformer()
    apply_lora(model, ADAPTER.lora_target_modules, rank=4, alpha=8)
    bases, others = lora_base_layers(model), frozen_block_linears(model)
    names = {n for n, m in model.named_modules() if any(m is o for o in others)}
    assert len(others) == 12 and all(n.split(".", 2)[2].startswith(("img_mod", "txt_mod", "img_mlp", "txt_mlp"))
                                     for n in names), names
    assert set_replay_precision(model, "fp8-dgrad", "frozen") == len(bases) + len(others)
    assert all(type(m) is FP8DgradFrozenLinear for m in bases + others)
    assert {m.fp8_min_rows for m in bases} == {0} and {m.fp8_min_rows for m in others} == {FP8_FROZEN_MIN_ROWS}
    assert type(model.proj_out) is nn.Linear and type(model.img_in) is nn.Linear
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if "lora_" in n and isinstance(m, nn.Linear))
    assert set_replay_precision(model, "fp8") == len(bases)  # lora-base: the others back to their GEMM
    assert all(type(m) is nn.Linear and "fp8_min_rows" not in m.__dict__ for m in others)
    assert set_replay_precision(model, "fp8", "frozen") == len(bases) + len(others)
    assert set_replay_precision(model, "default", "frozen") == 0
    assert all(type(m) is nn.Linear and "fp8_min_rows" not in m.__dict__ for m in bases + others)
    with pytest.raises(ValueError, match="--replay-fp8-layers must be one of"):
        set_replay_precision(model, "fp8", "all")


def test_a_call_under_the_row_floor_runs_the_compute_dtype_gemm():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(32, 48, generator=g), torch.randn(32, generator=g)
    x = torch.randn(5, 48, generator=g)
    exact = nn.functional.linear(x, w, b)
    assert torch.equal(frozen_fp8_linear(x, w, b, min_rows=6), exact)   # 5 rows < 6: the plain GEMM
    fp8 = frozen_fp8_linear(x, w, b, min_rows=5)                         # 5 rows >= 5: FP8
    assert torch.equal(fp8, frozen_fp8_linear(x, w, b)) and not torch.equal(fp8, exact)


def test_full_fine_tune_refuses_fp8_replay(mesh):
    with pytest.raises(ValueError, match="--fsdp-trainable-mode full trains every weight: use --replay-precision "
                                         "default"):
        Actor(tiny_transformer(), mesh, make_cfg("full", fsdp__replay_precision="fp8"), device=torch.device("cpu"),
              adapter=ADAPTER)


@pytest.mark.parametrize("param_dtype, precision, layers", [("fp32", "fp8", "lora-base"), ("bf16", "fp8", "lora-base"),
                                                       ("bf16", "fp8-dgrad", "lora-base"),
                                                       ("bf16", "fp8-dgrad", "frozen")])
def test_fp8_replay_keeps_the_first_ratio_exactly_1(mesh, monkeypatch, param_dtype, precision, layers):
    """The no_grad anchor pass and the first update's own forward (with grad) run the same FP8
    GEMMs: ratio 1 exactly; the second update (after a step) is off 1. The row floor is lowered so
    that the tiny DiT's MLPs run FP8 under --replay-fp8-layers frozen (its modulation stays under it)."""
    monkeypatch.setattr("trainer.train_model.FP8_FROZEN_MIN_ROWS", 8)
    cfg = make_cfg("lora", fsdp__replay_precision=precision, fsdp__fsdp_param_dtype=param_dtype,
                   fsdp__fsdp_master_dtype="fp32", fsdp__replay_fp8_layers=layers)
    actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    kind = FP8DgradFrozenLinear if precision == "fp8-dgrad" else FP8FrozenLinear
    assert sum(type(m) is kind for m in actor.model.modules()) == (16 if layers == "lora-base" else 28)
    actor.anchor_from_first_update = False  # a separate no_grad anchor for every micro-batch, first update included
    m = actor.train_step(make_batch(4), ADV, replay)
    first, second = actor.last_update_stats
    assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item() and first["ratio_mean"].item() == 1.0
    assert (second["ratio_max"].item(), second["ratio_min"].item()) != (1.0, 1.0)
    assert m["train/optimizer_steps"] == 2 and actor.last_anchor_passes == 4


def _lora_grads(actor, batch, adv) -> torch.Tensor:
    """The LoRA gradient of the first update's objective at ratio 1, -mean(A x logp), one flat vector."""
    actor.optimizer.zero_grad(set_to_none=True)
    logp = replay(actor.model, batch)
    (-(adv[:, None] * logp).mean()).backward()
    out = torch.cat([p.grad.full_tensor().reshape(-1) for p in actor.trainable if p.grad is not None])
    actor.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_fp8_replay_gradients_are_close_to_the_default_precision(mesh, monkeypatch, param_dtype):
    """Same actor, same batch, LoRA B made non-zero (so every LoRA tensor gets a gradient): the FP8
    base (forward only, and forward plus input gradient) changes the LoRA gradient by a few percent
    of its norm against the fp32 and the bf16 GEMM, and changes it (FP8 is on)."""
    monkeypatch.setattr("trainer.train_model.FP8_FROZEN_MIN_ROWS", 8)  # the tiny DiT's MLPs in FP8 too
    actor = Actor(tiny_transformer(), mesh, make_cfg("lora", fsdp__fsdp_param_dtype=param_dtype,
                                                     fsdp__fsdp_master_dtype="fp32"),
                  device=torch.device("cpu"), adapter=ADAPTER)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if "lora_B" in name:
                local_shard(p).copy_(0.05 * torch.randn(local_shard(p).shape, generator=g))
    batch = make_batch(4)
    ref = _lora_grads(actor, batch, ADV)
    rels = {}
    for precision, layers in (("fp8", "lora-base"), ("fp8-dgrad", "lora-base"), ("fp8", "frozen")):
        set_replay_precision(actor.model, precision, layers)
        fp8 = _lora_grads(actor, batch, ADV)
        assert fp8.shape == ref.shape and torch.isfinite(fp8).all()
        rels[precision, layers] = float((fp8 - ref).norm() / ref.norm())
        assert 0 < rels[precision, layers] < 0.15, rels
        assert float(torch.nn.functional.cosine_similarity(fp8, ref, dim=0)) > 0.98
    # the FP8 input gradient, and the MLPs in FP8, each change the LoRA gradient beyond the LoRA
    # bases' FP8 forward: they are on
    assert rels["fp8-dgrad", "lora-base"] != rels["fp8", "lora-base"] != rels["fp8", "frozen"], rels
    set_replay_precision(actor.model, "default")
    assert torch.equal(_lora_grads(actor, batch, ADV), ref)  # the swap back restores the default GEMM exactly


def test_preflight_names_the_replay_precision_flag_and_its_fix(base, monkeypatch):  # noqa: F811
    lora = ["--fsdp-trainable-mode", "lora", "--lora-rank", "8", "--fsdp-master-dtype", "fp32"]
    assert problems(base + lora + ["--replay-precision", "fp8"]) == []  # CPU here: the CPU FP8 math runs
    for precision in ("fp8", "fp8-dgrad"):
        got = problems(base + ["--replay-precision", precision])
        assert [p for p in got if p.startswith(f"--replay-precision {precision} with --fsdp-trainable-mode full")
                and "use --fsdp-trainable-mode lora, or --replay-precision default" in p], got
    import torch as _torch

    monkeypatch.setattr(_torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(_torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    got = problems(base + lora + ["--replay-precision", "fp8", "--rollout-precision", "fp8"])
    hits = [p for p in got if "compute capability >= 8.9" in p and "8.0 (NVIDIA A100)" in p]
    assert len(hits) == 2 and hits[0].startswith("--rollout-precision fp8") and \
        hits[1].startswith("--replay-precision fp8") and hits[1].endswith("use --replay-precision default"), got
    got = problems(base + lora + ["--replay-precision", "fp8-dgrad"])
    assert [p for p in got if p.startswith("--replay-precision fp8-dgrad needs a GPU with FP8 tensor cores")], got
    monkeypatch.undo()
    got = problems(base + lora + ["--replay-fp8-layers", "frozen"])
    assert [p for p in got if p.startswith("--replay-fp8-layers frozen with --replay-precision default")
            and p.endswith("add --replay-precision fp8 (or fp8-dgrad), or drop --replay-fp8-layers")], got
    assert problems(base + lora + ["--replay-fp8-layers", "frozen", "--replay-precision", "fp8"]) == []
    monkeypatch.setattr(_torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert not [p for p in problems(base + lora + ["--replay-precision", "fp8"]) if "compute capability" in p]
    monkeypatch.undo()
    got = problems(base + lora + ["--fp8-fast-accum"])
    assert [p for p in got if p.startswith("--fp8-fast-accum without an FP8 GEMM")
            and p.endswith("add one of those, or drop --fp8-fast-accum")], got
    for fp8 in (["--replay-precision", "fp8-dgrad"], ["--rollout-precision", "fp8"]):
        assert problems(base + lora + fp8 + ["--fp8-fast-accum"]) == []


def test_the_actor_builds_its_fp8_layers_with_fast_accumulation(mesh):
    """--fp8-fast-accum: every FP8 layer of the actor's blocks (fp8-dgrad, frozen) runs its forward GEMM
    with fast accumulation (the anchor and the replay alike: the same layers)."""
    cfg = make_cfg("lora", fsdp__replay_precision="fp8-dgrad", fsdp__replay_fp8_layers="frozen",
                   fsdp__fsdp_master_dtype="fp32", fsdp__fp8_fast_accum=True,
                   lora__lora_rank=16)  # adapters whose linears FP8 could take (multiples of 16)
    actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    layers = [m for m in actor.model.modules() if isinstance(m, FP8FrozenLinear)]
    assert len(layers) == 28 and all(m.fp8_fast_accum for m in layers)
    # switched again once built, when the last block's never-trained adapters are frozen too: the
    # same 28 layers, no adapter linear among them
    assert set_replay_precision(actor.model, "fp8-dgrad", "frozen") == 28
    fp8 = [n for n, m in actor.model.named_modules() if isinstance(m, FP8FrozenLinear)]
    assert len(fp8) == 28 and not [n for n in fp8 if ".lora_" in n], fp8
    assert not any(m.fp8_fast_accum for m in actor.model.modules() if isinstance(m, FP8FrozenLinear))


def test_recorded_old_logprobs_with_an_fp8_replay_are_warned_about(base):  # noqa: F811
    """The sampler runs the base GEMMs in the compute dtype, the FP8 replay does not: with
    --old-logprob-source rollout the first ratio carries that gap, so preflight says so."""
    from tests.test_preflight import warnings_of

    lora = ["--fsdp-trainable-mode", "lora", "--lora-rank", "8", "--fsdp-master-dtype", "fp32",
            "--replay-precision", "fp8"]
    warns = [w for w in warnings_of(base + lora + ["--old-logprob-source", "rollout"])
             if w.startswith("--old-logprob-source rollout")]
    assert len(warns) == 1 and "--replay-precision fp8" in warns[0] and "not exactly 1" in warns[0], warns
    warns = [w for w in warnings_of(base + lora[:-1] + ["fp8-dgrad", "--old-logprob-source", "rollout"])
             if w.startswith("--old-logprob-source rollout")]
    assert len(warns) == 1 and "--replay-precision fp8-dgrad" in warns[0], warns
    assert not [w for w in warnings_of(base + lora) if w.startswith("--old-logprob-source")]


def _same_replay_and_update(a: Actor, b: Actor) -> None:
    """Two actors replay a batch to the same bits, and one update with separate anchors leaves
    them with the same LoRA weights, bit for bit, each first ratio exactly 1."""
    with torch.no_grad():
        assert torch.equal(replay(a.model, make_batch(4)), replay(b.model, make_batch(4)))
    for actor in (a, b):
        actor.anchor_from_first_update = False
        actor.train_step(make_batch(4), ADV, replay)
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
    for x, y in zip(a.trainable, b.trainable):
        assert torch.equal(x.to_local(), y.to_local())


def _fp8_engine(seed: int = 0):
    """What share_engine_fp8_weights reads of an FP8 engine that holds LoRA: its transformer with
    every eligible block linear an FP8Linear (the tiny DiT, seeded like the actor's), precision
    fp8, and the count of bf16 weights it freed."""
    from types import SimpleNamespace

    from trainer.core.fp8 import convert_to_fp8

    dit = tiny_transformer(seed)
    n = convert_to_fp8(dit.transformer_blocks)
    return SimpleNamespace(transformer=dit, precision="fp8", fp8_weights_dropped=n)


def test_the_fp8_replay_reads_the_engines_fp8_copy_and_computes_the_same_bits(mesh, monkeypatch):
    """share_engine_fp8_weights: every FP8 layer of a sharded actor (LoRA bases, MLPs, modulation)
    links to the engine's FP8 copy of the same weight; the first update's log-probs and its
    ratio of exactly 1 do not move by a bit, and the linked layers read the engine's copy (a
    changed copy changes the replay) without the engine's layers joining the actor's modules. A
    linked layer runs the engine's FP8 GEMM on calls of any number of rows (the modulation's 4
    here, under the row floor of 8 an unlinked layer keeps: the actor quantizing its own weights
    is built without that floor to compute the same bits). An engine of other weights, or one
    that still holds its bf16 weights, is not linked."""
    from trainer.core.fp8 import FP8Linear, restore_frozen_linears
    from trainer.train_model import share_engine_fp8_weights

    cfg = make_cfg("lora", fsdp__replay_precision="fp8-dgrad", fsdp__replay_fp8_layers="frozen")
    monkeypatch.setattr("trainer.train_model.FP8_FROZEN_MIN_ROWS", 0)
    own = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    monkeypatch.setattr("trainer.train_model.FP8_FROZEN_MIN_ROWS", 8)
    shared = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    assert {m.fp8_min_rows for m in shared.model.modules() if isinstance(m, FP8FrozenLinear)} == {0, 8}
    engine = _fp8_engine()
    names = ADAPTER.weight_name_map
    assert share_engine_fp8_weights(shared.model, engine, names) == (28, 0)
    linked = [m for m in shared.model.modules() if getattr(m, "fp8_source", None) is not None]
    assert len(linked) == 28 and all(isinstance(m.fp8_source, FP8Linear) for m in linked)
    engine_params = {id(p) for p in engine.transformer.parameters()} | {id(b) for b in engine.transformer.buffers()}
    assert not any(id(t) in engine_params for t in (*shared.model.parameters(), *shared.model.buffers()))
    assert not any(isinstance(m, FP8Linear) for m in shared.model.modules())

    batch = make_batch(4)
    _same_replay_and_update(own, shared)
    # the linked layers read the engine's copy: zeroing one, a LoRA base or a modulation linear
    # (called with 4 rows, under its row floor), changes the replay
    modulation = next(n for n, m in shared.model.named_modules() if m in linked and n.endswith("img_mod.1"))
    for layer in (next(m for m in linked if m.fp8_min_rows == 0), shared.model.get_submodule(modulation)):
        with torch.no_grad():
            before = replay(shared.model, batch)
            layer.fp8_source.weight_fp8.zero_()
            assert not torch.equal(replay(shared.model, batch), before)
    restore_frozen_linears(shared.model)
    assert not any("fp8_source" in m.__dict__ for m in shared.model.modules())

    other = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    assert share_engine_fp8_weights(other.model, _fp8_engine(seed=1), names) == (0, 28)
    kept = _fp8_engine()
    kept.fp8_weights_dropped = 0  # its base can still change: never linked
    assert share_engine_fp8_weights(other.model, kept, names) == (0, 0)
    assert not any(getattr(m, "fp8_source", None) is not None for m in other.model.modules())


def test_the_loop_links_the_fp8_replay_only_while_the_engine_stays_on_the_device(mesh, monkeypatch):
    """Trainer.share_fp8_weights: linked with an FP8 replay, an adapter sync and the engine resident
    through the update (perf/replay_fp8_shared_layers counts the layers); not under
    --offload-rollout, with a full sync or with the default replay precision."""
    from types import SimpleNamespace as NS

    from trainer.loop import Trainer

    def run(offload_rollout=False, kind="adapter", precision="fp8"):
        cfg = make_cfg("lora", fsdp__replay_precision="fp8" if precision == "default" else precision,
                       fsdp__replay_fp8_layers="frozen")
        actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
        r = NS(actor=actor, engine=_fp8_engine(), adapter=ADAPTER, syncer=NS(kind=kind), load_metrics={}, rank=0,
               device=torch.device("cpu"), cfg=NS(fsdp=NS(replay_precision=precision, fsdp_param_dtype="fp32"),
                                                  colocate=NS(offload_rollout=offload_rollout)))
        Trainer.share_fp8_weights(r)
        return r.load_metrics, sum(getattr(m, "fp8_source", None) is not None for m in actor.model.modules())

    assert run() == ({"perf/replay_fp8_shared_layers": 28.0, "perf/replay_fp8_released_gb": 0.0}, 28)
    metrics, linked = run(precision="fp8-dgrad")  # the linked layers' own weights are freed
    assert linked == 28 and metrics["perf/replay_fp8_released_gb"] == pytest.approx(_linked_weight_bytes() / 1e9)
    for refused in (dict(offload_rollout=True), dict(kind="full"), dict(precision="default")):
        assert run(**refused) == ({}, 0), refused


def _linked_weight_bytes() -> int:
    """The bytes of the tiny DiT's block linears' weights, in the fp32 the tests' actors keep."""
    dit = tiny_transformer()
    return sum(m.weight.numel() * 4 for m in dit.transformer_blocks.modules() if type(m) is nn.Linear)


def test_fp8_dgrad_frees_the_linked_weights_and_computes_the_same_bits(mesh):
    """release_linked_weights: under fp8-dgrad a linked layer reads only the engine's FP8 copy, in
    its forward and its input gradient, so its own weight goes: the parameter leaves the module
    (and the checkpoint's state dict) and its storage is freed even while a reference to it lives
    on. The replay and the update are the linked-and-kept actor's bit for bit, the first ratio
    exactly 1; a second link finds the released layers linked. Nothing switches their precision
    afterwards; fp8's layers (their input gradient reads the weight) keep theirs."""
    from trainer.core.fp8 import release_linked_weights
    from trainer.train_model import share_engine_fp8_weights

    cfg = make_cfg("lora", fsdp__replay_precision="fp8-dgrad", fsdp__replay_fp8_layers="frozen")
    kept = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    freed = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    engine = _fp8_engine()
    for actor in (kept, freed):
        assert share_engine_fp8_weights(actor.model, engine, ADAPTER.weight_name_map) == (28, 0)
    params = dict(freed.model.named_parameters())
    held = [m.weight for m in freed.model.modules() if getattr(m, "fp8_source", None) is not None]
    assert release_linked_weights(freed.model) == (28, _linked_weight_bytes())
    assert all(w.untyped_storage().nbytes() == 0 for w in held)  # freed, though `held` still points at them
    gone = set(params) - set(dict(freed.model.named_parameters()))
    assert len(gone) == 28 and all(n.endswith(".weight") for n in gone)
    assert not gone & set(freed.model.state_dict())
    assert release_linked_weights(freed.model) == (0, 0)
    assert share_engine_fp8_weights(freed.model, engine, ADAPTER.weight_name_map) == (28, 0)
    with pytest.raises(RuntimeError, match="released its weight after linking to another engine"):
        share_engine_fp8_weights(freed.model, _fp8_engine(), ADAPTER.weight_name_map)

    _same_replay_and_update(kept, freed)
    with pytest.raises(RuntimeError, match="released their weights"):
        set_replay_precision(freed.model, "default")
    with pytest.raises(RuntimeError, match="released"):
        frozen_fp8_linear(torch.randn(2, 16), None, None, fp8_dgrad=True)

    fp8 = Actor(tiny_transformer(), mesh, make_cfg("lora", fsdp__replay_precision="fp8", fsdp__replay_fp8_layers="frozen"),
                device=torch.device("cpu"), adapter=ADAPTER)
    assert share_engine_fp8_weights(fp8.model, engine, ADAPTER.weight_name_map) == (28, 0)
    assert release_linked_weights(fp8.model) == (0, 0)


@pytest.mark.parametrize("precision", ["fp8", "fp8-dgrad"])
def test_a_compiled_actor_traces_the_linked_fp8_copies(mesh, monkeypatch, precision):
    """--fsdp-compile: dynamo traces a linked layer's read of the engine's buffers (the engine's
    layer is no submodule of the actor), in fp8-dgrad's backward too; the compiled update is the
    eager one's (dynamo's eager backend: the same kernels) with the first ratio exactly 1. The
    compiled fp8-dgrad actor has freed its linked weights (release_linked_weights): the graph
    reads only the engine's copies."""
    from trainer.core import modules
    from trainer.core.fp8 import release_linked_weights
    from trainer.train_model import share_engine_fp8_weights

    monkeypatch.setitem(modules.REGIONAL_COMPILE_KWARGS, "backend", "eager")
    monkeypatch.setattr("trainer.train_model.FP8_FROZEN_MIN_ROWS", 8)
    try:
        metrics = []
        for compiled in (False, True):
            cfg = make_cfg("lora", fsdp__replay_precision=precision, fsdp__replay_fp8_layers="frozen",
                           fsdp__fsdp_master_dtype="fp32", fsdp__fsdp_compile=compiled)
            actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
            assert share_engine_fp8_weights(actor.model, _fp8_engine(), ADAPTER.weight_name_map) == (28, 0)
            if compiled:
                assert release_linked_weights(actor.model)[0] == (28 if precision == "fp8-dgrad" else 0)
            metrics.append(actor.train_step(make_batch(4), ADV, replay))
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
        assert metrics[0]["train/loss"] == metrics[1]["train/loss"]
        assert metrics[0]["train/grad_norm"] == metrics[1]["train/grad_norm"]
    finally:
        torch._dynamo.reset()


def test_the_link_is_checked_in_the_dtype_the_forward_sees():
    """An fp32-stored weight that FSDP2 casts to bf16 for each forward: its quantization at the
    forward is of the bf16 cast, so the engine's copy of the bf16 weight links only when the check
    casts as the forward does (compute_dtype), and is refused against the fp32 values."""
    from trainer.core.fp8 import FP8Linear, share_fp8_weights

    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 32, bias=False).requires_grad_(False)
    layer.weight.copy_(torch.randn(32, 48, generator=g))
    layer.__class__ = FP8FrozenLinear
    engine = nn.Linear(48, 32, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        engine.weight.copy_(layer.weight.to(torch.bfloat16))
    engine.__class__ = FP8Linear
    engine.requantize()
    assert share_fp8_weights({"w": layer}, {"w": engine}) == (0, 1)
    assert share_fp8_weights({"w": layer}, {"w": engine}, torch.bfloat16) == (1, 0)
    x = torch.randn(4, 48, generator=g, dtype=torch.bfloat16)
    linked = layer(x)
    layer.__dict__.pop("fp8_source")
    with torch.no_grad():
        layer.weight.data = layer.weight.data.to(torch.bfloat16)  # what FSDP2's param_dtype hands the forward
    assert torch.equal(linked, layer(x))

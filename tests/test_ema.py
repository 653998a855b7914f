"""The EMA of the trainable parameters: the closed form on a toy, the actor's hook (FSDP2 on one
gloo rank), the checkpoint (bit-exact round trip, EMA-off layout unchanged, a clear error when
an EMA run resumes a checkpoint without one), the offload and the swap used by eval."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.dist.tiny import ADAPTER, full_params, make_batch, make_cfg, one_rank_mesh, replay, tiny_transformer
from trainer.actor import Actor
from trainer.ema import ParamEMA


@pytest.fixture(scope="module")
def mesh():
    yield from one_rank_mesh()


def reference_ema(history: list[dict[str, torch.Tensor]], decay: float, interval: int) -> dict[str, torch.Tensor]:
    """The EMA by its definition, in float64: history[0] are the initial parameters, history[s]
    those after optimizer step s; ema starts at history[0] and takes every interval-th step."""
    ema = {n: t.double().clone() for n, t in history[0].items()}
    for step in range(1, len(history)):
        if step % interval == 0:
            for n in ema:
                ema[n] = decay * ema[n] + (1.0 - decay) * history[step][n].double()
    return ema


def assert_close_fp32(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want) and got
    for n in want:
        g = got[n]
        assert g.dtype == torch.float32, n
        # a handful of fp32 roundings per update; the moving part is far larger than that
        torch.testing.assert_close(g.double(), want[n], rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("interval", [1, 3])
def test_toy_ema_equals_the_closed_form(interval):
    torch.manual_seed(0)
    toy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    toy[2].bias.requires_grad_(False)  # frozen: not averaged
    opt = torch.optim.AdamW([p for p in toy.parameters() if p.requires_grad], lr=0.05)
    ema = ParamEMA(((n, p) for n, p in toy.named_parameters() if p.requires_grad), 0.9, interval)
    snap = lambda: {n: p.detach().clone() for n, p in toy.named_parameters() if p.requires_grad}  # noqa: E731
    history = [snap()]
    for step in range(1, 8):
        loss = toy(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(snap())
        if ema.due(step):
            ema.update()
    assert "2.bias" not in ema.shadow and len(ema.shadow) == 3
    assert ema.updates == 7 // interval
    want = reference_ema(history, 0.9, interval)
    assert_close_fp32(ema.state_dict(), want)
    # the average really lags the parameters: it is neither the first nor the last value
    w = "0.weight"
    assert not torch.allclose(ema.shadow[w], history[-1][w]) and not torch.allclose(ema.shadow[w], history[0][w])


def test_ema_settings_are_checked():
    p = [("w", nn.Parameter(torch.ones(2)))]
    with pytest.raises(ValueError, match=r"--ema-decay must be in \[0, 1\)"):
        ParamEMA(p, 1.0)
    with pytest.raises(ValueError, match="--ema-update-interval must be >= 1"):
        ParamEMA(p, 0.9, 0)


def _actor(mesh, decay: float = 0.0, interval: int = 1) -> Actor:
    cfg = make_cfg("full", optim__ema_decay=decay, optim__ema_update_interval=interval)
    return Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)


def _trainable_full(actor: Actor) -> dict[str, torch.Tensor]:
    keep = set(actor.ema.names)
    return {n: t for n, t in full_params(actor.model).items() if n in keep}


def _ema_full(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: t.full_tensor().clone() for n, t in actor.ema.state_dict().items()}


@pytest.mark.parametrize("interval", [1, 2])
def test_actor_ema_under_fsdp2_equals_the_closed_form(mesh, interval):
    from torch.distributed.tensor import DTensor

    actor = _actor(mesh, 0.8, interval)
    shadow = actor.ema.state_dict()
    params = {n: p for n, p in actor.model.named_parameters() if p.requires_grad}
    assert all(isinstance(t, DTensor) and t.dtype == torch.float32 for t in shadow.values())
    assert all(shadow[n].placements == params[n].placements for n in params)
    history = [_trainable_full(actor)]
    actor.optimizer.register_step_post_hook(lambda *a: history.append(_trainable_full(actor)))
    for r in range(2):  # 2 rollouts x 2 updates = 4 optimizer steps
        actor.train_step(make_batch(4, seed=r), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    assert actor.optimizer_steps == 4 and len(history) == 5
    assert actor.ema.updates == 4 // interval
    assert_close_fp32(_ema_full(actor), reference_ema(history, 0.8, interval))
    assert actor.state_dict()["ema_decay"] == 0.8 and actor.state_dict()["ema_update_interval"] == interval


def test_ema_off_builds_nothing_and_keeps_the_state(mesh):
    actor = _actor(mesh)
    assert actor.ema is None
    assert set(actor.state_dict()) == {"lr_scheduler_steps", "skipped_rounds"}


def _save(actor: Actor, root, it: int, ema: bool) -> None:
    from trainer.checkpoint import save_checkpoint

    ok = save_checkpoint(root, "t2i", it, model=actor.model, optimizer=actor.optimizer,
                         trainer_state={"rollout_id": it, "policy_version": 1, **actor.state_dict()},
                         weight_sync_manifest=None, adapter_contract={"mode": "full"}, trainable_only=False,
                         ema=actor.ema.state_dict() if ema else None)
    assert ok


def _dcp_keys(root, it: int) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(root / "t2i" / f"iter_{it:07d}" / "fsdp")).read_metadata().state_dict_metadata)


def test_checkpoint_round_trip_is_bit_exact_and_ema_off_layout_unchanged(mesh, tmp_path):
    from trainer.checkpoint import CheckpointError, load_checkpoint

    trained = _actor(mesh, 0.9)
    trained.train_step(make_batch(4, seed=1), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    saved = _ema_full(trained)
    assert not all(torch.equal(saved[n], t) for n, t in _trainable_full(trained).items())
    _save(trained, tmp_path / "on", 1, ema=True)
    _save(trained, tmp_path / "off", 1, ema=False)

    on, off = _dcp_keys(tmp_path / "on", 1), _dcp_keys(tmp_path / "off", 1)
    assert {k for k in on if not k.startswith("ema.")} == off
    assert not any(k.startswith("ema.") for k in off)
    assert {k[len("ema."):] for k in on if k.startswith("ema.")} == set(trained.ema.names)
    assert all(f"model.{n}" in off for n in trained.ema.names)

    fresh = _actor(mesh, 0.9)
    assert not all(torch.equal(saved[n], t) for n, t in _ema_full(fresh).items())
    load_checkpoint(tmp_path / "on", "t2i", model=fresh.model, optimizer=fresh.optimizer,
                    adapter_contract={"mode": "full"}, trainable_only=False, ema=fresh.ema.state_dict())
    got = _ema_full(fresh)
    assert all(torch.equal(saved[n], got[n]) for n in saved)

    with pytest.raises(CheckpointError, match=r"holds no EMA state .* Resume with --ema-decay 0"):
        load_checkpoint(tmp_path / "off", "t2i", model=fresh.model, optimizer=fresh.optimizer,
                        adapter_contract={"mode": "full"}, trainable_only=False, ema=fresh.ema.state_dict())
    # an EMA-off run loads an EMA checkpoint (the EMA is dropped)
    plain = _actor(mesh)
    state = load_checkpoint(tmp_path / "on", "t2i", model=plain.model, optimizer=plain.optimizer,
                            adapter_contract={"mode": "full"}, trainable_only=False)
    assert state["ema_decay"] == 0.9
    params = full_params(plain.model)
    assert all(torch.equal(params[n], t) for n, t in _trainable_full(trained).items())


def test_offload_moves_the_ema_and_restores_it_bit_exactly(mesh):
    actor = _actor(mesh, 0.9)
    actor.train_step(make_batch(4, seed=2), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    before = _ema_full(actor)
    actor.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in actor.ema.local_tensors())
    actor.onload()
    after = _ema_full(actor)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_swapped_in_shows_the_ema_and_puts_the_live_weights_back(mesh):
    actor = _actor(mesh, 0.9)
    actor.train_step(make_batch(4, seed=3), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    live = _trainable_full(actor)
    ema = _ema_full(actor)
    with actor.ema.swapped_in():
        inside = _trainable_full(actor)
        assert all(torch.equal(inside[n], ema[n]) for n in ema)
    back = _trainable_full(actor)
    assert all(torch.equal(back[n], live[n]) for n in live)
    with pytest.raises(RuntimeError, match="boom"), actor.ema.swapped_in():
        raise RuntimeError("boom")
    back = _trainable_full(actor)
    assert all(torch.equal(back[n], live[n]) for n in live)


@pytest.mark.parametrize("offloaded", [False, True])
def test_eval_samples_the_ema_and_the_next_rollout_the_live_weights(mesh, offloaded):
    from tests.dist.tiny import ReceiverEngine
    from trainer.loop import evaluate_with_ema
    from trainer.weight_sync import WeightSyncer

    actor = _actor(mesh, 0.5)
    actor.train_step(make_batch(4, seed=4), torch.tensor([1.0, -1.0, 0.5, -0.5]), replay)
    engine = ReceiverEngine(tiny_transformer(seed=5))
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.05)
    syncer.sync(actor.model, engine)
    live, ema = full_params(actor.model), _ema_full(actor)
    assert any(not torch.equal(live[n], ema[n]) for n in ema)
    if offloaded:
        actor.offload()
    seen = {}

    def evaluate():
        seen.update({n: p.detach().clone() for n, p in engine.transformer.named_parameters()})
        seen["offloaded"] = actor.offloaded
        return {"eval/x": 1.0}

    assert evaluate_with_ema(actor, syncer, engine, evaluate) == {"eval/x": 1.0}
    assert seen.pop("offloaded") is offloaded
    assert all(torch.equal(seen[n], ema[n]) for n in ema)  # eval sampled the EMA
    assert all(torch.equal(seen[n], live[n]) for n in live if n not in ema)  # frozen ones as they are
    after = {n: p.detach() for n, p in engine.transformer.named_parameters()}
    assert all(torch.equal(after[n], live[n]) for n in live)  # the next rollout samples the live policy
    assert actor.offloaded is offloaded
    if offloaded:
        actor.onload()
    assert all(torch.equal(t, live[n]) for n, t in full_params(actor.model).items())
    assert syncer.policy_version == engine.policy_version == 1 and syncer.failures == 0


def test_export_ema_of_a_checkpoint_without_one_is_refused(mesh, tmp_path):
    """tools/export_checkpoint.py --ema needs EMA state (tests/test_e2e.py exports a real one)."""
    from tools.export_checkpoint import ExportError, load_checkpoint

    _save(_actor(mesh), tmp_path, 1, ema=False)
    assert load_checkpoint(tmp_path, "t2i", 1).tensors
    with pytest.raises(ExportError, match=r"holds no EMA weights .*\(drop --ema\)"):
        load_checkpoint(tmp_path, "t2i", 1, ema=True)

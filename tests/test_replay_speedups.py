"""The update's speed-ups compute exactly what the slower paths computed (fp32, tiny models).

- pi_old anchor: the first executed update takes its anchor from its own forward, later updates
  from a no_grad pass before any optimizer step. Bit-identical weights and metrics vs a separate
  no_grad anchor for every micro-batch, with fewer replays.
- text conditioning: an all-ones mask is not passed (flash-eligible SDPA) and padding columns
  shared by every row are dropped; the DiT output is unchanged.
"""

from __future__ import annotations


import pytest
import torch

from tests.dist.tiny import (ADAPTER, LATENT_HW, LORA_TARGETS, TEXT_LEN, full_params, make_batch, make_cfg, one_rank_mesh, replay,
                             tiny_transformer)
from trainer.actor import Actor
from trainer.models.qwen_image import dit_velocity, text_conditioning

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


@pytest.fixture(scope="module")
def mesh():
    yield from one_rank_mesh()


class CountingReplay:
    """The tiny replay, counting calls with and without grad."""

    def __init__(self) -> None:
        self.grad = 0
        self.no_grad = 0

    def __call__(self, model, rows):
        if torch.is_grad_enabled():
            self.grad += 1
        else:
            self.no_grad += 1
        return replay(model, rows)


def run_update(mesh, fused: bool, adv: torch.Tensor, *, mode: str = "full", valid=None, **over):
    actor = Actor(tiny_transformer(), mesh, make_cfg(mode, **over), device=torch.device("cpu"),
                  adapter=ADAPTER)
    actor.anchor_from_first_update = fused
    fn = CountingReplay()
    metrics = actor.train_step(make_batch(int(adv.shape[0])), adv, fn, valid=valid)
    return actor, fn, metrics


CASES = {
    # 2 updates x 2 micro-batches of 1
    "full": (torch.tensor([1.0, -1.0, 0.5, -0.5]), None, "full", {}),
    # micro-batches of 2 with an invalid row (the index_select path), activation checkpointing on
    "invalid_rows_ac": (torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([True, False, True, True]), "full",
                        {"grpo__micro_batch_size": 2, "fsdp__fsdp_activation_checkpointing": True}),
    # the first update is skipped (all-zero advantages): the second is the first executed one
    "first_skipped": (torch.tensor([0.0, 0.0, 0.5, -0.5]), None, "full", {}),
    # LoRA, three updates
    "lora_3_updates": (torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25]), None, "lora",
                       {"grpo__num_updates_per_batch": 3, "fsdp__fsdp_master_dtype": "fp32"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_anchor_from_first_update_is_bit_identical_with_fewer_replays(mesh, case):
    adv, valid, mode, over = CASES[case]
    ref, ref_fn, ref_m = run_update(mesh, False, adv, mode=mode, valid=valid, **over)
    new, new_fn, new_m = run_update(mesh, True, adv, mode=mode, valid=valid, **over)
    p_ref, p_new = full_params(ref.model), full_params(new.model)
    assert p_ref.keys() == p_new.keys()
    assert all(torch.equal(p_ref[k], p_new[k]) for k in p_ref), [k for k in p_ref if not torch.equal(p_ref[k], p_new[k])]
    timing = {"perf/train_time", "perf/train_transitions_per_s", "perf/train_samples_per_s"}
    assert ref_m.keys() == new_m.keys()
    assert {k: v for k, v in ref_m.items() if k not in timing} == {k: v for k, v in new_m.items() if k not in timing}
    # the optimizer state moved identically too (AdamW moments)
    for pr, pn in zip(ref.trainable, new.trainable):
        sr, sn = ref.optimizer.state[pr], new.optimizer.state[pn]
        assert all(torch.equal(sr[k].full_tensor() if hasattr(sr[k], "full_tensor") else sr[k],
                               sn[k].full_tensor() if hasattr(sn[k], "full_tensor") else sn[k]) for k in sr)
    # replays: the reference anchors every executed micro-batch; the fused path all but the first update's
    n_mb = int(new_m["train/num_microbatches"])
    executed = len(new.last_update_stats)
    mb_per_update = n_mb // int(over.get("grpo__num_updates_per_batch", 2))
    assert ref_fn.grad == new_fn.grad == executed * mb_per_update
    assert ref_fn.no_grad == ref.last_anchor_passes == executed * mb_per_update
    assert new_fn.no_grad == new.last_anchor_passes == (executed - 1) * mb_per_update
    # the contract: the first executed update sees ratio == 1 exactly, the next one does not
    first, *later = new.last_update_stats
    assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
    if later:
        assert (later[0]["ratio_max"].item(), later[0]["ratio_min"].item()) != (1.0, 1.0)


def test_all_updates_skipped_replays_nothing(mesh):
    actor, fn, m = run_update(mesh, True, torch.zeros(4))
    assert fn.grad == fn.no_grad == 0 and m["train/optimizer_steps"] == 0 and actor.skipped_rounds == 1


# ---------------------------------------------------------------- text conditioning


def test_text_conditioning_drops_shared_padding_and_all_ones_mask():
    emb = torch.randn(3, 5, 4)
    ones = torch.ones(3, 5, dtype=torch.long)
    e, m = text_conditioning(emb, ones)
    assert m is None and e is emb
    assert text_conditioning(emb, None) == (emb, None)
    # one prompt (same length 3) padded to 5: trimmed to 3 columns, then all ones -> no mask
    pad = torch.tensor([[1, 1, 1, 0, 0]] * 3)
    e, m = text_conditioning(emb, pad)
    assert m is None and torch.equal(e, emb[:, :3])
    # two lengths: trimmed to the longest, mask kept
    mixed = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    e, m = text_conditioning(emb, mixed)
    assert torch.equal(e, emb[:, :4]) and torch.equal(m, mixed[:, :4])
    # a hole inside the prompt is kept (only columns masked in EVERY row are dropped)
    hole = torch.tensor([[1, 0, 1, 0, 0]] * 3)
    e, m = text_conditioning(emb, hole)
    assert torch.equal(m, hole[:, :3]) and e.shape == (3, 3, 4)
    # bool masks work the same way
    e, m = text_conditioning(emb, pad.bool())
    assert m is None and e.shape == (3, 3, 4)


def _dit_inputs(b: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(b, LATENT_HW * LATENT_HW, 16, generator=g)
    emb = torch.randn(b, TEXT_LEN, 16, generator=g)
    t = torch.tensor([700.0, 400.0])[:b]
    shapes = [[(1, LATENT_HW, LATENT_HW)]] * b
    return lat, t, emb, shapes


@torch.no_grad()
def test_dit_output_identical_with_and_without_all_ones_mask():
    """fp32, tiny model: the diffusers DiT given an all-ones mask == given none, bit for bit;
    dit_velocity (which drops it) == the masked call."""
    model = tiny_transformer(seed=3).eval()
    lat, t, emb, shapes = _dit_inputs()
    ones = torch.ones(2, TEXT_LEN, dtype=torch.long)

    def direct(e, m):
        return model(hidden_states=lat, encoder_hidden_states=e, encoder_hidden_states_mask=m,
                     timestep=t / 1000, img_shapes=shapes, return_dict=False)[0]

    with_mask, without = direct(emb, ones), direct(emb, None)
    assert torch.equal(with_mask, without)
    assert torch.equal(dit_velocity(model, lat, t, emb, ones, shapes), with_mask)
    assert torch.equal(dit_velocity(model, lat, t, emb, None, shapes), with_mask)


@torch.no_grad()
def test_dit_output_unchanged_by_trimming_shared_padding():
    """A one-prompt batch padded with zero columns (what pack_trajectory produces when other
    prompts of the rollout are longer): trimmed, mask-free == the padded, masked call."""
    model = tiny_transformer(seed=3).eval()
    lat, t, emb, shapes = _dit_inputs()
    padded = torch.cat([emb, torch.zeros(2, 3, 16)], dim=1)
    mask = torch.cat([torch.ones(2, TEXT_LEN, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)], dim=1)
    masked = model(hidden_states=lat, encoder_hidden_states=padded, encoder_hidden_states_mask=mask,
                   timestep=t / 1000, img_shapes=shapes, return_dict=False)[0]
    trimmed = dit_velocity(model, lat, t, padded, mask, shapes)
    # the masked keys get weight exactly 0, but the padded sequence is longer, so kernels may sum in
    # another order: equal to fp32 rounding, not necessarily bit for bit
    torch.testing.assert_close(trimmed, masked, atol=1e-6, rtol=1e-5)
    # a batch with two prompt lengths keeps its mask and stays equal too
    mask2 = mask.clone()
    mask2[1, TEXT_LEN - 2:] = 0
    masked2 = model(hidden_states=lat, encoder_hidden_states=padded, encoder_hidden_states_mask=mask2,
                    timestep=t / 1000, img_shapes=shapes, return_dict=False)[0]
    torch.testing.assert_close(dit_velocity(model, lat, t, padded, mask2, shapes), masked2, atol=1e-6, rtol=1e-5)


def test_progress_ticks_once_per_replayed_micro_batch(mesh):
    """The loop's update progress bar: one tick per replay, anchor passes included."""
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    actor = Actor(tiny_transformer(), mesh, make_cfg("full"), device=torch.device("cpu"),
                  adapter=ADAPTER)
    fn, ticks = CountingReplay(), []
    actor.train_step(make_batch(4), adv, fn, progress=lambda: ticks.append(1))
    assert len(ticks) == fn.grad + fn.no_grad == 4 + actor.last_anchor_passes


def test_fused_adamw_takes_the_steps_of_the_default_one(mesh):
    """--adam-fused: the actor's AdamW is torch's fused kernel (over the LoRA DTensors), and two updates
    move the weights and the moments as the multi-tensor default does, up to float rounding."""
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    over = {"fsdp__fsdp_master_dtype": "fp32"}
    ref, _, ref_m = run_update(mesh, True, adv, mode="lora", **over)
    new, _, new_m = run_update(mesh, True, adv, mode="lora", optim__adam_fused=True, **over)
    assert new.optimizer.param_groups[0]["fused"] and not ref.optimizer.param_groups[0]["fused"]
    assert new_m["train/optimizer_steps"] == ref_m["train/optimizer_steps"] == 2
    p_ref, p_new = full_params(ref.model), full_params(new.model)
    moved = [k for k in p_ref if not torch.equal(p_ref[k], full_params(Actor(
        tiny_transformer(), mesh, make_cfg("lora", **over), device=torch.device("cpu"), adapter=ADAPTER).model)[k])]
    assert moved  # the updates changed the adapter
    assert all(torch.allclose(p_ref[k], p_new[k], rtol=0, atol=1e-6) for k in p_ref)
    for pr, pn in zip(ref.trainable, new.trainable):
        sr, sn = ref.optimizer.state[pr], new.optimizer.state[pn]
        assert sr.keys() == sn.keys()  # the same state: a checkpoint of either resumes the other
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(sr[k].full_tensor(), sn[k].full_tensor(), rtol=1e-5, atol=1e-9)

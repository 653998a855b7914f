"""The SGLang engine batches candidates: one SGLang request per geometry and max_batch_size
candidates (one row each; several prompts in one request), and that gives the same responses,
in the same order, as one request per candidate.

Measured on the 2-core CPU machine (tiny model, fp32, 64x64, 6 steps, two prompts of different
lengths, three candidates each, sde and dance): batched vs one-per-request differ by <= 7.2e-7 in
latents and images and <= 6e-8 in log-probs; the prompt embeddings and masks are identical. The
tolerances are those of test_conformance.py (tests/sglang_engine/devices.py: 1e-5 in fp32; in
bf16 a batch of other rows may take other GEMM tilings, so bf16's rounding bounds).
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang_engine.devices import sglang_kwargs, tol
from trainer.engine.sglang_engine import SGLangEngine
from trainer.models.qwen_image import QwenImageAdapter
from trainer.sampling import parse_sampling_config

PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]
TENSORS = ("latents", "next_latents", "log_probs", "images", "sigmas", "sigmas_next", "timesteps", "slots",
           "group_indices", "policy_versions")
LISTS = ("sample_ids", "prompts", "generation_seeds", "metadata", "sde_indices")


def sampling_for(sde_type="sde", eta=0.7, sde_indices=(1, 2, 4)):
    return parse_sampling_config({"height": 64, "width": 64, "num_inference_steps": 6, "eta": eta,
                                  "sde_type": sde_type, "sde_indices": list(sde_indices)})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return SGLangEngine(str(tiny_model_dir), **sglang_kwargs())


@pytest.fixture(scope="module")
def rows_per_request(engine):
    """The candidates (rows) of every SGLang request the engine sends, per generate call."""
    seen: list[int] = []
    forward = engine.worker.execute_forward

    def counting(batch, *args, **kwargs):
        seen.extend(int(req.batch_size) for req in batch)
        return forward(batch, *args, **kwargs)

    engine.worker.execute_forward = counting
    yield seen
    engine.worker.execute_forward = forward


def make_requests(engine, sampling, group_size=3, seed=7, tag=""):
    adapter = QwenImageAdapter()
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"{tag}prompt:{g}:sample:{s}",
                                          sampling=sampling, sde_indices=list(sampling.sde_indices),
                                          sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(PROMPTS) for s in range(group_size)]


def generate(engine, reqs, max_batch_size, seen):
    engine.max_batch_size = max_batch_size
    seen.clear()
    try:
        return engine.generate(reqs), list(seen)
    finally:
        engine.max_batch_size = 0


def assert_same(one, batched):
    assert one.sample_ids == batched.sample_ids
    for k in LISTS:
        assert getattr(one, k) == getattr(batched, k), k
    diffs = {}
    pairs = [(k, getattr(one, k), getattr(batched, k)) for k in TENSORS]
    pairs += [(f"conditions.{k}", v, batched.conditions[k]) for k, v in one.conditions.items()]
    assert set(one.conditions) == set(batched.conditions) == {"prompt_embeds", "prompt_embeds_mask"}
    for k, x, y in pairs:
        assert x.shape == y.shape and x.dtype == y.dtype, k
        diffs[k] = (x.float() - y.float()).abs().max().item()
    assert all(d <= tol(k) for k, d in diffs.items()), diffs
    return diffs


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("dance", 0.3)])
def test_batched_requests_equal_one_request_per_candidate(engine, rows_per_request, sde_type, eta):
    reqs = make_requests(engine, sampling_for(sde_type, eta))
    one, rows = generate(engine, reqs, 1, rows_per_request)
    assert rows == [1] * 6
    assert engine.last_stats["sglang_requests"] == 6 and engine.last_stats["dit_forwards"] == 36
    # the candidates differ from each other (each row has its own x_T and step noise)
    assert (one.images[0] - one.images[1]).abs().max() > 1e-3
    assert (one.log_probs[0] - one.log_probs[1]).abs().max() > 1e-6
    by_id = {sid: i for i, sid in enumerate(one.sample_ids)}
    cases = [
        (0, reqs, [6]),  # both prompts, three candidates each, in one request
        (2, reqs, [2, 2, 2]),  # max_batch_size splits a prompt's group (0-1, 2 + the other prompt's 0, 1-2)
        (4, reqs, [4, 2]),  # three of one prompt with one of the other, then two
        (0, reqs[::-1], [6]),  # order is the caller's
        (0, [reqs[0], reqs[4], reqs[1]], [3]),  # interleaved prompts, unequal counts
    ]
    for max_batch_size, subset, expected_rows in cases:
        got, rows = generate(engine, subset, max_batch_size, rows_per_request)
        assert rows == expected_rows, (max_batch_size, rows)
        assert engine.last_stats["sglang_requests"] == len(expected_rows)
        assert_same(one[[by_id[r.sample_id] for r in subset]], got)


def test_one_call_samples_one_geometry(engine, rows_per_request):
    """Candidates whose schedule or SDE settings differ never share a call (one Trajectory has one
    geometry): mixing them is refused before SGLang runs; each geometry alone equals its
    one-per-request generation."""
    a = make_requests(engine, sampling_for("sde", 0.7), group_size=2, tag="a:")
    b = make_requests(engine, sampling_for("dance", 0.3, (0, 3)), group_size=2, tag="b:")
    mixed = [x for pair in zip(a, b) for x in pair]
    with pytest.raises(ValueError, match="differ in geometry.*once per geometry"):
        generate(engine, mixed, 0, rows_per_request)
    assert rows_per_request == []
    for reqs, sde_type, steps in ((a, "sde", [1, 2, 4]), (b, "dance", [0, 3])):
        one, _ = generate(engine, reqs, 1, rows_per_request)
        got, rows = generate(engine, reqs, 0, rows_per_request)
        assert rows == [4]
        assert_same(one, got)
        assert got.sde_type == sde_type and got.sde_indices == steps


def test_a_request_with_no_candidates_is_empty(engine):
    assert engine.generate([]) is None


def test_the_spec_needs_a_seed_per_candidate():
    from trainer.engine.sglang_plugin import TrainerRolloutSpec

    with pytest.raises(ValueError, match="one generation seed per candidate"):
        TrainerRolloutSpec(sample_ids=["a", "b"], generation_seeds=[1], sigmas=[1.0, 0.0], sde_indices=[0],
                           eta=0.7, sde_type="sde", sigma_max=1.0, latent_dtype=torch.float32)

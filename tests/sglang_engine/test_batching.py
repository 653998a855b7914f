"""The SGLang engine batches candidates: one SGLang request per geometry and max_batch_size
candidates (one row each; several prompts in one request), and that gives the same responses,
in the same order, as one request per candidate.

Measured on the 2-core CPU machine (tiny model, fp32, 64x64, 6 steps, two prompts of different
lengths, three candidates each, sde and dance): batched vs one-per-request differ by <= 7.2e-7 in
latents and images and <= 6e-8 in log-probs; the prompt embeddings and masks are identical. TOL
is 1e-5, as in test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch

from trainer.engine.sglang_engine import SGLangEngine
from trainer.models.qwen_image import QwenImageAdapter
from trainer.sampling import parse_sampling_config

TOL = 1e-5
PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea"]
TENSORS = ("trajectory_latents", "trajectory_next_latents", "log_probs", "image", "prompt_embeds",
           "prompt_embeds_mask", "sigmas", "sigmas_next", "timesteps")


def sampling_for(sde_type="sde", eta=0.7, sde_indices=(1, 2, 4)):
    return parse_sampling_config({"height": 64, "width": 64, "num_inference_steps": 6, "eta": eta,
                                  "sde_type": sde_type, "sde_indices": list(sde_indices)})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return SGLangEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)


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


def assert_same(one, batched, tol=TOL):
    assert [r["sample_id"] for r in one] == [r["sample_id"] for r in batched]
    diffs = {}
    for x, y in zip(one, batched):
        assert set(x) == set(y)
        for k, v in x.items():
            if isinstance(v, torch.Tensor):
                assert v.shape == y[k].shape and v.dtype == y[k].dtype, k
                diffs[k] = max(diffs.get(k, 0.0), (v.float() - y[k].float()).abs().max().item())
            else:
                assert v == y[k], k
    assert diffs.keys() >= set(TENSORS)
    assert all(d <= tol for d in diffs.values()), diffs
    return diffs


@pytest.mark.parametrize("sde_type,eta", [("sde", 0.7), ("dance", 0.3)])
def test_batched_requests_equal_one_request_per_candidate(engine, rows_per_request, sde_type, eta):
    reqs = make_requests(engine, sampling_for(sde_type, eta))
    one, rows = generate(engine, reqs, 1, rows_per_request)
    assert rows == [1] * 6
    assert engine.last_stats["sglang_requests"] == 6 and engine.last_stats["dit_forwards"] == 36
    # the candidates differ from each other (each row has its own x_T and step noise)
    assert (one[0]["image"] - one[1]["image"]).abs().max() > 1e-3
    assert (one[0]["log_probs"] - one[1]["log_probs"]).abs().max() > 1e-6
    by_id = {r["sample_id"]: r for r in one}
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
        assert_same([by_id[r.sample_id] for r in subset], got)


def test_geometries_get_their_own_requests(engine, rows_per_request):
    """Candidates whose schedule or SDE settings differ never share a request; the responses
    keep the caller's order and each equals its one-per-request generation."""
    a = make_requests(engine, sampling_for("sde", 0.7), group_size=2, tag="a:")
    b = make_requests(engine, sampling_for("dance", 0.3, (0, 3)), group_size=2, tag="b:")
    mixed = [x for pair in zip(a, b) for x in pair]
    one, _ = generate(engine, mixed, 1, rows_per_request)
    got, rows = generate(engine, mixed, 0, rows_per_request)
    assert rows == [4, 4]
    assert engine.last_stats["geometries"] == 2
    assert_same(one, got)
    assert [r["sde_type"] for r in got] == ["sde", "dance"] * 4
    assert [r["sde_indices"] for r in got[:2]] == [[1, 2, 4], [0, 3]]


def test_a_request_with_no_candidates_is_empty(engine):
    assert engine.generate([]) == []


def test_the_spec_needs_a_seed_per_candidate():
    from trainer.engine.sglang_plugin import TrainerRolloutSpec

    with pytest.raises(ValueError, match="one generation seed per candidate"):
        TrainerRolloutSpec(sample_ids=["a", "b"], generation_seeds=[1], sigmas=[1.0, 0.0], sde_indices=[0],
                           eta=0.7, sde_type="sde", sigma_max=1.0, latent_dtype=torch.float32)

"""One rollout end to end on the tiny model: plan, generate, artifacts, replayable batch.

Also run as a torchrun worker (see `main` at the bottom) for the 2-rank test, where one
group's candidates are split over the ranks and gathered into one sidecar.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from trainer import artifacts
from trainer.rollout import generate_rollout, group_owner, local_candidates, split_groups

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 5, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 3], "sde_resample_per_rollout": True, "num_sde_steps": 2, "sde_pool": [1, 2, 3, 4]}
PROMPTS = [
    {"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "p0"}},
    {"prompt": "a lighthouse", "metadata": {"task": "t2i", "sample_id": "p1"}},
    {"prompt": "an unusually long prompt describing a very small blue robot", "metadata": {"task": "t2i", "sample_id": "p2"}},
]


def test_local_candidates_partition():
    for groups, size, world in [(3, 4, 2), (3, 4, 3), (5, 3, 4), (2, 8, 8), (1, 4, 2), (4, 2, 1)]:
        blocks = [local_candidates(groups, size, r, world) for r in range(world)]
        assert [c for b in blocks for c in b] == [(g, s) for g in range(groups) for s in range(size)]
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        for g in range(groups):
            owner = group_owner(g, size, groups, world)
            assert (g, 0) in blocks[owner]
        expected_split = [g for g in range(groups) if sum(any(c[0] == g for c in b) for b in blocks) > 1]
        assert split_groups(groups, size, world) == expected_split
    assert local_candidates(3, 2, 1, 2) == [(1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="outside world size"):
        local_candidates(3, 2, 2, 2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from trainer.engine.native import NativeEngine

    return NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=4)


def run(engine, root, rollout_id, **kw):
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    kw.setdefault("retention", 2)
    return generate_rollout(engine, QwenImageAdapter(), PROMPTS, rollout_id=rollout_id,
                            sampling=parse_sampling_config(SAMPLING), group_size=2, generation_seed=11,
                            artifact_root=root, task="t2i", weight_manifest_hash="h0", **kw)


def test_rollout_writes_artifacts_and_returns_replayable_batch(engine, tmp_path, tiny_model_dir):
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config, resolve_sde_indices
    from trainer.trajectory import Trajectory

    out = run(engine, tmp_path, 4)
    sampling = parse_sampling_config(SAMPLING)
    assert out.sde_indices == resolve_sde_indices(sampling, 5, 4)  # the per-rollout redraw
    d = tmp_path / "t2i" / "rollout_0000004"
    assert out.artifact_dir == d
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [f"group_{g:08d}.safetensors" for g in range(3)]
        + [f"group_{g:08d}_sample_{s:04d}.png" for g in range(3) for s in range(2)])
    traj = out.trajectory
    assert list(zip(traj.group_indices.tolist(), traj.slots.tolist())) == [(g, s) for g in range(3) for s in range(2)]
    assert traj.sample_ids[0] == "prompt:p0:sample:0" and traj.rollout_id == 4
    manifest = traj.train_metadata[0]
    assert manifest["sampling_fingerprint"] == sampling.fingerprint() and manifest["weight_manifest_hash"] == "h0"

    # each sidecar holds exactly its group's tracks
    for g in range(3):
        tensors, meta = artifacts.read_sidecar(d / f"group_{g:08d}.safetensors")
        assert json.loads(meta["sample_ids"]) == [f"prompt:p{g}:sample:{s}" for s in range(2)]
        back = artifacts.sidecar_to_trajectory(tensors, meta)
        mine = traj[traj.rows_of_group(g)]
        assert torch.equal(back.latents, mine.latents)
        assert torch.equal(back.log_probs, mine.log_probs)

    # the returned batch replays to the sampler's log-probs
    adapter = QwenImageAdapter()
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for col in range(len(out.sde_indices)):
            torch.testing.assert_close(adapter.replay_transition(actor, traj, col),
                                       traj.log_probs[:, col], atol=1e-5, rtol=0)
            # and so does what the sidecars stored, padded back into one batch
            stored = Trajectory.cat([artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(p))
                                     for p in artifacts.iter_sidecars(d)])
            torch.testing.assert_close(adapter.replay_transition(actor, stored, col),
                                       traj.log_probs[:, col], atol=1e-5, rtol=0)


def test_retention_eval_and_resample(engine, tmp_path):
    steps = [run(engine, tmp_path, k).sde_indices for k in range(3)]
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == [1, 2]
    assert len({tuple(s) for s in steps}) > 1  # redrawn per rollout
    ev = run(engine, tmp_path, 2, eval=True, retention=1)
    assert ev.sde_indices == [1, 3]  # evaluation: the fixed sde_indices fallback
    assert ev.artifact_dir == tmp_path / "eval" / "t2i" / "rollout_0000002"
    assert len(list(artifacts.iter_sidecars(ev.artifact_dir))) == 3
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == [1, 2]


def test_retention_ignores_rollouts_of_an_abandoned_later_attempt(engine, tmp_path):
    """A directory of a later rollout id (an attempt that got further before the run resumed
    from an earlier checkpoint) must not push the current run's rollouts out of retention."""
    (tmp_path / "t2i" / "rollout_0000009").mkdir(parents=True)
    for k in (3, 4):
        run(engine, tmp_path, k)
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == [3, 4, 9]
    assert len(list(artifacts.iter_sidecars(tmp_path / "t2i" / "rollout_0000003"))) == 3


def test_empty_trained_step_set_fails_clearly(engine, tmp_path):
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    with pytest.raises(ValueError, match="trained SDE step set is empty"):
        generate_rollout(engine, QwenImageAdapter(), PROMPTS, rollout_id=0,
                         sampling=parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4}),
                         group_size=2, generation_seed=1, artifact_root=tmp_path)
    assert not (tmp_path / "t2i").exists()  # nothing written


def test_split_groups_need_a_process_group(engine, tmp_path):
    with pytest.raises(ValueError, match="initialised torch.distributed"):
        run(engine, tmp_path, 0, rank=0, world_size=4)


def test_two_ranks_gather_split_group(engine, tmp_path, tiny_model_dir):
    """3 groups x 2 on 2 ranks: group 1 is split; its sidecar must hold both slots and match
    a single-process rollout of the same candidates. The worker also replays its own batch
    through an FSDP2-sharded actor and checks the log-probs (<= 1e-5)."""
    from tests.workers.launch import torchrun

    torchrun("tests/test_rollout.py", nproc=2, args=[str(tiny_model_dir), str(tmp_path / "dist")], timeout=240)
    single = run(engine, tmp_path / "single", 7)
    d = tmp_path / "dist" / "t2i" / "rollout_0000007"
    assert sorted(p.name for p in d.glob("*.png")) == sorted(p.name for p in single.artifact_dir.glob("*.png"))
    for g in range(3):
        a_t, a_m = artifacts.read_sidecar(d / f"group_{g:08d}.safetensors")
        b_t, b_m = artifacts.read_sidecar(single.artifact_dir / f"group_{g:08d}.safetensors")
        assert a_m["sample_ids"] == b_m["sample_ids"] and a_t["common.slots"].tolist() == [0, 1]
        assert torch.equal(a_t["common.seed_hashes"], b_t["common.seed_hashes"])
        for key in ("tracks.latents", "tracks.next_latents", "tracks.log_probs"):
            torch.testing.assert_close(a_t[key], b_t[key], atol=1e-5, rtol=0)
    ranks = json.loads((tmp_path / "dist" / "ranks.json").read_text())
    assert ranks == {"0": [[0, 0], [0, 1], [1, 0]], "1": [[1, 1], [2, 0], [2, 1]]}


def main(model_dir: str, root: str) -> None:
    """torchrun worker: one rollout over 2 ranks (gloo)."""
    import torch.distributed as dist

    from trainer.distributed import init_distributed, shutdown_and_exit
    from trainer.engine.native import NativeEngine

    info = init_distributed("cpu")
    engine = NativeEngine(model_dir, device="cpu", dtype=torch.float32, max_batch_size=4)
    out = run(engine, root, 7)
    assert len(out.trajectory) == 3
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, out.candidates)

    # the adapter's replay also works through an FSDP2-sharded actor (per block, then the root)
    from torch.distributed.fsdp import fully_shard

    from trainer.distributed import build_mesh
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    adapter = QwenImageAdapter()
    actor = adapter.load_train_model(model_dir, dtype=torch.float32)
    mesh = build_mesh("cpu")
    for block in actor.transformer_blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(actor, mesh=mesh)
    with torch.no_grad():
        for col in range(len(out.sde_indices)):
            logp = adapter.replay_transition(actor, out.trajectory, col)
            err = (logp - out.trajectory.log_probs[:, col]).abs().max().item()
            assert err <= 1e-5, f"rank {info.rank}: FSDP2 replay of column {col} differs by {err}"
    if info.rank == 0:
        with open(f"{root}/ranks.json", "w") as f:
            json.dump({str(r): [list(c) for c in cs] for r, cs in enumerate(gathered)}, f)
    shutdown_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

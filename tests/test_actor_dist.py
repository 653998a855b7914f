"""Multi-process actor checks: one torchrun launch (2 ranks, CPU, gloo) of tests/dist/actor_worker.py.

Each rank writes a JSON of named checks; every check must hold on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {
    "full_every_trainable_changed", "full_never_trained_frozen", "first_update_ratio_exactly_1",
    "second_update_ratio_not_1", "two_updates_two_optimizer_steps", "full_sync_engine_matches_gathered",
    "full_sync_engine_forward_matches_actor", "full_sync_version_committed", "bad_manifest_raises",
    "bad_manifest_version_unchanged", "offload_frees_storage", "offload_roundtrip_params_bit_exact",
    "offload_roundtrip_optimizer_bit_exact", "microbatch_mismatch_raises", "lora_only_adapter_changed",
    "adapter_sync_engine_matches_gathered", "adapter_sync_engine_forward_matches_actor",
    "full_sync_into_lora_engine_raises", "full_sync_into_lora_engine_version_unchanged",
    "merge_sync_engine_matches_merged", "merge_sync_engine_forward_matches_actor",
    "real_replay_matches_sampler_logprob", "real_full_every_trainable_changed", "real_first_update_ratio_exactly_1",
    "real_full_sync_engine_dit_matches_gathered", "real_engine_samples_new_version",
    "real_replay_after_sync_matches_sampler", "real_adapter_sync_engine_matches",
    "real_merged_sync_into_lora_engine_raises", "real_merged_sync_engine_matches", "load_waves_sequential",
    "bucketed_full_bit_identical_to_full_tensor", "bucketed_merged_bit_identical_to_full_tensor",
    "bucketed_adapter_bit_identical_to_full_tensor", "merged_sync_engine_bit_identical",
    "full_sync_engine_bit_identical", "gather_uneven_shards_exact", "bucketed_path_gathers_every_param",
    "frozen_auto_placement", "frozen_replicate_placement", "replicated_frozen_update_bit_identical_to_sharded",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("actor_dist")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           str(ROOT / "tests" / "dist" / "actor_worker.py"), str(out), str(tiny_model_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ranks = []
    for r in range(2):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        ranks.append(json.loads(path.read_text()))
    assert proc.returncode == 0, f"torchrun rc {proc.returncode}: {[r.get('error') for r in ranks]}\n{proc.stderr[-4000:]}"
    return ranks


def test_every_check_holds_on_every_rank(results):
    for r in results:
        assert "error" not in r, r["error"]
        assert r["world_size"] == 2
        assert set(r["checks"]) == EXPECTED
        failed = sorted(k for k, v in r["checks"].items() if v is not True)
        assert not failed, f"rank {r['rank']} failed: {failed}"


def test_figures_are_consistent_across_ranks(results):
    f0, f1 = results[0]["figures"], results[1]["figures"]
    # reduced series are identical on both ranks; the sync moves the same tensors everywhere
    for key in ("train/loss", "train/ratio_max", "train/ratio_min", "train/grad_norm"):
        assert f0["full_train"][key] == f1["full_train"][key]
    assert f0["full_train"]["train/ratio_max"] >= 1.0 >= f0["full_train"]["train/ratio_min"]
    assert f0["full_sync"]["train/weight_sync_tensors"] == f1["full_sync"]["train/weight_sync_tensors"] > 0
    assert f0["adapter_sync"]["train/weight_sync_tensors"] < f0["merge_sync"]["train/weight_sync_tensors"]

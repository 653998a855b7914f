"""The EMA shards under FSDP2 on 1 and 2 gloo ranks (one torchrun launch of tests/dist/ema_worker.py each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.workers.launch import ROOT, free_port

EXPECTED = {"four_steps_two_updates", "same_placement_as_param", "shards_are_fp32", "local_shards_match_reference",
            "gathered_matches_reference", "ema_lags_live"}


@pytest.mark.parametrize("world", [1, 2])
def test_ema_shards_match_the_reference(tmp_path, world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "tests" / "dist" / "ema_worker.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        res = json.loads(path.read_text())
        assert "error" not in res, res["error"]
        assert res["world_size"] == world
        assert set(res["checks"]) == EXPECTED and all(res["checks"].values()), res["checks"]
    assert proc.returncode == 0, proc.stderr[-4000:]

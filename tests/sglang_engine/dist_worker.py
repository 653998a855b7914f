"""One rank of the 2-rank SGLang engine test (torchrun, gloo, CPU): every rank builds its own
in-process SGLang engine inside the trainer's process group and generates its own candidates;
rank results are compared with a native engine on the same rank and gathered.

    torchrun --nproc-per-node 2 tests/sglang_engine/dist_worker.py TINY_MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(model_dir: str, out_dir: str) -> None:
    from trainer.engine.native import NativeEngine
    from trainer.engine.sglang_engine import SGLangEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env_before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    sg = SGLangEngine(model_dir, device="cpu", dtype=torch.float32)
    env_after = {k: os.environ.get(k) for k in env_before}
    na = NativeEngine(model_dir, device="cpu", dtype=torch.float32)
    adapter = QwenImageAdapter()
    sampling = parse_sampling_config({"height": 64, "width": 64, "num_inference_steps": 6, "eta": 0.7,
                                      "sde_type": "sde", "sde_indices": [1, 2, 4]})
    sigmas = na.sigma_schedule(64, 64, 6)
    reqs = [adapter.build_rollout_request("a cat" if rank == 0 else "a dog", group_index=rank, slot=s,
                                          sample_id=f"prompt:{rank}:sample:{s}", sampling=sampling,
                                          sde_indices=[1, 2, 4], sigmas=sigmas, generation_seed=7)
            for s in range(2)]
    a, b = na.generate(reqs), sg.generate(reqs)
    diff = max((getattr(a, k).float() - getattr(b, k).float()).abs().max().item()
               for k in ("latents", "log_probs", "images"))
    # the trainer's collectives still run on its own 2-rank group after SGLang's set-up
    logps = [torch.zeros(2, 3) for _ in range(world)]
    dist.all_gather(logps, b.log_probs.contiguous())
    result = {"rank": rank, "world": world, "env_restored": env_before == env_after, "max_diff": diff,
              "gathered_logps": [t.tolist() for t in logps], "checksum": sg.get_weights_checksum()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

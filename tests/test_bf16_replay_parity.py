"""bf16 replay == sampler, bit for bit, for every family: the engine samples a tiny model in
bf16 and the actor (FSDP2, LoRA with fp32 masters, bf16 compute, checkpointing) replays the
recorded transitions; the log-probs must be equal, not close. The actor used to let FSDP2 cast
its forward inputs to bf16, which the engine does not do: SD3's fp32 timestep (857.7 -> 856) and
FLUX's fp32 rope tables were rounded in the replay only (3.8e-4 and 8e-5 nats apart)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.tiny import make_cfg, one_rank_mesh

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

FAMILIES = {
    # family: (model-dir fixture, adapter dotpath, sampling extras)
    "qwen_image": ("tiny_model_dir", "trainer.models.qwen_image.QwenImageAdapter", {"guidance_scale": 4.0}),
    "sd3": ("tiny_sd3_model_dir", "trainer.models.sd3.SD3Adapter",
            {"guidance_scale": 4.5, "cfg_renorm": False, "negative_prompt": ""}),
    "flux": ("tiny_flux_dir", "trainer.models.flux.FluxAdapter", {"guidance_scale": 3.5}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_actor_replay_equals_the_bf16_sampler(family, request):
    from trainer.actor import Actor
    from trainer.dotpath import import_dotpath
    from trainer.engine.native import NativeEngine
    from trainer.loop import make_replay_fn
    from trainer.sampling import parse_sampling_config

    fixture, dotpath, extra = FAMILIES[family]
    model_dir = str(request.getfixturevalue(fixture))
    adapter = import_dotpath(dotpath, "--model-adapter-path")()
    sampling = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                                      "sde_type": "sde", "sde_indices": [1, 2], **extra})
    engine = NativeEngine(model_dir, device="cpu", dtype=torch.bfloat16, adapter=adapter, max_sequence_length=16)
    sigmas = engine.sigma_schedule(32, 32, 4)
    reqs = [adapter.build_rollout_request("a red ball", group_index=0, slot=s, sample_id=f"p0:s{s}",
                                          sampling=sampling, sde_indices=[1, 2], sigmas=sigmas, generation_seed=5)
            for s in range(2)]
    batch = engine.generate(reqs).without_images()
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        cfg = make_cfg("lora", fsdp__fsdp_param_dtype="bf16", fsdp__fsdp_master_dtype="fp32",
                       fsdp__fsdp_activation_checkpointing=True)
        actor = Actor.from_adapter(adapter, model_dir, mesh, cfg, device=torch.device("cpu"))
        with torch.no_grad():
            replayed = make_replay_fn(adapter)(actor.model, batch)
        assert replayed.shape == batch.log_probs.shape
        gap = float((replayed.float() - batch.log_probs.float()).abs().max())
        assert gap == 0.0, f"{family}: bf16 replay is {gap:.3g} nats off the sampler"
    finally:
        next(gen, None)

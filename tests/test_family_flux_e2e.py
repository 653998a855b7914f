"""FLUX.1 end to end: the real training loop under torchrun (2 gloo processes) on the tiny FLUX
model. A LoRA run of 4 rollouts against one of 2 resumed for 2 more (weights, policy version, lr
step and the images sampled after the resume identical), its checkpoint exported both ways and
loaded back through diffusers (a merged FluxPipeline via DiffusionPipeline.from_pretrained; the
PEFT adapter via the pipeline's load_lora_weights) and through the engine (the sync's parity), and
a short full fine-tune run whose colour reward rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_e2e import _model_tensors, _state, _train, _write_prompts
from tests.workers.recipes import TINY_GEOMETRY

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

PROMPTS = ["a red ball", "a green cube", "a blue cup", "a yellow hat"]

#: 32x32, 4 steps, SDE steps 1 and 2 trained, FLUX.1-dev's embedded guidance
FLUX_SAMPLING = """
[sampling-config]
height = 32
width = 32
num_inference_steps = 4
guidance_scale = 3.5
eta = 1.0
sde_type = "sde"
sde_indices = [1, 2]
"""


def _recipe(tmp: Path, model_dir: Path) -> Path:
    train = _write_prompts(tmp / "train.jsonl", PROMPTS, "t")
    text = f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 2
generation-task = "t2i"
model-path = "{model_dir}"
model-adapter-path = "trainer.models.flux.FluxAdapter"
prompt-data = "{train}"
{TINY_GEOMETRY}
fsdp-trainable-mode = "lora"
lora-rank = 4
lora-alpha = 8
lora-adapter-mode = true
fsdp-master-dtype = "fp32"
eps-clip = 1e-3
lr = 1e-2
weight-decay = 0.0
reward-runtime = "cpu"
reward-scorer-path = "color"
save-interval = 1
artifact-retention-rollouts = 2
{FLUX_SAMPLING}"""
    path = tmp / "flux_lora.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def runs(tiny_flux_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_e2e")
    recipe = _recipe(tmp, tiny_flux_dir)
    a, b = tmp / "a", tmp / "b"
    _train(recipe, a, "--num-rollout", "4")
    _train(recipe, b, "--num-rollout", "2")
    log = _train(recipe, b, "--num-rollout", "4", "--load", str(b / "ckpt"))
    assert "continuing at rollout 2" in log
    return a, b


def test_lora_resume_is_exact(runs):
    a, b = runs
    ta, tb = _model_tensors(a / "ckpt", 3), _model_tensors(b / "ckpt", 3)
    assert ta and ta.keys() == tb.keys() and all("lora_" in n for n in ta)
    assert any(n.startswith("single_transformer_blocks.") for n in ta)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    sa, sb = _state(a / "ckpt", 3), _state(b / "ckpt", 3)
    for key in ("policy_version", "lr_scheduler_steps", "rollout_id"):
        assert sa[key] == sb[key], key
    assert sa["policy_version"] == 4 and sa["lr_scheduler_steps"] == 8
    contract = json.loads((a / "ckpt" / "t2i" / "iter_0000003" / "adapter_contract.json").read_text())
    assert contract["model_adapter_path"] == "trainer.models.flux.FluxAdapter"
    for rollout in (2, 3):
        da, db = (r / "artifacts" / "t2i" / f"rollout_{rollout:07d}" for r in (a, b))
        pngs = sorted(p.name for p in da.glob("*.png"))
        assert len(pngs) == 8 and pngs == sorted(p.name for p in db.glob("*.png"))
        for name in pngs:
            assert (da / name).read_bytes() == (db / name).read_bytes(), f"rollout {rollout} {name}"


def _fixed_input():
    from trainer.models.flux import guidance_tensor, latent_image_ids, text_ids

    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.9, 0.4]),
                guidance=guidance_tensor(3.5, 2), txt_ids=text_ids(8), img_ids=latent_image_ids(4, 4))


@torch.no_grad()
def _forward(model) -> torch.Tensor:
    return model.eval()(**_fixed_input(), return_dict=False)[0]


def test_export_round_trip_through_diffusers_and_the_engine(runs, tiny_flux_dir, tmp_path):
    """The trained adapter of iteration 3 three ways, all the same function: merged into a pipeline
    that DiffusionPipeline.from_pretrained loads (and that samples), the PEFT adapter through
    FluxPipeline.load_lora_weights, and the adapter synced into the native engine (sync parity:
    the engine then holds exactly the checkpoint's LoRA tensors)."""
    from diffusers import DiffusionPipeline, FluxPipeline

    from tools.export_checkpoint import export_checkpoint
    from trainer.engine.native import NativeEngine
    from trainer.models.flux import FluxAdapter

    a, _ = runs
    # no --model-adapter-path: the family comes from the checkpoint's contract
    merged = export_checkpoint(a / "ckpt", "t2i", 3, tmp_path / "merged", form="merged",
                               base_model_path=tiny_flux_dir, verify=True)
    adapter_info = export_checkpoint(a / "ckpt", "t2i", 3, tmp_path / "adapter", form="adapter", verify=True)
    assert merged["verify"]["lora_modules_checked"] > 0 and adapter_info["verify"]["peft_injection_checked"]

    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "merged"), local_files_only=True)
    assert isinstance(pipe, FluxPipeline)
    want = _forward(pipe.transformer)
    base = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True)
    assert (want - _forward(base.transformer)).abs().max() > 1e-4  # training moved the policy
    base.load_lora_weights(str(tmp_path / "adapter"))  # its default file: pytorch_lora_weights.safetensors
    torch.testing.assert_close(_forward(base.transformer), want, rtol=1e-5, atol=1e-5)
    image = pipe("a red ball", height=32, width=32, num_inference_steps=2, max_sequence_length=8,
                 output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()

    engine = NativeEngine(str(tiny_flux_dir), device="cpu", dtype=torch.float32, adapter=FluxAdapter())
    cfg = engine.load_lora_dir(tmp_path / "adapter")
    assert (cfg["rank"], cfg["alpha"]) == (4, 8.0)
    torch.testing.assert_close(_forward(engine.transformer), want, rtol=1e-5, atol=1e-5)
    ckpt = _model_tensors(a / "ckpt", 3)
    params = dict(engine.transformer.named_parameters())
    lora = {n.replace(".default", ""): p for n, p in params.items() if ".lora_" in n}
    assert lora.keys() == {n.replace(".default", "") for n in ckpt}
    for n, t in ckpt.items():
        assert torch.equal(lora[n.replace(".default", "")].detach(), t.float()), n


def test_tiny_flux_learns_the_colour_reward(tiny_flux_dir, tmp_path):
    """`bash run.sh train` of the tiny FLUX model (the loop under torchrun, 2 processes): a few
    rollouts of a full fine-tune against the colour reward raise it."""
    from tools.tiny_flux import build_tiny_flux_pipeline
    from trainer.metrics import read_scalars

    model = build_tiny_flux_pipeline(tmp_path / "model", seed=0, vae_output_gain=8.0)
    train = _write_prompts(tmp_path / "train.jsonl", ["a red ball"], "t")
    recipe = tmp_path / "learn.toml"
    recipe.write_text(f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 2
generation-task = "t2i"
model-path = "{model}"
model-adapter-path = "trainer.models.flux.FluxAdapter"
prompt-data = "{train}"
rollout-batch-size = 1
n-samples-per-prompt = 16
micro-batch-size = 4
num-updates-per-batch = 2
fsdp-trainable-mode = "full"
fsdp-param-dtype = "fp32"
fsdp-reduce-dtype = "fp32"
weight-sync-wire-dtype = "fp32"
eps-clip = 0.2
lr = 2e-2
weight-decay = 0.0
clip-grad = 10.0
reward-runtime = "cpu"
reward-scorer-path = "color"
save-interval = 100
{FLUX_SAMPLING.replace('sde_type = "sde"', 'sde_type = "dance"').replace('sde_indices = [1, 2]', 'sde_indices = [0, 1, 2, 3]')}""")
    _train(recipe, tmp_path / "run", "--num-rollout", "10", timeout=600)
    rewards = [v for _, v in read_scalars(tmp_path / "run" / "tb")["reward/color_mean"]]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.01, rewards

"""What the families' end-to-end tests share: a tiny LoRA recipe for the real loop under
torchrun (2 gloo processes, the colour reward, a high learning rate and a wide clip so a few
rollouts move the reward), the long run plus a run resumed from its first checkpoint, the
resume-identity checks and the reward's rise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from tests.test_e2e import _model_tensors, _train, _write_prompts, assert_resume_is_exact


def lora_recipe(tmp: Path, model_dir: Path, adapter_path: str, *, candidates: int, rollouts: int, lr: float,
                sampling: str, name: str) -> Path:
    """A LoRA recipe file (rank 4, fp32 everywhere, a checkpoint every rollout) for one prompt,
    "a red ball", with `candidates` candidates; `sampling` is its [sampling-config] table."""
    train = _write_prompts(tmp / "train.jsonl", ["a red ball"], "t")
    text = f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 2
generation-task = "t2i"
model-path = "{model_dir}"
model-adapter-path = "{adapter_path}"
prompt-data = "{train}"
rollout-batch-size = 1
n-samples-per-prompt = {candidates}
micro-batch-size = 2
num-updates-per-batch = 2
fsdp-param-dtype = "fp32"
fsdp-reduce-dtype = "fp32"
weight-sync-wire-dtype = "fp32"
fsdp-trainable-mode = "lora"
lora-rank = 4
lora-alpha = 8
lora-adapter-mode = true
fsdp-master-dtype = "fp32"
eps-clip = 0.2
lr = {lr}
weight-decay = 0.0
clip-grad = 10.0
reward-runtime = "cpu"
reward-scorer-path = "color"
save-interval = 1
artifact-retention-rollouts = {rollouts}
{sampling}"""
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


#: the shipped tiny editing recipe (i2i, LoRA, the colour-edit reward, 16 x 16, true CFG 4)
EDIT_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu_edit.toml"


def write_edit_records(d: Path, n: int = 1) -> Path:
    """A prompt file of `n` i2i records "<image> make the square red", each on its own
    blue-square source under d/media/."""
    from PIL import Image

    (d / "media").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        im = Image.new("RGB", (16, 16), (235, 235, 235))
        im.paste(Image.new("RGB", (8, 8), (30, 40 + 10 * i, 220)), (4, 4))
        im.save(d / "media" / f"src{i}.png")
        lines.append(json.dumps({"prompt": "<image> make the square red", "images": [f"media/src{i}.png"],
                                 "metadata": {"task": "i2i", "sample_id": f"e{i}"}}))
    path = d / "edit.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def edit_recipe(tmp: Path, model_dir: Path, train: Path, **keys: str) -> Path:
    """configs/tiny_cpu_edit.toml with its model-path and prompt-data pointed at `model_dir` and
    `train`, and each `keys` entry (a top-level key, "_" for "-", or a [sampling-config] key)
    replaced by the given TOML value; a value None drops the line."""
    text = EDIT_RECIPE.read_text()
    values = {"model-path": json.dumps(str(model_dir)), "prompt-data": json.dumps(str(train)),
              **{k.replace("_", "-") if k.replace("_", "-") in text else k: v for k, v in keys.items()}}
    for key, value in values.items():
        text, n = re.subn(rf"^{re.escape(key)} = .*$\n?", "" if value is None else f"{key} = {value}\n", text,
                          flags=re.M)
        assert n == 1, key
    path = tmp / "tiny_cpu_edit.toml"
    path.write_text(text)
    return path


def train_and_resume(recipe: Path, tmp: Path, rollouts: int) -> tuple[Path, Path]:
    """(a, b): `rollouts` rollouts uninterrupted, and a run resumed from a's first checkpoint
    for rollout 1 (what a run stopped after rollout 0 would load)."""
    a, b = tmp / "a", tmp / "b"
    _train(recipe, a, "--num-rollout", str(rollouts))
    log = _train(recipe, b, "--num-rollout", "2", "--load", str(a / "ckpt"), "--ckpt-step", "0")
    assert "continuing at rollout 1" in log
    return a, b


def assert_lora_resume_is_exact(a: Path, b: Path, adapter_path: str, candidates: int, *, task: str = "t2i",
                                media: str = "*.png") -> dict[str, torch.Tensor]:
    """Iteration 1 of the uninterrupted run and of the resumed one: the same checkpoint tensors
    (some LoRA tensor trained by rollout 1), policy version 2 and lr step 4, the family's adapter
    in the contract, and byte-identical images in the rollout after the resume. Returns a's
    iteration-1 tensors for the family's own checks."""
    ta = assert_resume_is_exact(a, b, 1, (1,), candidates, policy_version=2, lr_steps=4, task=task, media=media)
    assert any("lora_" in n for n in ta)
    t0 = _model_tensors(a / "ckpt", 0, task=task)
    assert any(not torch.equal(t, t0[n]) for n, t in ta.items() if "lora_" in n), "rollout 1 trained"
    assert not (b / "ckpt" / task / "iter_0000000").exists()  # b started from a's iteration 0
    contract = json.loads((a / "ckpt" / task / "iter_0000001" / "adapter_contract.json").read_text())
    assert contract["model_adapter_path"] == adapter_path
    return ta


def color_rewards(run: Path, rollouts: int) -> list[float]:
    """The run's per-rollout colour reward (the loop's TensorBoard series), one per rollout."""
    from trainer.metrics import read_scalars

    rewards = [v for _, v in read_scalars(run / "tb")["reward/color_mean"]]
    assert len(rewards) == rollouts
    return rewards


def assert_export_round_trip(run: Path, model_dir: Path, out: Path, iteration: int, pipeline_cls, adapter,
                             fixed_input, sample, task: str = "t2i", load_kwargs=None) -> None:
    """Checkpoint `iteration` of `run` exported both ways and loaded three ways, all the same
    function (the transformer's output on the keyword arguments `fixed_input()` returns, the
    same ones at every call): the merged pipeline through
    DiffusionPipeline.from_pretrained (a `pipeline_cls`, which `sample(pipe)` samples: finite
    images), the PEFT adapter through the base pipeline's load_lora_weights, and the adapter
    loaded into the native engine with `adapter`, which then holds exactly the checkpoint's LoRA
    tensors. The family comes from the checkpoint's contract (no --model-adapter-path).
    `load_kwargs(path)`: extra from_pretrained keyword arguments for a pipeline directory (a
    component given in place of the one model_index.json names)."""
    from diffusers import DiffusionPipeline

    from tools.export_checkpoint import export_checkpoint
    from trainer.engine.native import NativeEngine

    @torch.no_grad()
    def forward(model) -> torch.Tensor:
        return model.eval()(**fixed_input(), return_dict=False)[0]

    extra = load_kwargs or (lambda path: {})
    merged = export_checkpoint(run / "ckpt", task, iteration, out / "merged", form="merged",
                               base_model_path=model_dir, verify=True)
    adapter_info = export_checkpoint(run / "ckpt", task, iteration, out / "adapter", form="adapter", verify=True)
    assert merged["verify"]["lora_modules_checked"] > 0 and adapter_info["verify"]["peft_injection_checked"]

    pipe = DiffusionPipeline.from_pretrained(str(out / "merged"), local_files_only=True, **extra(out / "merged"))
    assert isinstance(pipe, pipeline_cls)
    want = forward(pipe.transformer)
    base = pipeline_cls.from_pretrained(str(model_dir), local_files_only=True, **extra(model_dir))
    assert (want - forward(base.transformer)).abs().max() > 1e-4  # training moved the policy
    base.load_lora_weights(str(out / "adapter"))  # its default file: pytorch_lora_weights.safetensors
    torch.testing.assert_close(forward(base.transformer), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(sample(pipe)).all()

    engine = NativeEngine(str(model_dir), device="cpu", dtype=torch.float32, adapter=adapter)
    cfg = engine.load_lora_dir(out / "adapter")
    assert (cfg["rank"], cfg["alpha"]) == (4, 8.0)
    torch.testing.assert_close(forward(engine.transformer), want, rtol=1e-5, atol=1e-5)
    ckpt = {n: t for n, t in _model_tensors(run / "ckpt", iteration, task=task).items() if "lora_" in n}
    params = dict(engine.transformer.named_parameters())
    lora = {n.replace(".default", ""): p for n, p in params.items() if ".lora_" in n}
    assert lora.keys() == {n.replace(".default", "") for n in ckpt}
    for n, t in ckpt.items():
        assert torch.equal(lora[n.replace(".default", "")].detach(), t.float()), n

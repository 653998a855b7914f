"""tools/export_checkpoint.py: real checkpoints of the tiny model, exported and loaded back.

The checkpoints are made the way training makes them, in ONE torchrun launch of this file
(2 ranks, gloo, CPU; see `make_checkpoints` at the bottom): the FSDP2 actor is built from the
tiny pipeline directory through the Qwen-Image adapter, takes one FlowGRPO update so its weights
differ from the base, and is saved with trainer.checkpoint.save_checkpoint, so every tensor is
sharded over two DCP files. The reference output is the trained (sharded) actor's own forward on
a fixed input; every export must reproduce it after loading with diffusers / peft / the engine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.tiny import LATENT_HW, LORA_TARGETS, TEXT_LEN, make_batch, make_cfg, replay
from tools import export_checkpoint as ex
from trainer import checkpoint as ck

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
RANK, ALPHA = 4, 8  # alpha != rank, so a wrong merge scale shows


def fixed_input():
    g = torch.Generator().manual_seed(123)
    return dict(hidden_states=torch.randn(2, LATENT_HW * LATENT_HW, 16, generator=g),
                encoder_hidden_states=torch.randn(2, TEXT_LEN, 16, generator=g),
                encoder_hidden_states_mask=torch.ones(2, TEXT_LEN, dtype=torch.long),
                timestep=torch.tensor([0.9, 0.4]),
                img_shapes=[(1, LATENT_HW, LATENT_HW)] * 2)


@torch.no_grad()
def forward(model) -> torch.Tensor:
    return model(**fixed_input(), return_dict=False)[0].detach().clone()


def base_transformer(model_dir):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(str(model_dir), subfolder="transformer").eval()


def train_and_save(mesh, model_dir, save_dir, mode):
    """One update of the real actor on the tiny model, then a real checkpoint (iteration 1).
    Returns the trained model's output on the fixed input."""
    from trainer.actor import Actor
    from trainer.models.qwen_image import QwenImageAdapter

    cfg = make_cfg(mode, fsdp__fsdp_activation_checkpointing=True)
    cfg.lora.lora_rank, cfg.lora.lora_alpha = (RANK, ALPHA) if mode == "lora" else (0, ALPHA)
    actor = Actor.from_adapter(QwenImageAdapter(), str(model_dir), mesh, cfg, device=torch.device("cpu"))
    actor.train_step(make_batch(4, seed=3), ADV, replay)
    contract = {"mode": mode, "task": "t2i", "base_model_path": str(model_dir), "base_model_hash": "tiny",
                "lora_rank": RANK if mode == "lora" else 0, "lora_alpha": ALPHA, "lora_dropout": 0.0,
                "lora_target_modules": list(LORA_TARGETS) if mode == "lora" else []}
    assert ck.save_checkpoint(save_dir, "t2i", 1, model=actor.model, optimizer=actor.optimizer,
                              trainer_state={"rollout_id": 1, "policy_version": 1}, weight_sync_manifest={},
                              adapter_contract=contract, trainable_only=(mode == "lora"))
    if mode == "full":  # the same weights again, stored the way a LoRA run stores them: trainable only
        assert ck.save_checkpoint(save_dir, "t2i", 2, model=actor.model, optimizer=actor.optimizer,
                                  trainer_state={"rollout_id": 2, "policy_version": 1}, weight_sync_manifest={},
                                  adapter_contract=contract, trainable_only=True)
    actor.model.eval()
    return forward(actor.model), sorted(actor.never_trained)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    from tests.workers.launch import torchrun

    root = tmp_path_factory.mktemp("export_ckpts")
    torchrun("tests/test_export.py", nproc=2, args=["--make-checkpoints", str(root), str(tiny_model_dir)])
    out = torch.load(root / "refs.pt")
    out["base"] = forward(base_transformer(tiny_model_dir))
    for mode in ("full", "lora"):
        out[mode + "_save"] = root / mode
        # the update moved the policy well beyond the comparison tolerance
        assert (out[mode] - out["base"]).abs().max() > 1e-3
        # both ranks wrote shards: the export has to reassemble every tensor
        assert len(list((root / mode / "t2i" / "iter_0000001" / "fsdp").glob("*.distcp"))) == 2
    return out


def export(trained, mode, out, **kw):
    return ex.export_checkpoint(trained[mode + "_save"], "t2i", 1, out, **kw)


def assert_reproduces(got, trained, mode):
    torch.testing.assert_close(got, trained[mode], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- round trips

def test_full_merged_export_loads_as_a_pipeline_and_reproduces(trained, tiny_model_dir, tmp_path):
    from diffusers import QwenImagePipeline

    # no --base-model-path: a full fine-tune falls back to the base recorded in the contract
    info = export(trained, "full", tmp_path / "merged", form="merged", verify=True)
    assert info["verify"]["tensors"] == 77 and info["transformer"]["weights_from_base"] == []
    pipe = QwenImagePipeline.from_pretrained(str(tmp_path / "merged"))
    assert_reproduces(forward(pipe.transformer.eval()), trained, "full")
    saved = json.loads((tmp_path / "merged" / "export_info.json").read_text())
    assert saved["mode"] == "full" and saved["iteration"] == 1 and saved["policy_version"] == 1
    # the other components are the base's, byte for byte
    for rel in ("model_index.json", "vae/config.json", "scheduler/scheduler_config.json"):
        assert (tmp_path / "merged" / rel).read_bytes() == (tiny_model_dir / rel).read_bytes()
    assert not (tmp_path / "merged" / "vae").is_symlink()


def test_full_checkpoint_of_trainable_weights_takes_the_frozen_ones_from_the_base(trained, tiny_model_dir,
                                                                                  tmp_path):
    from diffusers import QwenImageTransformer2DModel

    info = ex.export_checkpoint(trained["full_save"], "t2i", 2, tmp_path / "m", form="merged",
                                base_model_path=tiny_model_dir, verify=True)
    assert info["transformer"]["weights_from_base"] == trained["full_never_trained"] != []
    model = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "m"), subfolder="transformer")
    assert_reproduces(forward(model.eval()), trained, "full")

    # a gap that is not a frozen weight is a damaged checkpoint, not something to fill from the base
    ckpt = ex.load_checkpoint(trained["full_save"], "t2i", 2)
    del ckpt.tensors._raw_key["img_in.weight"]
    with pytest.raises(ex.ExportError, match=r"lacks 1 trained transformer weights .*img_in.weight"):
        ex.write_merged_transformer(ckpt, tiny_model_dir, tmp_path / "t", lora=None, dtype=None)


def test_lora_merged_export_folds_the_adapter_and_reproduces(trained, tiny_model_dir, tmp_path):
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import load_file

    info = export(trained, "lora", tmp_path / "merged", form="merged", base_model_path=tiny_model_dir,
                  verify=True, components="symlink")
    # 2 blocks x 8 targets, minus the last block's never-trained text-output modules
    assert info["verify"]["lora_modules_checked"] == 14 and info["lora"]["scaling"] == ALPHA / RANK
    sd = load_file(str(tmp_path / "merged" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert not [k for k in sd if "lora" in k or "base_layer" in k]
    model = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "merged"), subfolder="transformer")
    assert_reproduces(forward(model.eval()), trained, "lora")
    assert (tmp_path / "merged" / "vae").is_symlink()


def test_adapter_export_loads_with_peft_and_diffusers_and_reproduces(trained, tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel

    info = export(trained, "lora", tmp_path / "adapter", form="adapter", verify=True)
    # the contract's base path is found, so peft's injection into the base was checked too
    assert info["verify"]["peft_injection_checked"] and info["adapter"]["tensors"] == 28
    cfg = LoraConfig.from_pretrained(str(tmp_path / "adapter"))
    assert (cfg.r, cfg.lora_alpha) == (RANK, ALPHA)

    peft_model = PeftModel.from_pretrained(base_transformer(tiny_model_dir), str(tmp_path / "adapter"))
    assert_reproduces(forward(peft_model.eval()), trained, "lora")

    transformer = base_transformer(tiny_model_dir)
    transformer.load_lora_adapter(str(tmp_path / "adapter"), weight_name="adapter_model.safetensors",
                                  prefix="base_model.model")
    assert_reproduces(forward(transformer.eval()), trained, "lora")


def test_adapter_export_loads_into_the_native_engine(trained, tiny_model_dir, tmp_path):
    """tools/sample.py --lora goes through NativeEngine.load_lora_dir, which injects exactly the
    adapter's target_modules and requires a tensor for every LoRA layer it made."""
    from trainer.engine.native import NativeEngine

    export(trained, "lora", tmp_path / "adapter", form="adapter")
    engine = NativeEngine(tiny_model_dir, device="cpu", dtype=torch.float32)
    cfg = engine.load_lora_dir(tmp_path / "adapter")
    assert (cfg["rank"], cfg["alpha"]) == (RANK, ALPHA)
    assert_reproduces(forward(engine.transformer.eval()), trained, "lora")


def test_bf16_merged_export_keeps_the_dtype_asked_for(trained, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    export(trained, "lora", tmp_path / "m16", form="merged", base_model_path=tiny_model_dir, verify=True,
           dtype="bf16", components="hardlink")
    sd = load_file(str(tmp_path / "m16" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    # hard links share the inode with the base
    linked, original = tmp_path / "m16" / "vae" / "config.json", tiny_model_dir / "vae" / "config.json"
    assert os.stat(linked).st_ino == os.stat(original).st_ino


# ---------------------------------------------------------------- refusals and errors

def test_lora_merged_takes_the_recorded_base_and_says_so(trained, tiny_model_dir, tmp_path, capsys):
    """No --base-model-path: the base the checkpoint records; the output names where it came from."""
    rc = ex.main(["--save-dir", str(trained["lora_save"]), "--output-dir", str(tmp_path / "m"), "--form", "merged",
                  "--verify"])
    out = capsys.readouterr().out
    contract = trained["lora_save"] / "t2i" / "iter_0000001" / "adapter_contract.json"
    assert rc == 0 and f"base model {tiny_model_dir.resolve()}: as recorded in {contract}" in out
    info = json.loads((tmp_path / "m" / "export_info.json").read_text())
    assert info["base_model_path_from"] == str(contract) and info["verify"]["lora_modules_changed"] == 14
    assert_reproduces(forward(base_transformer(tmp_path / "m")), trained, "lora")


def test_lora_merged_without_a_usable_base_is_refused_with_the_reason(trained, tmp_path):
    save, d = copy_save(trained, "lora", tmp_path)
    contract = json.loads((d / "adapter_contract.json").read_text())
    contract["base_model_path"] = str(tmp_path / "moved")
    (d / "adapter_contract.json").write_text(json.dumps(contract))
    with pytest.raises(ex.ExportError, match=r"needs --base-model-path: .*nothing to fold it into.*moved\?"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "out", form="merged")
    del contract["base_model_path"]
    (d / "adapter_contract.json").write_text(json.dumps(contract))
    with pytest.raises(ex.ExportError, match="needs --base-model-path.*nothing to fold it into.*records "
                                             "base_model_path"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "out", form="merged")
    assert [p.name for p in tmp_path.iterdir()] == ["save"]


def test_export_files_follow_the_umask_and_are_synced_before_the_rename(trained, tmp_path, monkeypatch):
    synced = []
    real = ex.fsync_tree

    def record(root):
        synced.append((Path(root), sorted(p.name for p in Path(root).iterdir())))
        return real(root)

    monkeypatch.setattr(ex, "fsync_tree", record)
    old = os.umask(0o022)
    try:
        export(trained, "lora", tmp_path / "a", form="adapter")
    finally:
        os.umask(old)
    [(staging, names)] = synced
    assert staging.parent == tmp_path and staging.name.startswith(".a.partial-") and not staging.exists()
    assert names == sorted(p.name for p in (tmp_path / "a").iterdir())  # everything was there when synced
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [tmp_path / "a", *(tmp_path / "a").iterdir()]}
    assert set(modes.values()) == {"0o644", "0o755"} and modes["a"] == "0o755", modes


def test_full_checkpoint_has_no_adapter_form(trained, tmp_path):
    with pytest.raises(ex.ExportError, match="--form adapter needs a LoRA checkpoint"):
        export(trained, "full", tmp_path / "out", form="adapter")


def test_non_empty_output_dir_is_refused(trained, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ex.ExportError, match="not an empty directory; refusing"):
        export(trained, "lora", tmp_path / "out", form="adapter")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def copy_save(trained, mode, tmp_path):
    dst = tmp_path / "save"
    shutil.copytree(trained[mode + "_save"], dst)
    return dst, dst / "t2i" / "iter_0000001"


def test_missing_uncommitted_and_corrupt_checkpoints_name_the_directory(trained, tmp_path):
    save, d = copy_save(trained, "lora", tmp_path)
    with pytest.raises(ex.ExportError, match=r"iter_0000007 does not exist; committed iterations .*\[1\]"):
        ex.export_checkpoint(save, "t2i", 7, tmp_path / "o1", form="adapter")
    with pytest.raises(ex.ExportError, match="has no t2i2/ directory"):
        ex.export_checkpoint(save, "t2i2", 1, tmp_path / "o1", form="adapter")

    shard = sorted((d / "fsdp").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    with pytest.raises(ex.ExportError, match=f"reading the DCP shards in {d / 'fsdp'} failed"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "o2", form="adapter")

    (d / "COMMITTED").unlink()
    with pytest.raises(ex.ExportError, match=f"{d} has no COMMITTED marker"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "o3", form="adapter")
    assert not [p for p in tmp_path.iterdir() if p.name != "save"]  # nothing half-written left behind


def test_contract_without_alpha_is_refused(trained, tmp_path):
    save, d = copy_save(trained, "lora", tmp_path)
    contract = json.loads((d / "adapter_contract.json").read_text())
    del contract["lora_alpha"]
    (d / "adapter_contract.json").write_text(json.dumps(contract))
    with pytest.raises(ex.ExportError, match="no lora_alpha"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "o", form="adapter")


def test_contract_with_a_nan_or_infinite_alpha_is_refused(trained, tmp_path, capsys):
    """flowgrpo-export of a contract whose lora_alpha is NaN or Infinity (NaN weights with exit 0
    before): exit 2 naming the contract and the field, nothing written."""
    save, d = copy_save(trained, "lora", tmp_path)
    contract = json.loads((d / "adapter_contract.json").read_text())
    for alpha, shown in ((float("nan"), "NaN"), (float("inf"), "Infinity"), (0, "0")):
        (d / "adapter_contract.json").write_text(json.dumps({**contract, "lora_alpha": alpha}))
        for form in ("adapter", "merged"):
            out = tmp_path / f"o-{form}"
            assert ex.main(["--save-dir", str(save), "--output-dir", str(out), "--form", form]) == 2
            err = capsys.readouterr().err
            assert f"lora_alpha is {shown}: it must be a finite number > 0" in err and "adapter_contract.json" in err, err
            assert not out.exists()


def test_wrong_base_model_is_refused(trained, tmp_path):
    from tools.make_tiny_model import build_tiny_pipeline
    from diffusers import QwenImageTransformer2DModel

    other = build_tiny_pipeline(tmp_path / "other")
    # a transformer of another width: the LoRA pairs do not fit its weights
    small = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=3, joint_attention_dim=16,
                                        axes_dims_rope=(4, 2, 2))
    shutil.rmtree(other / "transformer")
    small.save_pretrained(str(other / "transformer"))
    with pytest.raises(ex.ExportError, match="wrong --base-model-path"):
        export(trained, "lora", tmp_path / "o", form="merged", base_model_path=other)


def test_incomplete_base_is_named_as_the_base_not_as_the_checkpoint(trained, tiny_model_dir, tmp_path):
    """The base's JSON files are reported as --base-model-path problems (a checkpoint's own
    sidecars say the checkpoint is damaged)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "transformer" / "config.json").unlink()
    with pytest.raises(ex.ExportError, match=r"config.json is missing: --base-model-path .* is not a complete"):
        export(trained, "lora", tmp_path / "a", form="adapter", base_model_path=base, verify=True)
    save, d = copy_save(trained, "lora", tmp_path)
    (d / "trainer_state.json").write_text("{")
    with pytest.raises(ex.ExportError, match=r"trainer_state.json is not valid JSON .*: the checkpoint is damaged"):
        ex.export_checkpoint(save, "t2i", 1, tmp_path / "b", form="adapter")


# ---------------------------------------------------------------- --verify is not vacuous

def test_verify_catches_a_tampered_merged_export(trained, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    export(trained, "lora", tmp_path / "m", form="merged", base_model_path=tiny_model_dir)
    f = tmp_path / "m" / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    ckpt = ex.load_checkpoint(trained["lora_save"], "t2i", 1)
    lora = ex.lora_settings(ckpt)
    assert ex.verify_merged(tmp_path / "m", ckpt, tiny_model_dir, lora)["lora_modules_changed"] == 14

    # the adapter left unfolded in one weight (what a merge with the wrong name would do)
    name = "transformer_blocks.0.attn.to_q.weight"
    save_file({**sd, name: load_file(str(tiny_model_dir / "transformer" / f.name))[name]}, str(f))
    with pytest.raises(ex.ExportError, match="to_q.weight: value differs"):
        ex.verify_merged(tmp_path / "m", ckpt, tiny_model_dir, lora)
    # adapter tensors smuggled into a merged transformer
    save_file({**sd, "transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(RANK, 48)}, str(f))
    with pytest.raises(ex.ExportError, match="adapter tensors in a merged export"):
        ex.verify_merged(tmp_path / "m", ckpt, tiny_model_dir, lora)
    # a wrong alpha gives a wrong scale
    with pytest.raises(ex.ExportError, match="differs from W"):
        save_file(sd, str(f))
        ex.verify_merged(tmp_path / "m", ckpt, tiny_model_dir, ex.LoraSettings(RANK, ALPHA * 2, ()))


def test_verify_catches_a_tampered_adapter(trained, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    export(trained, "lora", tmp_path / "a", form="adapter")
    ckpt = ex.load_checkpoint(trained["lora_save"], "t2i", 1)
    lora = ex.lora_settings(ckpt)
    f = tmp_path / "a" / "adapter_model.safetensors"
    sd = load_file(str(f))
    key = "base_model.model.transformer_blocks.0.attn.to_k.lora_B.weight"
    save_file({**sd, key: sd[key] * 1.5}, str(f))
    with pytest.raises(ex.ExportError, match="to_k.lora_B.weight: shape or value differs"):
        ex.verify_adapter(tmp_path / "a", ckpt, lora, tiny_model_dir)
    save_file({k: v for k, v in sd.items() if "to_v" not in k}, str(f))
    with pytest.raises(ex.ExportError, match="names differ from the checkpoint"):
        ex.verify_adapter(tmp_path / "a", ckpt, lora, tiny_model_dir)


# ---------------------------------------------------------------- pieces

def test_merge_formula_matches_peft_merge():
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(6, 5))
    base_w = lin[0].weight.detach().clone()
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=6, target_modules=["0"]), lin)
    with torch.no_grad():
        lin[0].lora_B["default"].weight.normal_()
    a, b = lin[0].lora_A["default"].weight.detach(), lin[0].lora_B["default"].weight.detach()
    lin[0].merge()
    ours = ex.merge_lora_weight(base_w, a, b, 6 / 2)
    torch.testing.assert_close(ours, lin[0].base_layer.weight.detach(), rtol=0, atol=1e-6)
    assert ex.merge_lora_weight(base_w.bfloat16(), a, b, 3.0).dtype == torch.bfloat16


def test_cli_exports_and_reports_errors(trained, tmp_path, capsys):
    rc = ex.main(["--save-dir", str(trained["lora_save"]), "--task", "t2i", "--output-dir", str(tmp_path / "a"),
                  "--form", "adapter", "--verify"])  # --iteration omitted: the newest committed one
    assert rc == 0 and "(verified)" in capsys.readouterr().out
    assert json.loads((tmp_path / "a" / "export_info.json").read_text())["iteration"] == 1
    rc = ex.main(["--save-dir", str(trained["lora_save"]), "--iteration", "7", "--output-dir", str(tmp_path / "b"),
                  "--form", "merged"])
    assert rc == 2 and "iter_0000007 does not exist" in capsys.readouterr().err


def test_sharded_base_keeps_its_shard_layout(trained, tiny_model_dir, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    base = tmp_path / "sharded_base"
    shutil.copytree(tiny_model_dir, base)
    shutil.rmtree(base / "transformer")
    base_transformer(tiny_model_dir).save_pretrained(str(base / "transformer"), max_shard_size="200KB")
    shards = sorted(p.name for p in (base / "transformer").glob("*.safetensors"))
    assert len(shards) > 2

    export(trained, "lora", tmp_path / "m", form="merged", base_model_path=base, verify=True)
    tdir = tmp_path / "m" / "transformer"
    assert sorted(p.name for p in tdir.glob("*.safetensors")) == shards
    index = json.loads((tdir / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads(
        (base / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    model = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "m"), subfolder="transformer")
    assert_reproduces(forward(model.eval()), trained, "lora")


# ---------------------------------------------------------------- the torchrun side

def make_checkpoints(root: str, model_dir: str) -> None:
    """Every rank: train and save a full and a LoRA checkpoint; rank 0 saves the reference outputs."""
    import torch.distributed as dist
    from pathlib import Path

    from trainer.distributed import build_mesh, init_distributed, shutdown_and_exit

    init_distributed("cpu")
    mesh = build_mesh("cpu")
    refs = {}
    for mode in ("full", "lora"):
        refs[mode], refs[mode + "_never_trained"] = train_and_save(mesh, model_dir, Path(root) / mode, mode)
    if dist.get_rank() == 0:
        torch.save(refs, Path(root) / "refs.pt")
    shutdown_and_exit(0)


if __name__ == "__main__":
    import sys
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module.*returned a view tensor")
    if sys.argv[1:2] != ["--make-checkpoints"]:
        raise SystemExit("usage: torchrun --nproc-per-node 2 tests/test_export.py --make-checkpoints ROOT MODEL_DIR")
    make_checkpoints(sys.argv[2], sys.argv[3])

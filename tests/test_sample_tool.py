"""tools/sample.py: the user-facing sampler writes the rollout artifacts for a prompt file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import torch


ROOT = Path(__file__).resolve().parents[1]
SMALL = json.dumps({"height": 64, "width": 64, "num_inference_steps": 4, "eta": 0.7, "sde_indices": [1, 2]})


def write_prompts(path: Path) -> Path:
    lines = [{"prompt": p, "metadata": {"task": "t2i", "sample_id": f"demo_{i}"}}
             for i, p in enumerate(["a red panda in a teacup", "a lighthouse at dusk", "three green apples"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_must_show_command(tmp_path):
    """make_tiny_model + sample.py on 3 prompts x 4 samples -> 12 PNGs and 3 sidecars (as in
    the docs, plus a small --sampling-config to keep the test fast on 2 shared cores)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    cmd = (f"{sys.executable} tools/make_tiny_model.py --output {tmp_path}/tiny && "
           f"{sys.executable} tools/sample.py --model-path {tmp_path}/tiny --prompt-data {prompts} "
           f"--output {tmp_path}/out --n-samples-per-prompt 4 --sampling-config '{SMALL}'")
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    d = tmp_path / "out" / "t2i" / "rollout_0000000"
    pngs = sorted(d.glob("*.png"))
    sidecars = sorted(d.glob("*.safetensors"))
    assert len(pngs) == 12 and len(sidecars) == 3
    assert "wrote 12 PNGs and 3 sidecars" in proc.stdout
    from PIL import Image

    assert Image.open(pngs[0]).size == (64, 64)
    from trainer.artifacts import read_sidecar

    tensors, meta = read_sidecar(sidecars[0])
    assert json.loads(meta["sample_ids"]) == [f"prompt:demo_0:sample:{s}" for s in range(4)]
    assert tensors["tracks.latents"].shape[:2] == (4, 2)


def _lora_dir(model_dir: Path, out: Path) -> Path:
    """A PEFT adapter directory with nonzero B, written the way peft saves one."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    from trainer.models.qwen_image import QwenImageAdapter

    adapter = QwenImageAdapter()
    model = adapter.load_train_model(str(model_dir), dtype=torch.float32)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter.lora_target_modules)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    state = {f"base_model.model.{k}": v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
    out.mkdir(parents=True)
    save_file(state, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(adapter.lora_target_modules)}))
    return out


def test_lora_changes_the_samples_and_output_is_never_overwritten(tmp_path, tiny_model_dir, capsys):
    from tools.sample import main

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    base = ["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--n-samples-per-prompt", "1",
            "--sampling-config", SMALL, "--max-batch-size", "3"]
    assert main(base + ["--output", str(tmp_path / "plain")]) == 0
    lora = _lora_dir(tiny_model_dir, tmp_path / "lora")
    assert main(base + ["--output", str(tmp_path / "lora_out"), "--lora", str(lora)]) == 0
    assert "loaded LoRA" in capsys.readouterr().out
    from PIL import Image

    name = "t2i/rollout_0000000/group_00000000_sample_0000.png"
    a = np.asarray(Image.open(tmp_path / "plain" / name), dtype=np.int16)
    b = np.asarray(Image.open(tmp_path / "lora_out" / name), dtype=np.int16)
    assert np.abs(a - b).max() > 0
    assert main(base + ["--output", str(tmp_path / "plain")]) == 2
    assert "already holds artifacts" in capsys.readouterr().err
    assert main(base + ["--output", str(tmp_path / "plain"), "--overwrite"]) == 0


def test_bad_inputs_fail_clearly(tmp_path, tiny_model_dir, capsys):
    """Each bad input: exit 2 and one line `flowgrpo-sample: error: ...` naming the flag or file."""
    from tools.sample import main

    def fails(argv: list[str], match: str) -> None:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own checks exit from parse_args
            code = e.code
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # model loading may print progress before it
        assert code == 2 and last.startswith("flowgrpo-sample: error: ") and "Traceback" not in err, err
        assert re.search(match, last), last

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    base = ["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--output", str(tmp_path / "o")]
    fails(base + ["--sampling-config", json.dumps({"guidance_scale": 0.5, "sde_indices": [1]})], "guidance_scale")
    fails(base + ["--sampling-config", SMALL, "--lora", str(tmp_path / "missing")], "argument --lora: .*missing")
    # an adapter directory whose files are damaged: the error names the file
    broken = tmp_path / "broken_lora"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)], r"adapter_config.json: .*lora_alpha is missing")
    (broken / "adapter_config.json").write_text("{not json")
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)], r"adapter_config.json is not valid JSON")
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)],
          r"adapter_model.safetensors is not a readable safetensors file")
    fails(base + ["--sampling-config", SMALL, "--rollout-id", "-1"], "--rollout-id must be >= 0")
    # a missing model directory, or one that is not a pipeline, fails before anything loads
    fails(["--model-path", str(tmp_path / "nomodel")] + base[2:], "argument --model-path: .*nomodel does not exist")
    fails(["--model-path", str(tmp_path)] + base[2:], "--model-path .* has no model_index.json")


def _no_model_load(monkeypatch) -> None:
    """Fail the test if the tool gets as far as loading the model."""
    from trainer.engine import native

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(native.NativeEngine, "__init__", refuse)


def test_a_geometry_the_model_cannot_draw_is_refused_before_it_loads(tmp_path, tiny_sd3_model_dir, capsys,
                                                                     monkeypatch):
    """The tiny SD3 DiT's position table is 96 patches: its default 384 x 384 is named with the
    largest size and the configs it comes from, before any weights load."""
    from tools.sample import main

    _no_model_load(monkeypatch)
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    assert main(["--model-path", str(tiny_sd3_model_dir), "--prompt-data", str(prompts),
                 "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        "flowgrpo-sample: error: --sampling-config height 384 is more than --model-path "
        f"{tiny_sd3_model_dir} can draw: "
        "transformer/config.json's pos_embed_max_size 96 x patch_size 1 x vae/config.json's scale factor 2 allow at "
        "most 192 pixels; use height <= 192; --sampling-config width 384 is more than --model-path "
        f"{tiny_sd3_model_dir} can draw: transformer/config.json's pos_embed_max_size 96 x patch_size 1 x "
        "vae/config.json's scale factor 2 allow at most 192 pixels; use width <= 192")


def test_sampling_config_keys_merge_over_the_family_geometry(tmp_path, tiny_model_dir, capsys):
    """Keys without sde_indices keep the family's trained steps (they used to fail after the model
    loaded); --sampling-config.KEY sets one key."""
    from tools.sample import main
    from trainer.artifacts import read_sidecar

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    assert main(["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--output", str(tmp_path / "o"),
                 "--sampling-config", '{"height": 64, "width": 64, "num_inference_steps": 8}',
                 "--sampling-config.num_inference_steps", "6", "--sampling-config.width=32"]) == 0
    assert "trained steps [1, 3, 5]" in capsys.readouterr().out
    _, meta = read_sidecar(sorted((tmp_path / "o" / "t2i" / "rollout_0000000").glob("*.safetensors"))[0])
    recorded = json.loads(meta["sampling"])
    assert (recorded["height"], recorded["width"], recorded["num_inference_steps"], recorded["sde_indices"]) == \
        (64, 32, 6, [1, 3, 5])


def _lora_checkpoint(peft_dir: Path, save: Path, iteration: int = 3) -> Path:
    """A committed LoRA checkpoint iteration holding the PEFT adapter's tensors, in the trainer's
    layout (DCP "model.*" entries under peft's names, the contract with rank and alpha)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    it = save / "t2i" / f"iter_{iteration:07d}"
    (it / "fsdp").mkdir(parents=True)
    tensors = {k.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v
               for k, v in load_file(str(peft_dir / "adapter_model.safetensors")).items()}
    with warnings.catch_warnings():  # one process is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": tensors}, storage_writer=dcp.FileSystemWriter(str(it / "fsdp")), no_dist=True)
    (it / "adapter_contract.json").write_text(json.dumps({"mode": "lora", "lora_rank": 4, "lora_alpha": 8}))
    (it / "trainer_state.json").write_text(json.dumps({"rollout_id": iteration, "policy_version": iteration}))
    (it / "COMMITTED").write_text(f"{iteration}\n")
    return it


def test_lora_takes_a_checkpoint_and_refuses_anything_else_before_loading(tmp_path, tiny_model_dir, capsys,
                                                                         monkeypatch):
    """A LoRA run's checkpoint (its iteration, or its --save directory) samples exactly as the
    adapter exported from it; a directory that is neither is refused before the model loads,
    pointing at flowgrpo-export --form adapter."""
    from PIL import Image

    from tools.sample import main

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    base = ["--model-path", str(tiny_model_dir), "--prompt-data", str(prompts), "--sampling-config", SMALL]
    peft = _lora_dir(tiny_model_dir, tmp_path / "peft")
    it = _lora_checkpoint(peft, tmp_path / "save")
    outs = {}
    for name, lora in (("peft", peft), ("iteration", it), ("save", tmp_path / "save")):
        assert main(base + ["--output", str(tmp_path / name), "--lora", str(lora)]) == 0, capsys.readouterr().err
        assert f"loaded LoRA {lora} (rank 4, alpha 8" in capsys.readouterr().out
        outs[name] = [np.asarray(Image.open(f)) for f in sorted((tmp_path / name / "t2i" / "rollout_0000000").glob("*.png"))]
    assert len(outs["peft"]) == 3
    for name in ("iteration", "save"):  # the same adapter, so the same images
        assert all((a == b).all() for a, b in zip(outs["peft"], outs[name]))

    _no_model_load(monkeypatch)
    full = _lora_checkpoint(peft, tmp_path / "full_save", iteration=5)
    (full / "adapter_contract.json").write_text(json.dumps({"mode": "full"}))
    assert main(base + ["--output", str(tmp_path / "x"), "--lora", str(full)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (
        f"flowgrpo-sample: error: --lora {full} is a full fine-tune checkpoint, not a LoRA one: export it with "
        f"`flowgrpo-export --form merged --save-dir {tmp_path / 'full_save'} --iteration 5 --output-dir DIR` and pass "
        "DIR as --model-path")
    (tmp_path / "neither").mkdir()
    assert main(base + ["--output", str(tmp_path / "x"), "--lora", str(tmp_path / "neither")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"flowgrpo-sample: error: --lora {tmp_path / 'neither'} is neither a PEFT adapter directory")
    assert "flowgrpo-export --form adapter" in err[0]

"""tools/sample.py: the user-facing sampler writes the rollout artifacts for a prompt file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
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
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)], r"adapter_config.json has no r / lora_alpha")
    (broken / "adapter_config.json").write_text("{not json")
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)], r"adapter_config.json is not valid JSON")
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    fails(base + ["--sampling-config", SMALL, "--lora", str(broken)],
          r"adapter_model.safetensors is not a readable safetensors file")
    fails(base + ["--sampling-config", SMALL, "--rollout-id", "-1"], "--rollout-id must be >= 0")
    # a missing model directory, or one that is not a pipeline, fails before anything loads
    fails(["--model-path", str(tmp_path / "nomodel")] + base[2:], "argument --model-path: .*nomodel does not exist")
    fails(["--model-path", str(tmp_path)] + base[2:], "--model-path .* has no model_index.json")

"""Sidecars, PNGs, layout and retention (no model needed: synthetic responses)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from trainer import artifacts
from trainer.artifacts import ArtifactError
from trainer.models.qwen_image import QwenImageAdapter
from trainer.sampling import parse_sampling_config

SAMPLING = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                                  "sde_indices": [1, 2]})


def fake_group(group_index=3, k=3, s=2, seq=4, ch=16, t=5, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed + group_index)
    embeds = torch.randn(t, d, generator=g)
    out = []
    for slot in range(k):
        out.append({
            "prompt": f"prompt {group_index}",
            "metadata": {"task": "t2i", "sample_id": f"p{group_index}"},
            "sample_id": f"prompt:p{group_index}:sample:{slot}",
            "group_index": group_index,
            "slot": slot,
            "generation_seed": 1234,
            "image": torch.rand(3, 32, 32, generator=g),
            "trajectory_latents": torch.randn(s, seq, ch, generator=g).to(dtype),
            "trajectory_next_latents": torch.randn(s, seq, ch, generator=g).to(dtype),
            "sigmas": torch.tensor([0.9, 0.7]),
            "sigmas_next": torch.tensor([0.7, 0.5]),
            "timesteps": torch.tensor([900.0, 700.0]),
            "log_probs": torch.randn(s, generator=g),
            "sde_indices": [1, 2],
            "prompt_embeds": embeds,
            "prompt_embeds_mask": torch.ones(t, dtype=torch.int64),
            "height": 32,
            "width": 32,
            "vae_scale_factor": 8,
            "num_inference_steps": 4,
            "eta": 0.7,
            "sde_type": "sde",
            "sigma_max": 0.99,
            "policy_version": 5,
        })
    return out


def test_layout(tmp_path):
    assert artifacts.sidecar_path(tmp_path, "t2i", 12, 3) == tmp_path / "t2i" / "rollout_0000012" / "group_00000003.safetensors"
    assert artifacts.image_path(tmp_path, "t2i", 12, 3, 7) == \
        tmp_path / "t2i" / "rollout_0000012" / "group_00000003_sample_0007.png"
    assert artifacts.rollout_dir(tmp_path, "t2i", 4, eval=True) == tmp_path / "eval" / "t2i" / "rollout_0000004"


def test_sidecar_round_trip(tmp_path):
    group = fake_group()
    path = artifacts.write_group_sidecar(tmp_path / "group_00000003.safetensors", list(reversed(group)), task="t2i",
                                         rollout_id=9, sampling=SAMPLING, weight_manifest_hash="abc123")
    tensors, meta = artifacts.read_sidecar(path)
    assert meta["format"] == artifacts.SIDECAR_FORMAT and meta["task"] == "t2i"
    assert json.loads(meta["rollout_id"]) == 9 and meta["group_index"] == "3"
    assert meta["sampling_fingerprint"] == SAMPLING.fingerprint()
    assert json.loads(meta["weight_manifest_hash"]) == "abc123"
    manifests = json.loads(meta["candidates"])
    assert [m["slot"] for m in manifests] == [0, 1, 2]
    assert all(m["policy_version"] == 5 and m["sampling_fingerprint"] == SAMPLING.fingerprint()
               and m["weight_manifest_hash"] == "abc123" for m in manifests)
    assert tensors["tracks.latents"].dtype == torch.bfloat16 and tensors["tracks.latents"].shape == (3, 2, 4, 16)
    assert tensors["conditions.prompt_embeds"].shape == (5, 16)  # stored once per group
    back = artifacts.sidecar_to_responses(tensors, meta)
    for orig, got in zip(group, back):  # slot order restored
        for key in ("trajectory_latents", "trajectory_next_latents", "log_probs", "sigmas", "timesteps",
                    "prompt_embeds", "prompt_embeds_mask"):
            assert torch.equal(orig[key], got[key]), key
        for key in ("sample_id", "slot", "group_index", "height", "width", "sde_indices", "prompt", "policy_version"):
            assert orig[key] == got[key], key
    # the adapter packs the rebuilt candidates like the originals
    adapter = QwenImageAdapter()
    a, b = adapter.pack_trajectory(group), adapter.pack_trajectory(back)
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))


def test_failed_write_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    group = fake_group()
    target = tmp_path / "r" / "group_00000003.safetensors"

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    for name in ("fsync", "replace"):
        with monkeypatch.context() as m:
            m.setattr(artifacts.os, name, boom)
            with pytest.raises(OSError, match="simulated"):
                artifacts.write_group_sidecar(target, group, task="t2i", rollout_id=0, sampling=SAMPLING)
        assert not target.exists(), name
        assert list(target.parent.iterdir()) == [], name  # no .tmp left behind either

    # a crash that kills the process mid-write leaves only a .tmp, which nothing treats as a sidecar
    (target.parent / (target.name + ".tmp")).write_bytes(b"\x00" * 10)
    assert list(artifacts.iter_sidecars(target.parent)) == []
    with pytest.raises(ArtifactError, match=r"does not exist \(a \.tmp of it exists"):
        artifacts.read_sidecar(target)


def test_corrupt_sidecars_raise_naming_the_file(tmp_path):
    path = artifacts.write_group_sidecar(tmp_path / "group_00000000.safetensors", fake_group(0), task="t2i",
                                         rollout_id=0, sampling=SAMPLING)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    for bad in (truncated, garbage):
        with pytest.raises(ArtifactError, match=f"{bad}.*corrupt or partial"):
            artifacts.read_sidecar(bad)
    other = artifacts.write_sidecar(tmp_path / "other.safetensors", {"x": torch.zeros(2)}, {"format": "something"})
    with pytest.raises(ArtifactError, match="not a trajectory sidecar"):
        artifacts.read_sidecar(other)
    incomplete = artifacts.write_sidecar(tmp_path / "incomplete.safetensors", {"common.slots": torch.zeros(2)},
                                         {"format": artifacts.SIDECAR_FORMAT})
    with pytest.raises(ArtifactError, match="lacks"):
        artifacts.read_sidecar(incomplete)


def test_never_overwrites_silently(tmp_path):
    path = tmp_path / "group_00000001.safetensors"
    artifacts.write_group_sidecar(path, fake_group(1), task="t2i", rollout_id=0, sampling=SAMPLING)
    with pytest.raises(FileExistsError, match="never overwritten"):
        artifacts.write_group_sidecar(path, fake_group(1), task="t2i", rollout_id=0, sampling=SAMPLING)


def test_group_consistency_checks(tmp_path):
    group = fake_group()
    group[1]["prompt"] = "another prompt"
    with pytest.raises(ValueError, match="disagree"):
        artifacts.group_sidecar_payload(group, task="t2i", rollout_id=0, sampling=SAMPLING)
    group = fake_group()
    group[2]["slot"] = 0
    with pytest.raises(ValueError, match="duplicate slots"):
        artifacts.group_sidecar_payload(group, task="t2i", rollout_id=0, sampling=SAMPLING)


def test_png(tmp_path):
    from PIL import Image

    img = torch.rand(3, 8, 12)
    path = artifacts.write_png(tmp_path / "a.png", img)
    arr = torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1)
    assert arr.shape == (3, 8, 12)
    assert torch.equal(arr, (img * 255).round().to(torch.uint8))
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        artifacts.write_png(tmp_path / "b.png", torch.rand(8, 8))


def test_retention_keeps_exactly_n(tmp_path):
    (tmp_path / "t2i").mkdir()
    (tmp_path / "t2i" / "notes").mkdir()  # unrelated entries are never touched
    for k in range(6):
        d = artifacts.prepare_rollout_dir(tmp_path, "t2i", k)
        (d / "group_00000000.safetensors").write_bytes(b"x")
        artifacts.prune_stale_artifacts(tmp_path, "t2i", keep=2)
        kept = [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")]
        assert kept == list(range(max(0, k - 1), k + 1))
    assert (tmp_path / "t2i" / "notes").is_dir()
    # eval directories have their own retention, untouched by the training prune
    for k in (0, 10, 20):
        artifacts.prepare_rollout_dir(tmp_path, "t2i", k, eval=True)
    removed = artifacts.prune_stale_artifacts(tmp_path, "t2i", keep=1, eval=True)
    assert [p.name for p in removed] == ["rollout_0000000", "rollout_0000010"]
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == [4, 5]
    # keep <= 0 keeps everything
    assert artifacts.prune_stale_artifacts(tmp_path, "t2i", keep=0) == []
    assert len(artifacts.list_rollout_dirs(tmp_path, "t2i")) == 2


def test_retention_after_resume_from_an_earlier_checkpoint(tmp_path):
    """An attempt got to rollout 5; the run resumes at rollout 2. Retention counts only rollouts
    up to the current one: it must not reap the resumed run's own rollouts in favour of the
    abandoned attempt's later ones (those stay until prepare_rollout_dir replaces them)."""
    for k in range(6):
        artifacts.prepare_rollout_dir(tmp_path, "t2i", k)
    for k, remaining in ((2, [1, 2, 3, 4, 5]), (3, [2, 3, 4, 5])):
        artifacts.prepare_rollout_dir(tmp_path, "t2i", k)
        removed = artifacts.prune_stale_artifacts(tmp_path, "t2i", keep=2, up_to=k)
        assert [p.name for p in removed] == [f"rollout_{k - 2:07d}"]
        assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path, "t2i")] == remaining


def test_prepare_rollout_dir_replaces_an_earlier_attempt(tmp_path, caplog):
    d = artifacts.prepare_rollout_dir(tmp_path, "t2i", 3)
    (d / "group_00000000.safetensors").write_bytes(b"old")
    with caplog.at_level("WARNING"):
        d2 = artifacts.prepare_rollout_dir(tmp_path, "t2i", 3)
    assert d2 == d and list(d.iterdir()) == []
    assert "earlier attempt" in caplog.text
    assert os.path.isdir(d)

"""Sidecars, PNGs, layout and retention (no model needed: synthetic trajectories)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from trainer import artifacts
from trainer.artifacts import ArtifactError
from trainer.sampling import parse_sampling_config
from trainer.trajectory import Geometry, SamplerSettings, Trajectory

SAMPLING = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                                  "sde_indices": [1, 2]})


def fake_group(group_index=3, k=3, s=2, seq=4, ch=16, t=5, d=16, dtype=torch.bfloat16, seed=0, pad=2) -> Trajectory:
    """K candidates of one group as an engine returns them: the text conditioning zero-padded by
    `pad` tokens past the prompt's own `t` (a batch with a longer prompt elsewhere)."""
    g = torch.Generator().manual_seed(seed + group_index)
    embeds = torch.cat([torch.randn(t, d, generator=g), torch.zeros(pad, d)])
    mask = torch.cat([torch.ones(t, dtype=torch.int64), torch.zeros(pad, dtype=torch.int64)])
    i64 = torch.int64
    return Trajectory(
        prompts=[f"prompt {group_index}"] * k,
        sample_ids=[f"prompt:p{group_index}:sample:{slot}" for slot in range(k)],
        group_indices=torch.full((k,), group_index, dtype=i64), slots=torch.arange(k, dtype=i64),
        generation_seeds=[1234] * k, policy_versions=torch.full((k,), 5, dtype=i64),
        metadata=[{"task": "t2i", "sample_id": f"p{group_index}"} for _ in range(k)],
        images=torch.rand(k, 3, 32, 32, generator=g),
        latents=torch.randn(k, s, seq, ch, generator=g).to(dtype),
        next_latents=torch.randn(k, s, seq, ch, generator=g).to(dtype),
        sigmas=torch.tensor([0.9, 0.7]).repeat(k, 1), sigmas_next=torch.tensor([0.7, 0.5]).repeat(k, 1),
        timesteps=torch.tensor([900.0, 700.0]).repeat(k, 1), log_probs=torch.randn(k, s, generator=g),
        conditions={"prompt_embeds": embeds.repeat(k, 1, 1), "prompt_embeds_mask": mask.repeat(k, 1)},
        sde_indices=[1, 2], geometry=Geometry(32, 32, 8), sampler=SamplerSettings(num_inference_steps=4, eta=0.7),
    ).validate()


def test_layout(tmp_path):
    assert artifacts.sidecar_path(tmp_path, "t2i", 12, 3) == tmp_path / "t2i" / "rollout_0000012" / "group_00000003.safetensors"
    assert artifacts.image_path(tmp_path, "t2i", 12, 3, 7) == \
        tmp_path / "t2i" / "rollout_0000012" / "group_00000003_sample_0007.png"
    assert artifacts.rollout_dir(tmp_path, "t2i", 4, eval=True) == tmp_path / "eval" / "t2i" / "rollout_0000004"


def test_sidecar_round_trip(tmp_path):
    group = fake_group()
    path = artifacts.write_group_sidecar(tmp_path / "group_00000003.safetensors", group[[2, 1, 0]], task="t2i",
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
    # stored once per group, at the prompt's own length (the batch's padding dropped)
    assert tensors["conditions.prompt_embeds"].shape == (5, 16)
    assert tensors["conditions.prompt_embeds_mask"].tolist() == [1] * 5
    back = artifacts.sidecar_to_trajectory(tensors, meta)
    assert back.images is None and back.rollout_id == 9 and back.train_metadata == manifests
    for key in ("latents", "next_latents", "log_probs", "sigmas", "sigmas_next", "timesteps", "slots",
                "group_indices", "policy_versions"):
        assert torch.equal(getattr(group, key), getattr(back, key)), key  # slot order restored
    for key in ("sample_ids", "prompts", "generation_seeds", "metadata", "sde_indices", "height", "width",
                "vae_scale_factor", "num_inference_steps", "eta", "sde_type", "sigma_max"):
        assert getattr(group, key) == getattr(back, key), key
    assert torch.equal(back.prompt_embeds, group.prompt_embeds[:, :5])
    # joined with a group of a longer prompt, the rebuilt rows are padded back to what the engine gave
    longer = fake_group(4, t=7, pad=0)
    joined = Trajectory.cat([back, longer])
    assert torch.equal(joined.prompt_embeds[:3], group.prompt_embeds)
    assert torch.equal(joined.prompt_embeds_mask[:3], group.prompt_embeds_mask)


def test_a_sidecar_carries_its_geometry_and_sampler_settings(tmp_path):
    """The sidecar records the trajectory's Geometry (frames and media in the metadata) and
    SamplerSettings; one written before frames / media existed still loads (an image, no
    media); one without its eta cannot be replayed and says so."""
    import dataclasses

    group = dataclasses.replace(fake_group(), geometry=Geometry(32, 32, 8, frames=3, media=("source_image",)),
                                sampler=SamplerSettings(4, 0.3, "dance", 0.95))
    path = artifacts.write_group_sidecar(tmp_path / "g.safetensors", group, task="t2i", rollout_id=1, sampling=SAMPLING)
    tensors, meta = artifacts.read_sidecar(path)
    back = artifacts.sidecar_to_trajectory(tensors, meta)
    assert back.geometry == group.geometry and back.sampler == group.sampler
    old = {k: v for k, v in meta.items() if k not in ("frames", "media")}
    assert artifacts.sidecar_to_trajectory(tensors, old).geometry == Geometry(32, 32, 8)
    with pytest.raises(ValueError, match=r"lacks \['eta'\].*cannot be replayed"):
        artifacts.sidecar_to_trajectory(tensors, {k: v for k, v in meta.items() if k != "eta"})


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
    import dataclasses

    group = fake_group()
    group.prompts[1] = "another prompt"
    with pytest.raises(ValueError, match="disagree"):
        artifacts.group_sidecar_payload(group, task="t2i", rollout_id=0, sampling=SAMPLING)
    group = fake_group()
    group = dataclasses.replace(group, slots=torch.tensor([0, 1, 0]))
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

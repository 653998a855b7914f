"""CLIPScore, the aesthetic predictor and HPSv2.1 on tiny random-weight models written in their
real on-disk formats and loaded through the scorers' own constructors; the same scores through
the cpu, colocate and remote (tools/reward_server.py) runtimes; refused partial directories."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.test_rewards_remote import serving
from tests.tiny_rewards import write_tiny_aesthetic_dir, write_tiny_clip_dir, write_tiny_hps_dir
from trainer.rewards.base import ImageBatch, build_scorer
from trainer.rewards.post_process import compute_advantages

PROMPTS = ["a red panda in a teacup", "an astronaut riding a horse", "a red panda in a teacup", "a cat"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    hps_dir, hps_ref, hps_tok = write_tiny_hps_dir(root / "hps")
    return {
        "clipscore": write_tiny_clip_dir(root / "clip"),
        "aesthetic": write_tiny_aesthetic_dir(root / "aesthetic"),
        "hpsv21": hps_dir, "hps_ref": hps_ref, "hps_tok": hps_tok,
    }


def images(n=4, h=40, w=48, seed=1):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_clipscore_is_clamped_scaled_cosine(dirs):
    scorer = build_scorer("clipscore", dirs["clipscore"])
    batch = ImageBatch.from_any(images())
    s = scorer(batch, PROMPTS, [{}] * 4)["clipscore"]
    img = scorer.clip.image(scorer.clip.pixels(batch))
    txt, rows = scorer.clip.text(PROMPTS)
    cos = (img * txt[rows]).sum(-1)
    torch.testing.assert_close(s, 2.5 * cos.clamp(min=0))
    # the same image under another prompt scores differently (unless both clamp to 0)
    alone = scorer(batch.slice(0, 1), [PROMPTS[1]], [{}])["clipscore"]
    assert abs(float(alone[0]) - float(s[0])) > 1e-5 or float(s[0]) == 0.0


def test_aesthetic_is_the_head_on_normalised_vision_embeddings(dirs):
    from transformers import CLIPModel

    scorer = build_scorer("aesthetic", dirs["aesthetic"])
    batch = ImageBatch.from_any(images())
    s = scorer(batch, PROMPTS, [{}] * 4)["aesthetic"]
    # independent route: the full CLIPModel's image features, normalised, through the head
    clip = CLIPModel.from_pretrained(dirs["aesthetic"]).eval()
    px = scorer.processor(images=batch.pil, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        f = clip.get_image_features(pixel_values=px)
        f = getattr(f, "pooler_output", f)
        ref = scorer.head(f / f.norm(dim=-1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(s, ref, rtol=1e-4, atol=1e-5)
    assert s.std() > 1e-3  # different images, different scores
    # the prompt is not used
    torch.testing.assert_close(scorer(batch, ["x"] * 4, [{}] * 4)["aesthetic"], s)


def test_hpsv21_matches_an_openclip_style_forward(dirs):
    from trainer.rewards.hpsv2 import hps_pixels

    scorer = build_scorer("hpsv21", dirs["hpsv21"])
    for h, w in ((32, 32), (40, 24)):  # square; and a portrait image, padded to a square
        batch = ImageBatch.from_any(images(h=h, w=w))
        s = scorer(batch, PROMPTS, [{}] * 4)["hpsv21"]
        px = hps_pixels(batch, 32)
        assert px.shape == (4, 3, 32, 32)
        ids = dirs["hps_tok"](PROMPTS, padding=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = (dirs["hps_ref"].encode_image(px) * dirs["hps_ref"].encode_text(ids)).sum(-1)
        torch.testing.assert_close(s, ref, rtol=1e-4, atol=1e-5)
    # padding is black (0 before normalisation), centred
    px = hps_pixels(ImageBatch.from_any(torch.ones(1, 3, 64, 32)), 32)
    from trainer.rewards.hpsv2 import CLIP_MEAN, CLIP_STD

    black = (0 - CLIP_MEAN[0]) / CLIP_STD[0]
    assert px[0, 0, :, :8].allclose(torch.tensor(black)) and px[0, 0, :, -8:].allclose(torch.tensor(black))
    assert px[0, 0, :, 12:20].allclose(torch.tensor((1 - CLIP_MEAN[0]) / CLIP_STD[0]), atol=1e-3)


@pytest.mark.parametrize("name", ["clipscore", "aesthetic", "hpsv21"])
def test_runtimes_agree(dirs, name):
    from trainer.rewards.manager import RewardManager

    imgs = images()
    cpu = RewardManager("cpu", name, dirs[name]).score(imgs, PROMPTS).components[name]
    colo = RewardManager("colocate", name, dirs[name], device="cpu").score(imgs, PROMPTS).components[name]
    with serving(build_scorer(name, dirs[name])) as url:
        remote = RewardManager("remote", endpoint=url, remote_max_retries=0).score(imgs, PROMPTS).components[name]
    torch.testing.assert_close(colo, cpu)
    torch.testing.assert_close(remote, cpu)  # PNG transport is lossless


FILES = {  # one file whose absence each scorer must name
    "clipscore": "config.json", "aesthetic": "sac+logos+ava1-l14-linearMSE.pth", "hpsv21": "HPS_v2.1_compressed.pt",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_partial_model_directory_is_refused_naming_the_file(dirs, tmp_path, name):
    partial = tmp_path / "partial"
    shutil.copytree(dirs[name], partial)
    os.remove(partial / FILES[name])
    with pytest.raises(FileNotFoundError, match=rf"--reward-model-path=.*missing .*{FILES[name].replace('+', '.')}"):
        build_scorer(name, str(partial))
    with pytest.raises(ValueError, match="needs --reward-model-path"):
        build_scorer(name, None)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        build_scorer(name, str(tmp_path / "nowhere"))
    if name != "hpsv21":  # the tokenizer / processor files are checked as well
        os.remove(partial / "tokenizer.json") if name == "clipscore" else None
        shutil.copy(os.path.join(dirs[name], FILES[name]), partial / FILES[name])
        if name == "clipscore":
            with pytest.raises(FileNotFoundError, match="tokenizer.json or vocab.json"):
                build_scorer(name, str(partial))


def test_non_finite_scores_fail_their_group_and_are_counted(dirs):
    scorer = build_scorer("aesthetic", dirs["aesthetic"])
    batch = ImageBatch.from_any(images())
    s = scorer(batch, PROMPTS, [{}] * 4)["aesthetic"].clone()
    s[1] = float("nan")
    res = compute_advantages({"aesthetic": s}, 2, component_weights={"aesthetic": 1.0})
    assert res.failed_groups == [0] and res.metrics["reward/failed_groups"] == 1.0
    assert res.valid.tolist() == [False, False, True, True] and res.advantages[:2].tolist() == [0.0, 0.0]

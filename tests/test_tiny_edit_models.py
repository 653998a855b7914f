"""The tiny offline edit pipelines (Qwen-Image-Edit 2509/2511 "plus", FLUX.1-Kontext) have the
real checkouts' layout, load through diffusers' own edit pipelines and edit a source image on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image


@pytest.fixture(scope="module")
def qwen_edit_dir(tmp_path_factory):
    from tools.tiny_qwen_image_edit import main

    out = tmp_path_factory.mktemp("tiny_qwen_edit") / "model"
    assert main(["--output-dir", str(out), "--variant", "2511", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    from tools.make_tiny_model import main  # the shared entry point builds the edit families too

    out = tmp_path_factory.mktemp("tiny_kontext") / "model"
    assert main(["--output-dir", str(out), "--family", "flux_kontext", "--seed", "0"]) == 0
    return out


def _sources():
    # two sources differing only in colour: an edit model must see which one it was given
    return Image.new("RGB", (32, 32), (220, 30, 30)), Image.new("RGB", (32, 32), (30, 30, 220))


def test_qwen_edit_layout(qwen_edit_dir):
    index = json.loads((qwen_edit_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler"):
        assert (qwen_edit_dir / sub).is_dir(), sub
    proc = json.loads((qwen_edit_dir / "processor" / "preprocessor_config.json").read_text())
    assert proc["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (proc["patch_size"], proc["merge_size"], proc["temporal_patch_size"]) == (14, 2, 2)
    assert (qwen_edit_dir / "processor" / "tokenizer_config.json").is_file()
    dit = json.loads((qwen_edit_dir / "transformer" / "config.json").read_text())
    assert dit["zero_cond_t"] is True
    size = sum(p.stat().st_size for p in qwen_edit_dir.rglob("*") if p.is_file())
    assert size < 40 * 1024 * 1024, f"tiny edit model is {size / 1e6:.1f} MB"


def test_qwen_edit_variants_differ_only_in_zero_cond_t(tmp_path, qwen_edit_dir):
    from safetensors.torch import load_file

    from tools.tiny_qwen_image_edit import build_tiny_qwen_image_edit_pipeline, edit_transformer_config

    other = build_tiny_qwen_image_edit_pipeline(tmp_path / "e2509", seed=0, variant="2509")
    a = json.loads((qwen_edit_dir / "transformer" / "config.json").read_text())
    b = json.loads((other / "transformer" / "config.json").read_text())
    assert {k for k in a if a.get(k) != b.get(k)} == {"zero_cond_t"} and b["zero_cond_t"] is False
    wa = load_file(qwen_edit_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    wb = load_file(other / "transformer" / "diffusion_pytorch_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="--variant"):
        edit_transformer_config({}, "2512")


def test_image_prompt_processor_expands_one_pad_per_merged_patch_group(qwen_edit_dir):
    from trainer.models.qwen_vl_processor import ImagePromptProcessor, image_token_count

    proc = ImagePromptProcessor.from_pretrained(qwen_edit_dir / "processor")
    text = ["Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it red",
            "Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it blue and round"]
    images = [Image.new("RGB", (64, 48)), Image.new("RGB", (112, 112))]
    out = proc(text=text, images=images, padding=True, return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    assert grids == [[1, 4, 4], [1, 8, 8]]  # 48x64 -> 56x56 (4x4 patches); 112x112 -> 8x8 patches
    for row, grid in zip(out["input_ids"], grids):
        assert int((row == proc.image_token_id).sum()) == image_token_count(grid, 2)
    assert out["pixel_values"].shape == (16 + 64, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="placeholders"):
        proc(text=text, images=images[:1])
    with pytest.raises(ValueError, match="no images"):
        proc(text=text)


def test_processor_dir_without_config_names_the_file(tmp_path):
    from trainer.models.qwen_vl_processor import ImagePromptProcessor

    with pytest.raises(ValueError, match="preprocessor_config.json"):
        ImagePromptProcessor.from_pretrained(tmp_path)


def test_qwen_edit_plus_pipeline_loads_and_edits(qwen_edit_dir, monkeypatch):
    """The stock QwenImageEditPlusPipeline loads the directory offline and its output depends on
    the source image (seen by the VL encoder and as condition latents)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    from diffusers import QwenImageEditPlusPipeline

    from tools.tiny_qwen_image_edit import edit_prompt_template_start_idx
    from trainer.models.qwen_vl_processor import ImagePromptProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the pipeline VAE-encodes every source at ~1024 x 1024 (a module constant): ~50 s for the
    # tiny VAE on CPU; 64 x 64 keeps the same code path
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        str(qwen_edit_dir), local_files_only=True, dtype=torch.float32,
        processor=ImagePromptProcessor.from_pretrained(qwen_edit_dir / "processor"))
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode_start_idx = edit_prompt_template_start_idx(pipe)
    assert pipe.transformer.config.zero_cond_t is True
    outs = [pipe(image=[src], prompt="make the square green", height=32, width=32, num_inference_steps=2,
                 true_cfg_scale=1.0, output_type="pt", generator=torch.Generator().manual_seed(0)).images
            for src in _sources()]
    assert outs[0].shape == (1, 3, 32, 32) and all(torch.isfinite(o).all() for o in outs)
    assert (outs[0] - outs[1]).abs().max() > 1e-4


def test_flux_kontext_layout_and_pipeline_edits(kontext_dir, monkeypatch):
    from diffusers import FluxKontextPipeline

    index = json.loads((kontext_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = FluxKontextPipeline.from_pretrained(str(kontext_dir), local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # max_area and _auto_resize keep the tiny run at 32 x 32 (the defaults resize to ~1 megapixel)
    outs = [pipe(image=src, prompt="make the square green", height=32, width=32, max_area=32 * 32,
                 _auto_resize=False, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images for src in _sources()]
    assert outs[0].shape == (1, 3, 32, 32) and all(torch.isfinite(o).all() for o in outs)
    assert (outs[0] - outs[1]).abs().max() > 1e-4


# --------------------------------------------------------------------- the geometry the adapters will use


def test_area_dimensions_match_the_edit_plus_pipeline():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    from trainer.models.edit_geometry import area_dimensions

    for w, h in [(1, 1), (640, 480), (480, 640), (1920, 1080), (300, 1700), (33, 31)]:
        for area in (384 * 384, 1024 * 1024, 64 * 64):
            assert area_dimensions(area, w / h) == calculate_dimensions(area, w / h), (w, h, area)
    with pytest.raises(ValueError):
        area_dimensions(0, 1.0)


def test_qwen_edit_sizes_and_img_shapes_are_what_the_pipeline_feeds_the_dit(qwen_edit_dir, monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    from diffusers import QwenImageEditPlusPipeline

    from tools.tiny_qwen_image_edit import edit_prompt_template_start_idx
    from trainer.models.edit_geometry import qwen_edit_img_shapes, qwen_edit_source_sizes
    from trainer.models.qwen_vl_processor import ImagePromptProcessor

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 96 * 64)
    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", 80 * 56)
    proc = ImagePromptProcessor.from_pretrained(qwen_edit_dir / "processor")
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(qwen_edit_dir), local_files_only=True,
                                                     dtype=torch.float32, processor=proc)
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode_start_idx = edit_prompt_template_start_idx(pipe)
    seen = {}
    forward, call = pipe.transformer.forward, proc.__call__
    def spy_forward(*a, **kw):  # noqa: E306
        seen.setdefault("img_shapes", kw["img_shapes"])
        seen.setdefault("tokens", kw["hidden_states"].shape[1])
        return forward(*a, **kw)
    def spy_processor(*a, **kw):  # noqa: E306
        seen.setdefault("condition", [im.size for im in kw["images"]])
        return call(*a, **kw)
    monkeypatch.setattr(pipe.transformer, "forward", spy_forward)
    monkeypatch.setattr(pipe, "processor", type("P", (), {"__call__": staticmethod(spy_processor)})())
    source = Image.new("RGB", (48, 32), (200, 20, 20))
    pipe(image=[source], prompt="make it green", height=32, width=48, num_inference_steps=2, output_type="pt")
    sizes = qwen_edit_source_sizes(48, 32, condition_area=80 * 56, vae_area=96 * 64)
    assert seen["condition"] == [sizes["condition"]]
    expected = qwen_edit_img_shapes(32, 48, [sizes["vae"]], vae_scale_factor=4)
    assert [tuple(s) for s in seen["img_shapes"][0]] == expected
    assert seen["tokens"] == sum(f * h * w for f, h, w in expected)  # condition tokens follow the target's


def test_kontext_source_size_and_position_ids_match_the_pipeline(kontext_dir, monkeypatch):
    from diffusers import FluxKontextPipeline

    from trainer.models.edit_geometry import kontext_position_ids, kontext_source_size

    pipe = FluxKontextPipeline.from_pretrained(str(kontext_dir), local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    class Stop(Exception):
        pass

    prepare = pipe.prepare_latents
    def spy_prepare(image, *a, **kw):  # noqa: E306
        seen["image"] = tuple(image.shape[-2:])
        out = prepare(image, *a, **kw)
        seen["image_ids"], seen["latent_ids"] = out[3], out[2]
        raise Stop
    monkeypatch.setattr(pipe, "prepare_latents", spy_prepare)
    # the tiny VAE's scale factor is 4, so the rounding multiple is 8
    for size, auto in (((50, 37), False), ((1000, 700), True)):
        with pytest.raises(Stop):
            pipe(image=Image.new("RGB", size), prompt="x", height=32, width=32, max_area=32 * 32,
                 _auto_resize=auto, num_inference_steps=1)
        w, h = kontext_source_size(*size, vae_scale_factor=4, auto_resize=auto)
        assert seen["image"] == (h, w), (size, auto)
    # the source's packed grid ((h / 4) / 2 x (w / 4) / 2 tokens) carries first axis 1
    assert torch.equal(seen["image_ids"], kontext_position_ids(h // 8, w // 8, 1.0))
    assert torch.equal(seen["latent_ids"], kontext_position_ids(4, 4, 0.0))

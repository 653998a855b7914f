"""Shared test fixtures. Fixtures used by one test file live in that file."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Qwen-Image pipeline directory (diffusers format, ~17 MB), built
    offline once per test session by tools/make_tiny_model.py. Treat it as read-only."""
    from tools.make_tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_qwen_image") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_sd3_model_dir(tmp_path_factory):
    """A tiny random-weight Stable Diffusion 3.5 pipeline directory (~1 MB; a dual-attention DiT,
    CLIP-L + CLIP-G + T5), built offline once per session by tools/tiny_sd3.py. The VAE decoder's
    output gain of 8 makes image colours depend on the latents, so a colour reward can be learned.
    Treat it as read-only."""
    from tools.tiny_sd3 import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(tmp_path_factory.mktemp("tiny_sd3") / "model", seed=0, vae_output_gain=8.0)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random-weight FLUX.1 pipeline directory (diffusers format, ~1 MB), built offline
    once per test session by tools/tiny_flux.py. Treat it as read-only."""
    from tools.tiny_flux import build_tiny_flux_pipeline

    return build_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux") / "model", seed=0)

"""Video geometry (trainer/video.py): the validity rules, the latent shape and token count of a
(num_frames, height, width) request under Wan2.1's VAE and DiT, and the per-candidate noise of a
video latent, which is sampling.initial_noise / step_noise at a 4-D per-candidate shape."""

from __future__ import annotations

import pytest
import torch

from trainer import sampling, video


@pytest.mark.parametrize("frames, latent", [(1, 1), (5, 2), (9, 3), (33, 9), (81, 21)])
def test_latent_frames_follow_the_causal_vae(frames, latent):
    assert video.latent_frames(frames) == latent
    assert video.pixel_frames(latent) == frames


@pytest.mark.parametrize("frames", [0, 2, 4, 32, 80, -3, 5.0, True, "81"])
def test_frame_counts_not_4k_plus_1_are_refused_with_the_nearest_valid(frames):
    problem = video.frames_problem(frames)
    assert problem is not None and "4k+1" in problem
    with pytest.raises(ValueError, match="4k\\+1"):
        video.latent_frames(frames)


def test_the_frames_problem_names_both_neighbours():
    assert "use 81 or 85" in video.frames_problem(82)
    assert "use 33 or 37" in video.frames_problem(35)


@pytest.mark.parametrize("height, width, ok", [
    (480, 832, True), (240, 416, True), (16, 16, True), (32, 48, True),
    (480, 830, False), (8, 16, False), (0, 16, False), (481, 832, False), (480.0, 832, False)])
def test_sizes_must_be_multiples_of_16(height, width, ok):
    assert (video.size_problem(height, width) is None) is ok


def test_every_problem_is_reported_at_once_naming_the_keys():
    problems = video.video_geometry_problems(80, 481, 830)
    assert len(problems) == 2
    assert "'num_frames'" in problems[0] and "--sampling-config" in problems[0]
    assert "height 481" in problems[1] and "width 830" in problems[1] and "use 480 or 496" in problems[1]
    assert video.video_geometry_problems(81, 480, 832) == []
    with pytest.raises(ValueError) as e:
        video.candidate_noise_shape(80, 481, 832)
    assert "num_frames" in str(e.value) and "height" in str(e.value)


@pytest.mark.parametrize("geometry, shape, tokens", [
    ((81, 480, 832), (16, 21, 60, 104), 21 * 30 * 52),   # Wan2.1's published geometry: 32760 tokens
    ((33, 240, 416), (16, 9, 30, 52), 9 * 15 * 26),      # FlowGRPO's Wan recipe: 3510 tokens
    ((5, 32, 32), (16, 2, 4, 4), 2 * 2 * 2),             # the tiny model in the tests
])
def test_latent_shape_and_token_count(geometry, shape, tokens):
    got = video.candidate_noise_shape(*geometry)
    assert got == shape
    assert video.token_count(got) == tokens
    assert video.latent_bytes(got, num_states=2) == 2 * 4 * torch.Size(shape).numel()


def test_token_count_refuses_a_latent_that_does_not_patchify():
    with pytest.raises(ValueError, match="patches"):
        video.token_count((16, 2, 5, 4))
    with pytest.raises(ValueError, match="C, F'"):
        video.token_count((2, 4, 4))


def test_the_shape_matches_what_wan_pipeline_prepares():
    """WanPipeline.prepare_latents' own shape rule, read from diffusers, agrees with ours."""
    from diffusers import WanPipeline

    class _Vae:  # prepare_latents reads only the two factors from the pipeline
        pass

    pipe = WanPipeline.__new__(WanPipeline)
    pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial = 4, 8
    lat = WanPipeline.prepare_latents(pipe, 1, 16, 240, 416, 33, torch.float32, torch.device("cpu"),
                                      torch.Generator().manual_seed(0))
    assert tuple(lat.shape[1:]) == video.candidate_noise_shape(33, 240, 416)


# ------------------------------------------------------------------------- noise

SHAPE = video.candidate_noise_shape(9, 32, 48)   # [16, 3, 4, 6]


def test_initial_noise_is_shape_generic_and_a_pure_function_of_seed_and_id():
    a = sampling.initial_noise(SHAPE, 7, "prompt:0:sample:0")
    assert a.shape == SHAPE and a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.equal(a, sampling.initial_noise(SHAPE, 7, "prompt:0:sample:0"))
    assert not torch.equal(a, sampling.initial_noise(SHAPE, 7, "prompt:0:sample:1"))
    assert not torch.equal(a, sampling.initial_noise(SHAPE, 8, "prompt:0:sample:0"))
    # standard normal over the whole clip (6 * 16 * 3 * 4 = 1152 draws)
    assert abs(float(a.mean())) < 0.15 and abs(float(a.std()) - 1.0) < 0.1


def test_a_video_latent_is_the_same_stream_as_a_flat_draw():
    """The shape only lays the draw out: a video candidate's x_T is the flat draw of its element
    count, frame-major inside each channel, so no frame layout change can alter the noise
    silently without changing the shape."""
    a = sampling.initial_noise(SHAPE, 7, "prompt:3:sample:2")
    flat = sampling.initial_noise((torch.Size(SHAPE).numel(),), 7, "prompt:3:sample:2")
    assert torch.equal(a.reshape(-1), flat)


def test_step_noise_differs_per_step_and_from_the_initial_noise():
    x_t = sampling.initial_noise(SHAPE, 7, "prompt:0:sample:0")
    eps = [sampling.step_noise(SHAPE, 7, "prompt:0:sample:0", s) for s in range(3)]
    assert all(e.shape == SHAPE for e in eps)
    assert torch.equal(eps[1], sampling.step_noise(SHAPE, 7, "prompt:0:sample:0", 1))
    assert not torch.equal(eps[0], eps[1]) and not torch.equal(eps[1], eps[2])
    assert not torch.equal(eps[0], x_t)


def test_a_batch_of_candidates_stacks_to_the_trajectory_layout():
    """[B, C, F', H', W'] from per-candidate draws: each row is its own candidate's noise,
    whatever the batch composition."""
    ids = [f"prompt:0:sample:{k}" for k in range(3)]
    batch = torch.stack([sampling.initial_noise(SHAPE, 7, i) for i in ids])
    assert batch.shape == (3, *SHAPE)
    alone = sampling.initial_noise(SHAPE, 7, ids[2])
    assert torch.equal(batch[2], alone)


def test_the_geometry_imports_without_torch():
    """The config preflight imports it; like trainer.sampling it must not pull torch in."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['torch'] = None\n"
            "from trainer import video\n"
            "assert video.candidate_noise_shape(81, 480, 832) == (16, 21, 60, 104)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))


# ------------------------------------------------------------------------- frame sampling


@pytest.mark.parametrize("frames, rule, expected", [
    (33, {"every": 4}, [0, 4, 8, 12, 16, 20, 24, 28, 32]),
    (5, {"every": 4}, [0, 4]),
    (81, {"count": 5}, [0, 20, 40, 60, 80]),
    (9, {"count": 4}, [0, 3, 5, 8]),
    (5, {"count": 8}, [0, 1, 2, 3, 4]),
    (9, {"count": 1}, [4]),
    (1, {"every": 3}, [0]),
])
def test_frame_sampling_rules(frames, rule, expected):
    assert video.sample_frame_indices(frames, **rule) == expected


@pytest.mark.parametrize("rule", [{}, {"every": 2, "count": 2}, {"every": 0}, {"count": 0}, {"count": 2.0}])
def test_frame_sampling_needs_exactly_one_valid_rule(rule):
    with pytest.raises(ValueError):
        video.sample_frame_indices(9, **rule)

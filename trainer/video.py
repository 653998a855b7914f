"""Video geometry: what (num_frames, height, width) a Wan-style video model accepts, the latent
shape and token count it becomes, and each candidate's noise for a video latent.

Importable without torch (the config preflight will ask these functions): plain integer math.

Wan2.1's VAE (AutoencoderKLWan) is causal in time: the first frame is encoded alone and every
further group of `temporal` frames becomes one latent frame, so F pixel frames give
(F - 1) // temporal + 1 latent frames, and only F = temporal * k + 1 round-trips exactly
(diffusers' WanPipeline silently rounds any other count down to that form; this project refuses
instead, so the count a user asks for is the count that is trained). Space is downsampled by
`spatial`, then the DiT patchifies (pt, ph, pw) = (1, 2, 2): height and width must be multiples
of spatial * ph = 16 (WanPipeline.check_inputs), and a video is
latent_frames / pt * (H / 16) * (W / 16) tokens.

Noise. A candidate's x_T and per-step SDE noise are `trainer.sampling.initial_noise` /
`step_noise`, which take any shape: for a video they draw the [C, F', H', W'] latent of one
candidate from the same (generation_seed, sample_id[, step]) seed as an image latent, so every
guarantee of the image path (any rank, device or batch composition gives the same noise)
carries over unchanged. `candidate_noise_shape` is the shape to pass them.
"""

from __future__ import annotations

from typing import Any

#: Wan2.1's VAE: time compressed 4x (the first frame alone), space 8x; 16 latent channels
WAN_TEMPORAL_FACTOR = 4
WAN_SPATIAL_FACTOR = 8
WAN_LATENT_CHANNELS = 16
#: WanTransformer3DModel's patch (frames, rows, columns) in both published sizes
WAN_PATCH_SIZE = (1, 2, 2)

_FLAG = "--sampling-config"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def frames_problem(num_frames: Any, temporal: int = WAN_TEMPORAL_FACTOR) -> str | None:
    """None when a video of `num_frames` frames round-trips the causal VAE (an integer
    temporal * k + 1 >= 1), else the problem with the two nearest valid counts."""
    if not _is_int(num_frames) or num_frames < 1:
        return f"num_frames must be an integer >= 1 of the form {temporal}k+1 (e.g. 33, 81), got {num_frames!r}"
    if (num_frames - 1) % temporal:
        below = (num_frames - 1) // temporal * temporal + 1
        return (f"num_frames {num_frames} is not of the form {temporal}k+1 (the VAE encodes the first frame alone, "
                f"then groups of {temporal}): use {below} or {below + temporal}")
    return None


def size_problem(height: Any, width: Any, spatial: int = WAN_SPATIAL_FACTOR,
                 patch_size: tuple[int, int, int] = WAN_PATCH_SIZE) -> str | None:
    """None when height and width are positive multiples of spatial * patch (16 for Wan2.1), else
    the problem with the nearest valid sizes."""
    multiple = spatial * patch_size[1], spatial * patch_size[2]
    bad = []
    for name, value, m in (("height", height, multiple[0]), ("width", width, multiple[1])):
        if not _is_int(value) or value < m:
            bad.append(f"{name} must be an integer multiple of {m} >= {m}, got {value!r}")
        elif value % m:
            lo = value // m * m
            bad.append(f"{name} {value} is not a multiple of {m} (VAE factor {spatial} x DiT patch): "
                       f"use {lo} or {lo + m}")
    return "; ".join(bad) or None


def video_geometry_problems(num_frames: Any, height: Any, width: Any, temporal: int = WAN_TEMPORAL_FACTOR,
                            spatial: int = WAN_SPATIAL_FACTOR,
                            patch_size: tuple[int, int, int] = WAN_PATCH_SIZE) -> list[str]:
    """Every problem of a (num_frames, height, width) request at once, each naming the
    --sampling-config key; empty when the geometry is valid."""
    out = []
    problem = frames_problem(num_frames, temporal)
    if problem:
        out.append(f"{_FLAG} key 'num_frames': {problem}")
    problem = size_problem(height, width, spatial, patch_size)
    if problem:
        out.append(f"{_FLAG} keys 'height'/'width': {problem}")
    return out


def _require_valid(num_frames, height, width, temporal, spatial, patch_size) -> None:
    problems = video_geometry_problems(num_frames, height, width, temporal, spatial, patch_size)
    if problems:
        raise ValueError("invalid video geometry:\n  " + "\n  ".join(problems))


def latent_frames(num_frames: int, temporal: int = WAN_TEMPORAL_FACTOR) -> int:
    """Latent frames of `num_frames` pixel frames: (F - 1) // temporal + 1 (F must be temporal*k+1)."""
    problem = frames_problem(num_frames, temporal)
    if problem:
        raise ValueError(problem)
    return (num_frames - 1) // temporal + 1


def pixel_frames(num_latent_frames: int, temporal: int = WAN_TEMPORAL_FACTOR) -> int:
    """The pixel frames the VAE decodes `num_latent_frames` latent frames to: (F' - 1) * temporal + 1,
    the inverse of latent_frames."""
    if not _is_int(num_latent_frames) or num_latent_frames < 1:
        raise ValueError(f"num_latent_frames must be an integer >= 1, got {num_latent_frames!r}")
    return (num_latent_frames - 1) * temporal + 1


def candidate_noise_shape(num_frames: int, height: int, width: int, channels: int = WAN_LATENT_CHANNELS,
                          temporal: int = WAN_TEMPORAL_FACTOR, spatial: int = WAN_SPATIAL_FACTOR,
                          patch_size: tuple[int, int, int] = WAN_PATCH_SIZE) -> tuple[int, int, int, int]:
    """One candidate's latent [C, F', H', W'] = [channels, (F-1)//temporal+1, H/spatial, W/spatial]
    (WanPipeline.prepare_latents' shape without the batch dimension); ValueError naming every
    problem when the geometry is invalid. The shape to pass to sampling.initial_noise / step_noise;
    a trajectory of S recorded states is then [B, S, C, F', H', W']."""
    _require_valid(num_frames, height, width, temporal, spatial, patch_size)
    return (int(channels), latent_frames(num_frames, temporal), height // spatial, width // spatial)


def token_count(latent_shape: tuple[int, ...], patch_size: tuple[int, int, int] = WAN_PATCH_SIZE) -> int:
    """Patchified tokens of one candidate's latent [C, F', H', W']: (F'/pt) * (H'/ph) * (W'/pw),
    the DiT's self-attention sequence length (its cost grows with its square)."""
    if len(latent_shape) != 4:
        raise ValueError(f"latent_shape must be [C, F', H', W'], got {tuple(latent_shape)}")
    _, f, h, w = (int(s) for s in latent_shape)
    pt, ph, pw = patch_size
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latent [F', H', W'] = {[f, h, w]} does not divide into patches {tuple(patch_size)}")
    return (f // pt) * (h // ph) * (w // pw)


def latent_bytes(latent_shape: tuple[int, ...], num_states: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of `num_states` recorded latents of one candidate (fp32 by default): a trajectory
    sidecar's size grows linearly in the latent frames."""
    n = 1
    for s in latent_shape:
        n *= int(s)
    return n * int(num_states) * int(bytes_per_element)


def sample_frame_indices(num_frames: int, *, every: int | None = None, count: int | None = None) -> list[int]:
    """The frames a scorer (or a frame strip) looks at, by one declared rule:

    every=k  -> 0, k, 2k, ... (< num_frames): FlowGRPO's video OCR reward reads every 4th frame;
    count=n  -> n frames evenly spaced from the first to the last, both included
                (round(i * (F - 1) / (n - 1))); n >= F gives every frame, n == 1 the middle one.

    Exactly one of the two must be given; both are deterministic in num_frames alone, so a
    candidate is scored on the same frames in the rollout and in any re-scoring."""
    if not _is_int(num_frames) or num_frames < 1:
        raise ValueError(f"num_frames must be an integer >= 1, got {num_frames!r}")
    if (every is None) == (count is None):
        raise ValueError("give exactly one frame-sampling rule: every=k (every k-th frame) or count=n "
                         "(n evenly spaced frames)")
    if every is not None:
        if not _is_int(every) or every < 1:
            raise ValueError(f"frame sampling 'every' must be an integer >= 1, got {every!r}")
        return list(range(0, num_frames, every))
    if not _is_int(count) or count < 1:
        raise ValueError(f"frame sampling 'count' must be an integer >= 1, got {count!r}")
    if count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [(num_frames - 1) // 2]
    return [round(i * (num_frames - 1) / (count - 1)) for i in range(count)]

"""Rewards for videos: image scorers on sampled frames, temporal consistency, OCR on frames, the
VLM judge on a frame grid.

A video scorer declares ``required_tracks = ("video",)`` and is called with the scorer
protocol's signature, its first argument a `VideoBatch` (one uint8 [F, H, W, 3] clip per
candidate, converted once, as ImageBatch does for images):

    scorer.score(videos: VideoBatch, prompts: list[str], metadata: list[dict]) -> {component: Tensor [B]}

Shipped here (dotpaths; the short names and the manager's routing of the "video" track come with
the text-to-video task):

  FramewiseScorer            any image scorer on sampled frames, reduced per candidate by a declared
                             reduction: "mean" or "min"; frames by a declared rule: every k-th frame
                             or n evenly spaced (trainer.video.sample_frame_indices). Components
                             "video_<inner>" (mean) / "video_<inner>_min" (min).
  VideoOcrScorer             FramewiseScorer over OcrScorer, every 4th frame (FlowGRPO's video OCR
                             reward reads every 4th frame), mean: component "video_ocr".
  TemporalConsistencyScorer  weightless (no model): 1 - 3 * mean frame-to-frame |difference|,
                             clipped to [0, 1]; component "temporal_consistency" (below).
  VideoJudgeScorer           the VLM judge (trainer.rewards.vlm_judge) on one image per candidate:
                             a grid of evenly spaced frames in reading order; component
                             "video_vlm_judge".

NaN (could not score) propagates: a candidate with any sampled frame the inner scorer could not
score gets NaN under both reductions, so its group fails visibly instead of being scored on the
frames that happened to work.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from trainer.rewards.base import ImageBatch, RewardError, build_scorer, check_scores, metadata_list, uint8_hwc
from trainer.rewards.vlm_judge import DEFAULT_TEMPLATE, VlmJudgeScorer
from trainer.video import sample_frame_indices

REDUCTIONS = ("mean", "min")
#: frames FramewiseScorer samples when no rule is given: 8 evenly spaced (first and last included)
DEFAULT_FRAME_COUNT = 8


class VideoBatch:
    """A batch of RGB videos held once as uint8 arrays [F, H, W, 3] (F may differ per candidate),
    quantised like every frame the video writer stores: uint8 = round(clamp(x, 0, 1) * 255)."""

    def __init__(self, arrays: Sequence[np.ndarray]):
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 4 or a.shape[3] != 3 or a.shape[0] < 1:
                got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"video {i}: expected uint8 [F >= 1, H, W, 3], got {got}")
        self._arrays = list(arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def uint8(self) -> list[np.ndarray]:
        """uint8 [F, H, W, 3] arrays, one per candidate (read-only by convention)."""
        return self._arrays

    def slice(self, start: int, stop: int) -> "VideoBatch":
        """Sub-batch [start, stop) sharing the clips (the reward manager's batching)."""
        return VideoBatch(self._arrays[start:stop])

    def frames(self, indices_of) -> tuple[ImageBatch, list[int], list[int]]:
        """(ImageBatch of the chosen frames of every video, in order; owner; index) where frame j
        is frame index[j] of candidate owner[j]. `indices_of(num_frames) -> list[int]` picks the
        frames. The frames are views of the clips: nothing is copied."""
        frames, owner, index = [], [], []
        for i, clip in enumerate(self._arrays):
            for f in indices_of(int(clip.shape[0])):
                frames.append(clip[f])
                owner.append(i)
                index.append(int(f))
        return ImageBatch(frames), owner, index

    @classmethod
    def from_any(cls, videos: Any) -> "VideoBatch":
        """A VideoBatch from: a VideoBatch; a float tensor [B, F, 3, H, W] in [0, 1] (WanPipeline's
        output_type="pt" layout) or a list of [F, 3, H, W] tensors; uint8 arrays [F, H, W, 3].
        An ImageBatch is refused: a video scorer was configured for a task that produces images."""
        if isinstance(videos, VideoBatch):
            return videos
        if isinstance(videos, ImageBatch):
            raise RewardError("a video scorer (required_tracks ('video',)) was given images: it scores the "
                              "text-to-video task's clips; use an image scorer for an image task")
        if isinstance(videos, torch.Tensor):
            if videos.ndim != 5 or videos.shape[2] != 3:
                raise ValueError(f"expected a video tensor [B, F, 3, H, W], got {tuple(videos.shape)}")
            videos = list(videos)
        out = []
        for i, v in enumerate(videos):
            if isinstance(v, torch.Tensor):
                if v.ndim != 4 or v.shape[1] != 3:
                    raise ValueError(f"video {i}: expected a tensor [F, 3, H, W], got {tuple(v.shape)}")
                out.append(uint8_hwc(v))
            else:
                out.append(v)
        return cls(out)


def _frame_rule(every: int | None, count: int | None):
    sample_frame_indices(1, every=every, count=count)  # validates the rule now, not at the first rollout
    return lambda n: sample_frame_indices(n, every=every, count=count)


def reduce_per_candidate(values: torch.Tensor, owner: Sequence[int], batch_size: int, reduction: str) -> torch.Tensor:
    """[B] scores from per-frame `values` [N] owned by candidates `owner` [N]: the mean or min over
    each candidate's frames; NaN when any of its frames is NaN (or it has none)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    out = torch.full((batch_size,), math.nan, dtype=torch.float32)
    owner_t = torch.as_tensor(list(owner), dtype=torch.int64)
    for i in range(batch_size):
        v = values[owner_t == i]
        if v.numel() and bool(torch.isfinite(v).all()):
            out[i] = v.mean() if reduction == "mean" else v.min()
    return out


class FramewiseScorer:
    """An image scorer applied to sampled frames of each video, reduced per candidate.

    `scorer` is an image scorer object, or a dotpath / shipped short name built with
    (model_path, device) like --reward-scorer-path. Frames: every=k (every k-th from the first)
    or count=n (n evenly spaced, first and last included; 8 when neither is given, both is an
    error); reduction "mean" (the clip's typical
    frame) or "min" (its worst sampled frame: one bad frame sinks the clip). Each inner component
    c becomes "video_<c>" (mean) or "video_<c>_min". Every sampled frame of the batch goes to the
    inner scorer in one call, with its candidate's prompt and a copy of its metadata carrying
    "frame_index"."""

    required_tracks = ("video",)
    #: the --reward-frame-* settings (--reward-scorer-path framewise) reach it through these
    config_fields = ("reward_frame_scorer", "reward_frame_reduction", "reward_frame_every", "reward_frame_count")

    def __init__(self, model_path: str | None = None, device: str = "cpu", *, scorer: Any = "ocr",
                 reduction: str = "mean", every: int | None = None, count: int | None = None,
                 reward_frame_scorer: Any = None, reward_frame_reduction: str | None = None,
                 reward_frame_every: int | None = None, reward_frame_count: int | None = None):
        scorer = reward_frame_scorer if reward_frame_scorer is not None else scorer
        reduction = reward_frame_reduction if reward_frame_reduction is not None else reduction
        every = reward_frame_every if reward_frame_every is not None else every
        count = reward_frame_count if reward_frame_count is not None else count
        if reduction not in REDUCTIONS:
            raise ValueError(f"frame reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if every is None and count is None:
            count = DEFAULT_FRAME_COUNT
        self.indices_of = _frame_rule(every, count)
        self.every, self.count, self.reduction = every, count, reduction
        self.inner = build_scorer(scorer, model_path, device) if isinstance(scorer, str) else scorer
        if tuple(getattr(self.inner, "required_tracks", ("image",))) != ("image",):
            raise ValueError(f"FramewiseScorer wraps an image scorer; {type(self.inner).__name__} requires "
                             f"{tuple(self.inner.required_tracks)}")
        suffix = "" if reduction == "mean" else f"_{reduction}"
        self._names = {c: f"video_{c}{suffix}" for c in self.inner.components}
        self.components = tuple(self._names.values())

    def describe(self) -> str:
        rule = f"every {self.every}th frame" if self.every is not None else f"{self.count} evenly spaced frames"
        return f"{'/'.join(self.inner.components)} on {rule}, {self.reduction} per video"

    def score(self, videos: Any, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        videos = VideoBatch.from_any(videos)
        md = metadata_list(metadata, len(videos))
        frames, owner, index = videos.frames(self.indices_of)
        frame_md = [{**md[i], "frame_index": f} for i, f in zip(owner, index)]
        raw = check_scores(self.inner.score(frames, [prompts[i] for i in owner], frame_md), len(frames),
                           f"{type(self.inner).__name__} (on video frames)")
        return {self._names[c]: reduce_per_candidate(v, owner, len(videos), self.reduction)
                for c, v in raw.items() if c in self._names}

    __call__ = score

    def pop_failures(self) -> dict[str, int]:
        pop = getattr(self.inner, "pop_failures", None)
        return pop() if pop else {}


class VideoOcrScorer(FramewiseScorer):
    """Component "video_ocr": OcrScorer (trainer.rewards.ocr) on every 4th frame, mean per video
    (FlowGRPO's Wan recipe trains OCR; its video OCR reward reads every 4th frame)."""

    config_fields = ()  # fixed: OCR, every 4th frame, mean

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        from trainer.rewards.ocr import OcrScorer

        super().__init__(scorer=OcrScorer(model_path, device), reduction="mean", every=4)


#: 1 / E|U - U'| for independent uniform U, U' on [0, 1]: scales the mean frame difference so that
#: two unrelated frames of uniform noise score about 0
NOISE_DIFFERENCE_SCALE = 3.0


def temporal_consistency(clip: np.ndarray) -> float:
    """1 - 3 * mean_t mean_pixels |x_{t+1} - x_t| / 255 over consecutive frames of a uint8
    [F, H, W, 3] clip, clipped to [0, 1]; NaN for a single frame (nothing to compare).

    What it measures: pixel-level flicker between consecutive frames. 1 = every frame equals the
    next (a still video); ~0 = consecutive frames as unrelated as independent uniform noise
    (whose mean absolute difference is 1/3); smooth motion of a small object stays near 1.
    A still clip maximises it, so it is a regulariser to weight beside a content reward, never a
    target of its own."""
    if clip.shape[0] < 2:
        return math.nan
    total = 0.0
    for t in range(clip.shape[0] - 1):  # one frame pair at a time: int16 of a whole 81-frame clip is ~200 MB
        diff = np.abs(clip[t + 1].astype(np.int16) - clip[t].astype(np.int16))
        total += float(diff.mean()) / 255.0
    mean_diff = total / (clip.shape[0] - 1)
    return float(min(1.0, max(0.0, 1.0 - NOISE_DIFFERENCE_SCALE * mean_diff)))


class TemporalConsistencyScorer:
    """Component "temporal_consistency" (`temporal_consistency`): no model, no prompt."""

    components = ("temporal_consistency",)
    required_tracks = ("video",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        if model_path:
            raise ValueError(f"temporal_consistency has no weights; --reward-model-path={model_path} is not used")
        del device

    def score(self, videos: Any, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        videos = VideoBatch.from_any(videos)
        return {"temporal_consistency": torch.tensor([temporal_consistency(v) for v in videos.uint8],
                                                     dtype=torch.float32)}

    __call__ = score


def frame_grid(clip: np.ndarray, count: int = 4, columns: int = 2, gap: int = 0) -> np.ndarray:
    """`count` evenly spaced frames of a uint8 [F, H, W, 3] clip (first and last included) laid out
    in reading order, `columns` per row, `gap` white pixels apart; empty cells are white.
    Returns uint8 [rows * H + (rows - 1) * gap, columns * W + (columns - 1) * gap, 3]."""
    if clip.ndim != 4 or clip.shape[3] != 3 or clip.dtype != np.uint8:
        raise ValueError(f"frame_grid: expected uint8 [F, H, W, 3], got {clip.dtype} {tuple(clip.shape)}")
    if not (isinstance(columns, int) and columns >= 1 and isinstance(gap, int) and gap >= 0):
        raise ValueError(f"frame_grid: columns must be >= 1 and gap >= 0, got {columns!r}, {gap!r}")
    picks = sample_frame_indices(int(clip.shape[0]), count=count)
    cols = min(columns, len(picks))
    rows = -(-len(picks) // cols)
    h, w = int(clip.shape[1]), int(clip.shape[2])
    grid = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, 3), 255, dtype=np.uint8)
    for k, f in enumerate(picks):
        r, c = divmod(k, cols)
        grid[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = clip[f]
    return grid


#: the judge's text for a frame grid ({prompt} is the only placeholder, as for images)
DEFAULT_VIDEO_JUDGE_TEMPLATE = (
    "The image is a grid of frames sampled evenly from one video generated from the prompt: \"{prompt}\", "
    "in time order left to right, top to bottom. Rate how well the video matches the prompt, how good it "
    "looks and how consistent it is over time, from 0 (worst) to 10 (best). Answer with the number only.")


class VideoJudgeScorer:
    """Component "video_vlm_judge": the VLM judge (VlmJudgeScorer, same --reward-judge-* settings,
    same failure accounting) on one grid image per candidate (`frame_grid`: 4 evenly spaced frames,
    2 per row). The image judge's default template asks about "an image"; left at that default it
    is replaced by DEFAULT_VIDEO_JUDGE_TEMPLATE, which says the image is a frame grid."""

    components = ("video_vlm_judge",)
    required_tracks = ("video",)
    #: the --reward-judge-* settings reach it as they reach VlmJudgeScorer (rewards.base.scorer_options)
    config_fields = VlmJudgeScorer.config_fields

    def __init__(self, model_path: str | None = None, device: str = "cpu", *, grid_frames: int = 4,
                 grid_columns: int = 2, **judge_options: Any):
        sample_frame_indices(1, count=grid_frames)  # validate now
        if judge_options.get("reward_judge_prompt_template", DEFAULT_TEMPLATE) == DEFAULT_TEMPLATE:
            judge_options["reward_judge_prompt_template"] = DEFAULT_VIDEO_JUDGE_TEMPLATE
        self.judge = VlmJudgeScorer(model_path, device, **judge_options)
        self.grid_frames, self.grid_columns = int(grid_frames), int(grid_columns)

    def grids(self, videos: Any) -> ImageBatch:
        videos = VideoBatch.from_any(videos)
        return ImageBatch([frame_grid(v, self.grid_frames, self.grid_columns) for v in videos.uint8])

    def score(self, videos: Any, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        return {"video_vlm_judge": self.judge.score(self.grids(videos), prompts, metadata)["vlm_judge"]}

    __call__ = score

    def pop_failures(self) -> dict[str, int]:
        return self.judge.pop_failures()


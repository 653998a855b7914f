"""The scorer protocol, the one image conversion, and scorer loading by dotpath.

A scorer is a plain callable with one signature:

    scorer.score(images: ImageBatch, prompts: list[str], metadata: list[dict]) -> {component: Tensor [B]}

It declares the `components` it produces and the media `required_tracks` it needs (("image",)
for every shipped scorer), and is built as `ScorerClass(model_path=..., device=...)`. Images are
converted exactly once per batch, here (`ImageBatch`), never inside a scorer. An edit's source
image(s) come in metadata[SOURCE_IMAGES_KEY] (trainer.rewards.edit).

A plain function with the same arguments is a scorer too, named by its dotpath like a class:

    def brightness(images: ImageBatch, prompts: list[str], metadata: list[dict]) -> list[float]:
        return [float(a.mean()) / 255 for a in images.uint8]

It returns one number per image (None or NaN: could not score that image, its group fails) and
its component is its name ("brightness"). It is called as it is, in this process: it is given no
model directory and no device, so a scorer that loads a model is a class.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from trainer.artifacts import quantize_uint8
from trainer.config import SCORER_SHORT_NAMES
from trainer.dotpath import import_dotpath

#: metadata key of a candidate's source image(s) (image editing): a list, one entry per source in
#: record order, each uint8 [H, W, 3] as the engine conditioned on it (trainer.rewards.edit says
#: which other forms a scorer accepts). The remote route carries them beside the images.
SOURCE_IMAGES_KEY = "source_images"

#: the shipped scorers: component name -> dotpath. One registry, kept in trainer.config (which
#: imports no torch) so that preflight can resolve short names without importing a scorer.
SHIPPED_SCORERS = SCORER_SHORT_NAMES


class RewardError(RuntimeError):
    """A reward could not be computed (bad scorer output, bad configuration)."""


class ScorerUnavailable(RewardError):
    """The scorer could not be reached for a batch (a remote endpoint down or overloaded through
    its retries): the reward manager fails that call's candidates, counted, instead of the run."""


class ImageBatch:
    """A batch of RGB images held once as uint8 arrays, with cached derived views.

    The canonical form is uint8 [H, W, 3] per image: what the rollout writes as PNG, so an image
    scored in-process and the same image re-read from its PNG (tools/score.py) give the same
    reward. `float_tensors` / `pil` are derived from it on first use and cached, so a batch that
    passes through several scorers is converted once.
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        for i, a in enumerate(arrays):
            if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
                raise ValueError(f"image {i}: expected uint8 [H, W, 3], got {a.dtype} {tuple(a.shape)}")
        self._arrays = list(arrays)
        self._pil: list | None = None
        self._float: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def uint8(self) -> list[np.ndarray]:
        """uint8 [H, W, 3] arrays (read-only by convention)."""
        return self._arrays

    @property
    def pil(self) -> list:
        """PIL RGB images, created once."""
        if self._pil is None:
            from PIL import Image

            self._pil = [Image.fromarray(a) for a in self._arrays]
        return self._pil

    @property
    def float_tensors(self) -> list[torch.Tensor]:
        """fp32 CPU tensors [3, H, W] in [0, 1] (= uint8 / 255), created once."""
        if self._float is None:
            self._float = [torch.from_numpy(a).permute(2, 0, 1).float().div_(255.0) for a in self._arrays]
        return self._float

    def slice(self, start: int, stop: int) -> "ImageBatch":
        """Sub-batch [start, stop) sharing the uint8 arrays (views already built are shared too)."""
        out = ImageBatch(self._arrays[start:stop])
        if self._pil is not None:
            out._pil = self._pil[start:stop]
        if self._float is not None:
            out._float = self._float[start:stop]
        return out

    @classmethod
    def from_any(cls, images: Any) -> "ImageBatch":
        """Convert engine output or loaded files into an ImageBatch.

        Accepts: an ImageBatch; a float tensor [3, H, W] or [B, 3, H, W] in [0, 1] (the engine's
        output; values are clamped, then rounded: uint8 = round(clamp(x, 0, 1) * 255), the same
        quantisation as the PNG writer); a list of such [3, H, W] tensors; PIL images (converted to
        RGB); uint8 numpy arrays [H, W, 3].
        """
        if isinstance(images, ImageBatch):
            return images
        if isinstance(images, torch.Tensor):
            if images.ndim == 3:
                images = images.unsqueeze(0)
            if images.ndim != 4 or images.shape[1] != 3:
                raise ValueError(f"expected an image tensor [3, H, W] or [B, 3, H, W], got {tuple(images.shape)}")
            return cls(list(uint8_hwc(images)))
        if isinstance(images, np.ndarray):
            images = [images] if images.ndim == 3 else list(images)
        return cls([_one_to_uint8(img, i) for i, img in enumerate(images)])


def uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """[N, 3, H, W] (images, or a video's frames) float in [0, 1] or uint8 -> uint8 numpy
    [N, H, W, 3], quantised as the PNG writer does (artifacts.quantize_uint8: fp32 whatever the
    input dtype, so bf16 engine output quantises like fp32)."""
    return quantize_uint8(images.detach().cpu()).permute(0, 2, 3, 1).contiguous().numpy()


def _one_to_uint8(img: Any, index: int) -> np.ndarray:
    if isinstance(img, torch.Tensor):
        if img.ndim != 3 or img.shape[0] != 3:
            raise ValueError(f"image {index}: expected a tensor [3, H, W], got {tuple(img.shape)}")
        return uint8_hwc(img.unsqueeze(0))[0]
    if isinstance(img, np.ndarray):
        return img  # ImageBatch checks it is uint8 [H, W, 3]
    if hasattr(img, "convert"):  # PIL.Image
        return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    raise TypeError(f"image {index}: unsupported image type {type(img).__name__}")


@runtime_checkable
class GenerativeRewardScorer(Protocol):
    """What every scorer implements. Built as `cls(model_path=..., device=...)`."""

    #: the component names `score` returns
    components: tuple[str, ...]
    #: media tracks the scorer reads, e.g. ("image",)
    required_tracks: tuple[str, ...]

    def score(
        self, images: ImageBatch, prompts: list[str], metadata: list[dict]
    ) -> Mapping[str, torch.Tensor]:
        """One fp32 CPU tensor [B] per component; NaN marks a candidate that could not be scored."""


class FunctionScorer:
    """A plain function `fn(images, prompts, metadata) -> [B] numbers` as a GenerativeRewardScorer
    (module docstring): its one component is `component`, its numbers become an fp32 tensor, and
    None becomes NaN (not scored)."""

    required_tracks = ("image",)

    def __init__(self, fn: Any, component: str):
        self.fn = fn
        self.components = (component,)

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        values = self.fn(images, prompts, metadata)
        name = self.components[0]
        if isinstance(values, (torch.Tensor, np.ndarray)):
            return {name: torch.as_tensor(values).detach().to("cpu", torch.float32)}
        if isinstance(values, (Mapping, str, bytes)) or not isinstance(values, Iterable):
            raise RewardError(f"scorer function {name!r} returned {type(values).__name__}: a function returns one "
                              "number per image (a list, an array or a 1-D tensor); a scorer with several "
                              "components is a class")
        try:
            return {name: torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)}
        except (TypeError, ValueError) as e:
            raise RewardError(f"scorer function {name!r} returned a value that is not a number: {e}") from None

    __call__ = score


def resolve_scorer_path(scorer_path: str | None) -> str | None:
    """A shipped scorer's short name (its component name, e.g. "pickscore") -> its dotpath;
    anything else unchanged."""
    return SHIPPED_SCORERS.get(scorer_path, scorer_path) if scorer_path else scorer_path


def build_scorer(scorer_path: str, model_path: str | None = None, device: str = "cpu",
                 options: Mapping[str, Any] | None = None) -> Any:
    """Import the scorer at `scorer_path` (a dotpath or a shipped short name) and build it.

    A class is built with (model_path, device) and, for a scorer with settings of its own (its
    `config_fields`), those settings as keyword arguments. A plain function becomes a
    FunctionScorer whose component is the dotpath's last name; it takes no model directory."""
    from trainer.config import unknown_scorer_name

    if problem := unknown_scorer_name("--reward-scorer-path", scorer_path):
        raise ValueError(problem)
    scorer_path = resolve_scorer_path(scorer_path)
    obj = import_dotpath(scorer_path, "--reward-scorer-path")
    if inspect.isclass(obj):
        scorer = obj(model_path=model_path, device=device, **dict(options or {}))
    elif callable(obj):
        if model_path:
            raise ValueError(
                f"--reward-scorer-path={scorer_path!r} is a function, which takes no --reward-model-path "
                f"(got {model_path}); a scorer that loads a model is a class built as cls(model_path=..., device=...)"
            )
        return FunctionScorer(obj, scorer_path.rsplit(".", 1)[1])
    else:
        raise TypeError(f"--reward-scorer-path={scorer_path!r} is a {type(obj).__name__}, neither a scorer class "
                        "nor a function")
    for attr in ("components", "required_tracks", "score"):
        if not hasattr(scorer, attr):
            raise TypeError(
                f"--reward-scorer-path={scorer_path!r} does not implement GenerativeRewardScorer: missing {attr!r}"
            )
    return scorer


def scorer_options(scorer_path: str | None, config: Any) -> dict[str, Any]:
    """The settings a scorer class declares in `config_fields`, read from a config section
    (duck-typed; unset fields are left to the scorer's defaults)."""
    if not scorer_path or config is None:
        return {}
    cls = import_dotpath(resolve_scorer_path(scorer_path), "--reward-scorer-path")
    fields = getattr(cls, "config_fields", ())
    return {f: getattr(config, f) for f in fields if getattr(config, f, None) is not None}


def check_scores(
    scores: Mapping[str, Any], batch_size: int, source: str
) -> dict[str, torch.Tensor]:
    """Validate a scorer's output: every component a 1-D length-`batch_size` vector.

    Returns fp32 CPU tensors. Non-finite values are kept (they fail their group later, visibly);
    a wrong shape is a scorer bug and raises, naming `source`.
    """
    if not isinstance(scores, Mapping):
        raise RewardError(f"{source} returned {type(scores).__name__}, expected a dict {{component: [B] scores}}")
    out = {}
    for name, value in scores.items():
        t = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(-1)
        if t.numel() != batch_size:
            raise RewardError(
                f"{source} returned {t.numel()} values for component {name!r}, "
                f"expected {batch_size} (one per image)"
            )
        out[str(name)] = t
    return out


def metadata_list(metadata: Iterable[dict] | None, n: int) -> list[dict]:
    """None -> n empty dicts; otherwise a list that must have n entries."""
    if metadata is None:
        return [{} for _ in range(n)]
    md = [dict(m or {}) for m in metadata]
    if len(md) != n:
        raise ValueError(f"got {len(md)} metadata entries for {n} images")
    return md

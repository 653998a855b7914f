"""A newcomer's first hour with video and editing, through the commands the docs give: the sample
tool's video defaults, a partial --sampling-config, a mistyped scorer name, --load pointed at the
wrong level, and the warnings a Wan run prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_fsdp_view_warning_is_silenced_for_wans_roots_and_shown_for_other_modules():
    """FSDP2's "returned a view tensor" warning, as torch words it, for the root of each Wan model
    (one DiT, two experts) is silenced like the image families'; for a block, or any module not a
    root transformer, it still shows."""
    import warnings

    from trainer.loop import silence_known_harmless_warnings

    text = ("FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view (e.g., `x += y`) will "
            "silently drop the pre-backward hook and skip the all-gather, which can cause backward to fail or "
            "produce wrong gradients.")
    roots = ["FSDPWanTransformer3DModel", "FSDPWanExperts", "FSDPQwenImageTransformer2DModel"]
    others = ["FSDPWanTransformerBlock", "FSDPMyWanTransformer3DModelWrapper", "FSDPUNet3DConditionModel"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_harmless_warnings()
        for cls in roots + others:
            warnings.warn(text.format(cls), UserWarning)
    assert [str(w.message) for w in seen] == [text.format(cls) for cls in others]

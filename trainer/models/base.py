"""The model-adapter protocol: everything model-family specific the runtime needs.

The runtime depends only on this surface. A new family is a new adapter class chosen by
--model-adapter-path (a dotpath), plus its task string in GENERATION_TASKS.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

# Only tasks with a working replay path are listed here.
GENERATION_TASKS = ("t2i",)


class ModelFilesError(ValueError):
    """A model directory's files contradict each other; the message names the file to fix."""


@runtime_checkable
class GenerativeModelAdapter(Protocol):
    family: str
    supported_tasks: tuple[str, ...]
    #: module-name suffixes LoRA is applied to when --lora-target-modules is unset
    lora_target_modules: tuple[str, ...]

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None) -> Any:
        """Load only the trainable transformer (frozen text encoder / VAE belong to the engine)."""

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: Any, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> Any:
        """Turn one candidate into an engine RolloutRequest; guidance_scale != 1.0 raises."""

    def validate_rollout_response(self, response: dict) -> None:
        """Raise if trajectory latents, timesteps, sde indices, height or width are missing."""

    def pack_trajectory(self, responses: list[dict]) -> dict[str, Any]:
        """Collate candidates into one batch of tensors with a leading candidate dimension
        (what the sidecar stores and what replay_transition consumes)."""

    def replay_transition(self, transformer: Any, batch: dict[str, Any], step: int, sampling: Any) -> Any:
        """Log-prob [B] (fp32) of the recorded transition of trained-step column `step`,
        recomputed through `transformer` with the same math the sampler used."""

    def replay_transitions(self, transformer: Any, batch: dict[str, Any], sampling: Any) -> Any:
        """Log-probs [B, S] (fp32) of every trained-step column at once (what the update calls);
        equal to S replay_transition calls up to batch-size-dependent rounding."""

    def never_trained_param_names(self, model: Any) -> list[str]:
        """Parameters (wrapper-free model names) of the train model whose output the family
        discards, so they can never receive a gradient; the actor freezes exactly these. [] when
        there are none."""

    def artifact_tracks(self) -> tuple[str, ...]:
        """Media tracks a rollout produces (e.g. ("image",))."""

    def weight_name_map(self, name: str) -> str:
        """Map a training-side parameter name to the engine's name."""

"""The model-adapter protocol: everything model-family specific the runtime needs.

The runtime depends only on this surface: the actor (train model, LoRA targets, never-trained
parameters), the loop and rollout (requests, trajectory checks, replay) and the native engine (its modules,
prompt encoding, latent layout, velocity, decode). docs/architecture.md lists it with its callers. A new family is a new adapter class chosen by
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

    def validate_trajectory(self, traj: Any) -> None:
        """Raise ValueError when an engine's trajectory.Trajectory does not fit this family (its
        generic shape checks, Trajectory.validate, plus the family's latent layout and conditions)."""

    def replay_transition(self, transformer: Any, batch: Any, step: int, sampling: Any) -> Any:
        """Log-prob [B] (fp32) of the recorded transition of trained-step column `step` of a
        Trajectory, recomputed through `transformer` with the same math the sampler used."""

    def replay_transitions(self, transformer: Any, batch: Any, sampling: Any) -> Any:
        """Log-probs [B, S] (fp32) of every trained-step column at once (what the update calls);
        equal to S replay_transition calls up to batch-size-dependent rounding."""

    def never_trained_param_names(self, model: Any) -> list[str]:
        """Parameters (wrapper-free model names) of the train model whose output the family
        discards, so they can never receive a gradient; the actor freezes exactly these. [] when
        there are none."""

    # -- the engine's side (engine/native.py is generic over these) ----------------------------

    def load_rollout_modules(self, model_path: str, *, dtype: Any, device: Any) -> dict[str, Any]:
        """The frozen pipeline from a local directory: "transformer", "vae", "text_encoder",
        "tokenizer" and "scheduler_config" (a dict), modules already on `device` in `dtype`."""

    def prompt_encoder(self, transformer: Any, vae: Any, text_encoder: Any, tokenizer: Any,
                       scheduler_config: dict) -> Any:
        """A callable encode(prompts, device, max_sequence_length) -> (embeds [B, T, D],
        mask [B, T] or None)."""

    def latent_geometry(self, vae: Any) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the VAE."""

    def initial_latents(self, x_t: Any, transformer: Any, height: int, width: int, vae_scale_factor: int) -> Any:
        """Unpacked x_T [B, C, h, w] -> the DiT's input layout; raises if the shape does not fit."""

    def pad_text(self, embeds: Any, masks: Any) -> tuple[Any, Any]:
        """Per-prompt conditioning ([T_i, D] and [T_i] or None) -> one padded batch and its mask."""

    def velocity(self, transformer: Any, x: Any, t: Any, embeds: Any, mask: Any, height: int, width: int,
                 vae_scale_factor: int) -> Any:
        """The DiT's velocity for latents x at timesteps t [B]: the call replay makes too."""

    def guided_velocity(self, transformer: Any, x: Any, t: Any, embeds: Any, mask: Any, negative_embeds: Any,
                        negative_mask: Any, height: int, width: int, vae_scale_factor: int, guidance_scale: float,
                        renorm: bool) -> Any:
        """True-CFG velocity (guidance_scale > 1): conditional and unconditional rows in one
        forward, combined; the call replay makes too."""

    def decode(self, vae: Any, latents: Any, height: int, width: int, vae_scale_factor: int) -> Any:
        """Final latents -> images [B, 3, H, W] float32 in [0, 1] on CPU."""

    # -- misc ------------------------------------------------------------------------------

    def artifact_tracks(self) -> tuple[str, ...]:
        """Media tracks a rollout produces (e.g. ("image",))."""

    def weight_name_map(self, name: str) -> str:
        """Map a training-side parameter name to the engine's name."""

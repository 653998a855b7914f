"""Model adapters: the protocol and GENERATION_TASKS (base.py), the Qwen-Image adapter
(qwen_image.py). Kept import-light: preflight imports trainer.models.base without torch."""

"""Rollout engines: the protocol (base.py) and the native diffusers engine (native.py).

Kept import-light on purpose: `import trainer.engine.base` must not pull in torch-heavy
modules; import `trainer.engine.native` explicitly where the engine is built.
"""

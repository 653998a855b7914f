"""FlowGRPO post-training for text-to-image flow-matching models (torchrun + FSDP2)."""

__version__ = "0.1.0"

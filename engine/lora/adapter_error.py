"""The error every adapter-checkpoint refusal raises (`engine/lora/adapter_checkpoint.py`)."""


class AdapterError(ValueError):
    """The adapter is malformed or unsupported; the message names the offending field or tensor."""

"""llama-chat: a terminal runner for Llama-family models."""

__version__ = "0.1.0"

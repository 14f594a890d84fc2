"""dflash-server: LLM inference with DFlash speculative decoding."""

__version__ = "0.1.0"

"""Loggers for code that runs inside vLLM engines."""

from __future__ import annotations

import logging

__all__ = ["get_logger"]


def get_logger(module: str) -> logging.Logger:
    """A logger under vLLM's ``vllm`` tree, so engine logs show the connector's lines with
    vLLM's handler, format and level (``VLLM_LOGGING_LEVEL``)."""
    return logging.getLogger(f"vllm.{module}")

"""The SDK's version, sent with every tagged request (protocol.md section 2)."""

__version__ = "0.1.0"

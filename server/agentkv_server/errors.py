"""Exception tree of the server side.

AgentKVError                 (agentkv, the SDK's root: one hierarchy for the project)
 └── AgentKVServerError
      ├── ConfigError        bad settings or command-line options
      ├── EngineError        an engine could not be started, reached or used
      │    └── PortInUseError  a port it needed was taken (other ports may work)
      └── ModelError         a model could not be found, prepared or verified
"""

from __future__ import annotations

from agentkv import AgentKVError

__all__ = ["AgentKVServerError", "ConfigError", "EngineError", "ModelError", "PortInUseError"]


class AgentKVServerError(AgentKVError):
    """Root of every error raised by agentkv's server side."""


class ConfigError(AgentKVServerError):
    """Settings or options that cannot work together."""


class EngineError(AgentKVServerError):
    """An engine failed to start, answer or serve."""


class PortInUseError(EngineError):
    """A server could not bind a port it was given; the same start on other ports may work."""


class ModelError(AgentKVServerError):
    """A model's package is missing, or its weights failed to convert or verify."""

"""agentkv server side: router, vLLM KV connector, local bundle and benchmark.

The rooms import one way: ``bundle`` and ``bench`` may use ``router``; the ``connector`` runs
inside vLLM engines and talks to the router only over HTTP. Nothing here is imported by the SDK.
"""

from agentkv_server.errors import AgentKVServerError, ConfigError, EngineError

__all__ = ["AgentKVServerError", "ConfigError", "EngineError"]

"""vLLM plugin: names ``AgentKVConnector`` in vLLM's connector registry, in every vLLM process.

Engines load the connector by module path, which needs no registry. A ``MultiConnector`` (the
connector beside the host tier's offloading connector: bundle/launcher.py ``with_host_tier``)
also looks its children up by class name in the API server process, to rebuild their transfer
statistics, and that process never imports the connector; without the name it fails every
request. The entry point (pyproject.toml, ``vllm.general_plugins``) runs :func:`register` in
each vLLM process; registering is lazy (a module path and a class name), so it costs nothing.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(
            "AgentKVConnector", "agentkv_server.connector", "AgentKVConnector"
        )
    except ValueError:  # registered already: the plugin ran before in this process
        pass

from agentkv_server import router, settings, testing
from agentkv_server.errors import AgentKVServerError


def test_exports_are_sorted_and_importable():
    for module in (router, settings, testing):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name)


def test_router_errors_join_the_project_tree():
    assert issubclass(router.RouterError, AgentKVServerError)

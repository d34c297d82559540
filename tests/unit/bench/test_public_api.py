from agentkv_server import bench


def test_all_names_the_public_api_once() -> None:
    assert len(set(bench.__all__)) == len(bench.__all__)
    assert all(hasattr(bench, name) for name in bench.__all__)
    assert bench.BASELINE in bench.MODES
    assert set(bench.MODES) == {"recompute", "upstream", "upstream-best", "agentkv", "aggregated"}

from agentkv_server import plan


def test_all_names_the_public_api_once() -> None:
    assert len(set(plan.__all__)) == len(plan.__all__)
    assert all(hasattr(plan, name) for name in plan.__all__)
    assert set(plan.PATHS) == {"recompute", "pull", "holder"}

import inspect

import agentkv


def test_all_is_sorted_and_matches_the_public_names():
    public = {
        name
        for name, value in vars(agentkv).items()
        # agentkv.testing is a submodule that tests import, never re-exported.
        if not name.startswith("_") and not (inspect.ismodule(value) and name == "testing")
    }
    assert agentkv.__all__ == sorted(agentkv.__all__)
    assert set(agentkv.__all__) == public | {"__version__"}


def test_errors_share_one_root():
    assert issubclass(agentkv.SessionError, agentkv.AgentKVError)

"""``pip install 'agentkv[EXTRA]'`` into a clean venv, then importing the extra's modules, works.

Runs scripts/check_extras.py for the light extras, one venv each. Opt-in (``pytest
tests/packaging -m extras``): each install fetches its packages anew, minutes each on the shared
development machines, more than the default run can afford. The engine extras are left out:
``cpu`` is what scripts/install itself installs and import-checks before every CI run, and
``gpu`` needs several GB of CUDA wheels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.extras

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_extras.py"
_spec = importlib.util.spec_from_file_location("check_extras", _SCRIPT)
assert _spec is not None and _spec.loader is not None
check_extras = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_extras)


@pytest.mark.parametrize("extra", check_extras.LIGHT)
def test_extra_installs_and_its_modules_import(extra: str) -> None:
    ok, detail = check_extras.check(extra)
    assert ok, f"agentkv[{extra}]: {detail}"

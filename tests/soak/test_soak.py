"""The soak tier: the real 1P2D stack for a set time under concurrent agent sessions while
engines are killed and restarted, then one test per criterion (docs/faults.md, "Soak").

Opt-in (the default run deselects the ``soak`` marker); it starts engines, so run it under the
machine's engine lock, with ``-s`` for the report:

    flock /tmp/agentkv-engines.lock .venv/bin/python -m pytest -m soak tests/soak -s
    AGENTKV_SOAK_MINUTES=4 AGENTKV_SOAK_KILL_EVERY_S=60 \\
        flock /tmp/agentkv-engines.lock timeout 900 .venv/bin/python -m pytest -m soak tests/soak -s

``AGENTKV_SOAK_MINUTES`` (30), ``AGENTKV_SOAK_KILL_EVERY_S`` (150; 0: no kills) and
``AGENTKV_SOAK_SESSIONS`` (4) are the usual knobs; every field of ``soak.SoakConfig`` can be set
the same way. The soak runs once, in the module's fixture; each test then judges one criterion
of its outcome, and the report ends with every criterion's verdict, so a run stopped by ``-x``
still shows them all.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_SPEC = importlib.util.spec_from_file_location("agentkv_soak", Path(__file__).with_name("soak.py"))
assert _SPEC is not None and _SPEC.loader is not None
soak = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = soak  # dataclasses look their module up
_SPEC.loader.exec_module(soak)

CONFIG = soak.SoakConfig.from_env()

pytestmark = [pytest.mark.soak, pytest.mark.timeout(CONFIG.timeout_s)]


@pytest.fixture(scope="module")
def outcome() -> Any:
    """The soak's outcome (``soak.Outcome``), its report printed."""
    return soak.soak(CONFIG)


def judge(outcome: Any, name: str) -> None:
    criterion = outcome.criteria()[name]
    assert criterion.passed, f"{name}: {criterion.detail}"


def test_the_soak_ran_as_planned(outcome: Any) -> None:
    """Turns answered, a non-empty oracle sample, the kills due, every killed engine back."""
    judge(outcome, "ran as planned")


def test_no_turn_is_lost(outcome: Any) -> None:
    judge(outcome, "lost turns")


def test_no_answer_is_wrong(outcome: Any) -> None:
    judge(outcome, "wrong answers")


def test_no_kv_read_fails_between_live_engines(outcome: Any) -> None:
    judge(outcome, "failed KV reads")


def test_few_fallback_turns_away_from_kills(outcome: Any) -> None:
    judge(outcome, "fallback turns")


def test_p99_turn_time_does_not_drift(outcome: Any) -> None:
    judge(outcome, "p99 drift")


def test_rss_stays_flat(outcome: Any) -> None:
    judge(outcome, "RSS")

"""``agentkv plan`` through the top-level command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentkv_server.cli import main
from agentkv_server.plan import SEED_CASES, SEED_TOLERANCE, check_seed


def test_table_and_plot(tmp_path: Path, capsys) -> None:
    plot = tmp_path / "plan.png"
    assert main(["plan", "--plot", str(plot), "--history-tokens", "4096,65536"]) == 0
    out = capsys.readouterr().out
    assert "NOT A MEASUREMENT" in out and "seed check" in out and str(plot) in out
    assert plot.stat().st_size > 0


def test_json_has_the_seed_check(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--json", "--no-plot", "--model", "qwen3-32b"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [set(c) >= {"predicted_ratio", "published_ratio"} for c in data["seed_check"]] == [
        True
    ] * len(SEED_CASES)
    assert [m["name"] for m in data["models"]] == ["Qwen3-32B"]
    assert data["plot"] is None
    assert {r["history_tokens"] for r in data["models"][0]["rows"]} == {
        2048 * 2**i for i in range(7)
    }


def test_check_seed_exit_code_follows_the_seed_check(capsys) -> None:
    seed_ok = all(abs(check_seed(c).relative_error) <= SEED_TOLERANCE for c in SEED_CASES)
    assert main(["plan", "--no-plot", "--check-seed"]) == (0 if seed_ok else 1)
    assert main(["plan", "--no-plot"]) == 0
    capsys.readouterr()


def test_flags_change_the_answer(capsys) -> None:
    def pull_ms(*flags: str) -> float:
        main(["plan", "--json", "--no-plot", "--model", "glm-5-fp8", *flags])
        row = json.loads(capsys.readouterr().out)["models"][0]["rows"][-1]
        return row["ttft_ms"]["pull"]

    assert pull_ms("--link-efficiency", "0.2") > pull_ms()
    assert pull_ms("--new-tokens", "4000") > pull_ms()
    assert pull_ms("--kv-cache-dtype", "fp8") < pull_ms()  # half the latent bytes to move


def test_help_lists_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--json", "--plot", "--no-plot", "--check-seed", "--history-tokens", "--mfu"):
        assert flag in out
    assert "off by more than 15%" in out


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--history-tokens", "0"], "must be at least 1"),
        (["--history-tokens", "2k"], "not a whole number"),
        (["--mfu", "1.5"], "must be in (0, 1]"),
        (["--mfu", "0"], "must be above 0"),
        (["--itl-budget-ms", "-5"], "must be above 0"),
        (["--model", "gpt-9"], "invalid choice"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(flags, complaint, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", *flags])
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_missing_matplotlib_is_named_with_its_extra(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--plot", "unused.png"])
    assert "agentkv[bench]" in str(exited.value.code) and "--no-plot" in str(exited.value.code)
    assert main(["plan", "--no-plot"]) == 0
    capsys.readouterr()

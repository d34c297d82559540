"""Conventions every ``agentkv`` subcommand follows: a version, help on each option, exit codes."""

from __future__ import annotations

import argparse

import pytest

from agentkv import __version__
from agentkv_server.cli import EXIT_USAGE, SUBCOMMANDS, build_parser, main


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"agentkv {__version__}"


def _options(command: str) -> list[argparse.Action]:
    parser = build_parser([command])
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_has_help(command: str) -> None:
    missing = [a.option_strings or a.dest for a in _options(command) if not (a.help or "").strip()]
    assert not missing, f"agentkv {command}: options without help: {missing}"


def test_one_name_per_concept_across_serve_router_and_bench() -> None:
    """Engine URLs are --prefill-url/--decode-url wherever they are asked for; serve's engine
    counts are --prefill-engines/--decode-engines; the old --prefill/--decode are aliases."""
    meanings: dict[str, set[tuple[str | None, str | None]]] = {}
    for command in ("serve", "router", "bench"):
        for action in _options(command):
            for flag in action.option_strings:
                if flag not in ("--prefill", "--decode", "--redis"):
                    meanings.setdefault(flag, set()).add((action.metavar, str(action.type)))
    clashes = {flag: kinds for flag, kinds in meanings.items() if len(kinds) > 1}
    assert not clashes
    assert {"--prefill-url", "--decode-url"} <= {
        f for a in _options("bench") for f in a.option_strings
    }
    assert {"--prefill-engines", "--decode-engines"} <= {
        f for a in _options("serve") for f in a.option_strings
    }


def test_no_command_is_a_usage_error(capsys) -> None:
    assert main([]) == EXIT_USAGE
    assert "COMMAND" in capsys.readouterr().out


def test_a_missing_extra_is_one_line_and_a_usage_error(monkeypatch, capsys) -> None:
    monkeypatch.setitem(SUBCOMMANDS, "router", ("agentkv_server.no_such_module", "server", "x"))
    assert main(["router"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "pip install 'agentkv[server]'" in err and len(err.splitlines()) == 1

#!/usr/bin/env python3
"""Install each extra of agentkv into a clean venv and import the modules it is for.

    python scripts/check_extras.py                 the light extras (see LIGHT)
    python scripts/check_extras.py server cpu      the ones named ("base": no extra)

Each check creates a venv in a temporary directory, runs ``pip --python VENV install -c
scripts/constraints.txt '.[EXTRAS]'`` with this interpreter's pip (not editable: the wheel's
contents are what is checked),
then imports every module of the packages the extra is for, one by one, in that venv. A module
that fails to import there is a package the extra does not bring. Prints one line per check
and the seconds it took; exits 1 if any failed.

``cpu`` installs vLLM's CPU build and torch (minutes, about 2 GB); ``gpu`` needs CUDA wheels
(several GB) and is only worth running on a GPU machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"

# check name -> (extras installed, packages/modules whose every module must import)
CHECKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "base": ((), ("agentkv",)),
    "server": (("server",), ("agentkv_server.router", "agentkv_server.settings")),
    "bench": (("server", "bench"), ("agentkv_server.bench", "agentkv_server.plan")),
    "langchain": (("langchain",), ("agentkv_langchain",)),
    "llamaindex": (("llamaindex",), ("agentkv_llamaindex",)),
    "agents": (("agents",), ("agentkv_openai_agents",)),
    "dev": (("server", "dev"), ("agentkv_server.testing",)),
    "cpu": (("server", "cpu"), ("agentkv_server.connector", "agentkv_server.bundle")),
    "gpu": (("server", "gpu"), ("agentkv_server.connector", "agentkv_server.bundle")),
}
LIGHT = ("base", "server", "bench", "langchain", "llamaindex", "agents", "dev")

# Run inside the new venv: import every module under the given names, report failures.
_IMPORT_ALL = """
import importlib, pkgutil, sys, traceback
failed = []
for name in sys.argv[1:]:
    root = importlib.import_module(name)
    names = [name] + [m.name for m in pkgutil.walk_packages(getattr(root, "__path__", []), name + ".")]
    for module in names:
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def check(name: str, keep: bool = False) -> tuple[bool, str]:
    """Install and import; (ok, what failed or how long it took)."""
    extras, modules = CHECKS[name]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"agentkv-extra-{name}-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir)  # no pip inside: this interpreter's pip installs into it
        python = str(env_dir / "bin" / "python")
        target = f"{ROOT}[{','.join(extras)}]" if extras else str(ROOT)
        install = subprocess.run(
            [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
            + ["-c", str(CONSTRAINTS), target],
            capture_output=True,
            text=True,
            check=False,
        )
        if install.returncode != 0:
            return False, "pip install failed: " + _last_lines(install.stderr)
        imported = subprocess.run(
            [python, "-c", _IMPORT_ALL, *modules],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp,  # not the repository: the installed copy must be the one imported
        )
        if imported.returncode != 0:
            return False, "imports failed: " + _last_lines(imported.stdout + imported.stderr)
    return True, f"{time.monotonic() - started:.0f} s"


def _last_lines(text: str, count: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if "WARNING: Location" not in line]
    return " | ".join(lines[-count:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "checks", nargs="*", default=list(LIGHT), metavar="EXTRA",
        help=f"extras to check (default: {' '.join(LIGHT)}; also: cpu, gpu)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.checks) - set(CHECKS)):
        parser.error(f"unknown extra(s) {unknown}; choose from {', '.join(CHECKS)}")
    failures = 0
    for name in args.checks:
        ok, detail = check(name)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:11} {detail}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

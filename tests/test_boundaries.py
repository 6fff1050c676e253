"""The module boundaries hold, and the tools that hold them catch a violation: each
import-linter contract of pyproject.toml is checked on the real source, then on a copy
with one violation planted per contract; the private-name rule likewise."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sparsevllm"
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))


def lint_imports(src_root: Path) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS, "lint-imports is not installed (make test installs it)"
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache"],
        cwd=ROOT,  # its pyproject.toml holds the contracts; PYTHONPATH picks the source
        env={"PYTHONPATH": str(src_root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_source_keeps_every_contract():
    result = lint_imports(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# (file to change, line appended, contract that must then report BROKEN)
VIOLATIONS = [
    ("engine/kv_pool.py", "import sparsevllm.server.app", "Layers"),
    ("engine/scheduler.py", "import torch", "never import torch"),
    ("sparse/vanilla.py", "import sparsevllm.config", "know nothing of the engine"),
    ("calibration/budget.py", "import numpy", "read and made without torch"),
    ("server/app.py", "from ray import serve", "Ray stays optional"),
    (
        "engine/cache/chains.py",
        "\ndef _late():\n    import sparsevllm.engine.scheduler\n",
        "cycles",
    ),
]


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    shutil.copytree(SRC, root / "sparsevllm", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("path,line,contract", VIOLATIONS)
def test_a_planted_violation_breaks_its_contract(source_copy, path, line, contract):
    target = source_copy / "sparsevllm" / path
    original = target.read_text()
    target.write_text(original + "\n" + line + "\n")
    try:
        result = lint_imports(source_copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0
    # A BROKEN line may end with "(n ignored imports)".
    broken = [ln for ln in result.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), result.stdout


def private_imports(tree: ast.AST, module: str) -> list[str]:
    """`from sparsevllm.x import _name` where x is another module: a private name used
    across modules (it should be made public, or stay where it is used)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsevllm"):
            if node.module == module:
                continue
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_imported_across_modules():
    bad = {}
    for path in SRC.rglob("*.py"):
        module = "sparsevllm." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        names = private_imports(ast.parse(path.read_text()), module.removesuffix(".__init__"))
        if names:
            bad[str(path.relative_to(ROOT))] = names
    assert not bad, bad


def test_the_private_name_rule_catches_one():
    tree = ast.parse("from sparsevllm.engine.kv_pool import _helper, __version__\n")
    assert private_imports(tree, "sparsevllm.engine.scheduler") == [
        "sparsevllm.engine.kv_pool._helper"
    ]

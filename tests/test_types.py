"""The type checker holds the packages listed in pyproject's [tool.mypy] `files`: mypy
passes on the source and fails on a copy with a type error planted; and nothing on those
modules' boundaries (public functions, methods, class attributes and type aliases) is
typed with Any, whether written out or implied by a bare generic such as `dict`."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MYPY = shutil.which("mypy", path=str(Path(sys.executable).parent))
# Generics whose bare name means "of Any": `dict` is `dict[Any, Any]`.
BARE_GENERICS = frozenset(
    "dict list set frozenset tuple type Callable Mapping MutableMapping Sequence Iterable "
    "Iterator".split()
)


def typed_files() -> list[Path]:
    """The Python files mypy checks, as pyproject's `files` lists them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    paths = [ROOT / entry for entry in config["files"]]
    return sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def admits_any(annotation: ast.expr, own: frozenset[str] = frozenset()) -> str | None:
    """Why `annotation` lets Any in (None: it does not). `own`: names the module imports
    from the project (the engine's `Sequence` class is no bare generic)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:  # a forward reference (or a Literal's text, which parses to no Any)
            return admits_any(ast.parse(annotation.value, mode="eval").body, own)
        except SyntaxError:
            return None
    subscripted = {id(n.value) for n in ast.walk(annotation) if isinstance(n, ast.Subscript)}
    for node in ast.walk(annotation):
        name = _name(node) if isinstance(node, ast.expr) else None
        if name == "Any":
            return "Any"
        if name in BARE_GENERICS and name not in own and id(node) not in subscripted:
            return f"a bare {name}"
        if isinstance(node, ast.Subscript) and _name(node.value) == "Callable":
            params = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else None
            if isinstance(params, ast.Constant) and params.value is Ellipsis:
                return "Callable[..., ...]"
        if node is not annotation and isinstance(node, ast.Constant):
            if isinstance(node.value, str) and (why := admits_any(node, own)):
                return why
    return None


def _is_public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.expr]:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
    yield from (p.annotation for p in params if p is not None and p.annotation is not None)
    if fn.returns is not None:
        yield fn.returns


def boundary(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.expr]]:
    """(name, annotation) of each type on a module's boundary: its public functions'
    parameters and returns, its public classes' public methods and attributes, its
    public annotated names and type aliases."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_public(node.name):
            yield from ((prefix + node.name, t) for t in _signature(node))
        elif isinstance(node, ast.ClassDef) and not prefix and _is_public(node.name):
            yield from boundary(node.body, prefix=node.name + ".")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_public(node.target.id):
                yield prefix + node.target.id, node.annotation
                if _name(node.annotation) == "TypeAlias" and node.value is not None:
                    yield prefix + node.target.id, node.value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            # `X = dict[str, Any]`: an alias without its TypeAlias annotation.
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            yield from ((prefix + n, node.value) for n in names if _is_public(n))


def project_names(tree: ast.Module) -> frozenset[str]:
    """Names a module imports from the project itself (`from sparsevllm.x import Y`)."""
    return frozenset(
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsevllm")
        for alias in node.names
    )


def any_on_boundary(source: str) -> list[str]:
    tree = ast.parse(source)
    own = project_names(tree)
    return [
        f"{name}: {why}"
        for name, annotation in boundary(tree.body)
        if (why := admits_any(annotation, own))
    ]


def test_no_boundary_of_a_typed_module_admits_any():
    files = typed_files()
    assert ROOT / "src/sparsevllm/sparse/base.py" in files, files
    bad = {
        str(path.relative_to(ROOT)): found
        for path in files
        if (found := any_on_boundary(path.read_text()))
    }
    assert not bad, bad


@pytest.mark.parametrize(
    "source,found",
    [
        ("def f(x: Any) -> None: ...", ["f: Any"]),
        ("def f() -> dict[str, typing.Any]: ...", ["f: Any"]),
        ("def f(x: 'list[Any] | None') -> None: ...", ["f: Any"]),
        ("def f(*args: int, **kw: dict) -> None: ...", ["f: a bare dict"]),
        ("def f(cb: Callable[..., int]) -> None: ...", ["f: Callable[..., ...]"]),
        (
            "class C:\n    kv: Any = None\n    def m(self) -> list: ...",
            ["C.kv: Any", "C.m: a bare list"],
        ),
        ("class C:\n    def __init__(self, x: Any) -> None: ...", ["C.__init__: Any"]),
        (
            "X: TypeAlias = 'Mapping[str, Any]'\nY = Callable[..., int]",
            ["X: Any", "Y: Callable[..., ...]"],
        ),
        ("def _f(x: Any) -> Any: ...\nclass _C:\n    y: Any", []),
        ("class C:\n    def _m(self, x: Any) -> None: ...\n    _y: Any", []),
        ("def f(x: tuple[int, ...], y: type[object]) -> Mapping[str, object]: ...", []),
        # A project class that shares a generic's name is no bare generic ...
        ("from sparsevllm.engine.sequence import Sequence\ndef f(s: Sequence) -> None: ...", []),
        # ... but typing's is.
        ("from typing import Sequence\ndef f(s: Sequence) -> None: ...", ["f: a bare Sequence"]),
    ],
)
def test_the_boundary_check_finds_any(source, found):
    assert any_on_boundary(source) == found


def run_mypy(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """mypy as `make lint` runs it, in `root` (its pyproject.toml and src/)."""
    assert MYPY, "mypy is not installed (make test installs it)"
    return subprocess.run(
        [MYPY, "--cache-dir", str(cache)],
        cwd=root,
        env={"PATH": "/usr/bin:/bin"},  # no PYTHONPATH: the config's mypy_path finds src/
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """Shared by both runs: the second rechecks only the project's modules. It starts
    from a copy of the cache `make lint` left (a cold check of torch's stubs takes
    minutes on a small machine; the result is the same, the source is checked again)."""
    cache = tmp_path_factory.mktemp("mypy_cache")
    warm = ROOT / ".mypy_cache"
    if warm.is_dir():
        shutil.copytree(warm, cache, dirs_exist_ok=True)
    return cache


def test_mypy_passes_on_the_source(mypy_cache):
    result = run_mypy(ROOT, mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_mypy_fails_on_a_planted_type_error(tmp_path, mypy_cache):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(
        ROOT / "src" / "sparsevllm",
        tmp_path / "src" / "sparsevllm",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    target = tmp_path / "src" / "sparsevllm" / "sparse" / "vanilla.py"
    target.write_text(target.read_text() + '\n\ndef planted() -> int:\n    return "x"\n')
    result = run_mypy(tmp_path, mypy_cache)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [ln for ln in result.stdout.splitlines() if ": error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("src/sparsevllm/sparse/vanilla.py:"), errors
    assert "Incompatible return value type" in errors[0]

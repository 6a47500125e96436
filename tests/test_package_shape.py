"""The shape of the package: what a user imports is the library, and only the library.

* nothing under `tf_metaalign/` imports the programs' package `trainers` (our
  experiments live there and run from a checkout; they are not installed), nor the tests;
* every package `__init__` of the library lists its public API in `__all__`, and every
  name listed resolves;
* every program module in `trainers/` is split by stage (under ~400 lines each);
* the tree passes the lint settings of pyproject.toml (`ruff check`, when ruff is
  installed: it is in the `test` extra).
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tf_metaalign"


def _imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_library_never_imports_the_programs_or_the_tests():
    """Nor `tests` nor a test helper by its module name (`golden_io`, `trainer_entries`, ...:
    importable under pytest, where tests/ is on sys.path, but not for a user)."""
    tests = ROOT / "tests"
    helpers = {path.stem for path in tests.rglob("*.py")} - {"__init__"}
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted(LIBRARY.rglob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[0] in {"trainers", "tests"} | helpers
    ]
    assert not offenders, offenders


def test_only_the_library_is_installed():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["tf_metaalign", "tf_metaalign.*"]' in text
    assert not (ROOT / "setup.py").exists()


def _packages():
    return sorted(p.parent for p in LIBRARY.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_library_package_lists_its_public_api(package):
    name = ".".join(package.relative_to(ROOT).parts)
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name}/__init__.py has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names it does not define: {missing}"


def test_the_tree_passes_the_lint_settings():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run(
        [ruff, "check", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    proc = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


#: tests/ mirrors the library: a folder per library package with tests of its own, the
#: top-level modules' tests (functional, forward_mode, callbacks, ...) in tests/ itself, and
#: the tests of what is not the library beside them (the experiments, benchmarks,
#: notebooks, ported examples).
TEST_FOLDERS = {
    "algorithms": "tf_metaalign/algorithms",
    "trainers": "tf_metaalign/trainers",
    "optimizers": "tf_metaalign/optimizers",
    "prompts": "tf_metaalign/prompts",
    "data": "tf_metaalign/data",
    "experiments": "trainers/experiments and the programs in trainers/",
    "benchmarks": "benchmarks/",
    "colab": "colab/ (the notebooks, executed)",
    "examples": "examples/ (programs by others, ported)",
}


def test_the_tests_mirror_the_library():
    tests = ROOT / "tests"
    folders = {d.name for d in tests.iterdir() if d.is_dir() and any(d.glob("test_*.py"))}
    assert folders == set(TEST_FOLDERS), (
        f"test folders {sorted(folders)} != {sorted(TEST_FOLDERS)}: add a new folder to "
        "TEST_FOLDERS (and say what it mirrors)"
    )
    for name, mirrored in TEST_FOLDERS.items():
        if mirrored.startswith("tf_metaalign/"):
            assert (ROOT / mirrored / "__init__.py").exists(), (name, mirrored)
    # conftest.py puts every test folder on sys.path (a few tests import another folder's
    # NumPy oracles by module name), so a test module's basename must be unique.
    names = [p.name for p in tests.rglob("test_*.py")]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"test modules with the same name in two folders: {repeated}"


def test_every_program_is_split_by_stage():
    """A program module in `trainers/` stays under ~400 lines: a bigger one is split into
    its stages (`<program>_data`, `_run`, `_report`, as `promptability_*` and
    `finetune_*` are). The experiments' builders (`trainers/experiments/`) are exempt."""
    long = {
        path.name: n
        for path in sorted((ROOT / "trainers").glob("*.py"))
        if (n := len(path.read_text().splitlines())) > 420
    }
    assert not long, f"programs to split by stage (lines): {long}"


# ----------------------------------------------------------------------- the programs' imports

PROGRAMS_PACKAGE = ROOT / "trainers"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trainers_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PROGRAMS_PACKAGE.rglob("*.py"))}


def _trainers_imports(path: Path, modules) -> set[str]:
    """The modules of `trainers` that `path` imports anywhere in it: at the top, in a
    function body, under `if TYPE_CHECKING:` (a type checker follows those too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from trainers import fewshot_report`: the module; `from trainers.x import y`: x.
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            )
    return {m for m in found if m in modules} - {_module_name(path)}


def _is_program(path: Path) -> bool:
    """A module run as `python -m trainers.<name>`: it has `if __name__ == "__main__":`."""
    return any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        for node in ast.parse(path.read_text()).body
    )


def test_no_module_imports_a_program_back():
    """A program's main module (`trainers/fewshot.py`, run with `python -m`) holds its flags
    and `main`; its settings live in `<program>_config.py` (`finetune`'s in the main module,
    which no stage imports). So no stage module (`<program>_data`, `_run`, `_report`, ...)
    and no other module of `trainers/` imports a program's main module, not even under
    `TYPE_CHECKING`: the programs are the top of the import graph."""
    modules = _trainers_modules()
    programs = {name for name, path in modules.items() if _is_program(path)}
    assert {"trainers.fewshot", "trainers.multitask", "trainers.promptability"} <= programs
    offenders = sorted(
        f"{name} imports the program {imported}"
        for name, path in modules.items()
        for imported in _trainers_imports(path, modules) & programs
    )
    assert not offenders, offenders


def test_the_programs_imports_run_one_way():
    """The import graph of `trainers/` (every import, function bodies and `TYPE_CHECKING`
    blocks included) has no cycle: program -> stages -> settings and experiments."""
    modules = _trainers_modules()
    graph = {name: _trainers_imports(path, modules) for name, path in modules.items()}
    state, cycles = {}, []

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles

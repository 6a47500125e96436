"""What every notebook test does: execute a notebook offline in a fresh kernel (timed),
find a code cell by a marker, read its stdout and PNG outputs, and check the stored file
and the run the same way for every notebook of `colab/`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def execute(notebook: Path, timeout: int, needs=()):
    """Run `notebook` with the repository root as working directory; `(nb, seconds)`.
    Skips (with the reason) without nbformat/nbclient/ipykernel/matplotlib or `needs`."""
    nbformat = pytest.importorskip("nbformat", reason="pip install nbformat nbclient ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="pip install nbformat nbclient ipykernel")
    pytest.importorskip("ipykernel", reason="pip install ipykernel")
    pytest.importorskip("matplotlib", reason="pip install matplotlib")
    for module, reason in needs:
        pytest.importorskip(module, reason=reason)
    nb = nbformat.read(notebook, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    return nb, time.perf_counter() - start


def cell(nb, marker):
    """The one code cell whose source contains `marker`."""
    cells = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{len(cells)} code cells contain {marker!r}"
    return cells[0]


def stdout(c):
    return "".join(
        o.get("text", "")
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def has_png(c):
    return any("image/png" in o.get("data", {}) for o in c.get("outputs", []))


def check_stored_without_outputs(notebook: Path):
    """The file holds code, not a run's results, for the python3 kernel, and starts with
    the commented Colab install line (locally nothing is installed)."""
    nbformat = pytest.importorskip("nbformat", reason="pip install nbformat")
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"
    assert "# !pip install" in code[0].source


def check_ran_cleanly(nb, elapsed, budget_s):
    """Within the time budget, every code cell ran, no error output, and no Python
    warning on stderr (TensorFlow's C++ start-up lines are allowed)."""
    assert elapsed < budget_s, f"notebook took {elapsed:.0f} s (budget: {budget_s} s)"
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        assert c.execution_count is not None
        for o in c.outputs:
            assert o.get("output_type") != "error", o
            if o.get("name") == "stderr":
                assert "Warning:" not in o["text"], o["text"]

"""The notebooks in notebooks/ run from top to bottom without error (with small settings)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01-quickstart.ipynb",
        "02-paper-comparison.ipynb",
        "03-your-own-model.ipynb",
        "04-scale.ipynb",
        "05-algorithms.ipynb",
        "06-sparse.ipynb",
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("DOWNPOUR_NOTEBOOK_FAST", "1")  # the kernel inherits the environment
    notebook = nbformat.read(path, as_version=4)
    assert any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed without outputs; run notebooks/run_all.py"
    )
    client = NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": path.parent}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors

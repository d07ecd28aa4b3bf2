"""Execute the notebooks in place with their full settings, so their committed outputs come from a
real run:

    python notebooks/run_all.py                 # all notebooks
    python notebooks/run_all.py 01-quickstart.ipynb

The test suite executes them too (tests/test_notebooks.py), with DOWNPOUR_NOTEBOOK_FAST=1 and
without writing them.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("*.ipynb"))
    for name in names:
        path = HERE / name
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        NotebookClient(
            notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": HERE}}
        ).execute()
        nbformat.write(notebook, path)
        print(f"{name}: executed in {time.perf_counter() - start:.0f} s")

"""The README's Python example runs as printed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.timeout(180)
def test_the_python_example_runs_and_learns(tmp_path):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert len(example.strip().splitlines()) <= 12  # "a 10-line example"
    done = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) > 0.85
    assert (tmp_path / "runs" / "mnist5k" / "pushes.parquet").is_file()

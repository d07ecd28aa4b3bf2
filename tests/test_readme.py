"""The README's Python example runs as printed, saved as a script the way a user saves it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def python_example() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_the_python_example_is_short_and_guards_its_cluster_start():
    example = python_example()
    assert len(example.strip().splitlines()) <= 12  # "a 10-line example"
    # The embedded cluster's worker processes import the script again: only the parent trains.
    assert 'if __name__ == "__main__":' in example


@pytest.mark.slow
@pytest.mark.spawn  # what a user's script does
@pytest.mark.timeout(180)
def test_the_python_example_runs_as_a_script_and_learns(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(python_example())
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) > 0.85
    assert (tmp_path / "runs" / "mnist5k" / "pushes.parquet").is_file()

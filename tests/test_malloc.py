"""The allocator tuning that shard and replica processes apply to themselves."""

import platform
import subprocess
import sys

import pytest

from downpour_dask.runtime.malloc import tune_malloc

try:  # numpy 2
    from numpy._core.multiarray import _get_madvise_hugepage
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _get_madvise_hugepage

#: mallopt exists on glibc only; elsewhere tuning must report False, not fail.
GLIBC = platform.libc_ver()[0] == "glibc"


def _numpy_advises_huge_pages() -> bool:
    return _get_madvise_hugepage()


def test_workers_holding_shards_are_tuned(client):
    # The session cluster's workers hold shards in other tests; tuning is idempotent either way.
    assert all(client.run(tune_malloc).values()) is GLIBC
    assert not any(client.run(_numpy_advises_huge_pages).values())
    assert tune_malloc() is tune_malloc()


LINUX = sys.platform.startswith("linux")
#: numpy advises huge pages by default on Linux (kernels from 4.6); a test that switches it off
#: must see it on first
SHOW = (
    "import numpy._core.multiarray as m; from downpour_dask.runtime.malloc import tune_malloc; "
    "before = m._get_madvise_hugepage(); print(tune_malloc(), before, m._get_madvise_hugepage())"
)


@pytest.mark.parametrize(
    "setting, expected",
    [("0", f"False {LINUX} {LINUX}"), ("1", f"{GLIBC} {LINUX} False")],
)
def test_the_environment_variable_turns_it_off(setting, expected):
    """Tuned: glibc's thresholds set and numpy's huge-page advice off; with the variable at 0,
    neither."""
    done = subprocess.run(
        [sys.executable, "-c", SHOW],
        env={"DOWNPOUR_DASK_TUNE_MALLOC": setting, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == expected

"""The allocator tuning that shard and replica processes apply to themselves."""

import platform
import subprocess
import sys

import pytest

from downpour_dask.runtime.malloc import tune_malloc

#: mallopt exists on glibc only; elsewhere tuning must report False, not fail.
GLIBC = platform.libc_ver()[0] == "glibc"


def test_workers_holding_shards_are_tuned(client):
    # The session cluster's workers hold shards in other tests; tuning is idempotent either way.
    assert all(client.run(tune_malloc).values()) is GLIBC
    assert tune_malloc() is tune_malloc()


@pytest.mark.parametrize("setting, expected", [("0", "False"), ("1", str(GLIBC))])
def test_the_environment_variable_turns_it_off(setting, expected):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from downpour_dask.runtime.malloc import tune_malloc; print(tune_malloc())",
        ],
        env={"DOWNPOUR_DASK_TUNE_MALLOC": setting, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == expected

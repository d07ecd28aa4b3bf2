"""Shared fixtures: one real local Dask cluster (two single-threaded worker processes) per session.

Tests that kill workers or need a different topology start their own cluster.
"""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster


@pytest.fixture(scope="session")
def cluster():
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client(cluster):
    with Client(cluster, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture
def three_workers():
    """A client of a fresh three-worker cluster, for tests that kill workers (nannies start a
    new worker after a kill)."""
    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster, timeout=60) as client,
    ):
        client.wait_for_workers(3, timeout=60)
        yield client

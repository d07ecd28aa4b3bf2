"""The driver's data goes straight to the workers, not relayed through the scheduler."""

from __future__ import annotations

import numpy as np
from distributed import Client

from downpour_dask.runtime.cluster import send_to_workers


def _count_scheduler_scatters(dask_scheduler) -> None:
    """Wrap the scheduler's ``scatter`` handler (the relay path) with a call counter."""
    if not hasattr(dask_scheduler, "relayed_scatters"):
        original = dask_scheduler.handlers["scatter"]

        async def counted(*args, **kwargs):
            dask_scheduler.relayed_scatters += 1
            return await original(*args, **kwargs)

        dask_scheduler.handlers["scatter"] = counted
    dask_scheduler.relayed_scatters = 0


def _relayed(dask_scheduler) -> int:
    return dask_scheduler.relayed_scatters


def test_data_reaches_the_named_worker_without_the_scheduler_relay(client):
    client.run_on_scheduler(_count_scheduler_scatters)
    worker = sorted(client.scheduler_info()["workers"])[-1]
    block = np.arange(1000.0)
    (future,) = send_to_workers(client, [block], [worker], timeout=30)
    assert client.run_on_scheduler(_relayed) == 0
    assert client.who_has([future])[future.key] == (worker,)
    np.testing.assert_array_equal(future.result(timeout=30), block)
    # the same scatter with Dask's default goes through the relay (what the helper avoids)
    relayed = client.scatter([block], hash=False)
    assert client.run_on_scheduler(_relayed) == 1
    client.cancel([future, *relayed])


def test_a_client_that_asks_for_the_relay_keeps_it(cluster):
    with Client(cluster, direct_to_workers=False) as relaying:
        relaying.run_on_scheduler(_count_scheduler_scatters)
        named = send_to_workers(relaying, {"block-for-relay-test": np.ones(3)}, timeout=30)
        assert relaying.run_on_scheduler(_relayed) == 1
        np.testing.assert_array_equal(named["block-for-relay-test"].result(timeout=30), 1.0)

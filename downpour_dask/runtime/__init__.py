"""The Dask cluster as the algorithms see it: the embedded local cluster and the worker list,
where replicas and their data go, allocator tuning for worker processes, and
(:mod:`~downpour_dask.runtime.dask_internals`, :mod:`~downpour_dask.runtime.dask_connect`,
:mod:`~downpour_dask.runtime.dask_client_calls` and
:mod:`~downpour_dask.runtime.dask_scheduler_state`) every use of Dask's private API.
"""

"""The Dask cluster as the algorithms see it: the embedded local cluster and the worker list,
where replicas and their data go, allocator tuning for worker processes, and
(:mod:`~downpour_dask.runtime.dask_internals` and
:mod:`~downpour_dask.runtime.dask_client_calls`) every use of Dask's private API.
"""

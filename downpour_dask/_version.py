"""Version of downpour-dask (kept apart so every module can import it without cycles)."""

__version__ = "0.1.0"

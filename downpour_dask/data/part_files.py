"""Part files written all or nothing by the dataset generators.

``datasets.synthetic`` and ``write_criteo`` write a dataset as ``part-00000.parquet``... one
file after another, for minutes at a large size.  Stopped half way -- Ctrl-C, a full disk -- they
used to leave the files written so far, which then loaded as a dataset with fewer rows than
asked, silently.  :func:`all_or_nothing` removes them instead: the files the block wrote (and
their half-written ``.tmp``), and the directory if the block's call created it; nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def all_or_nothing(directory: Path) -> Iterator[list[Path]]:
    """Create ``directory`` if it is missing, and yield the list where the block names each
    file before it starts writing it.  If the block raises (any exception, KeyboardInterrupt
    too), those files and a ``<file>.tmp`` beside each are removed, then ``directory`` if this
    call created it and it is empty, and the exception goes on."""
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        yield written
    except BaseException:
        for path in written:
            for leftover in (path, path.with_name(path.name + ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
        if created:
            with contextlib.suppress(OSError):  # not empty: someone else wrote there meanwhile
                directory.rmdir()
        raise

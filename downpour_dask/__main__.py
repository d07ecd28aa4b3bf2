"""``python -m downpour_dask``: the same as the ``downpour-dask`` command."""

import sys

from .cli import main

sys.exit(main())

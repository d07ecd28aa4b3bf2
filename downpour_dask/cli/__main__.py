"""``python -m downpour_dask.cli``: the same as the ``downpour-dask`` command."""

import sys

from . import main

sys.exit(main())

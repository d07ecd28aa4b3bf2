"""Sandblaster L-BFGS: batch L-BFGS driven from the driver, its vectors kept on the shards.

Top to bottom: :mod:`.estimator` (``SandblasterLBFGS``: arguments, checks, ``fit``),
:mod:`.coordinator` (the driver-side coordinator of one fit and its record), :mod:`.portions`
(distributed passes: portions dispatched to workers as they free up, backup tasks),
:mod:`.blocks` (where the rows live: scattered arrays, or files each worker reads itself),
:mod:`.tasks` (what runs on the workers) and :mod:`.shard` (the shard actor running the vector
programs and counting every portion once).
"""

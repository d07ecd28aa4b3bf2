"""The check that a finished Downpour fit did not diverge (:func:`check_finite`)."""

from __future__ import annotations

import math

import numpy as np

#: A final evaluation loss this many times the run's first one means the fit diverged.
DIVERGED_LOSS_RATIO = 1e6


def check_finite(
    params: np.ndarray | None, final_loss: float | None = None, start_loss: float | None = None
) -> None:
    """Raise FloatingPointError if the fit diverged, so that a model that cannot predict does
    not pass as trained.

    Diverged means: its final parameters are not all finite (the shards refuse updates that
    would make them so, but a resumed or user-made state may be); or the final evaluation's
    loss is not finite (parameters so large that the model's outputs overflow); or that loss
    is more than :data:`DIVERGED_LOSS_RATIO` times the run's first evaluation loss
    ``start_loss`` (when positive).  The last case is a diverged fit whose outputs happen not
    to overflow: with ``learning_rate=1e30`` an MLP's hidden units can all end dead, leaving
    finite logits of order 1e29 -- a loss of 1e29 against a start of 2.5.
    """
    if params is not None and not np.isfinite(params).all():
        bad = int(np.count_nonzero(~np.isfinite(params)))
        what = f"{bad} non-finite parameters (NaN or inf) of {params.size}"
    elif final_loss is not None and not math.isfinite(final_loss):
        what = f"a non-finite loss ({final_loss}) on eval_data"
    elif _blew_up(final_loss, start_loss):
        what = (
            f"a loss of {final_loss:.4g} on eval_data, more than {DIVERGED_LOSS_RATIO:.0e} times "
            f"the {start_loss:.4g} it started from"
        )
    else:
        return
    raise FloatingPointError(
        f"the fit diverged: it ended with {what}; lower learning_rate, or set max_grad_norm"
    )


def _blew_up(final_loss: float | None, start_loss: float | None) -> bool:
    if final_loss is None or start_loss is None or not start_loss > 0:
        return False  # (a NaN start fails the comparison too)
    return final_loss > DIVERGED_LOSS_RATIO * start_loss

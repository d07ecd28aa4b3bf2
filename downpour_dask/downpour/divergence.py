"""The check that a finished Downpour fit did not diverge (:func:`check_finite`)."""

from __future__ import annotations

import numpy as np


def check_finite(params: np.ndarray | None, final_loss: float | None = None) -> None:
    """Raise FloatingPointError if the fit diverged: its final parameters are not all finite
    (the shards refuse updates that would make them so, but a resumed or user-made state may
    be), or the final evaluation's loss is not finite (parameters so large that the model's
    outputs overflow).  Such a model cannot predict, and must not pass as trained."""
    if params is not None and not np.isfinite(params).all():
        bad = int(np.count_nonzero(~np.isfinite(params)))
        what = f"{bad} non-finite parameters (NaN or inf) of {params.size}"
    elif final_loss is not None and not np.isfinite(final_loss):
        what = f"a non-finite loss ({final_loss}) on eval_data"
    else:
        return
    raise FloatingPointError(
        f"the fit diverged: it ended with {what}; lower learning_rate, or set max_grad_norm"
    )

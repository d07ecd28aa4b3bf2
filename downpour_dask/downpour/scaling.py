"""How much a replica scales its gradients: :func:`gradient_scale`.

A replica asks the model for its gradient already multiplied by the local rate, so the local
step is one pass over the parameters; this module decides when that is safe.
"""

from __future__ import annotations

import inspect

from ..core.models import Model


def gradient_scale(model: Model, alpha: float, refetched: bool = False) -> float:
    """What a replica asks ``model.loss_and_grad`` to multiply its gradient by: ``alpha``, so
    that the local step ``params -= alpha * g`` is one pass with no scratch pass, or 1.

    1 when no local step is ever applied: ``alpha`` is 0, or ``refetched`` (every step pushes
    and fetches every slice from a shard in the replica's process, which overwrites the local
    step, so the loop leaves it out: scaled, the gradient would only cost a pass to divide
    ``alpha`` back out before each push).  1 also when the model's ``loss_and_grad`` takes no
    ``scale=`` (a user's subclass may override it without), and when ``alpha`` is so far outside
    any learning rate's range that the scaled float32 gradient could under- or overflow before
    the push divides it back out.
    """
    if refetched or not 1e-10 <= alpha <= 1e10:
        return 1.0
    try:
        takes_scale = "scale" in inspect.signature(model.loss_and_grad).parameters
    except (TypeError, ValueError):
        takes_scale = False
    return float(alpha) if takes_scale else 1.0

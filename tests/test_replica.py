"""The replica loop's pieces that need no cluster (the loop itself runs in test_downpour)."""

import pytest

from downpour_dask import models
from downpour_dask.downpour.replica import gradient_scale


class NoScaleMLP(models.MLP):
    """A user's model whose loss_and_grad predates ``scale=``."""

    def loss_and_grad(self, params, X, y, out=None):
        return super().loss_and_grad(params, X, y, out)


@pytest.mark.parametrize(
    "model,alpha,expected",
    [
        (models.MLP(4, (3,), 2), 0.05, 0.05),  # the model folds alpha into its backward pass
        (models.SoftmaxRegression(4, 2), 1.5, 1.5),
        (models.MLP(4, (3,), 2), 0.0, 1.0),  # no local step: nothing to fold in
        (NoScaleMLP(4, (3,), 2), 0.05, 1.0),  # the replica multiplies by alpha itself
        (models.MLP(4, (3,), 2), 1e-30, 1.0),  # alpha * g could underflow float32
        (models.MLP(4, (3,), 2), 1e30, 1.0),  # or overflow it
    ],
)
def test_gradient_scale(model, alpha, expected):
    assert gradient_scale(model, alpha) == expected

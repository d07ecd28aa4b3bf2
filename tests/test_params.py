import numpy as np
import pytest

from downpour_dask.core.params import ParamLayout, split_range


def test_views_are_zero_copy_and_named_in_order():
    layout = ParamLayout({"W": (3, 4), "b": (4,)})
    flat = layout.zeros()
    views = layout.views(flat)
    views["W"][1, 2] = 5.0
    views["b"][:] = 7.0
    assert flat.dtype == np.float32 and layout.size == 16
    assert flat[1 * 4 + 2] == 5.0 and np.all(flat[12:] == 7.0)
    assert layout.names == ["W", "b"]
    assert np.shares_memory(views["W"], flat)


def test_views_reject_wrong_length():
    with pytest.raises(ValueError, match="16 elements"):
        ParamLayout({"W": (3, 4), "b": (4,)}).views(np.zeros(15, np.float32))


@pytest.mark.parametrize("size,n", [(16, 1), (16, 3), (16, 16), (1_000_003, 7)])
def test_split_covers_each_element_once_and_balances(size, n):
    ranges = split_range(size, n)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    lengths = [hi - lo for lo, hi in ranges]
    assert max(lengths) - min(lengths) <= 1 and len(ranges) == n


def test_split_is_element_granular_a_matrix_can_span_shards():
    layout = ParamLayout({"W": (10, 10), "b": (2,)})
    (lo0, hi0), (lo1, hi1) = layout.split(2)
    assert (hi0, lo1) == (51, 51)  # W occupies [0, 100): the boundary falls inside it


@pytest.mark.parametrize("n", [0, 17, -1])
def test_split_rejects_bad_counts(n):
    with pytest.raises(ValueError, match="between 1 and 16"):
        split_range(16, n)


def test_layout_rejects_empty_and_bad_shapes():
    with pytest.raises(ValueError, match="at least one"):
        ParamLayout({})
    with pytest.raises(ValueError, match="positive dimensions"):
        ParamLayout({"W": (0, 3)})

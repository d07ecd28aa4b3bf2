"""Sandblaster's data blocks: the rows a gradient runs over are aligned wherever they came from."""

import numpy as np

from downpour_dask.sandblaster.blocks import (
    MAX_BLOCK_BYTES,
    ArrayBlocks,
    aligned_block,
    default_portions,
)


def _misaligned(X: np.ndarray) -> np.ndarray:
    """``X``'s values 2 bytes off float32 alignment, as Dask can leave a received array."""
    raw = np.zeros(X.nbytes + 2, np.uint8)
    odd = raw[2:].view(X.dtype).reshape(X.shape)
    odd[:] = X
    assert not odd.flags.aligned
    return odd


def test_an_aligned_block_is_kept_and_a_misaligned_one_copied():
    X = np.arange(300, dtype=np.float32).reshape(100, 3)
    y = np.arange(100)
    Xa, ya = aligned_block((X, y))
    assert Xa is X and ya is y  # nothing to do: no copy
    Xb, _ = aligned_block((_misaligned(X), y))
    assert Xb.flags.aligned and Xb.flags.c_contiguous
    np.testing.assert_array_equal(Xb, X)


def _block_aligned(block) -> bool:
    return block[0].flags.aligned and block[1].flags.aligned


def test_scattered_blocks_are_aligned_on_their_workers_and_their_homes_known(client):
    X = np.random.default_rng(0).standard_normal((4001, 7)).astype(np.float32)
    data = ArrayBlocks(X, np.arange(4001) % 2)
    (batch,) = data.portions(4001, 4, None)
    blocks = data.place(client, batch, None, timeout=60)
    assert all(client.submit(_block_aligned, b, pure=False).result(timeout=60) for b in blocks)
    who = client.who_has(blocks)
    assert {pid: sorted(who[b.key])[0] for pid, b in enumerate(blocks)} == data.homes
    rows = client.gather(blocks)
    np.testing.assert_array_equal(np.concatenate([Xb for Xb, _ in rows]), X)


def test_default_portions_are_one_per_thread_unless_blocks_would_pass_the_cap():
    assert default_portions(2) == 2 and default_portions(0) == 1
    assert default_portions(2, 400_000_000) == 2  # 10^6 x 100 float32: two 200 MB blocks
    assert default_portions(2, 4_000_000_000) == 4  # 10^7 x 100: four blocks under 1 GiB
    assert default_portions(3, 2 * MAX_BLOCK_BYTES + 1) == 3
    assert default_portions(1, 2 * MAX_BLOCK_BYTES + 1) == 3

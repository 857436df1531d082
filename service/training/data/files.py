"""Loaders of file sources (``file://…`` under a tenant's data roots): ``.npz`` archives, checked
member by member before numpy reads them, and CSV files, checked cell by cell. An error names the
line, the column and the rule, never a cell's contents.
"""

from __future__ import annotations

import csv
import io
import math
import zipfile
from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from service.contract.data_sources import DataSourceError, SourceLocationError
from service.training.data.records import LoadedData, TaskSplit


def _build(
    uri: str,
    ids: Sequence[str],
    features: npt.NDArray[np.floating],
    labels: npt.NDArray[np.integer],
    tasks: npt.NDArray[np.integer],
    test: tuple[npt.NDArray[np.floating], npt.NDArray[np.integer]] | None,
    image_shape: tuple[int, int, int] | None,
) -> LoadedData:
    n = len(ids)
    if n == 0:
        raise DataSourceError(f"data source {uri!r} holds no training records.")
    if features.shape[0] != n or labels.shape != (n,) or tasks.shape != (n,):
        raise DataSourceError(
            f"data source {uri!r}: {n} record ids, features {features.shape}, labels {labels.shape} "
            f"and tasks {tasks.shape} do not line up."
        )
    repeated = sum(1 for c in Counter(ids).values() if c > 1)
    if repeated:  # counted, never named: a record id is private data
        raise DataSourceError(f"data source {uri!r}: {repeated} record_id value(s) occur more than once.")
    flat = np.ascontiguousarray(features.reshape(n, -1), dtype=np.float32)
    if not np.isfinite(flat).all():
        raise DataSourceError(f"data source {uri!r}: features must be finite (found NaN or inf).")
    if (labels < 0).any() or (tasks < 0).any():
        raise DataSourceError(f"data source {uri!r}: label and task must be integers >= 0.")
    test_x = np.zeros((0, flat.shape[1]), dtype=np.float32)
    test_y = np.zeros(0, dtype=np.int64)
    if test is not None:
        test_x = np.ascontiguousarray(test[0].reshape(test[0].shape[0], -1), dtype=np.float32)
        test_y = test[1].astype(np.int64)
        if test_x.shape[1] != flat.shape[1] or test_y.shape != (test_x.shape[0],):
            raise DataSourceError(
                f"data source {uri!r}: test features {test_x.shape} and labels {test_y.shape} do not "
                f"match {flat.shape[1]} training features."
            )
        if not np.isfinite(test_x).all() or (test_y < 0).any():
            raise DataSourceError(f"data source {uri!r}: test features must be finite and labels >= 0.")
    num_classes = int(max(labels.max(), test_y.max() if test_y.size else 0)) + 1
    d = flat.shape[1]
    if image_shape is None and math.isqrt(d) ** 2 == d:
        image_shape = (1, math.isqrt(d), math.isqrt(d))
    train = []
    for t in np.unique(tasks):
        mask = tasks == t
        train.append(
            TaskSplit(
                int(t),
                tuple(r for r, m in zip(ids, mask, strict=True) if m),
                flat[mask],
                labels[mask].astype(np.int64),
            )
        )
    test_splits = (
        (TaskSplit(0, tuple(f"test-{i}" for i in range(len(test_y))), test_x, test_y),) if len(test_y) else ()
    )
    return LoadedData(
        uri=uri,
        train=tuple(train),
        test=test_splits,
        num_classes=max(num_classes, 2),
        n_features=d,
        image_shape=image_shape,
    )


def _integer_array(uri: str, name: str, values: npt.NDArray[np.generic]) -> npt.NDArray[np.int64]:
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind == "f":
        floats = values.astype(np.float64)
        if np.isfinite(floats).all() and (floats == np.round(floats)).all():
            return floats.astype(np.int64)
    raise DataSourceError(f"data source {uri!r}: {name} must hold integers. Found dtype {values.dtype}.")


def _image_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    if len(shape) == 3:
        return (1, shape[1], shape[2])
    if len(shape) == 4:
        return (shape[1], shape[2], shape[3])
    return None


def _npz_arrays(uri: str, content: bytes, max_bytes: int) -> dict[str, npt.NDArray[np.generic]]:
    """The arrays of an ``.npz`` held in ``content``, refusing one whose arrays would take more
    than ``max_bytes`` uncompressed (a small compressed file can inflate without bound) or whose
    ``.npy`` header claims more elements than its member holds (numpy would allocate them first).
    Errors name the member and the rule, never what the archive holds."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(content))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DataSourceError(
            f"data source {uri!r}: not a readable .npz file ({type(exc).__name__})."
        ) from None
    with archive:
        members = archive.infolist()
        total = sum(m.file_size for m in members)
        if total > max_bytes:
            raise SourceLocationError(
                f"data source {uri!r}: its arrays hold {total} bytes uncompressed, more than "
                f"LEDGER_MAX_SOURCE_BYTES = {max_bytes}."
            )
        arrays: dict[str, npt.NDArray[np.generic]] = {}
        for member in members:
            name = member.filename.removesuffix(".npy")
            try:
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
                    if math.prod(shape) * dtype.itemsize > member.file_size:
                        raise DataSourceError(
                            f"data source {uri!r}: array {name[:40]!r} claims more data than it holds."
                        )
                with archive.open(member) as handle:
                    arrays[name] = np.asarray(np.lib.format.read_array(handle, allow_pickle=False))
            except DataSourceError:
                raise
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError) as exc:
                # (numpy's messages can quote the header: name the type only)
                raise DataSourceError(
                    f"data source {uri!r}: array {name[:40]!r} is not a readable .npy array "
                    f"({type(exc).__name__})."
                ) from None
    return arrays


def load_npz(uri: str, content: bytes, max_bytes: int) -> LoadedData:
    arrays = _npz_arrays(uri, content, max_bytes)

    def pick(*names: str, required: bool = True) -> npt.NDArray[np.generic] | None:
        for name in names:
            if name in arrays:
                return arrays[name]
        if required:
            raise DataSourceError(
                f"data source {uri!r}: the archive needs an array {' or '.join(map(repr, names))}."
            )
        return None

    ids_raw = pick("record_id")
    features = pick("X", "features")
    labels_raw = pick("y", "label")
    assert ids_raw is not None and features is not None and labels_raw is not None
    if features.dtype.kind not in "fiu":
        raise DataSourceError(f"data source {uri!r}: features must be numeric. Found dtype {features.dtype}.")
    ids = [x.decode() if isinstance(x, bytes) else str(x) for x in ids_raw.reshape(-1).tolist()]
    labels = _integer_array(uri, "label", labels_raw.reshape(-1))
    task_raw = pick("task", required=False)
    tasks = (
        _integer_array(uri, "task", task_raw.reshape(-1))
        if task_raw is not None
        else np.zeros(len(ids), np.int64)
    )
    test_x = pick("test_X", "test_features", required=False)
    test_y = pick("test_y", "test_label", required=False)
    if (test_x is None) != (test_y is None):
        raise DataSourceError(f"data source {uri!r}: test_X and test_y must be given together.")
    test = None
    if test_x is not None and test_y is not None:
        if test_x.dtype.kind not in "fiu":
            raise DataSourceError(f"data source {uri!r}: test_X must be numeric. Found dtype {test_x.dtype}.")
        test = (test_x.astype(np.float32), _integer_array(uri, "test_y", test_y.reshape(-1)))
    return _build(uri, ids, features.astype(np.float32), labels, tasks, test, _image_shape(features.shape))


def _column(name: str) -> str:
    """A column's header name for an error message (the header is the file's schema, not a
    record; shortened all the same)."""
    return repr(name if len(name) <= 40 else name[:40] + "…")


def load_csv(uri: str, content: bytes) -> LoadedData:
    """The records of a CSV file's ``content``. Errors name the line, the column and the rule,
    never a cell's value (a cell may hold anything: the finding echoed ``'sk_live_…'``)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataSourceError(
            f"data source {uri!r}: not UTF-8 text (an invalid byte at offset {exc.start})."
        ) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise DataSourceError(f"data source {uri!r}: the file is empty.")
        header = [h.strip() for h in header]
        for required in ("record_id", "label"):
            if required not in header:
                raise DataSourceError(f"data source {uri!r}: the header needs a {required!r} column.")
        if len(set(header)) != len(header):
            raise DataSourceError(f"data source {uri!r}: the header names a column twice.")
        col = {name: i for i, name in enumerate(header)}
        feature_cols = [i for i, h in enumerate(header) if h not in ("record_id", "label", "task", "split")]
        if not feature_cols:
            raise DataSourceError(f"data source {uri!r}: no feature columns.")
        ids: list[str] = []
        rows: list[list[float]] = []
        labels: list[int] = []
        tasks: list[int] = []
        test_rows: list[list[float]] = []
        test_labels: list[int] = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DataSourceError(
                    f"data source {uri!r}: line {line} has {len(row)} fields; the header has {len(header)}."
                )
            feats = [_cell(uri, row, i, header, line, float, "a number") for i in feature_cols]
            label = _cell(uri, row, col["label"], header, line, int, "an integer")
            task = _cell(uri, row, col["task"], header, line, int, "an integer") if "task" in col else 0
            split = row[col["split"]].strip() if "split" in col else "train"
            if split == "test":
                test_rows.append(feats)
                test_labels.append(label)
            elif split == "train":
                ids.append(row[col["record_id"]].strip())
                rows.append(feats)
                labels.append(label)
                tasks.append(task)
            else:
                raise DataSourceError(
                    f"data source {uri!r}: line {line}: column 'split' must be 'train' or 'test'."
                )
    except csv.Error:
        raise DataSourceError(
            f"data source {uri!r}: line {reader.line_num}: not well-formed CSV (csv.Error)."
        ) from None
    d = len(feature_cols)
    test = None
    if test_rows:
        test = (np.asarray(test_rows, dtype=np.float32), np.asarray(test_labels, dtype=np.int64))
    return _build(
        uri,
        ids,
        np.asarray(rows, dtype=np.float32).reshape(len(rows), d),
        np.asarray(labels, dtype=np.int64),
        np.asarray(tasks, dtype=np.int64),
        test,
        None,
    )


_Cell = TypeVar("_Cell", int, float)


def _cell(
    uri: str, row: Sequence[str], index: int, header: Sequence[str], line: int, kind: type[_Cell], what: str
) -> _Cell:
    try:
        return kind(row[index])
    except ValueError:
        raise DataSourceError(
            f"data source {uri!r}: line {line}: column {_column(header[index])} is not {what}."
        ) from None

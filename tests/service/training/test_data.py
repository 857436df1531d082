"""Data sources (service.training.data): URIs, npz/csv round trips, built-in streams, the ledger check.

File sources are read only under data roots (``DataRoots``): the ``roots`` fixture makes the
test's ``tmp_path`` the one root of every tenant. Errors carry no data: they give counts, lines,
columns and rules, never a record id or a cell (the tests assert the message and the absence).
(The escape cases of the roots themselves: tests/security/test_data_source_escape.py.)"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.contract.data_roots import DataRoots, TenantRoots
from service.contract.data_sources import DataSourceError, SourceLocationError, parse_source
from service.training.data import LoadedData, RecordMismatchError, check_records, load, load_data

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def digits() -> LoadedData:
    pytest.importorskip("sklearn")
    return load_data("builtin:digits")


@pytest.fixture
def roots(tmp_path: Path) -> TenantRoots:
    """``tmp_path`` as the data root of every tenant, seen by tenant ``acme``."""
    return DataRoots({"*": [str(tmp_path)]}).for_tenant("acme")


# ---------------------------------------------------------------------------------------------
# URIs: parsed without reading
# ---------------------------------------------------------------------------------------------


def test_parse_reads_nothing_and_load_reports_a_missing_file(tmp_path: Path, roots: TenantRoots) -> None:
    path = tmp_path / "absent.npz"
    uri = f"file://{path}"
    source = parse_source(uri)  # no file yet: parsing must not touch it
    assert source.kind == "npz" and source.path == path
    with pytest.raises(SourceLocationError) as info:
        load(source, roots)
    assert str(info.value) == (
        f"data source {uri!r} must name a regular file under a data root of tenant 'acme' "
        "(LEDGER_DATA_ROOTS): there is no such file."
    )


def test_a_file_source_is_not_read_without_data_roots(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("record_id,f1,label\na,1,0\n")
    uri = f"file://{path}"
    with pytest.raises(SourceLocationError) as info:
        load_data(uri)
    assert str(info.value) == (
        f"data source {uri!r}: a file is read only under the tenant's data roots, and none were given."
    )


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "non-empty"),
        ("s3://bucket/x.npz", "scheme"),
        ("file:///tmp/x.parquet", ".npz or .csv"),
        ("file://[x.npz", "not a valid URI"),
        ("file:///tmp/x.npz?a=1", "no query"),
        ("file:x.csv", "the path must be absolute"),
        ("file://relative/x.csv", "a file URI takes no host part"),
        ("file:///tmp/%2e%2e/x.csv", "must not hold '\\.\\.', '\\.' or empty components"),
        ("file:///tmp//x.csv", "must not hold '\\.\\.', '\\.' or empty components"),
        ("file:///tmp/a%0Ab/x.csv", "control character"),
        ("builtin:mnist", "unknown builtin"),
        ("builtin:permuted-digits", "needs \\?tasks=N"),
        ("builtin:permuted-digits?tasks=0", "tasks must be an integer"),
        ("builtin:permuted-digits?tasks=two", "tasks must be an integer"),
        ("builtin:split-digits?tasks=11", "tasks must be an integer in \\[1, 10\\]"),
        ("builtin:split-digits?tasks=2&colour=red", "unknown query parameter 'colour'"),
        ("builtin:digits?tasks=2", "unknown query parameter 'tasks'"),
        ("builtin:permuted-synthetic-digits?tasks=2", "needs \\?tasks=N&per_task=M"),
        ("builtin:permuted-synthetic-digits?tasks=2&per_task=0", "per_task must be an integer"),
        ("builtin:permuted-synthetic-digits?tasks=20&per_task=100000", "tasks\\*per_task must be <= 1000000"),
        ("builtin:split-synthetic-digits?tasks=11&per_task=10", "tasks must be an integer in \\[1, 10\\]"),
        ("builtin:split-synthetic-digits?tasks=2&per_task=10&size=3", "unknown query parameter 'size'"),
        ("builtin:split-synthetic-digits?tasks=2&per_task=10&public=100001", "public must be an integer"),
        ("builtin:split-digits?tasks=6&public_classes=5", "tasks must be at most 10 - public_classes = 5"),
        ("builtin:split-digits?tasks=2&public_classes=10", "public_classes must be an integer in \\[1, 9\\]"),
        ("builtin:split-digits?tasks=2&public_classes=0", "public_classes must be an integer in \\[1, 9\\]"),
        ("builtin:permuted-digits?tasks=2&public_classes=5", "unknown query parameter 'public_classes'"),
    ],
)
def test_bad_uris_are_refused_with_a_message_naming_them(uri: str, message: str) -> None:
    with pytest.raises(DataSourceError, match=message):
        parse_source(uri)


def test_builtin_streams_parse_tasks_and_seed() -> None:
    source = parse_source("builtin:permuted-digits?tasks=4&seed=7")
    assert (source.kind, source.tasks, source.seed) == ("permuted-digits", 4, 7)


@pytest.mark.slow
def test_synthetic_digits_are_deterministic_independent_of_size_and_learnable() -> None:
    """Task t's records depend on (seed, t, per_task) only; ids are unique; pixels lie in [0, 1];
    tasks are permuted copies of one law; a linear model learns them (the point of the source)."""
    from sklearn.linear_model import LogisticRegression  # type: ignore[import-untyped,unused-ignore]

    small = load_data("builtin:permuted-synthetic-digits?tasks=2&per_task=3000&seed=3")
    large = load_data("builtin:permuted-synthetic-digits?tasks=3&per_task=3000&seed=3")
    other = load_data("builtin:permuted-synthetic-digits?tasks=2&per_task=3000&seed=4")
    for a, b in zip(small.train, large.train, strict=False):
        assert a.record_ids == b.record_ids and np.array_equal(a.features, b.features)
    assert not np.array_equal(small.train[1].features, other.train[1].features)
    ids = large.record_ids
    assert len(set(ids)) == len(ids) == 9000 and ids[0] == "sdigits-000-000000"
    x, y = small.train[0].features, small.train[0].labels
    assert x.shape == (3000, 64) and 0.0 <= x.min() and x.max() <= 1.0
    assert np.bincount(y, minlength=10).min() > 200  # every class drawn
    # task 1 is task 0's law under one fixed pixel permutation: its test split is task 0's, permuted
    assert np.allclose(np.sort(small.test[1].features, axis=1), np.sort(small.test[0].features, axis=1))
    model = LogisticRegression(max_iter=500).fit(x, y)
    # held-out writers' templates: accuracy is generalisation, not recall of a template
    assert model.score(small.test[0].features, small.test[0].labels) > 0.75
    split = load_data("builtin:split-synthetic-digits?tasks=5&per_task=500&public=300")
    assert [sorted(set(t.labels.tolist())) for t in split.train] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [sorted(set(t.labels.tolist())) for t in split.test] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert len(split.public[0]) == 300 and not set(split.public[0].record_ids) & set(split.record_ids)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def test_npz_round_trip_with_tasks_images_and_a_test_split(tmp_path: Path, roots: TenantRoots) -> None:
    rng = np.random.default_rng(0)
    ids = np.array([f"r{i}" for i in range(12)])
    images = rng.random((12, 4, 4)).astype(np.float32)
    labels = np.arange(12) % 3
    tasks = np.array([0] * 5 + [1] * 7)
    test_x = rng.random((4, 4, 4)).astype(np.float32)
    path = tmp_path / "d.npz"
    np.savez(
        path, record_id=ids, X=images, y=labels, task=tasks, test_X=test_x, test_y=np.array([0, 1, 2, 0])
    )
    data = load_data(f"file://{path}", roots)
    assert data.record_ids == tuple(ids)
    assert [len(t) for t in data.train] == [5, 7]
    assert data.image_shape == (1, 4, 4) and data.n_features == 16 and data.num_classes == 3
    x, y = data.train_arrays()
    np.testing.assert_array_equal(x, images.reshape(12, 16))
    np.testing.assert_array_equal(y, labels)
    tx, ty = data.test_arrays()
    assert tx.shape == (4, 16) and ty.tolist() == [0, 1, 2, 0]


def test_npz_accepts_the_features_and_label_names(tmp_path: Path, roots: TenantRoots) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, record_id=np.arange(3), features=np.ones((3, 5)), label=np.array([1.0, 0.0, 1.0]))
    data = load_data(f"file://{path}", roots)
    assert data.record_ids == ("0", "1", "2") and data.train[0].labels.dtype == np.int64
    assert data.image_shape is None  # 5 features: not square


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"X": np.ones((2, 2)), "y": np.zeros(2)}, "needs an array 'record_id'"),
        ({"record_id": np.array(["a", "b"]), "X": np.ones((2, 2)), "y": np.zeros(3)}, "do not line up"),
        ({"record_id": np.array(["a", "b"]), "X": np.full((2, 2), np.nan), "y": np.zeros(2)}, "finite"),
        ({"record_id": np.array(["a", "b"]), "X": np.ones((2, 2)), "y": np.array([0.5, 1])}, "integers"),
    ],
)
def test_invalid_npz_contents_are_refused(
    tmp_path: Path, roots: TenantRoots, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataSourceError, match=re.escape(message)):
        load_data(f"file://{path}", roots)


def test_an_npz_error_counts_repeated_record_ids_without_naming_them(
    tmp_path: Path, roots: TenantRoots
) -> None:
    path = tmp_path / "bad.npz"
    ids = np.array(["sk_live_repeated", "sk_live_repeated", "other"])
    np.savez(path, record_id=ids, X=np.ones((3, 2)), y=np.zeros(3))
    uri = f"file://{path}"
    with pytest.raises(DataSourceError) as info:
        load_data(uri, roots)
    assert str(info.value) == f"data source {uri!r}: 1 record_id value(s) occur more than once."
    assert "sk_live" not in str(info.value)


def test_csv_round_trip_with_task_and_split_columns(tmp_path: Path, roots: TenantRoots) -> None:
    path = tmp_path / "d.csv"
    rows = [
        ["record_id", "f1", "label", "f2", "task", "split"],
        ["a", "0.5", "1", "2", "0", "train"],
        ["b", "1.5", "0", "3", "1", "train"],
        ["c", "2.5", "1", "4", "1", "train"],
        ["t", "9", "0", "9", "0", "test"],
    ]
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    data = load_data(f"file://{path}", roots)
    assert data.record_ids == ("a", "b", "c")
    assert [t.record_ids for t in data.train] == [("a",), ("b", "c")]
    x, y = data.train_arrays()
    np.testing.assert_array_equal(x, np.array([[0.5, 2], [1.5, 3], [2.5, 4]], dtype=np.float32))
    assert y.tolist() == [1, 0, 1]
    assert data.test_arrays()[1].tolist() == [0]


def test_csv_errors_name_the_line_and_column_not_the_value(tmp_path: Path, roots: TenantRoots) -> None:
    path = tmp_path / "d.csv"
    uri = f"file://{path}"
    path.write_text("record_id,f1,label\na,1,0\nb,sk_live_cell_value,1\n")
    with pytest.raises(DataSourceError) as info:
        load_data(uri, roots)
    assert str(info.value) == f"data source {uri!r}: line 3: column 'f1' is not a number."
    assert "sk_live_cell_value" not in str(info.value)
    path.write_text("id,f1,label\na,1,0\n")
    with pytest.raises(DataSourceError) as info:
        load_data(uri, roots)
    assert str(info.value) == f"data source {uri!r}: the header needs a 'record_id' column."


# ---------------------------------------------------------------------------------------------
# Built-ins
# ---------------------------------------------------------------------------------------------


def test_digits_has_a_fixed_disjoint_split_and_stable_ids(digits: LoadedData) -> None:
    assert digits.n_records == 1437 and len(digits.test_arrays()[1]) == 360
    assert set(digits.record_ids).isdisjoint(digits.test[0].record_ids)
    assert set(digits.record_ids) | set(digits.test[0].record_ids) == {f"digits-{i:04d}" for i in range(1797)}
    x, _ = digits.train_arrays()
    assert x.dtype == np.float32 and x.shape == (1437, 64) and 0 <= x.min() and x.max() <= 1
    assert digits.image_shape == (1, 8, 8) and digits.num_classes == 10
    again = load_data("builtin:digits")
    assert again.record_ids == digits.record_ids  # fixed split, independent of any seed


def test_permuted_digits_tasks_are_disjoint_and_permuted(digits: LoadedData) -> None:
    data = load_data("builtin:permuted-digits?tasks=3&seed=1")
    assert len(data.train) == 3 and len(data.test) == 3
    ids = [set(t.record_ids) for t in data.train]
    assert all(a.isdisjoint(b) for i, a in enumerate(ids) for b in ids[i + 1 :])
    assert set().union(*ids) == set(digits.record_ids)
    base_test = digits.test[0].features
    np.testing.assert_array_equal(data.test[0].features, base_test)  # π₀ is the identity
    for t in (1, 2):
        assert data.test[t].features.shape == (360, 64)
        assert not np.array_equal(data.test[t].features, base_test)
        # a permutation of pixels: each image keeps its multiset of pixel values
        np.testing.assert_array_equal(np.sort(data.test[t].features, 1), np.sort(base_test, 1))
    assert data.train[1].features.shape[1] == 64
    assert load_data("builtin:permuted-digits?tasks=3&seed=1").record_ids == data.record_ids


def test_split_digits_partitions_the_classes(digits: LoadedData) -> None:
    data = load_data("builtin:split-digits?tasks=5")
    assert [sorted(set(t.labels.tolist())) for t in data.train] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [sorted(set(t.labels.tolist())) for t in data.test] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert sorted(data.record_ids) == sorted(digits.record_ids)
    assert len(set(data.record_ids)) == data.n_records
    assert data.num_classes == 10  # the head covers every class (S1)


# ---------------------------------------------------------------------------------------------
# The ledger check
# ---------------------------------------------------------------------------------------------


SMALL_IDS = ("rec-a", "rec-b", "rec-c", "rec-d")


def _small(tmp_path: Path, roots: TenantRoots) -> LoadedData:
    path = tmp_path / "s.npz"
    np.savez(path, record_id=np.array(SMALL_IDS), X=np.ones((4, 2)), y=np.array([0, 1, 0, 1]))
    return load_data(f"file://{path}", roots)


def test_check_records_accepts_an_exact_match(tmp_path: Path, roots: TenantRoots) -> None:
    check_records(_small(tmp_path, roots), {"batch-1": ["rec-a", "rec-b"], "batch-2": ["rec-c", "rec-d"]})


def test_check_records_counts_missing_unexpected_and_duplicated_ids_without_naming_them(
    tmp_path: Path, roots: TenantRoots
) -> None:
    data = _small(tmp_path, roots)
    with pytest.raises(RecordMismatchError) as info:
        # rec-x is missing from the source; rec-c and rec-d are in no batch; rec-b is in two
        check_records(data, {"b1": ["rec-a", "rec-b", "rec-x"], "b2": ["rec-b"]})
    err = info.value
    assert (err.missing, err.unexpected, err.duplicated) == (1, 2, 1)
    assert err.missing_batches == {"b1": 1}
    assert str(err) == (
        f"record ids of data source {data.uri!r} do not match the ledger's batches: "
        "1 record(s) of the ledger's batches are not in the source (1 of batch b1); "
        "2 training record(s) of the source are in none of the ledger's batches; "
        "1 record id(s) are named more than once. Training was not started."
    )
    assert "rec-" not in str(err)  # no record id, in the message or anywhere on the error
    assert not any("rec-" in repr(value) for value in vars(err).values())


def test_restrict_keeps_only_reserved_records(tmp_path: Path, roots: TenantRoots) -> None:
    data = _small(tmp_path, roots)
    sub = data.restrict(["rec-b", "rec-d"])
    assert sub.record_ids == ("rec-b", "rec-d") and sub.train_arrays()[1].tolist() == [1, 1]
    with pytest.raises(RecordMismatchError) as info:
        data.restrict(["rec-zz", "rec-b"])
    err = info.value
    assert (err.missing, err.unexpected, err.duplicated, err.missing_batches) == (1, 0, 0, {})
    assert str(err) == (
        f"record ids of data source {data.uri!r} do not match the ledger's batches: "
        "1 record(s) of the ledger's batches are not in the source. Training was not started."
    )
    assert "rec-zz" not in str(err)


@pytest.mark.slow
def test_the_data_module_does_not_import_torch() -> None:
    """The loaders and the record check (``service.training.data``) are numpy only: no torch."""
    code = "import sys; import service.training.data; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_public_classes_hold_out_whole_classes_the_tasks_never_see() -> None:
    data = load_data("builtin:split-digits?tasks=3&public_classes=4")
    public = data.public[0]
    assert set(public.labels.tolist()) == {0, 1, 2, 3}
    assert [sorted(set(t.labels.tolist())) for t in data.train] == [[4, 5], [6, 7], [8, 9]]
    assert [sorted(set(t.labels.tolist())) for t in data.test] == [[4, 5], [6, 7], [8, 9]]
    train_ids = {i for t in data.train for i in t.record_ids}
    assert not train_ids & set(public.record_ids)
    # every training image of the public classes is public; ``public=P`` takes P of them
    everything = load_data("builtin:digits").train[0]
    assert len(public) == int((everything.labels < 4).sum())
    assert len(train_ids) == int((everything.labels >= 4).sum())
    capped = load_data("builtin:split-digits?tasks=3&public_classes=4&public=100").public[0]
    assert len(capped) == 100 and set(capped.record_ids) <= set(public.record_ids)

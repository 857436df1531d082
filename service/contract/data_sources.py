"""Data sources named by URI: what a dataset's ``data_source`` may be and how it is stored,
parsed without reading anything (issue 29 §2: the server owns this contract, the trainers'
loaders in ``service.training.data`` import it).

A data source belongs to a dataset: an admin of the dataset's tenant sets it
(``service.ledger.datasets``, after ``service.contract.data_roots.check_source``); a job never
names one (DESIGN-NOTES 8). ``parse_source(uri)`` checks the URI's syntax and touches nothing;
``service.training.data.load(source, roots)`` reads the records, in the worker, only after the
ledger granted the run's reservation. No numpy here: the API process parses sources.

URIs
----
* ``file:///abs/path.npz`` — arrays ``record_id`` (N), ``X`` or ``features`` (N, …), ``y`` or
  ``label`` (N, integer classes); optional ``task`` (N, integer task index, default 0 for all) and
  a held-out evaluation split ``test_X``/``test_features`` with ``test_y``/``test_label``.
  Features of shape (N, H, W) or (N, C, H, W) are images; they are stored flat with
  ``image_shape``.
* ``file:///abs/path.csv`` — a header row with a ``record_id`` column, a ``label`` column, optional
  ``task`` and ``split`` (``train`` | ``test``) columns; every other column is a numeric feature,
  in file order.
* ``builtin:digits`` — scikit-learn's bundled 8×8 digits (1797 images, pixel values scaled to
  [0, 1]); record ids ``digits-0000`` … ``digits-1796`` by position in scikit-learn's array; a
  fixed stratified split of 360 test images, independent of any seed.
* ``builtin:permuted-digits?tasks=N[&seed=S]`` — the digits' training records partitioned (seeded)
  into N disjoint tasks; task t's images have their 64 pixels permuted by a fixed, seeded
  permutation πₜ (π₀ is the identity, as in Permuted MNIST). Each task's test split is the whole
  test set under πₜ.
* ``builtin:split-digits?tasks=N[&seed=S]`` — the ten classes split into N contiguous groups
  (N ≤ 10); task t holds the training records of its classes. Labels stay global (0–9), so a
  head released after any task covers every class (assumption S1 of the DP continual-learning
  paper).
* ``&public=P`` (``split-digits`` and ``permuted-digits``; default 0) — hold out P training images
  (drawn by their own generator seeded with S; without ``public`` nothing changes) as a
  **public** split (``LoadedData.public``, unpermuted): they belong to no
  task, are never ledgered, and serve to pre-train a feature extractor (the pre-trained models of
  the DP continual-learning paper). Declared public by the operator: the same distribution as the
  private tasks, disjoint records — as ImageNet pre-training is for CIFAR in that paper.
* ``&public_classes=K`` (``split-digits`` only; 1 ≤ K ≤ 9) — the public split is instead every
  training image of the classes 0 … K−1 (``public=P``: P of them, drawn as above), and the N tasks
  split the classes K … 9 (N ≤ 10 − K), their test splits those classes' test images: an extractor
  pre-trained on it has never seen a private class — disjoint classes, not only disjoint records
  (issue 27 §4).
* ``builtin:permuted-synthetic-digits?tasks=N&per_task=M[&seed=S][&public=P]`` and
  ``builtin:split-synthetic-digits?tasks=N&per_task=M[&seed=S][&public=P]`` — the digits at a
  realistic size, generated, no download: M records per task (up to 100 000; N·M ≤ 1 000 000),
  each an independent draw — a random training image of scikit-learn's digits (the **public**
  templates, bundled constants) under a random affine warp (rotation ±10°, scale 0.9–1.1, shift
  ±0.6 px, bilinear), a random contrast (×0.75–1.25) and pixel noise (σ = 0.05), clipped to [0, 1].
  ``permuted-…``: task t draws from all ten classes and permutes the 64 pixels by πₜ (π₀ the
  identity); ``split-…``: the ten classes in N ≤ 10 contiguous groups, task t draws from its
  group. The test split of each task (``SYNTHETIC_TEST_PER_TASK`` records) is drawn from the 360
  **held-out** digits as templates, so accuracy measures generalisation to unseen writers, not
  recall of a template. ``public=P`` (≤ 100 000) adds P records from their own draw, unpermuted,
  of every class. Record ids ``sdigits-TTT-IIIIII`` (task, position) and ``sdigits-public-IIIIII``;
  task t's records depend only on (S, t, M). The privacy unit is one generated record: the
  templates are public constants (as MNIST-1D's templates are), and records are independent given
  them, so a record's DP guarantee means what it says for the generated data set.
* ``builtin:stream?blocks=N&block_size=B[&dim=D][&seed=S]`` — a synthetic stream for continual
  release (defaults N=64, B=50, D=10, S=0): binary labels from a fixed, seeded logistic model
  P(y=1|x) = σ(θ*ᵀx) with ‖θ*‖ = 8, features uniform on the unit sphere (so ‖x‖ ≤ 1, which the
  output-perturbation sensitivity 2L/(λn) of logistic regression needs with L = 1). One task of
  N·B training records in arrival order, ids ``stream-0000000`` …, meant to be cut into N blocks of
  B (a ledger batch per block); a held-out test split of 2000 records from the same model. Record
  i depends only on S and i, so a longer stream extends a shorter one.

A source is stored in one form (``DataSource.canonical``): ``file:/x``, ``FILE:///x`` and
``file:///%78`` name one file and are all stored as ``file:///x`` (``file_uri``: only ``%``, ``?``
and ``#`` escaped); a builtin keeps its query as given, with the scheme in lower case. No control
character anywhere in a URI (``urlsplit`` dropped tabs and newlines silently).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Final
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

MAX_TASKS: Final = 1_000


MAX_SOURCE_LENGTH: Final = 2_000  # characters of a source URI (the datasets.data_source column)


class DataSourceError(ValueError):
    """A data source URI or its contents are invalid; the message names the URI and the rule,
    never a value read from the source."""


class SourceLocationError(DataSourceError):
    """A ``file://`` source is not a regular file of bounded size under the tenant's data roots."""


BUILTINS: Final = (
    "digits",
    "permuted-digits",
    "split-digits",
    "stream",
    "permuted-synthetic-digits",
    "split-synthetic-digits",
)


SYNTHETIC_BUILTINS: Final = ("permuted-synthetic-digits", "split-synthetic-digits")


PUBLIC_SPLIT_BUILTINS: Final = ("permuted-digits", "split-digits")


MAX_PUBLIC_DIGITS: Final = 1_000  # of the 1437 training images: leave every task some records


@dataclass(frozen=True, slots=True)
class DataSource:
    """A parsed, validated source URI. Nothing is read until ``load()``."""

    uri: str  # as given
    kind: str  # "npz" | "csv" | "stream" | one of BUILTINS
    path: Path | None = None
    # The form the ledger stores: ``file_uri(path)`` for a file (one string per file); a builtin
    # as given (its query is data: the ledger does not reorder it).
    canonical: str = ""
    tasks: int = 1
    seed: int = 0
    public: int = 0
    blocks: int = 0  # stream: blocks, block_size, dim
    block_size: int = 0
    dim: int = 0
    per_task: int = 0  # synthetic digits: records per task
    public_classes: int = 0  # split-digits: classes 0 … K−1 public, the tasks on K … 9

    @property
    def is_file(self) -> bool:
        return self.path is not None


def parse_source(uri: str) -> DataSource:
    """Validate ``uri``'s syntax (see the module docstring) without touching the file it names."""
    if not isinstance(uri, str) or not uri:
        raise DataSourceError(f"data source must be a non-empty URI string. Found {uri!r}.")
    if len(uri) > MAX_SOURCE_LENGTH:
        raise DataSourceError(
            f"data source must be at most {MAX_SOURCE_LENGTH} characters. Found {len(uri)}."
        )
    # urlsplit drops tabs and newlines silently ("builtin:digits\n" was stored as given)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):
        raise DataSourceError(f"data source {uri!r}: the URI holds a control character.")
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # e.g. an unbalanced "[" in the host part
        raise DataSourceError(f"data source {uri!r} is not a valid URI: {exc}.") from None
    if parts.scheme == "file":
        path = _file_path(uri, parts)
        return DataSource(uri=uri, kind=_file_kind(uri, parts.path), path=path, canonical=file_uri(path))
    if parts.scheme == "builtin":  # stored with the scheme in lower case, the rest as given
        return replace(_parse_builtin(uri, parts), canonical="builtin:" + uri.partition(":")[2])
    raise DataSourceError(f"data source {uri!r}: scheme must be 'file' or 'builtin'. Found {parts.scheme!r}.")


def _parse_builtin(uri: str, parts: SplitResult) -> DataSource:
    """A ``builtin:`` source (module docstring, "URIs")."""
    if parts.fragment:  # it was ignored, and stored with the source
        raise DataSourceError(f"data source {uri!r}: a builtin source takes no fragment.")
    name = parts.path
    if name not in BUILTINS:
        raise DataSourceError(f"data source {uri!r}: unknown builtin {name!r}; known: {list(BUILTINS)}.")
    try:
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError as exc:
        raise DataSourceError(f"data source {uri!r}: malformed query {parts.query!r}.") from exc
    if name == "stream":
        return _parse_stream(uri, query)
    if name in SYNTHETIC_BUILTINS:
        return _parse_synthetic_digits(uri, name, query)
    allowed = {"tasks", "seed"} if name != "digits" else set()
    if name in PUBLIC_SPLIT_BUILTINS:
        allowed.add("public")
    if name == "split-digits":
        allowed.add("public_classes")
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise DataSourceError(f"data source {uri!r}: unknown query parameter {unknown[0]!r}.")
    tasks = _query_int(uri, query, "tasks", 1, maximum=10 if name == "split-digits" else MAX_TASKS)
    if name != "digits" and "tasks" not in query:
        raise DataSourceError(f"data source {uri!r}: builtin {name!r} needs ?tasks=N.")
    seed = _query_int(uri, query, "seed", 0, minimum=0, maximum=2**32 - 1)
    public = _query_int(uri, query, "public", 0, minimum=0, maximum=MAX_PUBLIC_DIGITS)
    public_classes = _query_int(uri, query, "public_classes", 0, minimum=1, maximum=9)
    if public_classes and tasks > 10 - public_classes:
        raise DataSourceError(
            f"data source {uri!r}: tasks must be at most 10 - public_classes = {10 - public_classes} "
            f"(one private class a task at least). Found {tasks}."
        )
    return DataSource(
        uri=uri, kind=name, tasks=tasks, seed=seed, public=public, public_classes=public_classes
    )


def file_uri(path: PurePosixPath | Path) -> str:
    """The one stored form of a file source naming ``path`` (absolute, normalised):
    ``file://`` + the path, with only ``%``, ``?`` and ``#`` percent-encoded (what would otherwise
    be read back as an escape, a query or a fragment). ``file:/x``, ``FILE:///x`` and
    ``file:///%78`` all name ``/x`` and are all stored as ``file:///x``."""
    text = str(path)
    return "file://" + text.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def _file_kind(uri: str, raw_path: str) -> str:
    suffix = PurePosixPath(unquote(raw_path)).suffix.lower()
    if suffix not in (".npz", ".csv"):
        raise DataSourceError(f"data source {uri!r}: a file must end in .npz or .csv. Found {suffix!r}.")
    return suffix[1:]


def _file_path(uri: str, parts: SplitResult) -> Path:
    """The absolute, normalised path a ``file:`` URI names, or ``SourceLocationError``: the
    syntax alone refuses every way of naming a path that is not what it looks like."""
    netloc, query, fragment, raw = parts.netloc, parts.query, parts.fragment, parts.path
    if query or fragment:
        raise SourceLocationError(f"data source {uri!r}: a file URI takes no query or fragment.")
    if netloc:  # file://host/x.csv: a host part (it was read relative to the working directory)
        raise SourceLocationError(
            f"data source {uri!r}: a file URI takes no host part; write file:///absolute/path."
        )
    path = unquote(raw)  # %2e%2e is "..": check what the file system will see
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise SourceLocationError(f"data source {uri!r}: the path holds a control character.")
    if not path.startswith("/"):
        raise SourceLocationError(f"data source {uri!r}: the path must be absolute (file:///absolute/path).")
    components = path[1:].split("/")
    if any(c in ("", ".", "..") for c in components):
        raise SourceLocationError(
            f"data source {uri!r}: the path must not hold '..', '.' or empty components."
        )
    return Path(path)


def _query_int(
    uri: str, query: Mapping[str, str], name: str, default: int, *, minimum: int = 1, maximum: int
) -> int:
    if name not in query:
        return default
    text = query[name]
    if not text.isdigit() or not minimum <= int(text) <= maximum:
        raise DataSourceError(
            f"data source {uri!r}: {name} must be an integer in [{minimum}, {maximum}]. Found {text!r}."
        )
    return int(text)


STREAM_MAX_RECORDS: Final = 5_000_000


def _parse_stream(uri: str, query: Mapping[str, str]) -> DataSource:
    unknown = sorted(set(query) - {"blocks", "block_size", "dim", "seed"})
    if unknown:
        raise DataSourceError(f"data source {uri!r}: unknown query parameter {unknown[0]!r}.")
    blocks = _query_int(uri, query, "blocks", 64, maximum=100_000)
    block_size = _query_int(uri, query, "block_size", 50, maximum=100_000)
    dim = _query_int(uri, query, "dim", 10, maximum=1_000)
    seed = _query_int(uri, query, "seed", 0, minimum=0, maximum=2**32 - 1)
    if blocks * block_size > STREAM_MAX_RECORDS:
        raise DataSourceError(
            f"data source {uri!r}: blocks*block_size must be <= {STREAM_MAX_RECORDS}. "
            f"Found {blocks * block_size}."
        )
    return DataSource(uri=uri, kind="stream", seed=seed, blocks=blocks, block_size=block_size, dim=dim)


SYNTHETIC_MAX_PER_TASK: Final = 100_000


SYNTHETIC_MAX_RECORDS: Final = 1_000_000  # 256 MB of float32 features at most


SYNTHETIC_MAX_PUBLIC: Final = 100_000


def _parse_synthetic_digits(uri: str, name: str, query: Mapping[str, str]) -> DataSource:
    unknown = sorted(set(query) - {"tasks", "per_task", "seed", "public"})
    if unknown:
        raise DataSourceError(f"data source {uri!r}: unknown query parameter {unknown[0]!r}.")
    for needed in ("tasks", "per_task"):
        if needed not in query:
            raise DataSourceError(f"data source {uri!r}: builtin {name!r} needs ?tasks=N&per_task=M.")
    split = name == "split-synthetic-digits"
    tasks = _query_int(uri, query, "tasks", 1, maximum=10 if split else MAX_TASKS)
    per_task = _query_int(uri, query, "per_task", 1, maximum=SYNTHETIC_MAX_PER_TASK)
    seed = _query_int(uri, query, "seed", 0, minimum=0, maximum=2**32 - 1)
    public = _query_int(uri, query, "public", 0, minimum=0, maximum=SYNTHETIC_MAX_PUBLIC)
    if tasks * per_task > SYNTHETIC_MAX_RECORDS:
        raise DataSourceError(
            f"data source {uri!r}: tasks*per_task must be <= {SYNTHETIC_MAX_RECORDS}. "
            f"Found {tasks * per_task}."
        )
    return DataSource(uri=uri, kind=name, tasks=tasks, seed=seed, public=public, per_task=per_task)

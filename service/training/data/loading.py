"""Reading a source: ``load(source, roots)`` dispatches on the source's kind (a file under the
tenant's data roots, checked again as it is opened, or a built-in); ``load_data(uri, roots)``
parses and loads in one call.
"""

from __future__ import annotations

from service.contract.data_roots import TenantRoots, read_file
from service.contract.data_sources import SYNTHETIC_BUILTINS, DataSource, SourceLocationError, parse_source
from service.training.data.builtin import load_digits_source, load_stream, load_synthetic_digits
from service.training.data.files import load_csv, load_npz
from service.training.data.records import LoadedData


def load(source: DataSource, roots: TenantRoots | None = None) -> LoadedData:
    """Read the records. Call only after the ledger granted the run's reservation.

    A file source is read only through ``roots`` (the dataset's tenant's data roots), and
    checked again as it is opened (``service.contract.data_roots.read_file``)."""
    if source.path is not None:
        if roots is None:
            raise SourceLocationError(
                f"data source {source.uri!r}: a file is read only under the tenant's data roots, "
                "and none were given."
            )
        content = read_file(source, roots)
        if source.kind == "npz":
            return load_npz(source.uri, content, roots.max_bytes)
        return load_csv(source.uri, content)
    if source.kind == "stream":
        return load_stream(source.uri, source.blocks, source.block_size, source.dim, source.seed)
    if source.kind in SYNTHETIC_BUILTINS:
        return load_synthetic_digits(
            source.uri, source.kind, source.tasks, source.per_task, source.seed, source.public
        )
    return load_digits_source(
        source.uri, source.kind, source.tasks, source.seed, source.public, source.public_classes
    )


def load_data(uri: str, roots: TenantRoots | None = None) -> LoadedData:
    """``load(parse_source(uri), roots)``: validate and read in one call."""
    return load(parse_source(uri), roots)

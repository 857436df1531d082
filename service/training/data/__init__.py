"""Loading data sources: the records a source's URI names, read only when called, and the check
that a source's training record ids are exactly the ledger's batches. numpy only: no torch here.

What a URI may be, and how it is stored, is the server's contract
(``service.contract.data_sources``: ``parse_source``, ``DataSource``); where a file may live and
the checks made as it is opened are ``service.contract.data_roots`` (``TenantRoots``,
``read_file``). ``load(source, roots)`` reads the records, and the worker calls it only after the
ledger granted the reservation (the release flow, docs/ARCHITECTURE.md, reserves a run's cost
*before* the worker reads private data); ``load_data(uri, roots)`` parses and loads in one call.

Errors carry no data: a loading error names the line, the column and the rule, never a cell's
contents; ``RecordMismatchError`` gives counts and ledger batch ids, never a record id.

Privacy notes
-------------
Only the training records are private and ledgered: ``check_records`` compares the training
record ids with the ledger's batches. Test splits are held-out evaluation data (public, or
released only through accuracy numbers the operator accepts); they carry no ledger charge.
Every task of a built-in stream holds *different* records, so parallel composition over tasks
is honest: no image appears in two tasks under two record ids. A public split (``&public=P``)
holds records of no task: they are outside the ledger and carry no privacy guarantee at all.

Modules, one concept each: ``records`` (``TaskSplit``, ``LoadedData``, ``RecordIndex``, the ledger
check ``check_records``), ``loading`` (``load``, ``load_data``), ``files`` (the ``npz`` and CSV
loaders), ``builtin`` (digits, the stream, synthetic digits) and ``registration``
(``register_source``). What a trainer, the worker or a user needs is importable from here.
"""

from service.training.data.builtin import digits_split, synthetic_digit_images
from service.training.data.loading import load, load_data
from service.training.data.records import (
    LoadedData,
    RecordIndex,
    RecordMismatchError,
    TaskSplit,
    check_records,
)
from service.training.data.registration import register_source

__all__ = [
    "LoadedData",
    "RecordIndex",
    "RecordMismatchError",
    "TaskSplit",
    "check_records",
    "digits_split",
    "load",
    "load_data",
    "register_source",
    "synthetic_digit_images",
]

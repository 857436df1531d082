"""What a job's error and the worker's log may say of a failure: never a cell of the source or a
record id (``service.worker.gate``, step 2).

Why its own module: every stop of the gate (a refused plan, a bad source, a failed step) builds
its job error here, so what may leave the worker is decided in one place — our own exception
messages with the source's record ids masked, a foreign one's type and where it was raised.
"""

from __future__ import annotations

import traceback
from collections.abc import Collection
from typing import Any, Final

# Packages whose exception messages this project writes: they name fields, rules and counts,
# never what a source holds (``DataSourceError``'s contract, ``InvalidParamsError``, the
# accountant's errors). Any other exception's text (a builtin ``KeyError('r17')``, numpy's or
# torch's messages quoting a value) is withheld.
OWN_PACKAGES: Final = ("service.", "accountant.")


def without_records(text: str, record_ids: Collection[str]) -> str:
    """``text`` with every occurrence of a record id of the source replaced by ``<record id>``,
    longest ids first, also in their escaped (``repr``) form. Belt and braces for the messages
    ``failure_message`` keeps: they are ours and should never hold an id."""
    ids = {r for r in record_ids if r}
    if not ids:
        return text
    ids |= {repr(r)[1:-1] for r in ids}
    lengths = sorted({len(r) for r in ids}, reverse=True)
    out: list[str] = []
    i = 0
    while i < len(text):
        n = next((n for n in lengths if text[i : i + n] in ids), 0)
        out.append("<record id>" if n else text[i])
        i += n or 1
    return "".join(out)


def _raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, as the innermost frame of this project's code (file:line in
    function): a place in our source, never a value."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/service/" in f.filename or "/accountant/" in f.filename] or frames
    if not ours:
        return "an unknown place"
    frame = ours[-1]
    where = frame.filename
    for marker in ("/service/", "/accountant/"):
        if marker in where:
            where = where[where.rindex(marker) + 1 :]
    return f"{where}:{frame.lineno} in {frame.name}"


def failure_message(exc: BaseException, record_ids: Collection[str]) -> str:
    """What a job's error and the worker's log may say of a failure: the exception's type, and
    its message only when this project wrote it (``OWN_PACKAGES``), with the source's record ids
    masked; otherwise where it was raised and that its text was withheld."""
    name = type(exc).__name__
    if type(exc).__module__.startswith(OWN_PACKAGES):
        return f"{name}: {without_records(str(exc), record_ids)}"
    return f"{name} raised at {_raised_at(exc)} (its message is withheld: it may quote the data)"


def failure_log(exc: BaseException, record_ids: Collection[str]) -> str:
    """``failure_message`` and the stack's frames (file, line, function and source line: never
    locals, never the message of a chained exception)."""
    frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    return f"{failure_message(exc, record_ids)}\n{frames}"


def job_error(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": code, "message": message, **details}


__all__ = ["OWN_PACKAGES", "failure_log", "failure_message", "job_error", "without_records"]

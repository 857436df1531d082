"""Stored data sources in one form: one string per file.

Revision ID: e2b7c9d4f1a6
Revises: e2b7c4d9a1f0
Create Date: 2026-11-27

Issue 24 §5: ``file:/abs``, ``FILE:///abs`` and ``file:///abs`` (and percent-escaped spellings of
the same path) named one file and were stored as given, so the same file could be several
sources. The service now stores ``service.training.data.DataSource.canonical``: ``file://`` + the
decoded path with only ``%``, ``?`` and ``#`` escaped, and a builtin with its scheme in lower
case. This rewrites ``datasets.data_source`` rows to that form.

Static: the rule is spelled out here (``_canonical``), not imported. A stored ``file:`` source
that today's parser would refuse (a host part, a query, a relative path, ``.``/``..``/empty
components, a control character) is left as it is: the worker refuses it when it reads it, and
an admin sets it again. Nothing else changes: the audit chain keeps the spellings it recorded.

Downgrade: nothing to undo in the schema, and the spellings replaced are not kept; the canonical
form is a valid source for the previous revision too (it read every one of these spellings).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

import sqlalchemy as sa

from alembic import op

revision: str = "e2b7c9d4f1a6"
down_revision: str | Sequence[str] | None = "e2b7c4d9a1f0"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_datasets = sa.table("datasets", sa.column("id", sa.String(64)), sa.column("data_source", sa.String(2000)))


def _canonical(source: str) -> str:
    """The stored form of ``source`` (``service.training.data.file_uri`` as of this revision);
    ``source`` itself where it is not a source today's parser accepts the syntax of."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in source):
        return source
    try:
        parts = urlsplit(source)
    except ValueError:
        return source
    if parts.scheme == "builtin":
        return "builtin:" + source.partition(":")[2]
    if parts.scheme != "file" or parts.netloc or parts.query or parts.fragment:
        return source
    path = unquote(parts.path)
    if not path.startswith("/") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return source
    if any(c in ("", ".", "..") for c in path[1:].split("/")):
        return source
    return "file://" + path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def upgrade() -> None:
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(_datasets.c.id, _datasets.c.data_source).where(_datasets.c.data_source.is_not(None))
    ).all()
    for dataset_id, source in rows:
        canonical = _canonical(source)
        if canonical != source:
            connection.execute(
                _datasets.update().where(_datasets.c.id == dataset_id).values(data_source=canonical)
            )


def downgrade() -> None:
    pass  # the canonical spellings are valid sources before this revision too (docstring)

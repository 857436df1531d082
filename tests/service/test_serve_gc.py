"""``ledger serve``'s app: what start-up allocated is frozen out of the garbage collector's reach,
and the young generation is collected every ``YOUNG_COLLECTION_THRESHOLD`` allocations
(docs/PERFORMANCE.md, "Where the server CPU of a spend goes")."""

from __future__ import annotations

import gc

from fastapi import FastAPI

from service.commands.serve import YOUNG_COLLECTION_THRESHOLD, _frozen


def test_a_served_app_is_frozen_and_collects_its_young_generation_less_often() -> None:
    before = gc.get_threshold()
    try:
        app = FastAPI()
        assert _frozen(app) is app
        assert gc.get_freeze_count() > 0
        # Only the young generation's threshold changes; the older ones keep theirs.
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *before[1:])
        assert YOUNG_COLLECTION_THRESHOLD > before[0]
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()

"""The ledger every experiment runs against (service.experiments.embedded), in its smallest real
case: a two-block ``builtin:stream`` registered as batches, one continual-release job run
through the release gate by the in-process worker, and what the ledger then holds read back. The
experiments' own tests beside this one (slow) drive it through whole experiments."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

pytest.importorskip("torch")  # the worker's trainers

from service.experiments.embedded import TENANT, EmbeddedLedger
from service.ledger import datasets
from service.ledger.batches import record_batches, record_hash, task_layout
from service.training.continual_release import budget_for
from service.training.data import load_data

SOURCE = "builtin:stream?blocks=2&block_size=5&dim=3&seed=2"
BUDGET = budget_for("cumulative", 1)  # the geometric levels a cumulative run at ε = 1 fits


def test_a_registered_stream_runs_one_job_to_its_end_within_its_budget(
    database_url: URL, tmp_path: Path
) -> None:
    url = database_url.render_as_string(hide_password=False)
    with EmbeddedLedger(tmp_path / "out", database_url=url, device="cpu") as ledger:
        dataset = ledger.register_source(SOURCE, name="stream", budget=BUDGET, batch_size=5)

        # Registered: the source's one task, cut into blocks of five records in source order.
        ids = load_data(SOURCE).record_ids
        blocks = [ids[i : i + 5] for i in range(0, len(ids), 5)]
        (task,) = dataset.tasks
        assert task.name == "task-0" and len(task.batch_ids) == len(blocks) == 2
        (layout,) = task_layout(ledger.db, dataset.id)
        assert (layout.id, layout.name) == (task.id, task.name)
        assert [(b, size) for b, _, size in layout.batches] == [(b, 5) for b in task.batch_ids]
        salt, stored = record_batches(ledger.db, dataset.id)
        placed = zip(dataset.batch_ids, blocks, strict=True)
        assert stored == {record_hash(salt, r): batch for batch, block in placed for r in block}
        assert datasets.get_dataset(ledger.db, TENANT, dataset.id).data_source == SOURCE

        # Run: Algorithm 4 (cumulative) releases one model a block, each on the ledger's gate.
        params = {"mode": "cumulative", "epsilon": 1.0, "seed": 1}
        result = ledger.run_job(dataset, "continual_release", params, model_name="continual")
        assert result.status == "succeeded", result.job.error
        assert [v.version for v in result.versions] == list(range(1, len(blocks) + 1))  # oldest first
        assert [v.metrics["t"] for v in result.versions] == list(range(1, len(blocks) + 1))
        assert {v.job_id for v in result.versions} == {result.job.id}
        assert all(0.0 <= v.metrics["test_accuracy"] <= 1.0 for v in result.versions)

        # The spend after it: one charge a release, within the budget, the last release named.
        spent = result.spend.spent
        assert result.spend.to_json() == ledger.spend(dataset).to_json()
        assert spent.charges_committed == len(result.versions) and 0 < spent.epsilon_spent <= 1
        assert spent.last_release is not None
        assert (spent.last_release["model"], spent.last_release["version"]) == ("continual", len(blocks))
        assert ledger.versions("continual") == result.versions and ledger.versions("no-such-model") == []

        # Batches need not divide the task: the last one is smaller.
        uneven = ledger.register_source(SOURCE, name="uneven", budget=BUDGET, batch_size=4)
        (layout,) = task_layout(ledger.db, uneven.id)
        assert [size for _, _, size in layout.batches] == [4, 4, 2]

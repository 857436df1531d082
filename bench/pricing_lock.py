"""Does one tenant's costly pricing hold up another tenant's writes? (issue 12 §2, "High").

The review's case on the embedded default (SQLite, one ``ledger serve``): tenant A reserves a
composed event of ``--gaussians`` distinct Poisson-subsampled Gaussians on an ``rdp`` budget of
``--orders`` orders; while that request is in flight, tenant B creates ``--writes`` datasets one
after another. Before pricing moved out of the spend transaction, B's first write waited for the
whole pricing (15.5 s of pricing, 14 s of waiting in the review). Printed, and written as JSON:

* ``refused_s``: the costly reservation under the default ``LEDGER_MAX_PRICING_WORK`` (a 422 at
  once, nothing priced);
* with the bound raised so that the event is priced: ``pricing_s`` (the costly request's time),
  B's write latencies (p50, max) while it ran, and ``write_max_over_pricing``, their ratio (the
  review's figure was ≈ 0.9: the write waited for nearly all of the pricing).

Usage (repository root)::

    python bench/pricing_lock.py [--gaussians 200] [--orders 1000] [--writes 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.db.session import Database  # noqa: E402
from service.ledger import tenancy  # noqa: E402
from tests.service.api.conftest import bearer, start_server, stop_server  # noqa: E402


def _event(count: int, salt: float) -> dict[str, Any]:
    return {
        "kind": "composed",
        "events": [
            {
                "kind": "poisson_sampled",
                "sampling_probability": 0.01,
                "event": {"kind": "gaussian", "noise_multiplier": 1.0 + salt + i * 1e-3},
            }
            for i in range(count)
        ],
    }


def _setup(base: str, key: str, orders: int) -> tuple[str, str]:
    grid = [round(float(x), 6) for x in np.linspace(1.1, 256.0, orders)]
    budget = {"rule": "sequential", "epsilon": "1000", "delta": "1e-5", "accountant": "rdp", "orders": grid}
    with httpx.Client(base_url=base, timeout=600, headers=bearer(key)) as http:
        ds = http.post("/v1/datasets", json={"name": "costly", "budget": budget}).json()
        task = http.post(f"/v1/datasets/{ds['id']}/tasks", json={"name": "t"}).json()
        batch = http.post(
            f"/v1/datasets/{ds['id']}/tasks/{task['id']}/batches",
            json={"batches": [{"name": "b", "records": ["r1"]}]},
        ).json()["data"][0]["id"]
    return ds["id"], batch


def _run(args: argparse.Namespace, folder: Path, max_work: int | None) -> dict[str, Any]:
    url = f"sqlite:///{folder / ('ledger-%s.db' % (max_work or 'default'))}"
    env = {} if max_work is None else {"LEDGER_MAX_PRICING_WORK": str(max_work)}
    server = start_server(url, env=env)
    try:
        db = Database(url)
        try:
            costly_key = tenancy.create_api_key(db, "tenant-a", "admin")
            other_key = tenancy.create_api_key(db, "tenant-b", "admin")
        finally:
            db.dispose()
        dataset, batch = _setup(server.base_url, costly_key, args.orders)
        result: dict[str, Any] = {}

        def costly() -> None:
            started = time.monotonic()
            with httpx.Client(base_url=server.base_url, timeout=600) as http:
                answer = http.post(
                    f"/v1/datasets/{dataset}/reservations",
                    json={"batches": [batch], "event": _event(args.gaussians, time.time() % 1)},
                    headers=bearer(costly_key),
                )
            result["status"] = answer.status_code
            result["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=costly)
        thread.start()
        time.sleep(0.3)
        latencies: list[float] = []
        with httpx.Client(base_url=server.base_url, timeout=600, headers=bearer(other_key)) as http:
            for i in range(args.writes):
                if not thread.is_alive():
                    break
                started = time.monotonic()
                answer = http.post(
                    "/v1/datasets",
                    json={
                        "name": f"other-{i}",
                        "budget": {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"},
                    },
                )
                assert answer.status_code == 201, answer.text
                latencies.append(time.monotonic() - started)
        thread.join()
        return {
            "costly_status": result["status"],
            "costly_s": result["seconds"],
            "write_latencies_s": latencies,
        }
    finally:
        stop_server(server.process)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gaussians", type=int, default=200)
    parser.add_argument("--orders", type=int, default=1000)
    parser.add_argument("--writes", type=int, default=20)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "pricing_lock.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ledger-pricing-lock-") as tmp:
        folder = Path(tmp)
        bounded = _run(args, folder, None)
        work = (2 * args.gaussians + 1) * args.orders
        priced = _run(args, folder, work)
    writes = priced["write_latencies_s"]
    report = {
        "gaussians": args.gaussians,
        "orders": args.orders,
        "pricing_work": work,
        "refused_status": bounded["costly_status"],
        "refused_s": bounded["costly_s"],
        "pricing_status": priced["costly_status"],
        "pricing_s": priced["costly_s"],
        "writes_during_pricing": len(writes),
        "write_p50_s": statistics.median(writes) if writes else None,
        "write_max_s": max(writes) if writes else None,
        "write_max_over_pricing": (max(writes) / priced["costly_s"]) if writes else None,
    }
    for name, value in report.items():
        print(f"{name:>24}: {value:.4g}" if isinstance(value, float) else f"{name:>24}: {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""An external trainer releasing an Opacus DP-SGD model through the privacy ledger's gate.

    python examples/opacus_release.py --url http://127.0.0.1:8000 --key "$LEDGER_API_KEY" \\
        --dataset ds_… --target-epsilon 1.0 --epochs 2 --expected-batch-size 128

The order is the point (docs/ARCHITECTURE.md, "Release flow"):

1. **Plan, touching no data.** The number of records ``n`` comes from the ledger's batch sizes,
   not from the data. The plan is exactly what Opacus will run with Poisson sampling: sampling
   probability ``q = 1 / ceil(n / B)`` (Opacus's ``DPDataLoader`` samples each record with
   probability ``1 / len(data_loader)``), ``steps = epochs * ceil(n / B)``, and the noise
   multiplier σ given or calibrated so that the *dataset* charges at most ``--target-epsilon``
   (``LedgerClient.calibrate_noise_multiplier``: the dataset's own quote, which a Rényi-filter
   budget makes larger than Opacus's RDP ε for the same σ). The event is
   ``self_composed(poisson_sampled(gaussian(σ), q), steps)``.
2. **Reserve** that cost on every batch of the dataset (``LedgerClient.release_gate``). A
   refusal (``BudgetExceeded``) ends the run here — the data is never loaded, torch is never
   imported — with the remaining and requested budget printed and exit status 3.
3. **Train** with Opacus's ``PrivacyEngine`` using exactly the planned σ, sampling and steps.
4. **Commit** the release ``{model, version}`` on leaving the gate; the ledger answers with the
   certificate. Any exception while training aborts the reservation instead.
5. **Save the checkpoint only after the commit**, with its certificate inside, and only if the
   certificate re-verifies offline (``accountant.certificates.verify``).

Before it talks to the ledger it imports torch and Opacus (``pip install "privacy-ledger[opacus]"``):
a missing one ends the run with exit status 2 and nothing reserved. Opacus's own loader and
optimizer are then read back (``service.integrations.opacus.event_from_opacus``) and must be the
reserved event. ``service.integrations.opacus.make_private_with_epsilon`` does all of this in one
call (README, "Opacus").

Exit status: 0 released; 2 usage, missing package or connection error; 3 refused by the ledger; 1
anything else.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accountant.calibration import calibrate_noise_multiplier
from accountant.certificates import verify
from accountant.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from service.client import BudgetExceeded, Conflict, LedgerClient, LedgerError

EXIT_REFUSED = 3


@dataclass(frozen=True)
class Plan:
    n_records: int
    expected_batch_size: int
    steps_per_epoch: int
    epochs: int
    sampling_probability: float
    noise_multiplier: float
    delta: float

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def event(self) -> SelfComposedEvent:
        return SelfComposedEvent(
            PoissonSampledEvent(self.sampling_probability, GaussianEvent(self.noise_multiplier)),
            self.steps,
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=os.environ.get("LEDGER_URL"), help="ledger URL ($LEDGER_URL)")
    parser.add_argument(
        "--key", default=os.environ.get("LEDGER_API_KEY"), help="trainer key ($LEDGER_API_KEY)"
    )
    parser.add_argument("--dataset", required=True, help="the ledger's dataset id of these records")
    parser.add_argument(
        "--data-source",
        default="builtin:digits",
        help="records this trainer reads itself (default builtin:digits; or file:///path.npz|.csv)",
    )
    parser.add_argument("--model", default="opacus-digits", help="released model name")
    parser.add_argument("--version", help="released version (default: 1 + the last one released)")
    noise = parser.add_mutually_exclusive_group(required=True)
    noise.add_argument("--target-epsilon", type=float, help="calibrate sigma to this epsilon")
    noise.add_argument("--noise-multiplier", type=float, help="use this sigma")
    parser.add_argument("--delta", type=float, help="delta of the calibration (default: the budget's)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--expected-batch-size", type=int, default=128)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("checkpoints"))
    args = parser.parse_args(argv)
    if not args.url or not args.key:
        parser.error("--url and --key (or LEDGER_URL and LEDGER_API_KEY) are required")
    if args.epochs < 1 or args.expected_batch_size < 1:
        parser.error("--epochs and --expected-batch-size must be >= 1")
    return args


def missing_packages() -> list[str]:
    """The training packages that do not import: checked before anything is reserved."""
    missing = []
    for name in ("torch", "opacus"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def ledger_batches(client: LedgerClient, dataset_id: str) -> tuple[list[str], int]:
    """The dataset's task ids and its number of records, from the ledger alone."""
    tasks = [t["id"] for t in client.iter_tasks(dataset_id)]
    n_records = sum(b["size"] for t in tasks for b in client.iter_batches(dataset_id, t))
    return tasks, n_records


def next_version(client: LedgerClient, dataset_id: str, model: str) -> str:
    released = [
        c["release"]["version"]
        for c in client.iter_certificates(dataset_id)
        if c["release"]["model"] == model
    ]
    numbers = [int(v) for v in released if str(v).isdigit()]
    return str(max(numbers, default=0) + 1)


def make_plan(
    args: argparse.Namespace,
    n_records: int,
    budget: dict[str, Any],
    client: LedgerClient | None = None,
    tasks: list[str] | None = None,
) -> Plan:
    steps_per_epoch = math.ceil(n_records / args.expected_batch_size)
    q = 1.0 / steps_per_epoch  # what Opacus's DPDataLoader samples with
    delta = args.delta if args.delta is not None else float(budget["delta"])
    if args.noise_multiplier is not None:
        sigma = args.noise_multiplier
    else:
        if not 0 < delta < 1:
            raise ValueError(
                f"calibrating sigma needs a delta in (0, 1), the budget's is {delta}: pass --delta"
            )
        if client is not None and args.delta is None:
            sigma = client.calibrate_noise_multiplier(
                args.dataset,
                target_epsilon=args.target_epsilon,
                sampling_probability=q,
                steps=args.epochs * steps_per_epoch,
                tasks=tasks,
            )
        else:  # offline, or a δ of the caller's own: the RDP accountant's σ
            sigma = calibrate_noise_multiplier(
                target_epsilon=args.target_epsilon,
                delta=delta,
                sampling_probability=q,
                steps=args.epochs * steps_per_epoch,
                accountant="rdp",
            )
    return Plan(n_records, args.expected_batch_size, steps_per_epoch, args.epochs, q, sigma, delta)


def train(args: argparse.Namespace, plan: Plan) -> tuple[dict[str, Any], dict[str, float]]:
    """Opacus DP-SGD exactly as planned; the only place that reads the records."""
    print(f"loading data from {args.data_source} and training", flush=True)
    import torch
    from opacus import PrivacyEngine

    from service.training.data import DataRoots, parse_source

    # This trainer runs outside the service and reads its own file: its folder is its data root
    # (the service's worker reads only under the operator's LEDGER_DATA_ROOTS).
    source = parse_source(args.data_source)
    roots = None if source.path is None else DataRoots({"*": [str(source.path.parent)]}).for_tenant("local")
    data = source.load(roots)
    if data.n_records != plan.n_records:
        raise RuntimeError(
            f"the ledger's batches hold {plan.n_records} records but {args.data_source} holds "
            f"{data.n_records}: the reserved sampling probability would not be the one run."
        )
    torch.manual_seed(args.seed)
    features, labels = data.train_arrays()
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))
    loader = torch.utils.data.DataLoader(dataset, batch_size=plan.expected_batch_size)
    model = torch.nn.Sequential(
        torch.nn.Linear(data.n_features, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, data.num_classes),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns that its RNG is not cryptographically secure
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=args.max_grad_norm,
            poisson_sampling=True,
        )
    from service.integrations.opacus import event_from_opacus

    built = event_from_opacus(optimizer, loader, plan.epochs)  # what Opacus will run
    if built != plan.event():
        raise RuntimeError(f"Opacus runs {built}, the ledger reserved {plan.event()}")
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for _ in range(plan.epochs):
        for x, y in loader:  # a Poisson sample may be empty: the step still adds its noise
            if steps == plan.steps:
                raise RuntimeError(f"Opacus runs more than the {plan.steps} steps reserved")
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            steps += 1
    test_x, test_y = data.test_arrays()
    with torch.no_grad():
        accuracy = float(
            (model(torch.from_numpy(test_x)).argmax(1) == torch.from_numpy(test_y)).float().mean()
        )
    metrics = {
        "test_accuracy": accuracy,
        "opacus_epsilon": float(engine.get_epsilon(plan.delta)),
        "steps": steps,
    }
    state = {k.removeprefix("_module."): v.detach().clone() for k, v in model.state_dict().items()}
    return state, metrics


def save_checkpoint(
    path: Path, state: dict[str, Any], certificate: dict[str, Any], metrics: dict[str, float]
) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"state_dict": state, "certificate": certificate, "metrics": metrics}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_packages()
    if missing:
        print(
            f'cannot train: {", ".join(missing)} not installed (pip install "privacy-ledger[opacus]"); '
            "nothing was reserved",
            file=sys.stderr,
        )
        return 2
    with LedgerClient(args.url, args.key) as client:
        try:
            dataset = client.get_dataset(args.dataset)
            tasks, n_records = ledger_batches(client, args.dataset)
            version = args.version or next_version(client, args.dataset, args.model)
        except LedgerError as exc:
            print(f"cannot read dataset {args.dataset}: {exc}", file=sys.stderr)
            return 2
        if n_records == 0:
            print(f"dataset {args.dataset} has no batches", file=sys.stderr)
            return 2
        try:
            plan = make_plan(args, n_records, dataset["budget"], client, tasks)
        except (ValueError, LedgerError) as exc:  # InvalidArgumentError is a ValueError
            print(f"cannot plan the run: {exc}", file=sys.stderr)
            return 2
        event = plan.event()
        print(
            f"plan: n={plan.n_records} q={plan.sampling_probability:.6g} sigma={plan.noise_multiplier:.6g} "
            f"steps={plan.steps}; reserving {args.model} v{version} on dataset {args.dataset}",
            flush=True,
        )
        try:
            with client.release_gate(
                args.dataset, None, event, tasks=tasks, model=args.model, version=version
            ) as gate:
                print(f"reserved {gate.reservation_id}: epsilon {gate.cost.get('epsilon')}", flush=True)
                state, metrics = train(args, plan)
                if metrics["steps"] < plan.steps:  # commit what ran; the gate returns the rest
                    gate.commit_event = replace(plan, epochs=1, steps_per_epoch=int(metrics["steps"])).event()
        except BudgetExceeded as refused:
            print(
                f"refused by the ledger before training (budget_exceeded): requested epsilon "
                f"{refused.requested.get('epsilon')}, remaining epsilon {refused.remaining.get('epsilon')}; "
                "no data was read, nothing was released",
                flush=True,
            )
            return EXIT_REFUSED
        except Conflict as refused:
            print(f"refused by the ledger: {refused}", flush=True)
            return EXIT_REFUSED
        except LedgerError as exc:
            print(f"ledger error: {exc}", file=sys.stderr)
            return 2

    assert gate.certificate is not None  # the gate committed
    stored = gate.certificate
    verification = verify(stored["certificate"])
    if not verification.ok:
        print(
            f"certificate {stored['id']} does not re-verify ({verification.reason}); not saving",
            file=sys.stderr,
        )
        return 1
    path = args.output_dir / f"{args.model}-v{version}.pt"
    save_checkpoint(path, state, stored, metrics)
    print(
        json.dumps(
            {
                "released": {"model": args.model, "version": version},
                "certificate_id": stored["id"],
                "epsilon": stored["certificate"]["result"]["epsilon"],
                "checkpoint": str(path),
                "metrics": metrics,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

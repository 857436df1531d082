"""An external trainer releasing an Opacus DP-SGD model through the privacy ledger's gate.

    python examples/opacus_release.py --url http://127.0.0.1:8000 --key "$LEDGER_API_KEY" \\
        --dataset ds_… --target-epsilon 1.0 --epochs 2 --expected-batch-size 128

The order is the point (docs/ARCHITECTURE.md, "Release flow"):

1. **Plan, touching no data.** The number of records ``n`` comes from the ledger's batch sizes,
   not from the data. The plan is exactly what Opacus will run with Poisson sampling: sampling
   probability ``q = 1 / ceil(n / B)`` (Opacus's ``DPDataLoader`` samples each record with
   probability ``1 / len(data_loader)``), ``steps = epochs * ceil(n / B)``, and the noise
   multiplier σ: given (``--noise-multiplier``); or calibrated so that the run's *own* ε at the
   budget's δ by the ledger's tight engine (``accountant.calibration.tight_epsilon``, what a
   ``parallel`` budget charges the run) is at most ``--target-epsilon`` — what Opacus means by
   it; Opacus's looser PRV accountant may report up to 2% more — and refused here, before any data is
   read, when the dataset's budget cannot admit that run, naming the largest ``--target-epsilon``
   that fits; or calibrated so that the *dataset charges* at most ``--target-budget-epsilon``
   (its own quote, which a Rényi-filter budget makes larger than the run's own ε). Both numbers
   are printed: the run's own ε (ours and Opacus's PRV accountant) and what the dataset charges.
   (``LedgerClient.calibrate_noise_multiplier``.) The event is
   ``self_composed(poisson_sampled(gaussian(σ), q), steps)``.
2. **Reserve** that cost on every batch of the dataset (``LedgerClient.release_gate``). A
   refusal (``BudgetExceeded``) ends the run here — the data is never loaded, torch is never
   imported — with the remaining and requested budget printed and exit status 3.
3. **Train** with Opacus's ``PrivacyEngine`` using exactly the planned σ, sampling and steps.
4. **Commit** the release ``{model, version}`` on leaving the gate; the ledger answers with the
   certificate. Any exception while training aborts the reservation instead.
5. **Save the checkpoint only after the commit**, with its certificate inside, and only if the
   certificate re-verifies offline (``accountant.certificates.verify``).
6. **Register** the weights with the ledger as the released version
   (``LedgerClient.register_model_version``): the certificate names their SHA-256 (set on the gate
   before the commit), the server checks the bytes against it, and the version then has its DP
   statement, its model card (``ledger model-card``) and its place on the dashboard (``#/models``).

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
import hashlib
import importlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accountant.calibration import TIGHT_ACCOUNTANT, calibrate_noise_multiplier, tight_epsilon
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


def own_epsilon(plan: Plan) -> float | None:
    """The run's own ε at the plan's δ by PRV (``None`` when δ is not in (0, 1))."""
    return tight_epsilon(plan.event(), plan.delta) if 0 < plan.delta < 1 else None


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
    noise.add_argument(
        "--target-epsilon",
        type=float,
        help="calibrate sigma so that this run's own epsilon (PRV) is at most this",
    )
    noise.add_argument(
        "--target-budget-epsilon",
        type=float,
        help="calibrate sigma so that the dataset charges at most this (its quote)",
    )
    noise.add_argument("--noise-multiplier", type=float, help="use this sigma")
    parser.add_argument("--delta", type=float, help="delta of the run's epsilon (default: the budget's)")
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
    steps = args.epochs * steps_per_epoch
    if args.noise_multiplier is not None:
        sigma = args.noise_multiplier
    else:
        if not 0 < delta < 1:
            raise ValueError(
                f"calibrating sigma needs a delta in (0, 1), the budget's is {delta}: pass --delta"
            )
        if client is not None:  # BudgetExceeded (largest_target_epsilon) when the run cannot fit
            sigma = client.calibrate_noise_multiplier(
                args.dataset,
                target_epsilon=args.target_epsilon,
                target_budget_epsilon=args.target_budget_epsilon,
                delta=delta,
                sampling_probability=q,
                steps=steps,
                tasks=tasks,
            )
        elif args.target_epsilon is not None:  # offline: the run's own ε by the tight engine
            sigma = calibrate_noise_multiplier(
                target_epsilon=args.target_epsilon,
                delta=delta,
                sampling_probability=q,
                steps=steps,
                accountant=TIGHT_ACCOUNTANT,
            )
        else:
            raise ValueError("--target-budget-epsilon needs the ledger: it calibrates to the dataset's quote")
    return Plan(n_records, args.expected_batch_size, steps_per_epoch, args.epochs, q, sigma, delta)


def train(args: argparse.Namespace, plan: Plan) -> tuple[dict[str, Any], dict[str, float]]:
    """Opacus DP-SGD exactly as planned; the only place that reads the records."""
    print(f"loading data from {args.data_source} and training", flush=True)
    import torch
    from opacus import PrivacyEngine

    from service.contract.data_roots import DataRoots
    from service.contract.data_sources import parse_source
    from service.training.data import load

    # This trainer runs outside the service and reads its own file: its folder is its data root
    # (the service's worker reads only under the operator's LEDGER_DATA_ROOTS).
    source = parse_source(args.data_source)
    roots = None if source.path is None else DataRoots({"*": [str(source.path.parent)]}).for_tenant("local")
    data = load(source, roots)
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
    engine = PrivacyEngine(accountant="prv")  # Opacus's tight accountant: its ε is comparable
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
        "opacus_epsilon": float(engine.get_epsilon(plan.delta)),  # Opacus's PRV, of the steps run
        "run_epsilon": own_epsilon(plan),  # ours: the ledger's tight engine (an upper bound)
        "steps": steps,
    }
    state = {k.removeprefix("_module."): v.detach().clone() for k, v in model.state_dict().items()}
    return state, metrics


def state_bytes(state: dict[str, Any]) -> bytes:
    """The state dict as ``torch.save`` writes it: the bytes the certificate names."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


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
        except BudgetExceeded as refused:  # the run of --target-epsilon does not fit
            largest = refused.largest_target_epsilon
            fits = "no --target-epsilon fits" if largest is None else f"the largest that fits is {largest}"
            print(
                f"refused by the ledger before training (budget_exceeded): a run of --target-epsilon "
                f"{args.target_epsilon} does not fit the budget; {fits}. No data was read, nothing was "
                "reserved",
                flush=True,
            )
            return EXIT_REFUSED
        except (ValueError, LedgerError) as exc:  # InvalidArgumentError is a ValueError
            print(f"cannot plan the run: {exc}", file=sys.stderr)
            return 2
        event = plan.event()
        print(
            f"plan: n={plan.n_records} q={plan.sampling_probability:.6g} sigma={plan.noise_multiplier:.6g} "
            f"steps={plan.steps}; the run's own epsilon {own_epsilon(plan)} at delta "
            f"{plan.delta:g} (PRV); reserving {args.model} v{version} on dataset {args.dataset}",
            flush=True,
        )
        try:
            with client.release_gate(
                args.dataset, None, event, tasks=tasks, model=args.model, version=version
            ) as gate:
                print(
                    f"reserved {gate.reservation_id}: budget share epsilon {gate.cost.get('epsilon')} "
                    "(what the dataset charges; not a DP guarantee)",
                    flush=True,
                )
                state, metrics = train(args, plan)
                weights = state_bytes(state)
                gate.artifact_sha256 = hashlib.sha256(weights).hexdigest()  # the certificate names them
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
    try:
        with LedgerClient(args.url, args.key) as client:
            client.register_model_version(
                args.model,
                int(version),
                weights,
                certificate_id=stored["id"],
                architecture=f"torch.nn.Sequential(Linear(n_features, {args.hidden}), ReLU(), "
                "Linear(hidden, num_classes)); torch.save of the state dict",
                preprocessing=f"the records of {args.data_source} as its loader gives them (float32)",
                metrics={k: float(v) for k, v in metrics.items()},
            )
    except LedgerError as exc:  # released and saved; only the registry copy is missing
        print(f"released, but not registered with the ledger: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "released": {"model": args.model, "version": version},
                "certificate_id": stored["id"],
                # The release's guarantee (issue 24 §3), and the budget it consumed: a budget
                # share, not a guarantee (for a Rényi filter, the growth of its progress).
                "guarantee": stored["certificate"]["result"]["guarantee"],
                "budget_share": stored["certificate"]["result"]["budget_share"],
                # This run's own ε at the budget's δ (what target_epsilon calibrates), by the
                # ledger's tight engine (issue 25 §3) and by Opacus's PRV accountant (looser).
                "run_epsilon": {
                    "ledger_tight": metrics["run_epsilon"],
                    "opacus_prv": metrics["opacus_epsilon"],
                },
                "checkpoint": str(path),
                "metrics": metrics,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

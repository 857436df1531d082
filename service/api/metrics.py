"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms with labels, each a few lines: the service needs a handful of
series, not a dependency. Values live in this process; with ``uvicorn --workers N`` every worker
exposes its own (scrape each, or run one worker per container as Prometheus expects).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Request latency buckets (seconds): fine below 100 ms, where the ledger's targets are.
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Reservation age buckets (seconds): a hold normally lives for one training run.
AGE_BUCKETS: Final = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    type_name = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        # on every request: a length check and lookups by name, no sets built
        if len(labels) == len(self.label_names):
            try:
                return tuple([str(labels[n]) for n in self.label_names])
            except KeyError:
                pass
        raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.type_name}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    type_name = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}
        if not self.label_names:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read when scraped (``callback``), or set by the code."""

    type_name = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        callback: Callable[[], Iterable[tuple[LabelValues, float]]] | None = None,
    ) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelValues, float] = {}
        self.callback = callback

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value

    def replace(self, values: dict[LabelValues, float]) -> None:
        """Every series at once (label values in ``labels`` order): series not given are gone."""
        if any(len(key) != len(self.label_names) for key in values):
            raise ValueError(f"{self.name} takes labels {self.label_names}")
        with self._lock:
            self._values = dict(values)

    def render(self) -> list[str]:
        if self.callback is not None:
            items = sorted(self.callback())
        else:
            with self._lock:
                items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Histogram(_Metric):
    type_name = "histogram"

    def __init__(
        self, name: str, help_text: str, labels: Sequence[str] = (), buckets: Sequence[float] = ()
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        # per label set: [count per bucket (non-cumulative, last = +Inf)], sum, count
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
                self._series[key] = series
            series[0][index] += 1
            series[1][0] += value
            series[1][1] += 1

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), list(s))) for k, (c, s) in self._series.items())
        lines = self.header()
        for key, (counts, (total, count)) in items:
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = f'le="{_number(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(total)}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_number(count)}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def register(self, metric: _Metric) -> None:
        self._metrics.append(metric)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class LedgerMetrics:
    """The series the service exposes; one instance per app."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.requests = Counter(
            "ledger_http_requests_total",
            "HTTP requests answered, by method, route template and status code.",
            ("method", "route", "status"),
        )
        self.request_latency = Histogram(
            "ledger_http_request_duration_seconds",
            "Time from request received to response sent, by method and route template.",
            ("method", "route"),
            LATENCY_BUCKETS,
        )
        self.reservations = Counter("ledger_reservations_total", "Reservations admitted (budget held).")
        self.commits = Counter(
            "ledger_commits_total", "Commits: held budget turned into spent budget (releases)."
        )
        self.aborts = Counter("ledger_aborts_total", "Reservations aborted by their client.")
        self.expired = Counter(
            "ledger_reservations_expired_total",
            "Reservations expired by the background sweep after their TTL.",
        )
        self.refusals = Counter(
            "ledger_refusals_total",
            "Ledger calls refused, by error code (budget_exceeded, batch_overlap, ...).",
            ("code",),
        )
        self.reservation_age = Histogram(
            "ledger_reservation_age_seconds",
            "Age of a reservation when it was committed (first commit), aborted or expired.",
            ("outcome",),
            AGE_BUCKETS,
        )
        self.open_reservations = Gauge(
            "ledger_open_reservations",
            "Reservations currently holding budget (read from the database when scraped).",
        )
        self.oldest_open_reservation_age = Gauge(
            "ledger_oldest_open_reservation_age_seconds",
            "Age of the oldest reservation still holding budget (0 when none).",
        )
        # Per dataset, every tenant's (the operator's scrape; LEDGER_METRICS_DATASET_GAUGES=false
        # drops them): the dataset head's numbers as the API answers them (decimal → float).
        budget_labels = ("tenant", "dataset", "name", "rule", "accountant")
        self.budget_epsilon = Gauge(
            "ledger_dataset_epsilon_budget", "The dataset's epsilon budget.", budget_labels
        )
        self.budget_spent = Gauge(
            "ledger_dataset_epsilon_spent",
            "Epsilon spent on the dataset (committed releases).",
            budget_labels,
        )
        self.budget_held = Gauge(
            "ledger_dataset_epsilon_held", "Epsilon held by the dataset's open reservations.", budget_labels
        )
        self.budget_remaining = Gauge(
            "ledger_dataset_epsilon_remaining",
            "Epsilon budget minus spent (what GET /v1/datasets/{id}/spend answers as epsilon_remaining).",
            budget_labels,
        )
        self.budget_naive = Gauge(
            "ledger_dataset_naive_sequential_epsilon",
            "Epsilon the dataset's commits would cost under naive sequential composition.",
            budget_labels,
        )
        for metric in (
            self.requests,
            self.request_latency,
            self.reservations,
            self.commits,
            self.aborts,
            self.expired,
            self.refusals,
            self.reservation_age,
            self.open_reservations,
            self.oldest_open_reservation_age,
            self.budget_epsilon,
            self.budget_spent,
            self.budget_held,
            self.budget_remaining,
            self.budget_naive,
        ):
            self.registry.register(metric)

    def render(self) -> str:
        return self.registry.render()

"""Job params as submitted: the checks a job's algorithm, model name and params document pass
before a job is stored, and the limits on what a job may ask (``JobLimits``).

Job params: a typed document, validated at submit, stored only once valid (``create_job``).

* The document is JSON as the standard defines it: no NaN or Infinity (``1e999`` parses to
  Infinity), no lone surrogate and no NUL in a string, at most ``MAX_PARAMS_DEPTH`` levels deep and
  ``MAX_PARAMS_BYTES`` bytes as canonical JSON (422 naming the field). A row stored by an older
  version may hold any of these: answers render such rows defensively (``_renderable``; params
  above the bound are omitted and their size given) so one bad row cannot make ``GET /v1/jobs``
  answer 500 for its whole tenant.
* ``model_name`` (optional) is the job's: the registry name its versions are published under
  (default ``<algorithm>-<job id>``, unique per job). A name another dataset released versions under, or a
  queued or running job of another dataset will publish under, is refused (409
  ``model_name_taken``): versions are numbered per name after every release the ledger recorded
  (``registry.next_version``), so the job's versions would interleave with another dataset's model.
* The rest are the trainer's, checked against the algorithm's declaration
  (``service.contract.job_params``, torch-free: the same reader the trainer uses when the job runs).
* ``data_source`` is refused: the source belongs to the dataset, set by an admin
  (``service.ledger.datasets``), and a job on a dataset without one (or without batches) is
  refused at submit.

Limits (``JobLimits``, from ``LEDGER_JOB_MAX_STEPS``, ``LEDGER_JOB_MAX_WALL_S``,
``LEDGER_MAX_QUEUED_JOBS_PER_TENANT``): a tenant may have at most ``max_queued_per_tenant`` jobs
queued (409 ``too_many_queued_jobs`` at submit); the steps a job implies are checked against
``max_steps`` from its plan, before anything is reserved (``service.worker.gate``; an explicit
``params.steps`` above it is refused at submit already); a worker stops an attempt that runs
longer than ``max_wall_s``, aborts the rest of its reservation and fails it
(``service.worker.worker.JobControl``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from service.contract import job_params
from service.contract.job_params import ALGORITHMS
from service.ledger.errors import InvalidInput
from service.settings import Settings

JOB_KEYS: Final = ("model_name",)
"""Keys of ``params`` read by the job itself; the others are the trainer's."""


LEGACY_KEYS: Final = ("data_source",)
"""Keys that rows queued by older versions may hold: refused at submit, never passed to a trainer."""


MAX_PARAMS_KEYS: Final = 200


MAX_PARAMS_BYTES: Final = 32 * 1024
"""Bytes of the params document as canonical JSON (what is stored). The largest valid documents
(an L2DP-ML ``task_order`` for 1 000 tasks and the other keys) are under 6 KB."""


MAX_PARAMS_DEPTH: Final = 8
"""Nesting levels of the params document (the object itself is level 1; no trainer takes more
than a list of numbers, level 2)."""


MAX_KEY_LENGTH: Final = 100


MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
SET_SOURCE: Final = (
    "an admin sets it (POST /v1/datasets with data_source, or PUT /v1/datasets/{id}/data-source)"
)


@dataclass(frozen=True)
class JobLimits:
    """What one tenant's jobs may take of the shared workers (``service.settings``)."""

    max_steps: int
    max_wall_s: float
    max_queued_per_tenant: int

    @classmethod
    def of(cls, settings: Settings) -> JobLimits:
        return cls(settings.job_max_steps, settings.job_max_wall_s, settings.max_queued_jobs_per_tenant)

    @classmethod
    def from_environment(cls) -> JobLimits:
        """The limits ``LEDGER_*`` sets for this process (a worker started without explicit ones)."""
        return cls.of(Settings())


DEFAULT_LIMITS: Final = JobLimits.of(Settings.model_construct())
"""The settings' defaults (no environment read)."""


def check_algorithm(algorithm: object) -> str:
    if algorithm in ALGORITHMS:
        assert isinstance(algorithm, str)
        return algorithm
    raise InvalidInput("algorithm", f"must be one of {list(ALGORITHMS)}. Found {shown(algorithm)}.")


def check_model_name(name: object, field: str = "params.model_name") -> str:
    if not isinstance(name, str) or MODEL_NAME.fullmatch(name) is None:
        raise InvalidInput(
            field,
            "must be 1-200 characters of letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit. Found {shown(name)}.",
        )
    return name


def default_model_name(algorithm: str, job_id: str) -> str:
    """``<algorithm>-<job id>``: unique per job, so a job without ``model_name`` never numbers
    its versions among another job's (two jobs on one dataset used to share a name)."""
    return f"{algorithm}-{job_id}"


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message may quote it: ASCII (a lone surrogate would make the answer
    itself unencodable), and short (a message must not echo a megabyte back)."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _key_field(prefix: str, key: str) -> str:
    """``prefix.key`` as a field name an answer can carry (printable ASCII escapes, bounded)."""
    printable = key if key.isascii() and key.isprintable() else ascii(key)[1:-1]
    if len(printable) > MAX_KEY_LENGTH:
        printable = printable[:MAX_KEY_LENGTH] + "..."
    return f"{prefix}.{printable}"


def check_json_text(text: str, field: str) -> None:
    if "\x00" in text:
        raise InvalidInput(field, "must not contain NUL (U+0000): no database stores it in a JSON string.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidInput(
            field,
            f"must be Unicode text: it holds a lone surrogate U+{code:04X} at index {exc.start}, "
            "which no UTF-8 answer can carry.",
        ) from None


def _check_json(value: object, field: str, depth: int) -> None:
    """Raise ``InvalidInput`` naming the first value of ``value`` that standard JSON cannot carry."""
    if depth > MAX_PARAMS_DEPTH:
        raise InvalidInput(field, f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does.")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(
                field,
                "must be a finite number: JSON has no NaN or Infinity (and a number beyond the "
                f"double range, such as 1e999, reads as Infinity). Found {value}.",
            )
    elif isinstance(value, str):
        check_json_text(value, field)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(field, f"keys must be strings. Found {shown(key)}.")
            name = _key_field(field, key)
            if len(key) > MAX_KEY_LENGTH:
                raise InvalidInput(name, f"is a key of {len(key)} characters; at most {MAX_KEY_LENGTH}.")
            check_json_text(key, name)
            _check_json(item, name, depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{field}[{index}]", depth + 1)
    elif value is not None and not isinstance(value, bool | int):
        raise InvalidInput(
            field, f"must be JSON (object, array, string, number, boolean or null). Found {shown(value)}."
        )


def check_document(params: object) -> dict[str, Any]:
    """The params document's shape and size: an object of at most ``MAX_PARAMS_KEYS`` keys and
    ``MAX_PARAMS_BYTES`` bytes as JSON. Measured in C before anything walks it (walking a
    multi-megabyte document in Python would be the attack). Its values are checked by
    ``check_params``."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidInput("params", f"must be an object. Found {type(params).__name__}.")
    if len(params) > MAX_PARAMS_KEYS:
        raise InvalidInput("params", f"must have at most {MAX_PARAMS_KEYS} keys. Found {len(params)}.")
    try:
        size = len(json.dumps(params, ensure_ascii=True, separators=(",", ":"), allow_nan=True))
    except RecursionError:
        raise InvalidInput(
            "params", f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does."
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidInput("params", f"must be a JSON object ({exc}).") from None
    if size > MAX_PARAMS_BYTES:
        raise InvalidInput("params", f"must be at most {MAX_PARAMS_BYTES} bytes as JSON. Found {size} bytes.")
    # The RecursionError above is not a bound: Python 3.12's C encoder recurses far deeper than
    # 3.11's (a 5 000-level document encodes there; seen on the GPU machine). The size is bounded
    # now, so a walk that stops ``_WALK_BOUND`` levels down is cheap; ``check_params`` names the
    # exact path of anything between ``MAX_PARAMS_DEPTH`` and it.
    if _nests_deeper(params, _WALK_BOUND):
        raise InvalidInput("params", f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does.")
    return dict(params)


_WALK_BOUND: Final = 4 * MAX_PARAMS_DEPTH
"""Levels ``check_document`` walks at most: a document deeper is refused before any other walk."""


def _nests_deeper(document: object, limit: int) -> bool:
    """Whether ``document`` holds a container more than ``limit`` levels deep (it is level 1)."""
    level: list[object] = [document]
    for _ in range(limit):
        children: list[object] = []
        for value in level:
            if isinstance(value, Mapping):
                children.extend(v for v in value.values() if isinstance(v, Mapping | list))
            elif isinstance(value, list):
                children.extend(v for v in value if isinstance(v, Mapping | list))
        if not children:
            return False
        level = children
    return True


def check_params(algorithm: str, document: Mapping[str, Any], limits: JobLimits = DEFAULT_LIMITS) -> Any:
    """The params ``check_document`` let through, validated (422 naming ``params.<key>``): as
    standard JSON (no NaN/Infinity, lone surrogate or NUL; ``MAX_PARAMS_DEPTH`` levels), the job's
    own keys, then the trainer's as the trainer will read them. Returns what the trainer's reader
    made of them (its dataclass)."""
    _check_json(document, "params", 1)
    if "data_source" in document:
        raise InvalidInput(
            "params.data_source",
            f"is not a job param: the data source belongs to the dataset; {SET_SOURCE}. A job "
            "trains on its dataset's source and cannot name one.",
        )
    if document.get("model_name") is not None:
        check_model_name(document["model_name"])
    try:
        parsed = job_params.validate(algorithm, trainer_params(document))
    except job_params.InvalidParamsError as exc:
        raise InvalidInput(exc.field, exc.message) from None
    steps = getattr(parsed, "steps", None)
    if isinstance(steps, int) and steps > limits.max_steps:
        raise InvalidInput(
            "params.steps", f"must be <= {limits.max_steps} (LEDGER_JOB_MAX_STEPS). Found {steps}."
        )
    return parsed


def trainer_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's part of a job's params (without ``JOB_KEYS`` and ``LEGACY_KEYS``)."""
    return {k: v for k, v in params.items() if k not in JOB_KEYS and k not in LEGACY_KEYS}


def steps_refusal(steps: int, params: Mapping[str, Any], limits: JobLimits) -> dict[str, Any] | None:
    """The job's error when ``steps`` (what its plan implies) exceed ``limits.max_steps``; the
    worker checks it before reserving, so a refused job reads nothing and holds nothing."""
    if steps <= limits.max_steps:
        return None
    field = "params.steps" if "steps" in params else "params.epochs"
    return {
        "error": "too_many_steps",
        "message": (
            f"the job's plan takes {steps} training steps, more than the {limits.max_steps} a job may "
            f"take (LEDGER_JOB_MAX_STEPS); give fewer {field[len('params.') :]}."
        ),
        "field": field,
        "steps": steps,
        "limit": limits.max_steps,
    }


__all__ = [
    "ALGORITHMS",
    "DEFAULT_LIMITS",
    "JOB_KEYS",
    "LEGACY_KEYS",
    "MAX_KEY_LENGTH",
    "MAX_PARAMS_BYTES",
    "MAX_PARAMS_DEPTH",
    "MAX_PARAMS_KEYS",
    "MODEL_NAME",
    "SET_SOURCE",
    "JobLimits",
    "check_algorithm",
    "check_document",
    "check_json_text",
    "check_model_name",
    "check_params",
    "default_model_name",
    "shown",
    "steps_refusal",
    "trainer_params",
]

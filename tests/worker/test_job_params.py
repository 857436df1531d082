"""Job params as one typed, torch-free declaration (``service.contract.job_params``): what the API checks
at submit is what the trainer reads at run time, for every algorithm; the params document is
standard JSON within its bounds (``service.ledger.jobs.params.check_document`` / ``check_params``).

No database here: these are the checks ``create_job`` runs before anything is stored (the HTTP
tests with row counts are tests/security/test_red_team_findings.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.contract import job_params
from service.ledger import jobs
from service.ledger.errors import InvalidInput
from service.training.algorithms import TRAINERS

ROOT = Path(__file__).resolve().parents[2]

# Params each trainer accepts today (taken from the trainers' own tests), with a seed where the
# trainer would otherwise draw one (so two reads compare equal).
VALID: list[tuple[str, dict[str, Any]]] = [
    ("dp_sgd", {"noise_multiplier": 1.0, "steps": 10}),
    (
        "dp_sgd",
        {
            "target_epsilon": 2,
            "delta": 1e-5,
            "checkpoint_every": 100,
            "seed": 11,
            "model": "cnn",
            "hidden": [8, 16],
            "expected_batch_size": 32,
            "epochs": 2.5,
            "momentum": 0.5,
            "accountant": "prv",
            "num_classes": 10,
        },
    ),
    ("dp_sgd", {"noise_multiplier": 1.0, "steps": 3.0, "hidden": 32, "sampling_probability": 0.1}),
    ("dp_sgd", {"target_epsilon": 1.0, "seed": 1}),  # δ: the budget's
    ("dp_sgd", {"target_budget_epsilon": 1.0, "delta": 1e-5, "seed": 1}),
    ("adadp", {"target_epsilon": 2.0, "delta": 1e-5, "checkpoint_every": 150, "seed": 4, "beta": 1.2}),
    (
        "l2dp_ml",
        {
            "epsilon1": 1.0,
            "epsilon2": 0.5,
            "input_dim": 64,
            "epochs": [1, 2],
            "task_order": [1, 0],
            "seed": 3,
        },
    ),
    ("l2dp_ml", {"epsilon1": 1.0, "epsilon2": 0.5, "input_dim": 64, "epochs": 2, "seed": 3}),
    (
        "continual_release",
        {"mode": "sliding_window", "epsilon": 0.7, "sampling": True, "regularization": 0.3},
    ),
    ("continual_release", {"epsilon": 1, "base_blocks": 4, "max_blocks": 16, "seed": 2}),
    ("continual_release", {"epsilon": 1, "positive_class": 3}),
    ("cosine_classifier", {"target_epsilon": 1.0, "delta": 1e-5, "feature_dim": 16, "pretrain_epochs": 2}),
    ("peft_ensemble", {"noise_multiplier": 2.0, "epochs": 1, "expected_batch_size": 32, "seed": 1}),
    ("peft_naive", {"noise_multiplier": 2.0, "learning_rate": 1.0, "max_grad_norm": 0.5}),
    ("peft_full_data", {"target_epsilon": 1.0, "delta": 1e-5, "accountant": "prv", "momentum": 0.9}),
    ("naive_gaussian", {"noise_multiplier": 1.0, "sampling_probability": 0.2, "epochs": [1, 1], "seed": 5}),
    ("naive_gaussian", {"target_epsilon": 2.0, "seed": 5}),  # δ: the budget's
    ("naive_gaussian", {"target_budget_epsilon": 2.0, "delta": 1e-5, "seed": 5}),
    ("peft_naive", {"target_budget_epsilon": 1.0, "accountant": "rdp"}),
    ("cosine_classifier", {"target_epsilon": 1.0}),  # δ: the budget's
    ("dp_sgd_audit", {"target_epsilon": 2.0, "delta": 1e-5, "canaries": 500, "confidence": 0.99}),
]


def test_every_algorithm_has_a_declaration_and_a_trainer() -> None:
    """The server owns the names (``service.contract.job_params``); the trainers follow them."""
    assert set(job_params.PARAMS) == set(job_params.ALGORITHMS)
    assert tuple(TRAINERS) == job_params.ALGORITHMS


@pytest.mark.parametrize(("algorithm", "params"), VALID)
def test_the_trainer_reads_what_the_declaration_accepts(algorithm: str, params: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from service.training.algorithms import trainer_for

    declared = job_params.validate(algorithm, params)
    assert trainer_for(algorithm, "cpu").parse_params(params) == declared
    assert jobs.params.check_params(algorithm, params) == declared  # and the API takes it


@pytest.mark.parametrize(
    ("algorithm", "params", "field"),
    [
        ("dp_sgd", {"noise_multiplier": 1.0, "epoch": 3}, "params.epoch"),  # a typo
        ("dp_sgd", {"noise_multiplier": 1.0, "steps": "10"}, "params.steps"),  # a string
        ("dp_sgd", {"noise_multiplier": 1.0, "steps": 0}, "params.steps"),  # out of range
        ("dp_sgd", {"noise_multiplier": True}, "params.noise_multiplier"),  # a boolean is no number
        # a run's own epsilon or the budget's increase: one of the two, named apart (issue 24)
        ("dp_sgd", {"target_epsilon": 1.0, "target_budget_epsilon": 1.0}, "params.target_epsilon"),
        ("dp_sgd", {"target_budget_epsilon": -1.0}, "params.target_budget_epsilon"),
        ("dp_sgd", {"target_epsilon": 1.0, "delta": 1e-5, "noise_multiplier": 1.0}, "params.target_epsilon"),
        ("dp_sgd", {"noise_multiplier": 1.0, "model": "resnet"}, "params.model"),
        ("dp_sgd", {"noise_multiplier": 1.0, "compile_gradients": True}, "params.compile_gradients"),
        ("dp_sgd", {"noise_multiplier": 1.0, "world_size": 0}, "params.world_size"),  # issue 30
        ("dp_sgd", {"noise_multiplier": 1.0, "world_size": 65}, "params.world_size"),
        ("adadp", {"noise_multiplier": 1.0, "world_size": 2}, "params.world_size"),  # one process only
        ("adadp", {"noise_multiplier": 1.0, "momentum": 0.5}, "params.momentum"),
        ("l2dp_ml", {"epsilon1": 1.0, "epsilon2": 0.5}, "params.input_dim"),
        (
            "l2dp_ml",
            {"epsilon1": 1.0, "epsilon2": 0.5, "input_dim": 8, "task_order": [-1]},
            "params.task_order",
        ),
        ("continual_release", {"epsilon": 1.0, "base_blocks": 3}, "params.base_blocks"),
        ("continual_release", {"mode": "weekly", "epsilon": 1.0}, "params.mode"),
        ("continual_release", {"epsilon": 1.0, "positive_class": -1}, "params.positive_class"),
        ("cosine_classifier", {"noise_multiplier": 1.0, "epochs": 2}, "params.epochs"),  # a head param
        ("naive_gaussian", {"noise_multiplier": 1.0, "hidden": [8, 8]}, "params.hidden"),
        # the staged trainers name the two targets apart too (issue 24): exactly one
        ("cosine_classifier", {"target_epsilon": 1.0, "target_budget_epsilon": 1.0}, "params.target_epsilon"),
        ("peft_ensemble", {"target_budget_epsilon": 1.0, "noise_multiplier": 1.0}, "params.target_epsilon"),
        ("peft_full_data", {"target_budget_epsilon": 0}, "params.target_budget_epsilon"),
        ("naive_gaussian", {"target_epsilon": 1.0, "target_budget_epsilon": 1.0}, "params.target_epsilon"),
        ("naive_gaussian", {"delta": 1e-5}, "params.target_epsilon"),
    ],
)
def test_what_a_trainer_refuses_is_refused_at_submit_naming_the_field(
    algorithm: str, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params(algorithm, jobs.params.check_document(params))
    assert info.value.field == field
    with pytest.raises(job_params.InvalidParamsError) as declared:  # the trainer's own reader agrees
        job_params.validate(algorithm, params)
    assert declared.value.field == field


def test_the_job_keys_are_checked_and_the_data_source_is_refused() -> None:
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params("dp_sgd", {"noise_multiplier": 1.0, "data_source": "builtin:digits"})
    assert info.value.field == "params.data_source"
    assert "belongs to the dataset" in info.value.message and "data-source" in info.value.message
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params("dp_sgd", {"noise_multiplier": 1.0, "model_name": "../../etc"})
    assert info.value.field == "params.model_name"
    parsed = jobs.params.check_params("dp_sgd", {"noise_multiplier": 1.0, "model_name": "m-1"})
    assert parsed.noise_multiplier == 1.0  # model_name is the job's, not passed to the trainer


def test_an_explicit_step_count_above_the_limit_is_refused_at_submit() -> None:
    limits = jobs.params.JobLimits(max_steps=100, max_wall_s=60, max_queued_per_tenant=5)
    assert jobs.params.check_params("dp_sgd", {"noise_multiplier": 1.0, "steps": 100}, limits).steps == 100
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params("dp_sgd", {"noise_multiplier": 1.0, "steps": 101}, limits)
    assert info.value.field == "params.steps" and "LEDGER_JOB_MAX_STEPS" in info.value.message


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"noise_multiplier": math.nan}, "params.noise_multiplier", "NaN or Infinity"),
        ({"noise_multiplier": math.inf}, "params.noise_multiplier", "1e999"),
        ({"hidden": [8, -math.inf]}, "params.hidden[1]", "finite"),
        ({"model": "\ud800"}, "params.model", "lone surrogate U+D800"),
        ({"\udfff": 1}, "params.\\udfff", "lone surrogate U+DFFF"),
        ({"model": "ml\x00p"}, "params.model", "NUL"),
        ({"a": [[[[[[[[1]]]]]]]]}, "params.a[0][0][0][0][0][0][0]", "deeper than 8"),
        ({"k" * 101: 1}, "params." + "k" * 100 + "...", "at most 100"),
        ({"x": {1, 2}}, "params", "must be a JSON object"),
    ],
)
def test_values_json_cannot_carry_are_refused_naming_the_field(
    params: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params("dp_sgd", jobs.params.check_document(params))
    assert info.value.field == field and words in info.value.message
    info.value.message.encode("ascii")  # the answer can always be encoded


def test_the_document_is_bounded_before_it_is_walked() -> None:
    big = {"junk": "x" * jobs.params.MAX_PARAMS_BYTES}
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_document(big)
    assert (
        info.value.field == "params" and f"at most {jobs.params.MAX_PARAMS_BYTES} bytes" in info.value.message
    )
    deep: Any = 1
    for _ in range(5000):  # deeper than json.dumps recurses: a RecursionError, answered as a 422
        deep = [deep]
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_document({"a": deep})
    assert info.value.field == "params" and "deeper" in info.value.message
    # Deep but small enough for any encoder (Python 3.12's C encoder takes 5 000 levels): refused by
    # the bounded walk, not by a RecursionError.
    shallow_enough_to_encode: Any = 1
    for _ in range(40):
        shallow_enough_to_encode = {"k": shallow_enough_to_encode}
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_document({"a": shallow_enough_to_encode})
    assert info.value.field == "params" and "deeper" in info.value.message
    with pytest.raises(InvalidInput):
        jobs.params.check_document({f"k{i}": i for i in range(jobs.params.MAX_PARAMS_KEYS + 1)})
    with pytest.raises(InvalidInput):
        jobs.params.check_document(["not", "an", "object"])
    # The largest valid documents (a task order for 1 000 tasks) fit with room to spare.
    largest = {
        "epsilon1": 1.0,
        "epsilon2": 0.5,
        "input_dim": 1_000_000,
        "epochs": [10_000] * 16,
        "task_order": list(range(1000)),
        "model_name": "m" * 200,
    }
    jobs.params.check_params("l2dp_ml", jobs.params.check_document(largest))
    assert len(json.dumps(largest)) < jobs.params.MAX_PARAMS_BYTES / 4


@pytest.mark.slow
def test_the_api_validates_params_without_loading_torch() -> None:
    code = (
        "import sys\n"
        "from service.api import jobs as routes\n"
        "from service.ledger import jobs\n"
        "for algorithm in jobs.params.ALGORITHMS:\n"
        "    try:\n"
        "        jobs.params.check_params(algorithm, {'noise_multiplier': 1.0})\n"
        "    except Exception:\n"
        "        pass\n"
        "jobs.params.check_params('dp_sgd', {'noise_multiplier': 1.0, 'steps': 3})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

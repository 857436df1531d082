"""The training tests run torch on one intra-op thread, as the worker tests do
(tests/worker/conftest.py says why)."""

from tests.worker.conftest import _one_torch_thread  # noqa: F401

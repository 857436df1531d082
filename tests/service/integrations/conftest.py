"""The HTTP API fixtures (tests/service/api/conftest.py) for the adapters' HTTP tests."""

from tests.service.api.conftest import app, client, keys, settings  # noqa: F401

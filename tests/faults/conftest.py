"""The HTTP API fixtures (``settings``, ``app``, ``client``, ``keys``) of tests/service/api."""

from tests.service.api.conftest import app, client, keys, settings  # noqa: F401

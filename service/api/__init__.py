"""HTTP API v1: thin routers (parse, authorise, call the ledger, return), schemas, dependencies,
error mapping, middleware and metrics. Every router is mounted under ``PREFIX``."""

from typing import Final

PREFIX: Final = "/v1"

# syntax=docker/dockerfile:1
#
# privacy-ledger images, one Dockerfile, two targets:
#
#   docker build --target api    -t privacy-ledger-api .
#   docker build --target worker -t privacy-ledger-worker .
#   docker build --target worker -t privacy-ledger-worker-cuda \
#       --build-arg BASE_IMAGE=<a CUDA runtime image, e.g. nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04> \
#       --build-arg TORCH_INDEX_URL=<the PyTorch wheel index of that CUDA version> .
#
# api    - the HTTP API (and dashboard) without torch: `ledger serve --no-worker`. `ledger serve`
#          applies the Alembic migrations before it listens, so the schema is always current.
# worker - `ledger worker` with torch (CUDA when the base image and the host provide it, CPU
#          otherwise). It also applies the migrations at start-up (idempotent, safe when several
#          processes start at once), so it never runs against a missing or stale schema.
#
# Both run as the unprivileged user `ledger` (uid 10001). Model artifacts live in
# /var/lib/ledger/artifacts (LEDGER_ARTIFACT_DIR), a volume the api and the workers share.
#
# Only pyproject.toml, README.md and the three source folders are copied into the images, so the
# rest of the build context (a local .venv, ledger.db, .git) never reaches them.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The worker's base: a CPU Python image by default; any CUDA runtime image for GPUs (Python is
# installed from its distribution when the image has none).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# base: the project installed (PostgreSQL driver included, no torch), a non-root user
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 ledger \
 && useradd --system --uid 10001 --gid ledger --home-dir /app --no-create-home --shell /usr/sbin/nologin ledger
WORKDIR /app
COPY pyproject.toml README.md ./
COPY accountant ./accountant
COPY service ./service
COPY alembic ./alembic
# Editable install: the migrations are found next to the `service` package (service.db.migrations).
RUN python -m venv /opt/ledger \
 && /opt/ledger/bin/pip install -e ".[server,postgres]" \
 && mkdir -p /var/lib/ledger/artifacts \
 && chown -R ledger:ledger /var/lib/ledger
ENV PATH=/opt/ledger/bin:$PATH \
    LEDGER_ARTIFACT_DIR=/var/lib/ledger/artifacts

# ---------------------------------------------------------------------------------------------
# api: no torch; migrates, then serves HTTP API v1 on :8000
# ---------------------------------------------------------------------------------------------
FROM base AS api
USER ledger
EXPOSE 8000
VOLUME ["/var/lib/ledger/artifacts"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["ledger"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--no-worker"]

# ---------------------------------------------------------------------------------------------
# worker: torch (CPU, or CUDA from BASE_IMAGE + TORCH_INDEX_URL); migrates, then claims jobs
# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS worker
ARG TORCH_VERSION=2.13.0
# Empty: pip's configured index. Set it to install a CUDA (or CPU-only) build of torch.
ARG TORCH_INDEX_URL=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
     && apt-get install -y --no-install-recommends python3 python3-venv \
     && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 ledger \
 && useradd --system --uid 10001 --gid ledger --home-dir /app --no-create-home --shell /usr/sbin/nologin ledger
WORKDIR /app
COPY --from=base /app /app
# torch first, from the chosen index, so that installing the project does not pull another build.
RUN python3 -m venv /opt/ledger \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
        /opt/ledger/bin/pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        /opt/ledger/bin/pip install "torch==${TORCH_VERSION}"; \
    fi \
 && /opt/ledger/bin/pip install -e ".[postgres,worker]" \
 && mkdir -p /var/lib/ledger/artifacts \
 && chown -R ledger:ledger /var/lib/ledger
ENV PATH=/opt/ledger/bin:$PATH \
    LEDGER_ARTIFACT_DIR=/var/lib/ledger/artifacts
USER ledger
VOLUME ["/var/lib/ledger/artifacts"]
ENTRYPOINT ["ledger"]
CMD ["worker"]

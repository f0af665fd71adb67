# syntax=docker/dockerfile:1
# The kvpolicy operator image: `kvpolicy run` (kopf). It also carries the gate tools (`kvpolicy gate ...`), so the
# operator's gate Jobs use this image by default.
#   docker build -t ghcr.io/kvpolicy/kvpolicy-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# .dockerignore lets only these through: the package and what its build needs.
COPY pyproject.toml README.md ./
COPY operator/ ./operator/
# Runtime dependencies only (no test or demo extras), in a virtual environment the final stage copies whole.
RUN python -m venv /opt/kvpolicy \
    && /opt/kvpolicy/bin/pip install --no-cache-dir . \
    && /opt/kvpolicy/bin/kvpolicy --version

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 kvpolicy \
    && useradd --system --uid 10001 --gid kvpolicy --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvpolicy
COPY --from=build /opt/kvpolicy /opt/kvpolicy
# No bytecode writes: the chart runs this image with a read-only root filesystem.
ENV PATH=/opt/kvpolicy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 8080: kopf liveness (/healthz); 9090: Prometheus metrics (/metrics).
EXPOSE 8080 9090
ENTRYPOINT ["kvpolicy", "run"]

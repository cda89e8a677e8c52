#!/usr/bin/env bash
# Build the tokenmesh container image with buildah, or check a built one.
#
#   scripts/build_image.sh           build localhost/tokenmesh:<version from pyproject.toml>
#   scripts/build_image.sh --check   run that image's embedded mesh; require SERVING and "Paris"
#
# Needs root on Linux (mmdebstrap and buildah's chroot isolation); installs
# mmdebstrap, buildah and podman from Debian when they are missing. No
# registry is used: unless BASE_IMAGE names one, the base is Debian bookworm
# minbase made here with mmdebstrap (build/image/, git-ignored) and imported
# as localhost/bookworm-local:minbase once.
#
# Environment:
#   BASE_IMAGE        base image for both stages (default: the local bookworm minbase)
#   IMAGE             image to build/check (default localhost/tokenmesh:<version>)
#   DEBIAN_MIRROR     mirror for mmdebstrap (default http://deb.debian.org/debian)
#   PIP_CERT          CA bundle pip inside the build trusts (default: `pip config get
#                     global.cert`, else /etc/ssl/certs/ca-certificates.crt); passed as
#                     the build secret pip_ca, never stored in the image
#   CHECK_PORT        router port for --check (default: a free one)
#   CHECK_TIMEOUT_S   how long --check waits for SERVING (default 300)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
[ -n "$VERSION" ] || { echo "no version in pyproject.toml" >&2; exit 1; }
IMAGE=${IMAGE:-localhost/tokenmesh:$VERSION}
LOCAL_BASE=localhost/bookworm-local:minbase
BASE_IMAGE=${BASE_IMAGE:-$LOCAL_BASE}
BUILD_DIR=build/image
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { printf '==> %s\n' "$*" >&2; }

# step NAME CMD...: run CMD, then print how long it took.
step() {
    local name=$1 start end
    shift
    start=$(date +%s.%N)
    "$@"
    end=$(date +%s.%N)
    awk -v name="$name" -v s="$start" -v e="$end" 'BEGIN { printf "==> %s: %.1f s\n", name, e - s }' >&2
}

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "$0 needs root (mmdebstrap, buildah --isolation chroot); run it with sudo" >&2
        exit 1
    fi
}

install_tools() {
    local missing=()
    for tool in mmdebstrap buildah podman; do
        command -v "$tool" > /dev/null || missing+=("$tool")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} from Debian"
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y mmdebstrap buildah podman
    fi
}

# A stand-in for debian:bookworm-slim: minbase, merged /usr without the usrmerge
# package (and its perl), docs/man/locales excluded as in the slim image.
make_base() {
    mkdir -p "$BUILD_DIR"
    rm -f "$BUILD_DIR/bookworm-minbase.tar"
    step "mmdebstrap bookworm minbase" mmdebstrap --variant=minbase --format=tar \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$BUILD_DIR/bookworm-minbase.tar" "$MIRROR"
    step "podman import" podman import --change 'CMD ["bash"]' \
        "$BUILD_DIR/bookworm-minbase.tar" "$LOCAL_BASE"
}

ca_bundle() {
    local cert=${PIP_CERT:-}
    if [ -z "$cert" ]; then
        cert=$( { pip config get global.cert || python3 -m pip config get global.cert; } 2>/dev/null | head -n 1 || true)
    fi
    [ -n "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
    [ -s "$cert" ] && echo "$cert"
    return 0
}

build() {
    need_root
    install_tools
    if [ "$BASE_IMAGE" = "$LOCAL_BASE" ] && ! podman image exists "$LOCAL_BASE"; then
        make_base
    fi
    if command -v hadolint > /dev/null || [ -x .venv/bin/hadolint ]; then
        step "hadolint" "$(command -v hadolint || echo .venv/bin/hadolint)" Dockerfile
    fi
    local secret=() cert
    cert=$(ca_bundle)
    if [ -n "$cert" ]; then
        log "pip in the build trusts $cert (build secret pip_ca)"
        secret=(--secret "id=pip_ca,src=$cert")
    fi
    local previous
    previous=$(buildah images --noheading --format '{{.ID}}' "$IMAGE" 2> /dev/null || true)
    # --layers keeps each step's layer: a code change rebuilds from `COPY services` on.
    step "buildah bud $IMAGE" buildah bud --isolation chroot --network host --layers \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "IMAGE_VERSION=$VERSION" \
        "${secret[@]}" -f Dockerfile -t "$IMAGE" .
    # The image this build replaced, now untagged (the layer cache stays).
    if [ -n "$previous" ] && [ "$previous" != "$(buildah images --noheading --format '{{.ID}}' "$IMAGE")" ]; then
        buildah rmi "$previous" > /dev/null 2>&1 || true
    fi
    buildah images "$IMAGE"
}

# --check: the image's own `tokenmesh up` in a buildah container sharing the
# host's network, then health (readiness of the router) and a generation,
# both through the image's own client code. Stops and removes what it started.
CTR=""
UP_PID=""
check_cleanup() {
    if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2> /dev/null; then
        log "stopping tokenmesh up (pid $UP_PID) with SIGTERM"
        kill -TERM "$UP_PID" 2> /dev/null || true
        for _ in $(seq 60); do kill -0 "$UP_PID" 2> /dev/null || break; sleep 0.5; done
        if kill -0 "$UP_PID" 2> /dev/null; then
            log "tokenmesh up (pid $UP_PID) still running after 30 s: SIGKILL"
            kill -KILL "$UP_PID" 2> /dev/null || true
        fi
    fi
    if [ -n "${RUN_PID:-}" ]; then wait "$RUN_PID" 2> /dev/null || true; fi
    if [ -n "$CTR" ]; then buildah rm "$CTR" > /dev/null || true; fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
        2> /dev/null || echo 50051
}

check() {
    need_root
    command -v buildah > /dev/null || install_tools
    local port=${CHECK_PORT:-$(free_port)} timeout_s=${CHECK_TIMEOUT_S:-300} logf status answer start
    mkdir -p "$BUILD_DIR"
    logf="$BUILD_DIR/check-up.log"
    trap check_cleanup EXIT
    CTR=$(buildah from --pull-never --name "tokenmesh-check-$$" "$IMAGE")
    start=$(date +%s)
    log "tokenmesh up on 127.0.0.1:$port in $CTR (log $logf)"
    # The shell prints its pid, then becomes tokenmesh up: chroot isolation has
    # no pid namespace, so that pid is the host's, to SIGTERM at the end.
    # shellcheck disable=SC2016  # $$ and $(id -u) are the container shell's
    buildah run --isolation chroot --network host "$CTR" -- \
        sh -c 'echo "pid $$ uid $(id -u)"; exec tokenmesh up --host 127.0.0.1 --port "$0"' "$port" \
        > "$logf" 2>&1 &
    RUN_PID=$!
    for _ in $(seq 50); do
        UP_PID=$(sed -n 's/^pid \([0-9]*\) uid .*/\1/p' "$logf" | head -n 1)
        [ -n "$UP_PID" ] && break
        sleep 0.2
    done
    [ -n "$UP_PID" ] || { echo "FAIL: the container did not start"; cat "$logf"; exit 1; }
    if grep -q '^pid [0-9]* uid 0$' "$logf"; then
        echo "FAIL: the image runs as root"; exit 1
    fi
    status=""
    while [ "$(date +%s)" -lt "$((start + timeout_s))" ]; do
        if ! kill -0 "$UP_PID" 2> /dev/null; then
            echo "FAIL: tokenmesh up exited during start"; tail -n 40 "$logf"; exit 1
        fi
        status=$(buildah run --isolation chroot --network host "$CTR" -- python -c '
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
try:
    reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(
        health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
except grpc.RpcError as exc:
    print(exc.code().name)
' "127.0.0.1:$port" 2> /dev/null || true)
        [ "$status" = SERVING ] && break
        sleep 2
    done
    log "router readiness: ${status:-no answer} after $(($(date +%s) - start)) s"
    [ "$status" = SERVING ] || { echo "FAIL: not SERVING"; tail -n 40 "$logf"; exit 1; }
    answer=$(buildah run --isolation chroot --network host "$CTR" -- tokenmesh generate --chat \
        "What is the capital of France?" --max-tokens 20 --temperature 0 --addr "127.0.0.1:$port" 2>&1 || true)
    log "generate: $answer"
    case $answer in
        *Paris*) ;;
        *) echo "FAIL: the answer has no \"Paris\""; tail -n 40 "$logf"; exit 1 ;;
    esac
    check_written "$start"
    echo "OK: $IMAGE serves (readiness SERVING, \"Paris\"), non-root, writes only under /tmp"
}

# Nothing but /tmp may change in the container's own file system (the chart's
# root file system is read-only). buildah run itself adds /etc/hosts,
# /etc/resolv.conf and /run/.containerenv; the overlay's upper folder shows
# everything else the container wrote.
check_written() {
    local mnt upper written
    mnt=$(buildah mount "$CTR")
    upper="$(dirname "$mnt")/diff"
    if [ -d "$upper" ]; then
        written=$(cd "$upper" && find . -mindepth 1 \
            \( -path ./tmp -o -path ./etc/hosts -o -path ./etc/resolv.conf -o -path ./etc/hostname \
               -o -path ./run/.containerenv -o -path ./run/secrets -o -path ./dev -o -path ./proc -o -path ./sys \) -prune \
            -o -newermt "@$1" -print | grep -v -E '^\./(etc|run)$' || true)
        if [ -n "$written" ]; then
            echo "FAIL: the container wrote outside /tmp:"; echo "$written"; buildah umount "$CTR" > /dev/null; exit 1
        fi
    else
        log "no overlay upper folder at $upper: skipped the check of what was written"
    fi
    buildah umount "$CTR" > /dev/null
}

case ${1:-} in
    "") build ;;
    --check) check ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

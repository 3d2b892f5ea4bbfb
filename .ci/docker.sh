#!/usr/bin/env bash
# Docker engine + the offline base image for the SWE-Bench sandbox (crl_gym/envs/swebench).
#
#   1. installs docker.io and debootstrap from Debian (apt-get) when they are missing;
#   2. starts dockerd when no engine answers, and waits for it;
#   3. builds the base image WITHOUT any registry: debootstrap --variant=minbase of Debian
#      bookworm with python3, git, python3-pytest, then `docker import`.
#
# Caching: the image is skipped when its tag already exists; the debootstrap tarball is kept
# under $CRL_CACHE_DIR (default /var/cache/crl) so a fresh engine only re-imports it.
# The Debian mirror is read from this machine's apt sources, never written into the repo.
# Keep BASE_IMAGE in step with crl_gym/envs/swebench/image.py (a test checks they agree).
set -euo pipefail

BASE_IMAGE="${CRL_SWE_BASE_IMAGE:-crl/swe-base:bookworm-v1}"
SUITE="bookworm"
PACKAGES="python3,python3-pytest,git,patch,ca-certificates"
CACHE_DIR="${CRL_CACHE_DIR:-/var/cache/crl}"
TARBALL="$CACHE_DIR/swe-base-${SUITE}-v1.tar"

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

log() { echo "[docker.sh] $*" >&2; }

# --- 1. packages ------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]} with apt-get"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# --- 2. engine --------------------------------------------------------------------------
if ! $SUDO docker info >/dev/null 2>&1; then
    log "no Docker engine answers; starting dockerd (log: /tmp/dockerd.log)"
    $SUDO sh -c 'nohup dockerd > /tmp/dockerd.log 2>&1 &'
    for _ in $(seq 1 60); do
        if $SUDO docker info >/dev/null 2>&1; then break; fi
        sleep 1
    done
    if ! $SUDO docker info >/dev/null 2>&1; then
        log "dockerd did not come up within 60 s; last lines of /tmp/dockerd.log:"
        tail -n 30 /tmp/dockerd.log >&2 || true
        exit 1
    fi
fi
# Let the (non-root) CI user talk to the engine too.
if [ -S /var/run/docker.sock ] && [ "$(id -u)" != "0" ]; then
    $SUDO chmod 666 /var/run/docker.sock || true
fi
log "engine up: $($SUDO docker version --format '{{.Server.Version}}')"

# --- 3. base image ----------------------------------------------------------------------
if $SUDO docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE already present; skipping build"
    exit 0
fi

# The first Debian mirror of this machine's apt sources that serves $SUITE (deb822 or one-line).
find_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        # deb822 stanzas: take URIs of a stanza whose Suites list $SUITE itself.
        awk -v suite="$SUITE" '
            /^[[:space:]]*$/ { if (uris != "" && ok) { print uris; exit } uris=""; ok=0; next }
            /^URIs:/ { uris=$2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) ok=1 }
            END { if (uris != "" && ok) print uris }
        ' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v suite="$SUITE" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/ && $(i+1) == suite) print $i }' "$f"
    done
}

# Any Debian archive of this machine serves bookworm too (e.g. a trixie host's mirror).
any_debian_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -vE '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?' | grep -v security | head -n 1
}

if [ ! -s "$TARBALL" ]; then
    # CRL_DEBIAN_MIRROR overrides (a CI runner whose own sources are not Debian).
    MIRROR="${CRL_DEBIAN_MIRROR:-$(find_mirror | head -n 1)}"
    MIRROR="${MIRROR:-$(any_debian_mirror)}"
    if [ -z "$MIRROR" ]; then
        log "no Debian mirror found in /etc/apt/sources.list{,.d/*}; set CRL_DEBIAN_MIRROR to build $BASE_IMAGE"
        exit 1
    fi
    log "debootstrap $SUITE from $MIRROR (this takes a few minutes once; cached in $TARBALL)"
    $SUDO mkdir -p "$CACHE_DIR"
    ROOTFS="$(mktemp -d /tmp/crl-rootfs.XXXXXX)"
    trap '$SUDO rm -rf "$ROOTFS"' EXIT
    $SUDO debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >&2
    # A non-root user for the agent (uid 1000) and a work directory it owns.
    $SUDO sh -c "echo 'agent:x:1000:1000:sandbox agent:/home/agent:/bin/bash' >> '$ROOTFS/etc/passwd'"
    $SUDO sh -c "echo 'agent:x:1000:' >> '$ROOTFS/etc/group'"
    $SUDO sh -c "echo 'agent:*:19000:0:99999:7:::' >> '$ROOTFS/etc/shadow'"
    $SUDO mkdir -p "$ROOTFS/home/agent" "$ROOTFS/testbed"
    $SUDO chown 1000:1000 "$ROOTFS/home/agent" "$ROOTFS/testbed"
    # Smaller image: no apt lists, caches or docs.
    $SUDO rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/usr/share/doc/* \
        "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
    $SUDO tar -C "$ROOTFS" -cf "$TARBALL.tmp" .
    $SUDO mv "$TARBALL.tmp" "$TARBALL"
    $SUDO rm -rf "$ROOTFS"
    trap - EXIT
fi

log "importing $TARBALL as $BASE_IMAGE"
$SUDO docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change 'WORKDIR /testbed' \
    --change 'CMD ["/bin/bash"]' \
    "$TARBALL" "$BASE_IMAGE" >/dev/null
log "built $BASE_IMAGE"

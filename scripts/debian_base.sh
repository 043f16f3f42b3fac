#!/usr/bin/env bash
# A base image for deploy/Dockerfile without an image registry: Debian bookworm from the Debian
# mirror (mmdebstrap, or debootstrap --variant=minbase), imported into Docker.
#
#   sudo scripts/debian_base.sh [TAG]          # default tag: neuronode-base:bookworm
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=neuronode-base:bookworm ...
#
# The image holds what deploy/Dockerfile asks of a base: python3 (3.11) with its venv module, and
# useradd. DEBIAN_MIRROR picks the mirror (default http://deb.debian.org/debian). Needs root.
set -euo pipefail
tag=${1:-neuronode-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-venv,passwd

if [ "$(id -u)" != 0 ]; then
  echo "debian_base.sh: needs root (mmdebstrap/debootstrap build a root file system)" >&2
  exit 1
fi
if command -v mmdebstrap >/dev/null; then
  # One apt run and a tarball on stdout, straight into `docker import`: about twice as fast as
  # debootstrap here. Its apt lists are dropped (images that apt-get install update first).
  mmdebstrap --quiet --variant=minbase --include="$packages" \
      --dpkgopt=force-unsafe-io --dpkgopt=path-exclude=/usr/share/doc/* \
      --dpkgopt=path-exclude=/usr/share/man/* --dpkgopt=path-exclude=/usr/share/locale/* \
      bookworm - "$mirror" | docker import - "$tag" >/dev/null
elif command -v debootstrap >/dev/null; then
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$tag" >/dev/null
else
  echo "debian_base.sh: neither mmdebstrap nor debootstrap is installed (apt-get install mmdebstrap)" >&2
  exit 1
fi
echo "$tag"

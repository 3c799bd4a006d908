#!/usr/bin/env bash
# Build a Debian base image from Debian packages only (debootstrap + `docker import`), for
# machines that cannot pull from a registry. Prints the image tag on stdout.
#
# The tag is derived from the recipe (suite, mirror, package list, this script's content), so an
# unchanged recipe reuses the image already present and a changed one builds a new tag (and
# removes the older baton-base:<suite>-* tags).
#   BATON_BASE_SUITE    (default bookworm)
#   BATON_BASE_MIRROR   (default http://deb.debian.org/debian)
#   BATON_BASE_REPO     image repository name (default baton-base)
# Needs root (debootstrap) and the `debootstrap` package.
set -euo pipefail

SUITE="${BATON_BASE_SUITE:-bookworm}"
MIRROR="${BATON_BASE_MIRROR:-http://deb.debian.org/debian}"
REPO="${BATON_BASE_REPO:-baton-base}"
PACKAGES="ca-certificates,curl"

recipe_hash=$( { echo "$SUITE $MIRROR $PACKAGES"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)
TAG="$REPO:$SUITE-$recipe_hash"

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG already present (cached)" >&2
  echo "$TAG"
  exit 0
fi

command -v debootstrap >/dev/null 2>&1 || {
  echo "debootstrap is not installed (apt-get install -y debootstrap)" >&2
  exit 1
}

rootfs=$(mktemp -d /tmp/baton-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

echo "building $TAG with debootstrap ($SUITE from $MIRROR)" >&2
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1; then
  tail -n 30 "$rootfs.log" >&2
  rm -f "$rootfs.log"
  exit 1
fi
rm -f "$rootfs.log"
# Keep the image small: no apt lists, caches, docs or man pages.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
# Same apt source as the official image, so `apt-get update` works inside when there is network.
echo "deb $MIRROR $SUITE main" >"$rootfs/etc/apt/sources.list"

tar -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' - "$TAG" >&2
# Drop base images of older recipes so the cache holds one per suite. (grep finds none on a
# fresh machine and exits 1; under pipefail that must not fail the build.)
old_tags=$(docker images --format '{{.Repository}}:{{.Tag}}' "$REPO" | grep "^$REPO:$SUITE-" | grep -vx "$TAG" || true)
for old in $old_tags; do
  docker image rm "$old" >/dev/null 2>&1 && echo "removed old base $old" >&2
done
echo "$TAG"

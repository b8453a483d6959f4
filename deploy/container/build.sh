#!/usr/bin/env bash
# Builds the draftfeed-target image (deploy/container/Containerfile) with buildah, or podman when
# buildah is absent. With no BASE given it first makes a Debian base image locally with
# debootstrap from a Debian mirror, so no container registry has to be reachable.
#   bash deploy/container/build.sh                        # -> localhost/draftfeed-target:latest
#   BASE=docker.io/library/debian:bookworm bash deploy/container/build.sh
#   BASE=<CUDA devel image> RUNTIME_BASE=<CUDA runtime image> TAG=draftfeed-target:cuda \
#     bash deploy/container/build.sh
# Settings: TAG, BASE, RUNTIME_BASE (default BASE), SUITE (bookworm), MIRROR
# (http://deb.debian.org/debian), ISOLATION (chroot: RUN steps need neither user namespaces nor
# a container runtime), STORAGE_DRIVER (e.g. vfs where overlayfs cannot be mounted).
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${TAG:-localhost/draftfeed-target:latest}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ISOLATION=${ISOLATION:-chroot}
LOCAL_BASE=localhost/debian-$SUITE-base:latest

if command -v buildah >/dev/null; then
  tool=(buildah ${STORAGE_DRIVER:+--storage-driver="$STORAGE_DRIVER"})
  build=("${tool[@]}" bud)
elif command -v podman >/dev/null; then
  tool=(podman ${STORAGE_DRIVER:+--storage-driver="$STORAGE_DRIVER"})
  build=("${tool[@]}" build)
else
  echo "build.sh: neither buildah nor podman is installed (Debian: apt-get install buildah)" >&2
  exit 1
fi

if [[ -z "${BASE:-}" ]]; then
  BASE=$LOCAL_BASE
  if ! "${tool[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || {
      echo "build.sh: no BASE image given and no debootstrap to make one" \
        "(apt-get install debootstrap, or BASE=<a Debian image>)" >&2
      exit 1
    }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "build.sh: making $BASE with debootstrap ($SUITE from $MIRROR)"
    debootstrap --variant=minbase "$SUITE" "$work/rootfs" "$MIRROR"
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
    tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
    if [[ "${tool[0]}" == buildah ]]; then
      ctr=$("${tool[@]}" from scratch)
      "${tool[@]}" add "$ctr" "$work/rootfs.tar" /   # a local tar archive is unpacked
      "${tool[@]}" config --cmd /bin/bash "$ctr"
      "${tool[@]}" commit --rm "$ctr" "$BASE"
    else
      "${tool[@]}" import "$work/rootfs.tar" "$BASE"
    fi
  fi
fi
RUNTIME_BASE=${RUNTIME_BASE:-$BASE}

echo "build.sh: building $TAG from $BASE (runtime $RUNTIME_BASE) with ${build[*]}"
"${build[@]}" --layers --isolation="$ISOLATION" -f deploy/container/Containerfile \
  --ignorefile deploy/container/containerignore \
  --build-arg BASE="$BASE" --build-arg RUNTIME_BASE="$RUNTIME_BASE" -t "$TAG" .
echo "build.sh: built $TAG"

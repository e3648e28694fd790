#!/usr/bin/env bash
# A Debian bookworm base image made from the Debian package mirror, for machines that cannot pull
# python:3.11-slim (no registry access). It holds what Dockerfile.cpu needs from its base: python3
# (3.11, as in python:3.11-slim), venv, pip, the Python headers and the CA certificates.
#   images/bootstrap-base.sh [--tool buildah|podman|docker] [--tag NAME] [--cache DIR] [--mirror URL]
# Prints the image name on its last line; build on it with `images/build.sh cpu TAG --base NAME`.
# Needs root and debootstrap. The root filesystem is cached as a tarball under --cache (default
# $PRMFLOW_IMAGE_CACHE, else ~/.cache/prmflow-images), keyed on this script's content, and the image
# is not re-imported when the tool already holds the tag; so a second run costs seconds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
suite=bookworm
packages=python3,python3-venv,python3-pip,python3-dev,ca-certificates
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${PRMFLOW_IMAGE_CACHE:-$HOME/.cache/prmflow-images}"
tool=""
tag=""
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool="${2:?--tool needs docker, podman or buildah}"; shift 2 ;;
    --tag) tag="${2:?--tag needs an image name}"; shift 2 ;;
    --cache) cache="${2:?--cache needs a directory}"; shift 2 ;;
    --mirror) mirror="${2:?--mirror needs a URL}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "bootstrap-base.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
# shellcheck source=images/tool.sh
source "$here/tool.sh"
tool="$(pick_tool "$tool")"
key="$(sha256sum "$0" | cut -c1-12)"
tag="${tag:-localhost/prmflow-base:$suite-$key}"

if image_exists "$tool" "$tag"; then
  echo "base image $tag is already there" >&2
  echo "$tag"
  exit 0
fi

mkdir -p "$cache"
tarball="$cache/base-$suite-$key.tar"
if [ ! -s "$tarball" ]; then
  [ "$(id -u)" = 0 ] || { echo "bootstrap-base.sh: debootstrap needs root" >&2; exit 1; }
  command -v debootstrap >/dev/null || { echo "bootstrap-base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
  work="$(mktemp -d "$cache/.rootfs.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "debootstrap $suite ($packages) from $mirror ..." >&2
  debootstrap --variant=minbase --include="$packages" "$suite" "$work/root" "$mirror" >&2
  # apt inside the image sees the same suites as python:3.11-slim (updates and security included)
  cat > "$work/root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
  chroot "$work/root" apt-get clean
  rm -rf "$work/root/var/lib/apt/lists/"* "$work/root/var/cache/apt/"*.bin "$work/root/var/log/"*
  tar --numeric-owner -C "$work/root" -cf "$tarball.partial" .
  mv "$tarball.partial" "$tarball"   # a cut-off run never leaves a tarball that looks finished
  rm -rf "$work"
  trap - EXIT
fi

echo "importing $tarball as $tag ..." >&2
case "$tool" in
  docker|podman)
    "$tool" import --change 'CMD ["/bin/bash"]' "$tarball" "$tag" >&2 ;;
  buildah)
    ctr="$(buildah from scratch)"
    mnt="$(buildah mount "$ctr")"
    tar --numeric-owner -C "$mnt" -xf "$tarball"
    buildah umount "$ctr" >/dev/null
    buildah config --cmd /bin/bash \
      --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --rm "$ctr" "$tag" >&2 ;;
esac
echo "$tag"

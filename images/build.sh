#!/usr/bin/env bash
# Build the prmflow images with the digest-pinned bases from images/bases.env.
#   images/build.sh cpu  REGISTRY/prmflow-cpu:TAG
#   images/build.sh gpu  REGISTRY/prmflow-gpu:TAG
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kind="${1:?usage: build.sh cpu|gpu IMAGE:TAG}"
tag="${2:?usage: build.sh cpu|gpu IMAGE:TAG}"
# shellcheck source=/dev/null
source "$here/bases.env"
case "$kind" in
  cpu) base="$CPU_BASE_IMAGE" ;;
  gpu) base="$GPU_BASE_IMAGE" ;;
  *) echo "unknown image kind '$kind': use cpu or gpu" >&2; exit 2 ;;
esac
docker build -f "$here/Dockerfile.$kind" --build-arg "BASE_IMAGE=$base" -t "$tag" "$here/.."

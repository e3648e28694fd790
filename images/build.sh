#!/usr/bin/env bash
# Build a prmflow image with docker, podman or buildah, on the digest-pinned base from images/bases.env.
#   images/build.sh cpu|gpu IMAGE:TAG [--tool docker|podman|buildah] [--base IMAGE]
#                   [--wheels DIR] [--ca-bundle FILE] [-- EXTRA BUILD ARGS]
#   --tool       default: docker when its daemon answers, else podman, else buildah
#   --base       base image instead of bases.env's (e.g. one made by images/bootstrap-base.sh)
#   --wheels     a local wheel directory (cpu image): pip looks there first, and installs torch's
#                CPU build from it when it holds torch-2.13.0 (no access to the torch index needed)
#   --ca-bundle  a CA bundle for pip inside the build (a network whose TLS goes through a proxy with
#                its own CA), passed as the build secret `ca`: it is not stored in the image
# buildah builds with `--isolation chroot` (override with BUILDAH_ISOLATION), which needs no daemon
# and no user namespaces.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
kind="$1" tag="$2"
shift 2
tool="" base="" wheels="" ca=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool="${2:?--tool needs docker, podman or buildah}"; shift 2 ;;
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
    --ca-bundle) ca="${2:?--ca-bundle needs a file}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "build.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
# shellcheck source=/dev/null
source "$here/bases.env"
case "$kind" in
  cpu) base="${base:-$CPU_BASE_IMAGE}" ;;
  gpu) base="${base:-$GPU_BASE_IMAGE}" ;;
  *) echo "build.sh: unknown image kind '$kind': use cpu or gpu" >&2; exit 2 ;;
esac
# shellcheck source=images/tool.sh
source "$here/tool.sh"
tool="$(pick_tool "$tool")"

args=(-f "$here/Dockerfile.$kind" --build-arg "BASE_IMAGE=$base" -t "$tag")
if [ -n "$wheels" ]; then
  [ "$kind" = cpu ] || { echo "build.sh: --wheels is for the cpu image (the gpu image installs vLLM's CUDA torch from the index)" >&2; exit 2; }
  [ -d "$wheels" ] || { echo "build.sh: --wheels $wheels is not a directory" >&2; exit 2; }
  args+=(--build-context "wheels=$(cd "$wheels" && pwd)")
fi
if [ -n "$ca" ]; then
  [ -s "$ca" ] || { echo "build.sh: --ca-bundle $ca is not a readable, non-empty file" >&2; exit 2; }
  args+=(--secret "id=ca,src=$(cd "$(dirname "$ca")" && pwd)/$(basename "$ca")")
fi
case "$tool" in
  docker) cmd=(env DOCKER_BUILDKIT=1 docker build) ;;  # secrets and named contexts need BuildKit
  podman) cmd=(podman build --layers --force-rm --format docker) ;;  # docker format: OCI drops SHELL
  buildah) cmd=(buildah bud --layers --force-rm --format docker --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
esac
echo "+ ${cmd[*]} ${args[*]} ${extra[*]} $here/.." >&2
exec "${cmd[@]}" "${args[@]}" "${extra[@]}" "$here/.."

#!/usr/bin/env bash
# Build a prmflow image with docker, podman or buildah, on the digest-pinned base from images/bases.env.
#   images/build.sh cpu|gpu IMAGE:TAG [--push] [--tool docker|podman|buildah] [--base IMAGE]
#                   [--wheels DIR] [--ca-bundle FILE] [--constraints FILE] [-- EXTRA BUILD ARGS]
#   --push       push IMAGE:TAG to its registry after the build (log in first: docker/podman login) and
#                print the digest-pinned name to set as pipeline.images.cpu|gpu
#   --tool       default: docker when its daemon answers, else podman, else buildah
#   --base       base image instead of bases.env's (e.g. one made by images/bootstrap-base.sh)
#   --wheels     a local wheel directory (cpu image): pip looks there first, and installs torch's
#                CPU build from it when it holds torch-2.13.0 (no access to the torch index needed)
#   --ca-bundle  a CA bundle for pip inside the build (a network whose TLS goes through a proxy with
#                its own CA), passed as the build secret `ca`: it is not stored in the image
#   --constraints  a pip constraints file of `name==version` lines (e.g. `pip freeze --exclude-editable`
#                of an environment you tested): the image installs exactly those versions instead of
#                the newest that pyproject's ranges allow, and keeps the file as
#                /opt/prmflow/constraints.txt. It reaches the build as the build argument
#                PIP_CONSTRAINTS, so changing a pin rebuilds the dependency layer (a cached layer is
#                otherwise kept however new the releases on the index are)
# buildah builds with `--isolation chroot` (override with BUILDAH_ISOLATION), which needs no daemon
# and no user namespaces.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
kind="$1" tag="$2"
shift 2
tool="" base="" wheels="" ca="" constraints="" push=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=1; shift ;;
    --tool) tool="${2:?--tool needs docker, podman or buildah}"; shift 2 ;;
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
    --ca-bundle) ca="${2:?--ca-bundle needs a file}"; shift 2 ;;
    --constraints) constraints="${2:?--constraints needs a file}"; shift 2 ;;
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
# Checked before anything is built: a bad pin fails here, not minutes into pip.
pins=()
if [ -n "$constraints" ]; then
  [ -r "$constraints" ] || { echo "build.sh: --constraints $constraints is not a readable file" >&2; exit 2; }
  lineno=0
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    line="${line//[[:space:]]/}"
    [ -n "$line" ] || continue
    if ! [[ "$line" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+$ ]]; then
      echo "build.sh: $constraints line $lineno: '$line' is not a 'name==version' pin (pip freeze --exclude-editable writes those; drop '-e', '@ URL' and option lines)" >&2
      exit 2
    fi
    pins+=("$line")
  done < "$constraints"
  [ ${#pins[@]} -gt 0 ] || { echo "build.sh: --constraints $constraints holds no 'name==version' pin" >&2; exit 2; }
fi
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
[ ${#pins[@]} -eq 0 ] || args+=(--build-arg "PIP_CONSTRAINTS=${pins[*]}")
case "$tool" in
  docker) cmd=(env DOCKER_BUILDKIT=1 docker build) ;;  # secrets and named contexts need BuildKit
  podman) cmd=(podman build --layers --force-rm --format docker) ;;  # docker format: OCI drops SHELL
  buildah) cmd=(buildah bud --layers --force-rm --format docker --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
esac
if [ -n "$push" ] && [[ "$tag" != */* ]]; then
  echo "build.sh: --push needs a registry in the image name (REGISTRY/prmflow-$kind:TAG), not '$tag'" >&2
  exit 2
fi
echo "+ ${cmd[*]} ${args[*]} ${extra[*]} $here/.." >&2
"${cmd[@]}" "${args[@]}" "${extra[@]}" "$here/.."
[ -n "$push" ] || exit 0
# Push, then name the image by the digest the registry stored: what the pipeline should pull (a tag can move).
name_part="${tag##*/}"
repo="$tag"
[[ "$name_part" != *:* ]] || repo="${tag%:*}"  # without the tag (a registry port stays)
digestfile="$(mktemp)"
trap 'rm -f "$digestfile"' EXIT
case "$tool" in
  docker)
    echo "+ docker push $tag" >&2
    docker push "$tag" >&2
    pinned="$(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$tag" | grep -m1 "^$repo@")" ;;
  podman|buildah)
    echo "+ $tool push --digestfile $digestfile $tag" >&2
    "$tool" push --digestfile "$digestfile" "$tag" >&2
    pinned="$repo@$(cat "$digestfile")" ;;
esac
[[ "$pinned" =~ @sha256:[0-9a-f]{64}$ ]] || { echo "build.sh: pushed $tag but could not read its digest (got '$pinned')" >&2; exit 1; }
echo "pushed $tag; set it in the pipeline config:" >&2
echo "  pipeline: {images: {$kind: $pinned}}    (or --set images.$kind=$pinned)" >&2
echo "$pinned"

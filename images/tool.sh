# shellcheck shell=bash
# Shared by build.sh and bootstrap-base.sh (sourced): which container tool to drive.

# pick_tool [NAME]: the named tool, checked, else the first that works here: docker with a daemon
# answering, then podman, then buildah.
pick_tool() {
  local want="${1:-}"
  if [ -n "$want" ]; then
    case "$want" in
      docker|podman|buildah) ;;
      *) echo "unknown container tool '$want': use docker, podman or buildah" >&2; return 2 ;;
    esac
    command -v "$want" >/dev/null || { echo "'$want' is not installed" >&2; return 1; }
    echo "$want"; return 0
  fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return 0; fi
  if command -v podman >/dev/null; then echo podman; return 0; fi
  if command -v buildah >/dev/null; then echo buildah; return 0; fi
  echo "no container tool found: install docker (with its daemon running), podman or buildah" >&2
  return 1
}

# image_exists TOOL IMAGE
image_exists() {
  case "$1" in
    docker) docker image inspect "$2" >/dev/null 2>&1 ;;
    podman) podman image exists "$2" ;;
    buildah) buildah inspect --type image "$2" >/dev/null 2>&1 ;;
  esac
}

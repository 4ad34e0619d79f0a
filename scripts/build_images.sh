#!/usr/bin/env bash
# Build the areal-npu Ascend images (A2 and/or A3) with docker buildx, every pin taken from
# docker/versions.env. See docker/README.md.
#
#   scripts/build_images.sh                         # build both chips, load them into the local docker
#   scripts/build_images.sh --chip a3               # one chip
#   scripts/build_images.sh --push registry.example.com/team   # build and push both
#   scripts/build_images.sh --dry-run               # print the commands, run nothing
#
# Tags, for CHIP in a2/a3 (VERSION is areal-npu's version from pyproject.toml):
#   [REGISTRY/]areal-npu:VERSION-CHIP
#   [REGISTRY/]areal-npu:VERSION-cannCANN-torchTORCH-vllmVLLM-CHIP   (the stack-version tag)
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/build_images.sh [options] [-- extra docker buildx build arguments]

  --chip a2|a3|all     which image(s) to build (default: all)
  --push REGISTRY      push to REGISTRY (e.g. ghcr.io/org or registry:5000/team) instead of loading
                       the images into the local docker engine
  --platform PLATFORM  target platform, e.g. linux/arm64 (default: the builder's native platform)
  --image-name NAME    repository name (default: areal-npu)
  --versions FILE      versions file (default: docker/versions.env)
  --dry-run            print the docker commands instead of running them
  -h, --help           this help
EOF
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
versions_file="${repo_root}/docker/versions.env"
dockerfile="${repo_root}/docker/Dockerfile"
chips=(a2 a3)
registry=""
platform=""
image_name="areal-npu"
dry_run=0
extra_args=()

while [ "$#" -gt 0 ]; do
    case "$1" in
        --chip)
            [ "$#" -ge 2 ] || { usage >&2; exit 2; }
            case "$2" in
                a2 | a3) chips=("$2") ;;
                all) chips=(a2 a3) ;;
                *) echo "build_images.sh: --chip must be a2, a3 or all, not '$2'" >&2; exit 2 ;;
            esac
            shift 2 ;;
        --push)
            [ "$#" -ge 2 ] && [ -n "$2" ] || { echo "build_images.sh: --push needs a registry" >&2; exit 2; }
            registry="${2%/}"; shift 2 ;;
        --platform)
            [ "$#" -ge 2 ] || { usage >&2; exit 2; }
            platform="$2"; shift 2 ;;
        --image-name)
            [ "$#" -ge 2 ] || { usage >&2; exit 2; }
            image_name="$2"; shift 2 ;;
        --versions)
            [ "$#" -ge 2 ] || { usage >&2; exit 2; }
            versions_file="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; extra_args=("$@"); break ;;
        *) echo "build_images.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

# Read KEY=VALUE pins without executing the file.
declare -A pin=()
pin_keys=()
while IFS= read -r line || [ -n "${line}" ]; do
    case "${line}" in '' | '#'*) continue ;; esac
    key="${line%%=*}"
    value="${line#*=}"
    if [[ ! "${key}" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || [ "${key}" = "${line}" ] || [ -z "${value}" ]; then
        echo "build_images.sh: ${versions_file}: not a KEY=VALUE line: ${line}" >&2
        exit 2
    fi
    pin["${key}"]="${value}"
    pin_keys+=("${key}")
done < "${versions_file}"

for key in CANN_VERSION TORCH_VERSION VLLM_VERSION; do
    [ -n "${pin[${key}]:-}" ] || { echo "build_images.sh: ${versions_file} has no ${key}" >&2; exit 2; }
done

version="$(sed -n 's/^version = "\([^"]*\)".*/\1/p' "${repo_root}/pyproject.toml" | head -n 1)"
[ -n "${version}" ] || { echo "build_images.sh: no version in pyproject.toml" >&2; exit 2; }
revision="$(git -C "${repo_root}" rev-parse HEAD 2>/dev/null || echo unknown)"

# Only the pins the Dockerfile declares as ARG are passed (buildx warns about unused ones).
declared_args=" $(sed -n 's/^ARG \([A-Za-z_][A-Za-z0-9_]*\).*/\1/p' "${dockerfile}" | tr '\n' ' ') "

run() {
    if [ "${dry_run}" -eq 1 ]; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

repo="${image_name}"
[ -z "${registry}" ] || repo="${registry}/${image_name}"
stack="cann${pin[CANN_VERSION]}-torch${pin[TORCH_VERSION]}-vllm${pin[VLLM_VERSION]}"

for chip in "${chips[@]}"; do
    cmd=(docker buildx build
        --file "${dockerfile}"
        --build-arg "CHIP=${chip}")
    for key in "${pin_keys[@]}"; do
        case "${declared_args}" in *" ${key} "*) cmd+=(--build-arg "${key}=${pin[${key}]}") ;; esac
    done
    cmd+=(--tag "${repo}:${version}-${chip}"
        --tag "${repo}:${version}-${stack}-${chip}"
        --label "org.opencontainers.image.version=${version}"
        --label "org.opencontainers.image.revision=${revision}"
        --label "org.opencontainers.image.title=areal-npu (${chip})"
        --label "io.areal-npu.stack=${stack}")
    [ -z "${platform}" ] || cmd+=(--platform "${platform}")
    if [ -n "${registry}" ]; then
        cmd+=(--push)
    else
        cmd+=(--load)
    fi
    cmd+=("${extra_args[@]}" "${repo_root}")
    run "${cmd[@]}"
done

#!/usr/bin/env bash
# Start an areal-npu container on an Ascend node: finds the chip from the device tree (A2 exposes
# /dev/davinci0-7, A3 /dev/davinci0-15), passes the NPU devices, the driver / dcmi / npu-smi
# mounts, the host network and a large shared-memory segment, and mounts a work directory.
#
#   scripts/run_container.sh                          # interactive shell, $PWD at /workspace
#   scripts/run_container.sh -- areal-npu doctor      # run one command
#   scripts/run_container.sh --dry-run                # print the docker run line only
#
# AREAL_NPU_DEV_ROOT (or --dev-root) prefixes every host path that is looked up or mounted, so a
# test can point the script at a fake device tree.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/run_container.sh [options] [-- command ...]

  --image IMAGE      image to run (default: areal-npu:VERSION-CHIP, VERSION from pyproject.toml)
  --chip a2|a3       expected chip (default: found from the number of /dev/davinciN devices)
  --devices LIST     comma-separated NPU ids to pass, e.g. 0,1,2,3 (default: all found)
  --workdir DIR      host directory mounted at /workspace (default: the current directory)
  --shm-size SIZE    shared memory size (default: 64g)
  --name NAME        container name
  --dev-root DIR     root of the host device tree (default: $AREAL_NPU_DEV_ROOT, else /)
  --dry-run          print the docker run command instead of running it
  -h, --help         this help
EOF
}

die() {
    echo "run_container.sh: $*" >&2
    exit 2
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
image=""
chip=""
devices=""
workdir="${PWD}"
shm_size="64g"
name=""
dev_root="${AREAL_NPU_DEV_ROOT:-}"
dry_run=0
command_args=()

while [ "$#" -gt 0 ]; do
    case "$1" in
        --image | --chip | --devices | --workdir | --shm-size | --name | --dev-root)
            [ "$#" -ge 2 ] || die "$1 needs a value"
            case "$1" in
                --image) image="$2" ;;
                --chip) chip="$2" ;;
                --devices) devices="$2" ;;
                --workdir) workdir="$2" ;;
                --shm-size) shm_size="$2" ;;
                --name) name="$2" ;;
                --dev-root) dev_root="$2" ;;
            esac
            shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; command_args=("$@"); break ;;
        *) usage >&2; die "unknown argument '$1'" ;;
    esac
done

dev_root="${dev_root%/}"
case "${chip}" in '' | a2 | a3) ;; *) die "--chip must be a2 or a3, not '${chip}'" ;; esac

# NPU ids present on the host: /dev/davinciN (not davinci_manager).
found=()
for path in "${dev_root}"/dev/davinci[0-9]*; do
    [ -e "${path}" ] || continue
    id="${path##*/davinci}"
    [[ "${id}" =~ ^[0-9]+$ ]] && found+=("${id}")
done
[ "${#found[@]}" -gt 0 ] || die "no ${dev_root}/dev/davinciN devices: not an Ascend node (or the driver is not loaded)"
mapfile -t found < <(printf '%s\n' "${found[@]}" | sort -n)

# A2 (910B) nodes expose 8 NPUs, A3 (910C) nodes 16 (two dies per chip).
if [ -z "${chip}" ]; then
    case "${#found[@]}" in
        8) chip=a2 ;;
        16) chip=a3 ;;
        *) die "found ${#found[@]} NPUs (${found[*]}); an A2 node has 8 and an A3 node 16: pass --chip" ;;
    esac
fi
max_devices=8
[ "${chip}" = a3 ] && max_devices=16
[ "${#found[@]}" -le "${max_devices}" ] || die "found ${#found[@]} NPUs, more than an ${chip} node has (${max_devices})"

selected=("${found[@]}")
if [ -n "${devices}" ]; then
    IFS=',' read -r -a selected <<< "${devices}"
    for id in "${selected[@]}"; do
        [[ "${id}" =~ ^[0-9]+$ ]] || die "--devices takes NPU ids like 0,1,2,3, not '${id}'"
        [ -e "${dev_root}/dev/davinci${id}" ] || die "--devices: ${dev_root}/dev/davinci${id} does not exist"
    done
fi

if [ -z "${image}" ]; then
    version="$(sed -n 's/^version = "\([^"]*\)".*/\1/p' "${repo_root}/pyproject.toml" | head -n 1)"
    image="areal-npu:${version}-${chip}"
fi
[ -d "${workdir}" ] || die "--workdir ${workdir} is not a directory"
workdir="$(cd "${workdir}" && pwd)"

# host path (under the device root) -> the same path in the container
host() { printf '%s%s' "${dev_root}" "$1"; }
spec() {
    if [ -n "${dev_root}" ]; then printf '%s:%s' "$(host "$1")" "$1"; else printf '%s' "$1"; fi
}

cmd=(docker run --rm --network host --shm-size "${shm_size}")
[ -t 0 ] && [ -t 1 ] && cmd+=(-it)
[ -z "${name}" ] || cmd+=(--name "${name}")

for id in "${selected[@]}"; do
    cmd+=(--device "$(spec "/dev/davinci${id}")")
done
for node in /dev/davinci_manager /dev/devmm_svm /dev/hisi_hdc; do
    [ -e "$(host "${node}")" ] || die "missing $(host "${node}"): not an Ascend node (or the driver is not loaded)"
    cmd+=(--device "$(spec "${node}")")
done

# Driver, management tools and install record from the host, read-only.
for mount in /usr/local/Ascend/driver /usr/local/dcmi /usr/local/bin/npu-smi /etc/ascend_install.info; do
    if [ -e "$(host "${mount}")" ]; then
        cmd+=(--volume "$(host "${mount}"):${mount}:ro")
    else
        echo "run_container.sh: warning: $(host "${mount}") not found, not mounted" >&2
    fi
done

cmd+=(--volume "${workdir}:/workspace" --workdir /workspace)
# Node-specific settings pass through from the host when set there.
for var in HCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME HCCL_IF_BASE_PORT HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT HF_TOKEN HF_ENDPOINT; do
    [ -z "${!var:-}" ] || cmd+=(--env "${var}")
done
cmd+=("${image}" "${command_args[@]}")

if [ "${dry_run}" -eq 1 ]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
else
    exec "${cmd[@]}"
fi

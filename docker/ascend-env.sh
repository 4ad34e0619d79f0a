# shellcheck shell=sh
# Ascend environment for every shell in the areal-npu images. Installed as
# /etc/profile.d/areal-npu-ascend-env.sh and sourced by login shells (profile.d), interactive bash
# (/etc/bash.bashrc), non-interactive bash (BASH_ENV), the entry point and the image's build steps.
# POSIX sh, idempotent, and it never turns on errexit/nounset in the shell that sources it.

if [ -z "${AREAL_NPU_ASCEND_ENV_SOURCED:-}" ]; then
    _areal_npu_restore=""
    case "$-" in *e*) _areal_npu_restore="${_areal_npu_restore}e" ;; esac
    case "$-" in *u*) _areal_npu_restore="${_areal_npu_restore}u" ;; esac
    set +eu
    for _areal_npu_env in \
        /usr/local/Ascend/ascend-toolkit/set_env.sh \
        /usr/local/Ascend/nnal/atb/set_env.sh; do
        if [ -f "${_areal_npu_env}" ]; then
            # shellcheck disable=SC1090  # CANN's own scripts, present only inside the image
            . "${_areal_npu_env}"
        fi
    done
    # The driver is mounted from the host at run time (scripts/run_container.sh); its libraries
    # (libascend_hal.so and friends) are not on CANN's default library path.
    for _areal_npu_dir in /usr/local/Ascend/driver/lib64/common /usr/local/Ascend/driver/lib64/driver; do
        if [ -d "${_areal_npu_dir}" ]; then
            case ":${LD_LIBRARY_PATH:-}:" in
                *":${_areal_npu_dir}:"*) ;;
                *) LD_LIBRARY_PATH="${_areal_npu_dir}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" ;;
            esac
        fi
    done
    export LD_LIBRARY_PATH
    AREAL_NPU_ASCEND_ENV_SOURCED=1
    export AREAL_NPU_ASCEND_ENV_SOURCED
    if [ -n "${_areal_npu_restore}" ]; then
        set "-${_areal_npu_restore}"
    fi
    unset _areal_npu_env _areal_npu_dir _areal_npu_restore
fi

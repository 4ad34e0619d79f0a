#!/usr/bin/env bash
# Entry point of the areal-npu images: load the Ascend environment (CANN toolkit, NNAL/ATB, host
# driver libraries), then run the given command (default: bash) in its place.
# shellcheck source=docker/ascend-env.sh
source /etc/profile.d/areal-npu-ascend-env.sh
if [ "$#" -eq 0 ]; then
    set -- /bin/bash
fi
exec "$@"

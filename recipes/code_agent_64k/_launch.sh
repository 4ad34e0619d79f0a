# shellcheck shell=bash
# The body of qwen3_6_27b_a3.sh and qwen3_6_27b_a2.sh (sourced by them, not run on its own). The
# caller sets CHIP (A2 | A3), DEVICES_PER_NODE (8 | 16), DEFAULT_NNODES and RECIPE (the YAML).
#
# Node roles: the first TRAIN_NODES nodes (default: half, rounded down) run the trainer, the rest
# run the rollout engines. The trainer's data-parallel size and the number of engines follow from
# the node count and the recipe's tp / cp / pp (train.megatron.*, rollout.tensor_parallel_size),
# unless given as overrides (train.dp_size=..., rollout.num_engines=...).

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODEL_DIMS="$HERE/qwen3_6_27b_config.json"
# no virtualenv on PATH: the project's own (scripts/setup_env.sh makes .venv) when there is one
VENV_BIN="$HERE/../../.venv/bin"
if [[ -z ${AREAL_NPU:-} ]] && ! command -v areal-npu >/dev/null && [[ -x $VENV_BIN/areal-npu ]]; then
  AREAL_NPU=$VENV_BIN/areal-npu
  PYTHON=${PYTHON:-$VENV_BIN/python}
fi
AREAL_NPU=${AREAL_NPU:-areal-npu}
PYTHON=${PYTHON:-python3}
EXIT_USAGE=2
EXIT_NOT_BUILT=3

usage() {
  cat <<EOF
usage: $(basename "$0") [--dry-run [--json] [--verbose]] [key=value ...]

Qwen3.6-27B, 64K-token code-agent RL on Ascend $CHIP nodes ($DEVICES_PER_NODE devices of 64 GB each).
  --dry-run   print a summary (placement of all NNODES nodes, the trainer's memory per device with
              its reserve, a step-time prediction) and one row per role; start nothing (runs
              anywhere); exit 2 when the memory is above train.max_memory_fraction of a device
  --json      with --dry-run: the plan and its estimates as JSON on stdout
  --verbose   with --dry-run: also every process's environment, the memory terms and the k sweep
  key=value   recipe overrides, e.g. controller.steps=10 (see $(basename "$RECIPE"))

Environment:
  NNODES ($DEFAULT_NNODES)              nodes in the job
  TRAIN_NODES (NNODES/2)  the first nodes, which train; the others run the rollout engines
  NODE_RANK (0)           this node's rank
  MASTER_ADDR             node 0's address (MASTER_PORT: 29500)
  MODEL_PATH              the Qwen3.6-27B checkpoint directory (with its mtp.* weights)
  TASKS                   the task set: a SWE-bench / R2E-Gym layout JSONL file (or swebench task dir)
  IMAGES ("")             task.image_root: the folder holding the instances' images as OCI layouts,
                          docker-save / OCI archives or root filesystems, for the bwrap backend (empty:
                          TASKS' folder); container backends use the instances' image names as they are
  ENV_BACKEND (auto)      workflow.shell.env.backend: auto | bwrap | podman | docker | apptainer; the
                          recipe is refused (exit 2, before anything starts) when a task's image is not
                          usable by it on this node (docs/howto/code_agent_64k.md, "Real SWE tasks on an A3 cluster")
  HARNESS (mini_swe_agent) workflow.shell.harness: mini_swe_agent (mini-swe-agent v2 through the gateway,
                          as the reference validation ran) | shell (the built-in loop) | module:function
  RUN_DIR                 the run directory (default: runs/<recipe name>)
  HCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME   the network interface between nodes
  AREAL_NPU (areal-npu), PYTHON (python3), RAY (ray)  the commands used; with no areal-npu on PATH,
                          the checkout's .venv (scripts/setup_env.sh) when it has one

  LAUNCHER (ray)          ray: start Ray here (node 0: the head, which then runs the Ray launcher;
                          the others: workers that join it; RAY_PORT: 6379) and run the job on it;
                          needs the ray extra (in the images; pip install -e ".[ray]")
  RAY_AUTH_TOKEN ("")     Ray's token authentication: give the same token on every node and the launch
                          turns it on there (RAY_AUTH_MODE=token). Unset, Ray's head turns it on by itself
                          when node 0 holds ~/.ray/auth_token, and then a worker without that token cannot
                          join (RAY_AUTH_MODE=disabled opts out, on a private network only)
                          torchrun: not built across nodes (areal-npu starts torchrun on one node
                          only); stops with exit code $EXIT_NOT_BUILT and says so

On the NPU in bf16 the Megatron engine calls MindSpeed's packed Gated DeltaNet, RMSNorm and SwiGLU
kernels (checked with recording fakes only; fused rotary not wired); none of it has run on an NPU.
EOF
}

die() {  # die CODE MESSAGE
  echo "$(basename "$0"): $2" >&2
  exit "$1"
}

is_count() { [[ $1 =~ ^[0-9]+$ ]]; }

dry_run=0
json=0
verbose=0
overrides=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --json) json=1 ;;
    --verbose) verbose=1 ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; die "$EXIT_USAGE" "unknown option $arg" ;;
    *=*) overrides+=("$arg") ;;
    *) usage >&2; die "$EXIT_USAGE" "unexpected argument $arg (overrides look like key=value)" ;;
  esac
done
((json && !dry_run)) && die "$EXIT_USAGE" "--json describes the --dry-run plan; add --dry-run"
((verbose && !dry_run)) && die "$EXIT_USAGE" "--verbose details the --dry-run plan; add --dry-run"

NNODES=${NNODES:-$DEFAULT_NNODES}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
if ! is_count "$NNODES" || ((NNODES < 1)); then
  die "$EXIT_USAGE" "NNODES must be an integer >= 1; got '$NNODES'"
fi
TRAIN_NODES=${TRAIN_NODES:-$((NNODES / 2))}
if ! is_count "$NODE_RANK" || ((NODE_RANK >= NNODES)); then
  die "$EXIT_USAGE" "NODE_RANK must lie in 0..$((NNODES - 1)); got '$NODE_RANK'"
fi
if ! is_count "$TRAIN_NODES" || ((TRAIN_NODES < 1 || TRAIN_NODES >= NNODES)); then
  die "$EXIT_USAGE" "needs NNODES >= 2 (got $NNODES): TRAIN_NODES (got '$TRAIN_NODES') nodes train, the others run the rollout engines"
fi
LAUNCHER=${LAUNCHER:-ray}
[[ $LAUNCHER == ray || $LAUNCHER == torchrun ]] || die "$EXIT_USAGE" "LAUNCHER must be ray or torchrun; got '$LAUNCHER'"
# every required input that is missing, reported at once (a real run stops; --dry-run plans with placeholders)
missing=()
master_given=${MASTER_ADDR:-}
if ((NNODES > 1)) && [[ -z $master_given ]]; then
  missing+=("MASTER_ADDR (node 0's address, required with NNODES=$NNODES)")
  MASTER_ADDR="<node0>"
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
[[ -n ${MODEL_PATH:-} && -f ${MODEL_PATH:-}/config.json ]] \
  || missing+=("MODEL_PATH ('${MODEL_PATH:-}'): the Qwen3.6-27B checkpoint directory, with its config.json")
[[ -n ${TASKS:-} && -e ${TASKS:-} ]] \
  || missing+=("TASKS ('${TASKS:-}'): a JSONL task set (or swebench task directory)")
[[ -z ${IMAGES:-} || -d ${IMAGES:-} ]] || missing+=("IMAGES ('$IMAGES'): a directory (task.image_root)")

# ---- environment of every process (on top of what the plan gives each one) ----
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}  # NPU operators are dispatched by a separate queue thread
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one OpenMP thread per process: many processes share a node's cores
# the caching allocator grows segments instead of cutting new ones: less fragmentation with packed micro-batches of varying length
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}  # seconds HCCL waits for every rank to join a communicator
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}  # seconds a collective may wait for a slow rank (64K steps are long)
export HCCL_IF_BASE_PORT=${HCCL_IF_BASE_PORT:-64000}  # first host port of HCCL; the plan gives each job on a node its own window
export VLLM_ASCEND_ENABLE_NZ=0  # engines keep weights in ND layout, so RL weight updates load in place
export NNODES NODE_RANK MASTER_ADDR MASTER_PORT
# ASCEND_RT_VISIBLE_DEVICES is set per process by the plan; HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
# (the interface between nodes) pass through from the caller's environment.

# ---- the layout for NNODES nodes ----
# the project's Python first: without it every later step fails with a message that hides why
if ! why=$("$PYTHON" -c "import omegaconf, areal_npu" 2>&1); then
  die "$EXIT_USAGE" "PYTHON ($PYTHON) cannot import the project (${why##*$'\n'}); run bash scripts/setup_env.sh and source .venv/bin/activate, or set PYTHON"
fi
command -v "$AREAL_NPU" >/dev/null \
  || die "$EXIT_USAGE" "AREAL_NPU ($AREAL_NPU) is not a command; source .venv/bin/activate, or set AREAL_NPU"
values=$("$PYTHON" - "$RECIPE" "${overrides[@]}" <<'PY'
import sys

from omegaconf import OmegaConf

cfg = OmegaConf.merge(OmegaConf.load(sys.argv[1]), OmegaConf.from_dotlist(sys.argv[2:]))
m = cfg.train.megatron
print(m.tp_size, m.cp_size, m.pp_size, cfg.rollout.tensor_parallel_size)
PY
) || die "$EXIT_USAGE" "cannot read the layout from $RECIPE"
read -r tp cp pp engine_tp <<<"$values"
group=$((tp * cp * pp))
trainer_devices=$((TRAIN_NODES * DEVICES_PER_NODE))
rollout_devices=$(((NNODES - TRAIN_NODES) * DEVICES_PER_NODE))
((trainer_devices % group == 0)) \
  || die "$EXIT_USAGE" "$TRAIN_NODES training node(s) x $DEVICES_PER_NODE devices do not divide into tp $tp x cp $cp x pp $pp groups"
layout=()
case " ${overrides[*]} " in
  *" train.dp_size="*) ;;
  *) layout+=("train.dp_size=$((trainer_devices / group))") ;;
esac
case " ${overrides[*]} " in
  *" rollout.num_engines="*) ;;
  *) layout+=("rollout.num_engines=$((rollout_devices / engine_tp))") ;;
esac
[[ -n ${RUN_DIR:-} ]] && layout+=("run_dir=$RUN_DIR")

if ((dry_run)); then
  model_config=()
  if [[ -z ${MODEL_PATH:-} ]]; then
    export MODEL_PATH=/path/to/Qwen3.6-27B
  fi
  if [[ ! -f $MODEL_PATH/config.json ]]; then
    model_config=(--model-config "$MODEL_DIMS")  # the model's shape from the shipped config
  fi
  if [[ -z ${TASKS:-} || ! -e $TASKS ]]; then
    export TASKS="" IMAGES=""  # planned with the embedded repo tasks
  fi
  out=1
  ((json)) && out=2  # --json: stdout carries the JSON alone
  {
    echo "$(basename "$0"): NNODES=$NNODES (nodes 0..$((TRAIN_NODES - 1)) train, $TRAIN_NODES..$((NNODES - 1)) roll out), NODE_RANK=$NODE_RANK, LAUNCHER=$LAUNCHER; overrides: ${layout[*]} ${overrides[*]}"
    if ((${#missing[@]})); then
      printf 'missing inputs, planned with placeholders (a real run stops until they are set):\n'
      printf '  %s\n' "${missing[@]}"
    fi
    if ((verbose)); then
      for var in TASK_QUEUE_ENABLE OMP_NUM_THREADS PYTORCH_NPU_ALLOC_CONF HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT \
        HCCL_IF_BASE_PORT VLLM_ASCEND_ENABLE_NZ HCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
        echo "  $var=${!var:-<unset>}"
      done
    fi
  } >&"$out"
  launcher=$LAUNCHER
  [[ $launcher == torchrun ]] && launcher=local  # areal-npu's own launcher: torchrun on one node
  flags=(--dry-run --nodes "$NNODES" --devices-per-node "$DEVICES_PER_NODE" --device-kind npu --launcher "$launcher"
    "${model_config[@]}")
  [[ -n $master_given ]] && flags+=(--master-addr "$master_given")
  ((json)) && flags+=(--json)
  ((verbose)) && flags+=(--verbose)
  exec "$AREAL_NPU" train "$RECIPE" "${layout[@]}" "${overrides[@]}" "${flags[@]}"
fi

# ---- a real run ----
if ((${#missing[@]})); then
  die "$EXIT_USAGE" "missing inputs: $(printf '%s; ' "${missing[@]}")see --help"
fi
if [[ $LAUNCHER == ray ]]; then
  # Ray is the cluster manager: node 0 runs the head and the launcher (areal_npu/launch/ray_launch.py),
  # which plans the job on the cluster and places every trainer rank and engine in a placement group.
  RAY_PORT=${RAY_PORT:-6379}
  RAY=${RAY:-ray}
  if [[ -n ${RAY_AUTH_TOKEN:-} ]]; then
    export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}  # the same token on every node: head and workers agree
  elif ((NODE_RANK == 0)) && [[ ${RAY_AUTH_MODE:-} != disabled && -f ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} ]]; then
    echo "$(basename "$0"): node 0 holds a Ray auth token (${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}): Ray turns \
token authentication on, and the other nodes need the same token (RAY_AUTH_TOKEN, see --help)" >&2
  fi
  command -v "$RAY" >/dev/null || die "$EXIT_USAGE" "LAUNCHER=ray (the default) needs Ray on every node, and RAY ($RAY) \
is not a command: install the ray extra (pip install -e \".[ray]\"; the images built by scripts/build_images.sh have it) \
or set RAY"
  if ((NODE_RANK > 0)); then
    exec "$RAY" start --address="$MASTER_ADDR:$RAY_PORT" --block
  fi
  why=$("$PYTHON" -c "import ray" 2>&1) || die "$EXIT_USAGE" "LAUNCHER=ray: PYTHON ($PYTHON) cannot import ray \
(${why##*$'\n'}); install the ray extra (pip install -e \".[ray]\")"
  "$RAY" start --head --port="$RAY_PORT" --node-ip-address="$MASTER_ADDR" >&2
  trap '"$RAY" stop >&2' EXIT
  "$PYTHON" - "$MASTER_ADDR:$RAY_PORT" "$NNODES" <<'PY' || die 1 "the Ray workers did not join"
import sys, time

import ray

ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + 600
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"{sum(n['Alive'] for n in ray.nodes())} of {sys.argv[2]} nodes joined within 600 s "
             "(a worker's log says why; with token authentication every node needs RAY_AUTH_TOKEN)")
    time.sleep(2)
PY
  "$PYTHON" -m areal_npu.launch.ray_launch "$RECIPE" "${layout[@]}" "${overrides[@]}" \
    --address "$MASTER_ADDR:$RAY_PORT"
  exit $?
fi
# The image's entry point has sourced the Ascend toolkit's set_env.sh. What would start here: torchrun
# with this node's trainer ranks (nodes 0..TRAIN_NODES-1), the engines of the plan (the other
# nodes), the controller on node 0. areal-npu runs torchrun on one node only (--standalone).
die "$EXIT_NOT_BUILT" "not started: this job spans $NNODES nodes ($TRAIN_NODES training, $((NNODES - TRAIN_NODES)) \
running rollout engines); \`areal-npu train\` starts its trainer ranks with torchrun on one node only, a multi-node \
torchrun launch is not built: use LAUNCHER=ray (the default). \`$(basename "$0") --dry-run\` prints the whole plan."

#!/usr/bin/env bash
# Train on a hostfile cluster with the deepspeed launcher (ssh/pdsh from this node, or one
# launcher per node with --no-ssh, as SLURM does: see launch/slurm.sbatch).
#
#   launch/cluster.sh --hostfile hostfile --config configs/my_run.yaml --profile zero3 \
#       [--include "node-a:0,1@node-b"] [--exclude "node-b:3"] [--num-nodes N] [--num-gpus N] \
#       [--master-addr node-a] [--master-port 29500] [--no-ssh --node-rank R] \
#       [--env-file launch/deepspeed_env] [--resume auto|latest|TAG] [--dry-run] \
#       [--set key=value ...] [-- extra deepspeed launcher args]
#
# --profile is `--set profile=...` (ds_profiles/: zero1, zero2, zero2_offload, zero3, zero3_hpz,
# zero3_zeropp, zero3_offload; `rsclip-ds plan` picks one for your GPUs). --env-file: NAME=value lines
# (comments allowed, see launch/deepspeed_env.example) exported on every node: handed to the
# launcher through DS_ENV_FILE (it applies them on the nodes it reaches by ssh/pdsh) and
# exported here too (with --no-ssh the launcher does not read the file).
# --dry-run prints the command and exits. Exit code: the launcher's; 75 after SIGTERM/SIGINT to
# this script (the ranks saved a checkpoint; continue with --resume auto).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "cluster.sh: $*" >&2; exit 2; }
hostfile="" config="" profile="" include="" exclude="" num_nodes="" num_gpus=""
master_addr="" master_port="29500" no_ssh=0 node_rank="" env_file="" resume="" dry_run=0
sets=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile) hostfile="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --profile) profile="$2"; shift 2 ;;
    --include) include="$2"; shift 2 ;;
    --exclude) exclude="$2"; shift 2 ;;
    --num-nodes) num_nodes="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --no-ssh) no_ssh=1; shift ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --env-file) env_file="$2"; shift 2 ;;
    --resume) resume="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -n "$hostfile" ] || die "--hostfile is required (see hostfile.example: '<host> slots=<GPUs>' per line)"
[ -f "$hostfile" ] || die "hostfile not found: $hostfile"
[ -n "$config" ] || die "--config is required (a YAML/JSON run config; rsclip-ds show-config lists the keys)"
[ -f "$config" ] || die "config not found: $config"
if [ -n "$include$exclude" ] && [ -n "$num_nodes$num_gpus" ]; then
  die "--include/--exclude and --num-nodes/--num-gpus cannot be combined (the launcher refuses it)"
fi
if [ "$no_ssh" = 1 ] && [ -z "$node_rank" ]; then
  die "--no-ssh needs --node-rank (this node's line in the hostfile, from 0)"
fi

# One node in the hostfile: run it locally. (The launcher would otherwise ssh to it first,
# even to localhost, and fail where there is no passwordless ssh.)
nodes=$(grep -Ev '^[[:space:]]*(#|$)' "$hostfile" | wc -l)
if [ "$nodes" -eq 1 ] && [ "$no_ssh" = 0 ]; then
  echo "cluster.sh: one node in $hostfile: launching locally (--no_ssh --node_rank 0)" >&2
  no_ssh=1 node_rank=0
  [ -n "$master_addr" ] || master_addr=127.0.0.1
fi

cmd=(deepspeed --hostfile "$hostfile" --master_port "$master_port")
[ -n "$include" ] && cmd+=(--include "$include")
[ -n "$exclude" ] && cmd+=(--exclude "$exclude")
[ -n "$num_nodes" ] && cmd+=(--num_nodes "$num_nodes")
[ -n "$num_gpus" ] && cmd+=(--num_gpus "$num_gpus")
[ -n "$master_addr" ] && cmd+=(--master_addr "$master_addr")
[ "$no_ssh" = 1 ] && cmd+=(--no_ssh --node_rank "$node_rank")
cmd+=("${extra[@]}" --module rsclip_ds train --config "$config")
[ -n "$profile" ] && cmd+=(--set "profile=$profile")
[ -n "$resume" ] && cmd+=(--resume "$resume")
cmd+=("${sets[@]}")

if [ -n "$env_file" ]; then
  [ -f "$env_file" ] || die "env file not found: $env_file"
  # The launcher splits every line at '=' and chokes on comments and blank lines: hand it a clean copy.
  clean="$(mktemp "${TMPDIR:-/tmp}/deepspeed_env.XXXXXX")"
  trap 'rm -f "$clean"' EXIT
  grep -Ev '^[[:space:]]*(#|$)' "$env_file" > "$clean" || true
  export DS_ENV_FILE="$clean"
  while IFS= read -r line; do export "${line?}"; done < "$clean"
fi

echo "cluster.sh: ${cmd[*]}" >&2
[ "$dry_run" = 1 ] && exit 0

# The launcher runs in the background so that SIGTERM/SIGINT to this script (SLURM's --signal to
# the job step's tasks, scancel, a container stop) is handled here: the deepspeed runner is
# stopped; the ranks see their launcher's parent gone, save a checkpoint (no grace limit: launch
# itself is not signalled) and exit 75; this script waits for them, then exits 75. Waiting
# matters under SLURM: when a step's task exits, SLURM kills what is left of the step.
"${cmd[@]}" &
runner=$!
stopping=0
forward() {
  stopping=1
  local children
  children=$(pgrep -P "$runner" || true)
  echo "cluster.sh: signal received: stopping the deepspeed runner; the ranks save and exit 75" >&2
  kill -TERM "$runner" 2>/dev/null || true
  for c in $children; do while kill -0 "$c" 2>/dev/null; do sleep 1; done; done
}
trap forward TERM INT
set +e
wait "$runner"
code=$?
[ "$stopping" = 1 ] && exit 75
exit "$code"

#!/usr/bin/env bash
# A LuWu cluster on this machine: node daemons in the background (luwu up / luwu down).
#
#   deploy/local.sh up [N] [luwu up options...]   start N nodes (default 2) on 127.0.0.1, wait until ready
#   deploy/local.sh status | top                  ask the nodes (luwu status / luwu top)
#   deploy/local.sh train [NPROC] [args...]       torchrun NPROC workers (default 2) of deploy/train_example.py
#   deploy/local.sh down                          stop the supervisor and the nodes (SIGTERM, then SIGKILL)
#
# Environment: LUWU_PYTHON (default python3), LUWU_CONFIG (a base cluster file for settings such as
# [node] checkpoint_dir), LUWU_JOB (default luwu), LUWU_RUN_DIR (default .luwu-run/$LUWU_JOB).
# The resolved cluster file is $LUWU_RUN_DIR/cluster.toml; it holds no secret, so workers join with
# $LUWU_RUN_DIR/keys/join.toml (the nodes ask for the job's join secret, which up made) or, when up made
# CURVE keys, rank r with keys/worker<r>.toml. train picks the right one.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${LUWU_PYTHON:-python3}
job=${LUWU_JOB:-luwu}
run_dir=${LUWU_RUN_DIR:-.luwu-run/$job}
config_args=()
if [ -n "${LUWU_CONFIG:-}" ]; then
  config_args=(--config "$LUWU_CONFIG")
fi

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  exit "${1:-0}"
}

cmd=${1:-}
[ -n "$cmd" ] || usage 2
shift

case "$cmd" in
  up)
    nodes=2
    if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
      nodes=$1
      shift
    fi
    exec "$py" -m luwu.launcher up "${config_args[@]}" --nodes "$nodes" --run-dir "$run_dir" --cluster.job "$job" "$@"
    ;;
  down)
    exec "$py" -m luwu.launcher down --run-dir "$run_dir" "$@"
    ;;
  status | top)
    exec "$py" -m luwu.status "$cmd" --run-dir "$run_dir" "$@"
    ;;
  train)
    nproc=2
    if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
      nproc=$1
      shift
    fi
    if [ ! -f "$run_dir/cluster.toml" ]; then
      echo "local.sh: no $run_dir/cluster.toml: run '$0 up' first" >&2
      exit 1
    fi
    if [ -f "$run_dir/keys/worker0.toml" ]; then  # up made CURVE keys: rank r runs with its own file
      # shellcheck disable=SC2016 # expanded by each rank's shell (torchrun sets RANK)
      exec "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" --no-python \
        bash -c 'exec "$0" "$1" --config "$2/keys/worker$RANK.toml" "${@:3}"' "$py" "$here/train_example.py" "$run_dir" "$@"
    fi
    config=$run_dir/cluster.toml
    if [ -f "$run_dir/keys/join.toml" ]; then  # the nodes ask for the job's join secret: every rank shows it
      config=$run_dir/keys/join.toml
    fi
    exec "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
      "$here/train_example.py" --config "$config" "$@"
    ;;
  -h | --help | help)
    usage 0
    ;;
  *)
    echo "local.sh: unknown command '$cmd'" >&2
    usage 2
    ;;
esac

#!/usr/bin/env bash
# Start, stop or check LuWu node daemons on the hosts of a hosts file, over ssh.
#
#   deploy/ssh/launch.sh start  HOSTS_FILE [BASE_CLUSTER_FILE]   write the cluster file, copy it to every host,
#                                                                start one node per line (and one aggregator per
#                                                                [[groups]] of the base file), wait until all answer
#   deploy/ssh/launch.sh status HOSTS_FILE                       luwu status on the cluster file
#   deploy/ssh/launch.sh stop   HOSTS_FILE                       SIGTERM every aggregator, then every node (it
#                                                                checkpoints), SIGKILL after
#                                                                LUWU_STOP_TIMEOUT seconds
#
# HOSTS_FILE: one node per line, "SSH_TARGET PORT [METRICS_PORT]" (see hosts.example); the node index is
# the line's position. SSH_TARGET is [user@]address: the address (what follows @) is what the node binds
# and what workers connect to, so it must be an address of that host that the workers can reach.
# The cluster file (the base file's settings + [cluster] nodes from the hosts file) is written to
# $LUWU_RUN_DIR/cluster.toml here and copied to $LUWU_REMOTE_DIR/cluster.toml on every host. It holds
# no secret, so it does not let a worker in: workers get a file of keys/ (below), which holds it too.
# Node traffic crosses the network, so the nodes run CURVE: start makes the job's keys in $LUWU_RUN_DIR/keys
# (luwu keys, mode 600): node.env goes to every host (into a mode 700 dir) and is read by the node's
# shell, never put on its command line; worker rank r uses keys/worker<r>.toml (the cluster file plus
# its own key pair) as its --config; status uses keys/monitor.toml. A later start keeps the keys (and
# the node list and groups in the worker files): remove $LUWU_RUN_DIR/keys after changing the hosts
# file or the base file's [[groups]] (start refuses keys made for other groups' ranks).
# LUWU_INSECURE_PUBLIC_BIND=1 (a trusted private network only) runs the nodes without keys, and so
# without encryption; they still ask for the job's join secret, made once here (python -m
# luwu.deploy.join; LUWU_NODE__JOIN_SECRET if set, else the one of an earlier start): keys/node.env
# (LUWU_NODE__JOIN_SECRET) goes to every host as above, every worker rank uses keys/join.toml (the
# cluster file plus the secret) as its --config, and status uses keys/monitor.toml.
#
# The switch tier: when the base cluster file has [[groups]] (ranks = "0-3", aggregator = "tcp://HOST:PORT",
# optional metrics = "http://HOST:PORT"), start runs one aggregator per group on the host of its address
# (ssh target [LUWU_SSH_USER@]HOST; one per worker host, for that host's ranks), in front of the nodes,
# with pid file and log aggregator-<i>.* in the same remote dir; stop stops them before the nodes, and
# status lists them (their rates read from each group's metrics address). A group with no metrics key
# gets http://HOST:$LUWU_AGGREGATOR_METRICS_PORT when that is set, else serves no /metrics. With CURVE,
# luwu keys --cluster makes each aggregator a key pair of its own: aggregator i gets keys/aggregator<i>.env
# (its pair to its workers and to the nodes) as aggregator-<i>.env (mode 600) in the remote dir, read by
# its shell, never node.env; node.env lists its public key for its ranks and the workers' worker<r>.toml
# name it (their group's aggregator_key). With LUWU_INSECURE_PUBLIC_BIND=1 each aggregator reads the
# job's join secret of node.env instead (asked of its workers, shown to the nodes).
#
# Environment: LUWU_SSH (default "ssh -o BatchMode=yes"), LUWU_SCP (default "scp -q -o BatchMode=yes"),
# LUWU_PYTHON (here, default python3), LUWU_REMOTE_PYTHON (on the hosts, default python3),
# LUWU_RUN_DIR (here, default .luwu-run/ssh), LUWU_REMOTE_DIR (on the hosts, default .luwu-run/ssh,
# relative to the remote home), LUWU_START_TIMEOUT (default 120), LUWU_STOP_TIMEOUT (default 60),
# LUWU_WORKERS (worker key files to make, default 8), LUWU_INSECURE_PUBLIC_BIND=1 (no keys, no encryption:
# anyone who can read the network sees the traffic and the join secret; a trusted private network
# only, with a warning), LUWU_SSH_USER (the aggregators' ssh user, default none: ssh's own),
# LUWU_AGGREGATOR_METRICS_PORT (the aggregators' /metrics port where a group names none).
set -euo pipefail

read -r -a ssh_cmd <<<"${LUWU_SSH:-ssh -o BatchMode=yes}"
read -r -a scp_cmd <<<"${LUWU_SCP:-scp -q -o BatchMode=yes}"
py=${LUWU_PYTHON:-python3}
remote_py=${LUWU_REMOTE_PYTHON:-python3}
run_dir=${LUWU_RUN_DIR:-.luwu-run/ssh}
remote_dir=${LUWU_REMOTE_DIR:-.luwu-run/ssh}
start_timeout=${LUWU_START_TIMEOUT:-120}
stop_timeout=${LUWU_STOP_TIMEOUT:-60}
workers=${LUWU_WORKERS:-8}
insecure=${LUWU_INSECURE_PUBLIC_BIND:-0}
ssh_user=${LUWU_SSH_USER:-}
keys_dir=$run_dir/keys

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  exit "${1:-0}"
}

die() {
  echo "launch.sh: $*" >&2
  exit 1
}

targets=()
addrs=()
ports=()
mports=()
read_hosts() {
  local file=$1 target port mport rest n=0
  [ -f "$file" ] || die "no hosts file '$file'"
  while read -r target port mport rest || [ -n "${target:-}" ]; do
    n=$((n + 1))
    case "$target" in '' | '#'*) continue ;; esac
    case "${rest:-}" in '' | '#'*) ;; *) die "$file:$n: expected 'SSH_TARGET PORT [METRICS_PORT]', got extra '$rest'" ;; esac
    if ! [[ ${port:-} =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
      die "$file:$n: port must be 1..65535, got '${port:-}'"
    fi
    case "${mport:-}" in '' | '#'*) mport=-1 ;; esac
    [[ $mport =~ ^-?[0-9]+$ ]] || die "$file:$n: metrics port must be a number (or omitted), got '$mport'"
    targets+=("$target")
    addrs+=("${target##*@}")
    ports+=("$port")
    mports+=("$mport")
  done <"$file"
  [ ${#targets[@]} -gt 0 ] || die "$file lists no hosts"
}

# Run a command line on a host; arguments are quoted here, so the remote shell sees them as given.
remote() {
  local target=$1 line
  shift
  printf -v line '%q ' "$@"
  "${ssh_cmd[@]}" "$target" "$line"
}

# Run a POSIX sh script (fed on stdin, so its newlines survive any login shell) with arguments.
remote_sh() {
  local target=$1 script=$2 line
  shift 2
  printf -v line '%q ' "$@"
  "${ssh_cmd[@]}" "$target" "sh -s -- $line" <<<"$script"
}

node_list() {
  local i out=""
  for i in "${!targets[@]}"; do
    out+="${out:+,}tcp://${addrs[$i]}:${ports[$i]}"
  done
  printf '%s' "$out"
}

write_cluster_file() {
  local base=${1:-}
  mkdir -p "$run_dir"
  chmod 700 "$run_dir"
  "$py" - "$run_dir/cluster.toml" "$(node_list)" "$base" "${LUWU_AGGREGATOR_METRICS_PORT:-}" <<'PY'
import sys
from luwu.config import load_config
from luwu.ops.cluster_file import cluster_file_text

out, nodes, base, mport = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
cfg = load_config(base, argv=[f"--cluster.nodes={nodes}"])  # validates the base file and the addresses
groups = [dict(g) for g in cfg.cluster.groups]
for g in groups:  # an aggregator's /metrics, where luwu status and top read it
    if mport and "metrics" not in g:
        g["metrics"] = f"http://{g['aggregator'][len('tcp://'):].rpartition(':')[0]}:{int(mport)}"
text = cluster_file_text(cfg, nodes.split(","), groups=groups, header=f"Written by deploy/ssh/launch.sh from {base or 'defaults'} and the hosts file.")
with open(out, "w") as fh:
    fh.write(text)
print(f"cluster file {out}: job {cfg.cluster.job!r}, {len(cfg.cluster.nodes)} nodes, {len(groups)} aggregators")
PY
}

# The switch tier of the written cluster file: per group, its ranks, host and what its aggregator binds.
g_ranks=()
g_hosts=()
g_binds=()
read_groups() {
  local ranks host bind mhost mport
  [ -f "$run_dir/cluster.toml" ] || return 0
  while read -r ranks host bind mhost mport; do
    g_ranks+=("$ranks")
    g_hosts+=("$host")
    g_binds+=("$bind $mhost $mport")
  done < <("$py" - "$run_dir/cluster.toml" <<'PY'
import sys
from luwu.config import load_config
from luwu.groups import bind_line

for g in load_config(sys.argv[1], env={}).cluster.groups:
    host = g["aggregator"][len("tcp://"):].rpartition(":")[0].strip("[]")
    print(g["ranks"], host, bind_line(g))
PY
  )
}

agg_target() {
  printf '%s' "${ssh_user:+$ssh_user@}${g_hosts[$1]}"
}

# The job's CURVE keys (once: a restart keeps the workers' files valid), or the warned opt-out with
# one join secret for every node (node.env), the workers (join.toml) and status (monitor.toml).
make_keys() {
  if [ "$insecure" = 1 ]; then
    echo "launch.sh: WARNING: LUWU_INSECURE_PUBLIC_BIND=1: the nodes run without encryption; anyone who can read their traffic learns the join secret and can join the job" >&2
    # a CURVE start's keys: those nodes and aggregators are gone
    rm -f "$keys_dir/node.toml" "$keys_dir"/worker*.toml "$keys_dir"/aggregator*.toml "$keys_dir"/aggregator*.env
    "$py" -m luwu.deploy.join "$keys_dir" "$run_dir/cluster.toml"
  else
    if [ -f "$keys_dir/join.toml" ]; then  # an insecure start's files: its node.env holds no keys
      rm -f "$keys_dir/join.toml" "$keys_dir/monitor.toml" "$keys_dir/node.env"
    fi
    if [ ! -f "$keys_dir/node.env" ]; then
      "$py" -m luwu keys --out "$keys_dir" --workers "$workers" --cluster "$run_dir/cluster.toml"
    fi
    check_kept_keys
  fi
}

# Kept CURVE keys must be those of the cluster file's groups: node.env lists an aggregator key for
# each group's ranks (in group order), and aggregator i's pair is keys/aggregator<i>.env.
check_kept_keys() {
  local want have
  want=$(IFS=,; printf '%s' "${g_ranks[*]}")
  have=$("$py" - "$keys_dir/node.env" <<'PY'
import sys
from luwu.ops.keyset import read_env_file

entries = read_env_file(sys.argv[1]).get("LUWU_NODE__CURVE_AGGREGATOR_KEYS", "")
print(",".join(e.partition("=")[0] for e in entries.split(",") if e))
PY
  )
  if [ "$have" != "$want" ]; then
    die "$keys_dir was made for the groups of ranks '${have}', the cluster file has '${want}': remove $keys_dir to make new keys (the workers then need their new worker<r>.toml)"
  fi
}

# What luwu status reads: the monitor's keys (CURVE) or the join secret, once start made them.
status_file() {
  if [ -f "$keys_dir/monitor.toml" ]; then
    printf '%s' "$keys_dir/monitor.toml"
  else
    printf '%s' "$run_dir/cluster.toml"
  fi
}

start_node() {
  local i=$1 target=${targets[$1]} dir=$remote_dir
  # shellcheck disable=SC2016 # expanded by the remote shell
  remote_sh "$target" 'umask 077 && mkdir -p "$1" && chmod 700 "$1" && rm -f "$1/node.env"' "$dir"
  "${scp_cmd[@]}" "$run_dir/cluster.toml" "$target:$dir/cluster.toml"
  if [ -f "$keys_dir/node.env" ]; then
    "${scp_cmd[@]}" "$keys_dir/node.env" "$target:$dir/node.env"
  fi
  # shellcheck disable=SC2016 # expanded by the remote shell
  remote_sh "$target" '
    cd "$1" || exit 1
    if [ -f "node-$2.pid" ] && kill -0 "$(cat "node-$2.pid")" 2>/dev/null; then
      echo "node $2 already running (pid $(cat "node-$2.pid"))"; exit 0
    fi
    shift
    i=$1 py=$2 insecure=$3; shift 3
    if [ -f node.env ]; then
      chmod 600 node.env
      set -a; . ./node.env; set +a
    fi
    if [ "$insecure" = 1 ]; then
      export LUWU_NODE__INSECURE_PUBLIC_BIND=true
    fi
    umask 077
    nohup setsid "$py" -m luwu -v node --config cluster.toml --node.index "$i" "$@" >"node-$i.log" 2>&1 </dev/null &
    echo $! >"node-$i.pid"
    echo "node $i started (pid $!)"
  ' "$dir" "$i" "$remote_py" "$insecure" --node.bind "tcp://${addrs[$i]}:${ports[$i]}" \
    --metrics.host "${addrs[$i]}" --metrics.port "${mports[$i]}"
}

# One aggregator of the switch tier, for group i, on the host of its address. With CURVE its shell
# reads its own pair (keys/aggregator<i>.env, copied as aggregator-<i>.env), never node.env; opted out,
# node.env (the job's join secret: asked of its workers, shown to the nodes).
start_aggregator() {
  local i=$1 target dir=$remote_dir bind mhost mport
  target=$(agg_target "$i")
  read -r bind mhost mport <<<"${g_binds[$i]}"
  # shellcheck disable=SC2016 # expanded by the remote shell
  remote_sh "$target" 'umask 077 && mkdir -p "$1" && chmod 700 "$1" && rm -f "$1/aggregator-$2.env"' "$dir" "$i"
  "${scp_cmd[@]}" "$run_dir/cluster.toml" "$target:$dir/cluster.toml"
  if [ "$insecure" = 1 ]; then
    "${scp_cmd[@]}" "$keys_dir/node.env" "$target:$dir/node.env"
  else
    [ -f "$keys_dir/aggregator$i.env" ] || die "no $keys_dir/aggregator$i.env (luwu keys --cluster makes one per group)"
    "${scp_cmd[@]}" "$keys_dir/aggregator$i.env" "$target:$dir/aggregator-$i.env"
  fi
  # shellcheck disable=SC2016 # expanded by the remote shell
  remote_sh "$target" '
    cd "$1" || exit 1
    if [ -f "aggregator-$2.pid" ] && kill -0 "$(cat "aggregator-$2.pid")" 2>/dev/null; then
      echo "aggregator $2 already running (pid $(cat "aggregator-$2.pid"))"; exit 0
    fi
    shift
    i=$1 py=$2 insecure=$3; shift 3
    if [ "$insecure" = 1 ]; then
      chmod 600 node.env
      set -a; . ./node.env; set +a
      export LUWU_TRANSPORT__JOIN_SECRET="$LUWU_NODE__JOIN_SECRET" LUWU_NODE__INSECURE_PUBLIC_BIND=true
    else
      chmod 600 "aggregator-$i.env"
      set -a; . "./aggregator-$i.env"; set +a
    fi
    umask 077
    nohup setsid "$py" -m luwu -v aggregator --config cluster.toml "$@" >"aggregator-$i.log" 2>&1 </dev/null &
    echo $! >"aggregator-$i.pid"
    echo "aggregator $i started (pid $!)"
  ' "$dir" "$i" "$remote_py" "$insecure" --ranks "${g_ranks[$i]}" --node.bind "$bind" \
    --metrics.host "$mhost" --metrics.port "$mport"
}

# SIGTERM the pid in NAME.pid of the remote run dir, SIGKILL after stop_timeout seconds.
stop_daemon() {
  local target=$1 name=$2
  # shellcheck disable=SC2016 # expanded by the remote shell
  remote_sh "$target" '
    cd "$1" 2>/dev/null || { echo "$2: no run dir"; exit 0; }
    [ -f "$2.pid" ] || { echo "$2: not running (no pid file)"; exit 0; }
    pid=$(cat "$2.pid")
    if kill -TERM "$pid" 2>/dev/null; then
      t=0
      while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$(($3 * 10))" ]; do sleep 0.1; t=$((t + 1)); done
      if kill -0 "$pid" 2>/dev/null; then echo "$2: SIGKILL after $3 s"; kill -KILL "$pid"; fi
    fi
    rm -f "$2.pid"
    echo "$2 stopped (pid $pid)"
  ' "$remote_dir" "$name" "$stop_timeout"
}

stop_node() {
  stop_daemon "${targets[$1]}" "node-$1"
}

# Until every node (and aggregator) answers; prints the status table once they do.
wait_ready() {
  local deadline=$((SECONDS + start_timeout)) i out
  until out=$("$py" -m luwu.status status --config "$(status_file)" --timeout 2 2>&1); do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "launch.sh: not every node and aggregator answered within ${start_timeout}s (LUWU_START_TIMEOUT); their logs:" >&2
      for i in "${!targets[@]}"; do
        echo "--- node $i on ${targets[$i]}:" >&2
        remote "${targets[$i]}" tail -n 15 "$remote_dir/node-$i.log" >&2 || true
      done
      for i in "${!g_ranks[@]}"; do
        echo "--- aggregator $i (ranks ${g_ranks[$i]}) on $(agg_target "$i"):" >&2
        remote "$(agg_target "$i")" tail -n 15 "$remote_dir/aggregator-$i.log" >&2 || true
      done
      "$py" -m luwu.status status --config "$(status_file)" --timeout 2 >&2 || true
      return 1
    fi
    sleep 1
  done
  printf '%s\n' "$out"
}

cmd=${1:-}
case "$cmd" in
  start)
    [ $# -ge 2 ] || usage 2
    read_hosts "$2"
    write_cluster_file "${3:-}"
    read_groups
    make_keys
    for i in "${!targets[@]}"; do
      start_node "$i"
    done
    for i in "${!g_ranks[@]}"; do
      start_aggregator "$i"
    done
    wait_ready
    ;;
  stop)
    [ $# -ge 2 ] || usage 2
    read_hosts "$2"
    read_groups
    pids=()
    for i in "${!g_ranks[@]}"; do  # the aggregators first: their workers' pushes stop there
      stop_daemon "$(agg_target "$i")" "aggregator-$i" &
      pids+=("$!")
    done
    for pid in "${pids[@]}"; do
      wait "$pid" || true
    done
    pids=()
    for i in "${!targets[@]}"; do
      stop_node "$i" &
      pids+=("$!")
    done
    status=0
    for pid in "${pids[@]}"; do
      wait "$pid" || status=1
    done
    exit "$status"
    ;;
  status)
    [ $# -ge 2 ] || usage 2
    [ -f "$run_dir/cluster.toml" ] || die "no $run_dir/cluster.toml: run '$0 start $2' first"
    exec "$py" -m luwu.status status --config "$(status_file)" "${@:3}"
    ;;
  -h | --help | help) usage 0 ;;
  *) usage 2 ;;
esac

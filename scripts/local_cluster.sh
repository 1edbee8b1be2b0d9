#!/usr/bin/env bash
# A local multi-node Ray cluster on this machine, loopback only: a head and N-1 workers, each its own
# raylet with a custom resource naming it (dflash_node_0 on the head, dflash_node_1, ...), all under one
# --temp-dir. `stop` ends exactly the processes of that temp dir: never a bare `ray stop`, which ends
# every Ray cluster on the machine, other people's included.
#
#   scripts/local_cluster.sh start [NUM_NODES]   # default 3; then: serve deploy -a <dashboard> cluster/serve_config.yaml
#   scripts/local_cluster.sh status
#   scripts/local_cluster.sh stop
#
# Environment: DFLASH_CLUSTER_DIR (the temp dir, short: Ray puts sockets in it; default /tmp/dflash-cluster),
# DFLASH_CLUSTER_PORT (GCS port, default 6390; each node's other ports are derived from it),
# DFLASH_CLUSTER_DASHBOARD_PORT (default 8266; serve deploy talks to it), DFLASH_CLUSTER_CPUS (per node, default 1).
set -euo pipefail
cd "$(dirname "$0")/.."

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # else Ray binds the machine's external address
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # replicas import `deployments` from this checkout
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"  # head and workers alike (the head alone turns it on when ~/.ray/auth_token exists)
RAY="${RAY:-.venv/bin/ray}"
PYTHON="${PYTHON:-.venv/bin/python}"  # the same environment as $RAY
DIR="${DFLASH_CLUSTER_DIR:-/tmp/dflash-cluster}"
PORT="${DFLASH_CLUSTER_PORT:-6390}"
DASHBOARD_PORT="${DFLASH_CLUSTER_DASHBOARD_PORT:-8266}"
CPUS="${DFLASH_CLUSTER_CPUS:-1}"

node_flags() {  # the flags every node shares, and ports of its own (several raylets share 127.0.0.1)
  local i=$1 base=$((PORT + 10 + 10 * $1))
  echo --node-ip-address=127.0.0.1 --temp-dir="$DIR" --num-cpus="$CPUS" --num-gpus=0 \
    --resources="{\"dflash_node_$i\":1}" --object-store-memory=$((200 * 1024 * 1024)) --disable-usage-stats \
    --node-manager-port=$base --object-manager-port=$((base + 1)) \
    --dashboard-agent-listen-port=$((base + 2)) --dashboard-agent-grpc-port=$((base + 3)) \
    --runtime-env-agent-port=$((base + 4)) --metrics-export-port=$((base + 5)) \
    --min-worker-port=$((PORT + 1000 + 200 * i)) --max-worker-port=$((PORT + 1199 + 200 * i))
}

start_worker() {  # `ray start` for a worker node, kept on loopback: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
  # Ray refuses worker nodes, and with it on it swaps 127.0.0.1 in --address for the external address
  "$PYTHON" -c '
import sys
from ray._private import ray_constants, services
from ray.scripts.scripts import main
ray_constants.ENABLE_RAY_CLUSTER = True  # allow a worker node...
services.resolve_ip_for_localhost = lambda host: host  # ...that joins the head at 127.0.0.1
sys.argv[0] = "ray"
main()' start --address="127.0.0.1:$PORT" "$@"
}

cluster_pids() {  # every process started for this cluster: its command line names the temp dir
  ps -eo pid=,args= | while read -r pid args; do
    [[ "$args" == *"$DIR/session_"* || "$args" == *"--temp-dir=$DIR"* || "$args" == *"--temp_dir=$DIR"* ]] \
      && [[ "$pid" != "$$" && "$args" != *local_cluster.sh* ]] && echo "$pid"
  done
}

case "${1:-}" in
  start)
    num_nodes="${2:-3}"
    if [ -n "$(cluster_pids)" ]; then
      echo "local_cluster: a cluster already runs in $DIR; stop it first" >&2
      exit 1
    fi
    mkdir -p "$DIR"
    # shellcheck disable=SC2046  # node_flags is a list of flags
    "$RAY" start --head --port="$PORT" --include-dashboard=true --dashboard-host=127.0.0.1 \
      --dashboard-port="$DASHBOARD_PORT" $(node_flags 0) > "$DIR/start.log" 2>&1 \
      || { cat "$DIR/start.log" >&2; exit 1; }
    for ((i = 1; i < num_nodes; i++)); do
      # shellcheck disable=SC2046
      start_worker $(node_flags "$i") >> "$DIR/start.log" 2>&1 \
        || { cat "$DIR/start.log" >&2; exit 1; }
    done
    for _ in $(seq 60); do  # until the last node shows in the cluster's status (refreshed every few seconds)
      "$RAY" status --address="127.0.0.1:$PORT" 2>/dev/null | grep -q "dflash_node_$((num_nodes - 1))\b" && break
      sleep 1
    done
    echo "local_cluster: $num_nodes nodes (dflash_node_0..$((num_nodes - 1))) at 127.0.0.1:$PORT;" \
      "dashboard and serve deploy at http://127.0.0.1:$DASHBOARD_PORT"
    ;;
  status)
    "$RAY" status --address="127.0.0.1:$PORT"
    ;;
  stop)
    mapfile -t pids < <(cluster_pids)
    if [ ${#pids[@]} -eq 0 ]; then
      echo "local_cluster: nothing runs in $DIR"
      exit 0
    fi
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do  # up to 10 s for a clean exit, then SIGKILL what is left
      mapfile -t pids < <(cluster_pids)
      [ ${#pids[@]} -eq 0 ] && break
      sleep 0.2
    done
    [ ${#pids[@]} -eq 0 ] || kill -9 "${pids[@]}" 2>/dev/null || true
    echo "local_cluster: stopped the cluster in $DIR"
    ;;
  *)
    echo "usage: $0 start [NUM_NODES] | status | stop" >&2
    exit 2
    ;;
esac

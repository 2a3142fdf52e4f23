#!/usr/bin/env bash
# Several "nodes" on this machine as network namespaces on a bridge (needs root):
#
#   scripts/netns-nodes.sh up N [--rate 1gbit]     # prints the cluster's NAME, each node's namespace and address
#   scripts/netns-nodes.sh train NAME CONFIG [--nproc P] [shardwise train flags ...]
#   scripts/netns-nodes.sh down NAME               # kills what runs in its nodes, removes them and the bridge
#
# `train` runs `shardwise train` in every node with --nnodes, --node-rank, --node-addr and a c10d
# rendezvous on node 0's address; or run it yourself in one node:
#   ip netns exec NAME-n1 shardwise train CONFIG --nnodes 2 --node-rank 1 \
#       --rdzv-endpoint 10.213.0.1:29400 --node-addr 10.213.0.2
# The work is done by src/shardwise/bench/netns.py (its docstring says how the nodes are made).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m shardwise.bench.netns "$@"

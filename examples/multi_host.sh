#!/usr/bin/env bash
# Launching one ahcomm job on two hosts (2 nodes x 4 ranks = world size 8).
#
# This script is documentation: it prints the commands to run, one per host, and runs nothing
# unless asked (RUN=1, on each host, with NODE_RANK set). The tests do not run it.
#
# Every rank of a job needs the same AHCOMM_JOB_SECRET (at least 16 characters): it authenticates
# every connection, and a rank with another secret is refused. Make one, copy it to every host
# by a private channel (never a command line), and export it there before the launcher runs.
#
# How the job finds itself:
#   - Global rank 0 (node 0, local rank 0) serves the rendezvous on MASTER_ADDR:MASTER_PORT;
#     every other rank connects there, so MASTER_ADDR must be an address of node 0 that node 1
#     can reach, and MASTER_PORT a free TCP port on node 0 (open in its firewall).
#   - Ranks on the same host talk over the sdma links (ZeroMQ ipc + shared memory); ranks on
#     different hosts over the rdma links (ZeroMQ tcp). Each rank binds its tcp endpoint on the
#     interface that reaches the master; AHCOMM_IF_IP picks another one (e.g. the fast NIC).
#   - Ranks count as "local" by host identity (hostname + boot id + network namespace, so two
#     containers or namespaces on one kernel are two hosts); AHCOMM_SERVER_ID overrides it.
#   - Global ranks: node R runs ranks R*4 .. R*4+3 (AHCOMM_LOCAL_RANK 0..3 on each node).
#
# Usage:
#   examples/multi_host.sh                                   # print the commands
#   export AHCOMM_JOB_SECRET=...   (the same value on both hosts; see above)
#   MASTER_ADDR=host-a NODE_RANK=0 RUN=1 examples/multi_host.sh   # on host A
#   MASTER_ADDR=host-a NODE_RANK=1 RUN=1 examples/multi_host.sh   # on host B
set -euo pipefail

NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-4}
MASTER_ADDR=${MASTER_ADDR:-HOST_A_ADDRESS}   # placeholder: node 0's address, reachable from every node
MASTER_PORT=${MASTER_PORT:-29500}            # placeholder: a free port on node 0
PROGRAM=${PROGRAM:-examples/data_parallel_training.py}
ARGS=${ARGS:-}

launch_cmd() {  # $1 = node rank
  echo "ahcomm-run --nnodes $NNODES --node-rank $1 --nproc-per-node $NPROC_PER_NODE" \
       "--master-addr $MASTER_ADDR --master-port $MASTER_PORT python $PROGRAM $ARGS"
}

if [[ "${RUN:-0}" != "1" ]]; then
  echo "# Same checkout and environment on every host (e.g. pip install -e . in a venv)."
  echo "# One secret for the job: make it once (python3 -c 'import secrets; print(secrets.token_hex(32))'),"
  echo "# copy it to every host privately, and export the SAME value on each before the launcher:"
  echo "#   export AHCOMM_JOB_SECRET=<that value>"
  for ((node = 0; node < NNODES; node++)); do
    echo "# on node $node:"
    echo "$(launch_cmd "$node")"
  done
  cat <<EOF

# Or from one host, over ssh (mpirun's style; the secret travels on ssh's standard input):
#   ahcomm-run -H host-a:$NPROC_PER_NODE,host-b:$NPROC_PER_NODE python $PROGRAM $ARGS
#
# Under torchrun, once per host (ahcomm finds its rendezvous through torchrun's store):
#   torchrun --nnodes $NNODES --node-rank R --nproc-per-node $NPROC_PER_NODE \\
#     --master-addr $MASTER_ADDR --master-port $MASTER_PORT $PROGRAM $ARGS
#
# Without a launcher: start every rank yourself with these variables
# (also accepted: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as torchrun sets them,
# OMPI_COMM_WORLD_*, PMI_*, SLURM_PROCID/SLURM_NTASKS). On node R, for L in 0..$((NPROC_PER_NODE - 1)):
#   AHCOMM_RANK=\$((R * $NPROC_PER_NODE + L)) AHCOMM_WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) \\
#   AHCOMM_LOCAL_RANK=\$L AHCOMM_LOCAL_WORLD_SIZE=$NPROC_PER_NODE \\
#   AHCOMM_MASTER_ADDR=$MASTER_ADDR AHCOMM_MASTER_PORT=$MASTER_PORT python $PROGRAM $ARGS &
# (AHCOMM_JOB_SECRET exported as above)
#
# Under Slurm (one task per rank; srun passes the exported AHCOMM_JOB_SECRET on): srun -N $NNODES --ntasks-per-node $NPROC_PER_NODE \\
#   env AHCOMM_MASTER_ADDR=\$(scontrol show hostnames \$SLURM_JOB_NODELIST | head -n1) \\
#   AHCOMM_MASTER_PORT=$MASTER_PORT python $PROGRAM $ARGS
#
# Checks: rank 0's last line ends in OK ('replicas in sync': every rank holds the same bits); comm.stats() shows
# 'sdma' links to the ranks of the same node and 'rdma' links to the other node's ranks.
# Test a two-host layout on one machine: AHCOMM_TRANSPORT=rdma forces tcp between all ranks.
EOF
  exit 0
fi

: "${NODE_RANK:?set NODE_RANK (0..$((NNODES - 1))) on each host}"
[[ "$MASTER_ADDR" != HOST_A_ADDRESS ]] || { echo "set MASTER_ADDR to node 0's address" >&2; exit 2; }
[[ -n "${AHCOMM_JOB_SECRET:-}" ]] || { echo "export the job's AHCOMM_JOB_SECRET (the same on every host)" >&2; exit 2; }
exec $(launch_cmd "$NODE_RANK")

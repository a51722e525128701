#!/bin/bash
# Stops what slurm_start.sh DIR started (by the pid files under DIR).
D=$1
for f in $D/slurmd.pid $D/slurmctld.pid $D/munge/munged.pid; do [ -f $f ] && kill $(cat $f) 2>/dev/null; done
sleep 1; true

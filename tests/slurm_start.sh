#!/bin/bash
# A private single-node Slurm (munge, slurmctld, slurmd) for tests/test_slurm.py, as root: slurm_start.sh DIR
# (config, state, logs and the munge socket all under DIR; ports chosen free). Stop: slurm_stop.sh DIR.
set -e
D=$1; mkdir -p $D/state $D/spool $D/munge; chmod 700 $D/munge
H=$(hostname -s)
dd if=/dev/urandom of=$D/munge/munge.key bs=1024 count=1 2>/dev/null; chmod 400 $D/munge/munge.key
munged -f --key-file=$D/munge/munge.key --socket=$D/munge/munge.socket --pid-file=$D/munge/munged.pid --log-file=$D/munge/munged.log --seed-file=$D/munge/munged.seed
P1=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
P2=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > $D/slurm.conf <<EOC
ClusterName=ahcommtest
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$P1
SlurmdPort=$P2
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
PlugStackConfig=$D/plugstack.conf
NodeName=$H NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOC
touch $D/plugstack.conf
export SLURM_CONF=$D/slurm.conf
slurmctld -f $D/slurm.conf -i
slurmd -f $D/slurm.conf -N $H
echo started

#!/bin/bash
# A one-node Slurm cluster on this machine (for the test suite): installs slurm-wlm and munge if needed,
# writes a minimal slurm.conf (partitions debug, the default, and second: the tests submit to both) and starts
# munged, slurmctld and slurmd. Needs root. Idempotent.
set -euo pipefail
if ! command -v slurmctld >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
CPUS=$(nproc)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
CONF=$(cat <<CONF
ClusterName=normlab
SlurmctldHost=localhost
SlurmUser=root
NodeName=localhost CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=second Nodes=localhost MaxTime=INFINITE State=UP
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ReturnToService=2
MpiDefault=none
# A requeued job may start again only once its old credential has expired: cred_expire seconds (120 by default) after
# the requeue. Starting it sooner (scontrol update StartTime=now) gets it killed: "Job credential revoked". Then it
# waits for the next scheduling pass (every 30-60 s by default): every 2 s here, so that it starts about 11 s after the
# requeue instead of 20-50 s (a job of the test suite is requeued 5 times).
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
CONF
)
if [ "$CONF" != "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]; then
    printf '%s\n' "$CONF" > /etc/slurm/slurm.conf
    if pgrep -x slurmctld >/dev/null; then  # a running cluster takes the new settings: AuthInfo only at a restart
        scontrol shutdown >/dev/null
        for _ in $(seq 30); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 1; done
    fi
fi
if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || (dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null)
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd -N localhost
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed|allocated"; then exit 0; fi
    scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
    sleep 1
done
echo "local_cluster.sh: Slurm did not become ready" >&2
exit 1

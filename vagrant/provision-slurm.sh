#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Vagrant provisioning for Slurm (as root, in node K of an N-node cluster
# whose node J has the address NET.(10+J)), after provision.sh: the
# release's Slurm (Debian 12's 22.05, Debian 13's 24.11; Debian 11's 20.11
# has no cgroup/v2 plugin) set up as SchedMD recommends, with cgroup confinement on the
# VM's pure cgroup v2 hierarchy, and mpipause's SPANK plugin on:
#   ProctrackType=proctrack/cgroup, TaskPlugin=task/cgroup,task/affinity,
#   CgroupPlugin=cgroup/v2 with ConstrainCores and ConstrainRAMSpace,
#   JobAcctGatherType=jobacct_gather/cgroup, slurmdbd (MariaDB) on node0;
#   PreemptMode=SUSPEND,GANG (partition high suspends partition vagrant);
# munge with the cluster's one key (made on the host by the Vagrantfile's
# trigger), slurmctld on node0, slurmd on every node. Not run by `vagrant
# up`: `vagrant provision --provision-with slurm` (vagrant/boot-check.sh --slurm
# does). Idempotent. docs/vagrant.md, "Slurm on the VMs".
#
#   provision-slurm.sh K N NET
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: provision-slurm.sh K N NET" >&2 && exit 2; }
k=$1 n=$2 net=$3
[[ $k =~ ^[0-9]+$ && $n =~ ^[1-9][0-9]*$ && $k -lt $n ]] || { echo "provision-slurm: want node index K < N, got K=$k N=$n" >&2 && exit 2; }
[[ $net =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "provision-slurm: NET is the first three octets (192.168.56), got '$net'" >&2 && exit 2; }
src=/vagrant
node=node$k
export DEBIAN_FRONTEND=noninteractive

say() { echo "provision-slurm $node: $*"; }
die() {
	echo "provision-slurm $node: $*" >&2
	exit 1
}

[ -f /usr/lib/mpipause/mpipause_spank.so ] || die "no /usr/lib/mpipause/mpipause_spank.so: provision.sh's install step first"
[ -s "$src/vagrant/.secrets/munge.key" ] || die "no vagrant/.secrets/munge.key: the Vagrantfile's trigger makes it on the host; run: vagrant provision"

if ! command -v slurmd >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
	# Not in the box (its recipe, and so every other check's box, stays
	# as it is): from the Debian mirror, through libvirt's NAT.
	apt-get update -q >/dev/null
	apt-get install -y -q --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null
	say "Slurm $(slurmd -V | awk '{ print $2 }') and munge installed"
fi
# sacct reads what slurmdbd stored (22.05 has no accounting without it):
# slurmdbd and its MariaDB on node0.
if [ "$k" = 0 ] && { ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; }; then
	apt-get update -q >/dev/null
	apt-get install -y -q --no-install-recommends slurmdbd mariadb-server >/dev/null
	say "slurmdbd and MariaDB $(mariadbd --version | awk '{ print $3 }') installed"
fi
# The units are enabled by the packages; they start below, configured.
systemctl stop slurmctld slurmd slurmdbd 2>/dev/null || true

install -m 0400 -o munge -g munge "$src/vagrant/.secrets/munge.key" /etc/munge/munge.key
systemctl enable -q munge
systemctl restart munge

hw=$(slurmd -C | sed -n 's/^NodeName=[^ ]* //p' | sed 's/ *UpTime=.*//')
[ -n "$hw" ] || die "slurmd -C printed no node line"
# Every node must say the same of every node: the VMs are alike, so each
# writes its own hardware for all (slurmd -C rounds RealMemory the same).
install -d /etc/slurm
cat >/etc/slurm/slurm.conf <<EOF
# vagrant/provision-slurm.sh: node0..node$((n - 1)), slurmctld on node0
ClusterName=vagrant
SlurmctldHost=node0
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
JobAcctGatherType=jobacct_gather/cgroup
JobAcctGatherFrequency=task=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=node0
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerNode=256
PlugStackConfig=/etc/slurm/plugstack.conf
# A job of partition high suspends the jobs of vagrant whose cores it
# needs, and they resume when it ends (gang scheduling's suspend, resume).
PreemptType=preempt/partition_prio
PreemptMode=SUSPEND,GANG
NodeName=node[0-$((n - 1))] $hw State=UNKNOWN
PartitionName=vagrant Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 OverSubscribe=NO
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 OverSubscribe=NO
EOF
cat >/etc/slurm/cgroup.conf <<EOF
CgroupPlugin=cgroup/v2
ConstrainCores=yes
ConstrainRAMSpace=yes
EOF
echo "required /usr/lib/mpipause/mpipause_spank.so" >/etc/slurm/plugstack.conf
install -d -o slurm -g slurm /var/lib/slurm/slurmctld
install -d /var/lib/slurm/slurmd
if [ "$k" = 0 ]; then
	# A small database: the VM has 1 GiB for everything.
	printf '[mysqld]\ninnodb_buffer_pool_size=32M\n' >/etc/mysql/mariadb.conf.d/90-slurmdbd.cnf
	systemctl enable -q mariadb
	systemctl restart mariadb
	# Debian's mariadb.service upgrades the system tables in the
	# background after a start (/etc/mysql/debian-start), the first start
	# of a VM included: slurmdbd creates its tables after that.
	t0=$SECONDS
	while pgrep -x mariadb-upgrade >/dev/null || pgrep -f /etc/mysql/debian-start >/dev/null; do
		[ $((SECONDS - t0)) -lt 180 ] || die "MariaDB's upgrade of its tables (debian-start) still runs after 180 s"
		sleep 1
	done
	# slurmdbd logs in as the slurm user over MariaDB's socket, no password.
	mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
		GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
	install -d -o slurm -g slurm /var/log/slurm
	install -m 0600 -o slurm -g slurm /dev/stdin /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=node0
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StorageLoc=slurm_acct_db
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
EOF
	systemctl enable -q slurmdbd
	# On Debian 13's first boot slurmdbd 24.11 has exited at its first
	# query ("mysql_query failed: 5027 Number of columns in result (=1)
	# set exceeds maximum allowed number of columns (=0)", in
	# _check_mysql_concat_is_sane) with MariaDB's table upgrade already
	# over, and started at the next provisioning: the cause is not known
	# here. A slurmdbd that exits is started again, MariaDB first, three
	# times at most, each saying why.
	for try in 1 2 3; do
		systemctl restart slurmdbd
		t0=$SECONDS
		until sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; do
			state=$(systemctl show -p ActiveState --value slurmdbd)
			if { [ "$state" = failed ] || [ "$state" = inactive ]; } && [ "$try" -lt 3 ]; then
				say "slurmdbd exited (start $try of 3): $(tail -2 /var/log/slurm/slurmdbd.log 2>/dev/null | tr '\n' ' '); MariaDB and slurmdbd again"
				systemctl restart mariadb
				continue 2
			fi
			[ $((SECONDS - t0)) -lt 60 ] || die "slurmdbd does not answer after 60 s: $(tail -3 /var/log/slurm/slurmdbd.log 2>/dev/null | tr '\n' ' ')"
			sleep 1
		done
		break
	done
	# The job's user with an account: sacct lists its jobs.
	sacctmgr -n -P list cluster format=cluster | grep -qx vagrant || sacctmgr -i add cluster vagrant >/dev/null
	sacctmgr -n -P list account format=account | grep -qx mpipause || sacctmgr -i add account mpipause >/dev/null
	sacctmgr -n -P list user format=user | grep -qx vagrant || sacctmgr -i add user vagrant account=mpipause >/dev/null
	systemctl enable -q slurmctld
	systemctl restart slurmctld
else
	systemctl disable -q slurmctld 2>/dev/null || true
fi
systemctl enable -q slurmd
systemctl restart slurmd
# slurmd is Type=simple: a refusal of its cgroup plugin shows only as its
# exit, soon after the start; sinfo on node0 (slurm-e2e.sh) says the rest.
t0=$SECONDS
while [ $((SECONDS - t0)) -lt 5 ]; do
	systemctl is-active -q slurmd || {
		journalctl -u slurmd --no-pager -o cat -n 15 >&2
		die "slurmd exited (above)"
	}
	sleep 1
done
say "Slurm $(slurmd -V | awk '{ print $2 }'): munge, slurmd$([ "$k" = 0 ] && echo ", slurmctld, slurmdbd") running: proctrack/cgroup, task/cgroup,task/affinity, cgroup/v2 ($hw)"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The container cluster rig (docs/containers.md): N systemd-nspawn containers
# node0..node{N-1}, each a Debian 12 booted with its own systemd as PID 1 on a
# pure cgroup v2 hierarchy, with its own PID, mount, UTS, IPC, cgroup and
# network namespaces, on a bridge that lives in a network namespace of the
# rig's own (nothing is added to the host's network namespace). In each node
# mpipause is installed from bin/mpipause_*.deb with apt, and the Vagrant
# provisioning script (vagrant/provision.sh: hosts, key, mpi, ssh, mpid)
# does the rest: /etc/hosts, the shared cluster key, MPI over TCP on eth0,
# root's ssh between the nodes, mpid started by its unit.
#
#   crig.sh up [N]             boot node0..node{N-1} (default 3), provision them
#   crig.sh exec NODE -- CMD   run CMD (argv) in NODE, as root, in a scope of the
#                              node's systemd, with a login's environment
#   crig.sh slurm [--no-cgroup] munge, slurmctld (node0) and slurmd (every node)
#                              with Slurm's cgroup/v2 setup (--no-cgroup: linuxproc
#                              and task/affinity instead); checks srun -N<N> hostname
#   crig.sh status             the nodes, their systemd state and mpid
#   crig.sh down               remove everything up made (idempotent)
#   crig.sh image              build the cached base image only
#
#   MPIPAUSE_CRIG        the rig's name (default crig): several rigs can be up at once
#   MPIPAUSE_CRIG_CACHE  where base images are kept (default /var/tmp/mpipause-crig-cache)
#   MPIPAUSE_CRIG_DEB    the .deb to install (default: bin/'s of this commit, make deb)
#   DEBIAN_MIRROR        the mirror debootstrap takes Debian from (default: the host's)
set -euo pipefail
SECONDS=0

repo=$(cd "$(dirname "$0")/../.." && pwd)
self=$repo/kernel-tests/containers/crig.sh
name=${MPIPAUSE_CRIG:-crig}
cache=${MPIPAUSE_CRIG_CACHE:-/var/tmp/mpipause-crig-cache}
work=/var/tmp/mpipause-crig/$name
netns=mpipause-crig-$name
net=10.78.0 # node K is $net.(10+K), as the Vagrant nodes are NET.(10+K)
suite=bookworm
# The base image: what the nodes boot. Its cache key is this list and the
# recipe's version (bump it when image() changes what it does to the root).
recipe=1
pkgs=(
	systemd systemd-sysv dbus libpam-systemd # the nodes' init, and logind for ssh sessions
	iproute2 procps libcap2-bin jq           # cluster-e2e.sh, mpid's capabilities by name
	openssh-server openssh-client            # the MPI launchers' agent between nodes
	openmpi-bin mpich                        # Open MPI 4.1, MPICH 4.0
	munge slurmd slurmctld slurm-client      # crig.sh slurm (off until then)
)

die() {
	echo "crig: $*" >&2
	exit 1
}
say() { echo "crig: [$((SECONDS))s] $*"; }
usage() {
	sed -n 's/^#   //p' "$self" >&2
	exit 2
}

[[ $name =~ ^[a-z0-9][a-z0-9-]{0,15}$ ]] || die "MPIPAUSE_CRIG: want [a-z0-9][a-z0-9-]*, at most 16 characters, got '$name'"
# The cgroup v2 hierarchy, wherever it is mounted (/sys/fs/cgroup, or
# /sys/fs/cgroup/unified on a hybrid host); the rig's cgroups go below it.
cgroup2=$(awk '{ for (i = 7; i <= NF; i++) if ($i == "-") break; if ($(i + 1) == "cgroup2" && $4 == "/") { print $5; exit } }' /proc/self/mountinfo)
cgdir=$cgroup2/mpipause-crig/$name

need_root() { [ "$(id -u)" = 0 ] || die "needs root"; }
nodes() { cat "$work/nodes" 2>/dev/null || echo 0; }
node_index() {
	local n=${1#node}
	if ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -ge "$(nodes)" ]; then
		die "no node '$1' in rig $name (up: $(nodes) nodes)"
	fi
	echo "$n"
}
# alive PID COMM: PID is a live process named COMM.
alive() { [ -n "$1" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]; }
# leader K: node K's PID 1 (its systemd), as the host numbers it.
leader() {
	local l
	l=$(cat "$work/node$1/leader" 2>/dev/null) || die "node$1 of rig $name is not up"
	alive "$l" systemd || die "node$1's systemd ($l) is gone: crig.sh down, then up"
	echo "$l"
}
# node_do K CMD...: CMD in every namespace of node K, as it is after boot: the
# node's own root, the host's environment (the internal steps of up).
node_do() {
	local l
	l=$(leader "$1")
	shift
	nsenter -t "$l" -a -r -w -- "$@"
}

# The environment of an ssh login to a node (which is how the MPI launchers
# start their remote daemons there): a clean one and /etc/environment.
node_env=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
	HOME=/root USER=root LOGNAME=root SHELL=/bin/bash LANG=C.UTF-8)
# shellcheck disable=SC2016 # expanded in the node
login_sh='set -a; . /etc/environment; set +a; exec "$@"'

image_key() {
	printf '%s\n' "$suite" "$recipe" "${pkgs[@]}" | sha256sum | cut -c1-16
}

cmd_image() {
	need_root
	local key dir tmp mirror t0=$SECONDS
	key=$(image_key)
	dir=$cache/$suite-$key
	base=$dir/root
	[ -f "$dir/done" ] && return 0
	command -v debootstrap >/dev/null || die "no debootstrap: make deps"
	mkdir -p "$cache"
	exec 8>"$cache/.lock"
	flock 8
	if [ -f "$dir/done" ]; then
		exec 8>&-
		return 0
	fi
	mirror=$("$repo/scripts/debian-mirror.sh") || die "no Debian mirror to debootstrap from (above)"
	tmp=$(mktemp -d "$cache/.build.XXXXXX")
	say "debootstrap $suite (minbase, ${#pkgs[@]} packages and their dependencies) from $mirror into $dir (once; cached)"
	if ! debootstrap --variant=minbase --include="$(
		IFS=,
		echo "${pkgs[*]}"
	)" "$suite" "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1; then
		tail -20 "$tmp/debootstrap.log" >&2
		rm -rf "$tmp"
		die "debootstrap failed (above)"
	fi
	local r=$tmp/root
	# Slurm and munge are off until crig.sh slurm configures them.
	chroot "$r" systemctl disable -q munge slurmd slurmctld 2>/dev/null || true
	# No login prompt on the console, no boot status lines in the log.
	ln -sf /dev/null "$r/etc/systemd/system/console-getty.service"
	mkdir -p "$r/etc/systemd/system.conf.d"
	printf '[Manager]\nShowStatus=no\n' >"$r/etc/systemd/system.conf.d/crig.conf"
	printf '127.0.0.1\tlocalhost\n' >"$r/etc/hosts"
	rm -f "$r/etc/hostname" "$r"/var/cache/apt/archives/*.deb
	echo "$suite minbase: ${pkgs[*]}" >"$tmp/packages"
	touch "$tmp/done"
	rm -rf "$dir"
	mv -T "$tmp" "$dir"
	exec 8>&-
	say "base image ready in $((SECONDS - t0)) s: $(du -sh "$dir" | cut -f1) in $dir"
}

# start_node K: node K's systemd-nspawn, detached, in cgroup $cgdir/nodeK,
# in a mount namespace of its own where its root (an overlay of the base
# image), its bpffs and a tmpfs on /run (nspawn's own files) are mounted:
# they all go with it.
start_node() {
	local k=$1 d=$work/node$1
	mkdir -p "$d/upper/etc" "$d/work" "$d/root" "$d/bpf" "$cgdir/node$k"
	echo "node$k" >"$d/upper/etc/hostname"
	(
		echo "$BASHPID" >"$cgdir/node$k/cgroup.procs"
		# SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1: the cgroup v2 hierarchy alone,
		# even on a hybrid host. --register=no --keep-unit: no machined or
		# systemd needed on the host. --private-network: a network
		# namespace of its own, where up then moves one end of a veth.
		# CAP_BPF, CAP_PERFMON and bpf(2): for mpid (scripts/check-systemd.sh).
		# shellcheck disable=SC2016 # expanded by the inner bash
		exec setsid unshare --mount --propagation private -- bash -c '
			set -e
			mount -t overlay overlay -o "lowerdir=$1,upperdir=$2/upper,workdir=$2/work" "$2/root"
			mount -t bpf bpf "$2/bpf"
			mount -t tmpfs tmpfs /run
			exec env SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 systemd-nspawn --quiet \
				--directory="$2/root" --machine="$3" --register=no --keep-unit \
				--private-network --link-journal=no \
				--capability=CAP_BPF,CAP_PERFMON --system-call-filter=bpf \
				--bind="$2/bpf:/sys/fs/bpf" --bind-ro="$4" --bind-ro="$5:/mnt/crig" \
				--console=read-only --boot' _ "$base" "$d" "node$k" "$repo/bin" "$work/src"
	) </dev/null >"$d/console.log" 2>&1 &
	echo $! >"$d/pid"
}

# find_leader K: wait for node K's PID 1 (the process of its cgroup whose
# pid in its own namespace is 1) and record it.
find_leader() {
	local k=$1 d=$work/node$1 p t0=$SECONDS
	while true; do
		kill -0 "$(cat "$d/pid")" 2>/dev/null || die "node$k: systemd-nspawn exited: $(tail -5 "$d/console.log")"
		while read -r p; do
			if awk '$1 == "NSpid:" && NF == 3 && $3 == 1 { ok = 1 } END { exit !ok }' "/proc/$p/status" 2>/dev/null; then
				echo "$p" >"$d/leader"
				return 0
			fi
		done < <(find "$cgdir/node$k" -name cgroup.procs -exec cat {} + 2>/dev/null)
		[ $((SECONDS - t0)) -lt 30 ] || die "node$k: no PID 1 after 30 s: $(tail -5 "$d/console.log")"
		sleep 0.1
	done
}

# net_node K: node K's eth0, the peer of veth K on the bridge.
net_node() {
	local k=$1 l
	l=$(leader "$k")
	ip -n "$netns" link add "veth$k" type veth peer name eth0 netns "$l"
	ip -n "$netns" link set "veth$k" master br0 up
	# IPv6 off, as on the netns rig: no link-local address for MPI to pick.
	nsenter -t "$l" -n sh -c "sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 &&
		ip link set lo up && ip addr add $net.$((10 + k))/24 dev eth0 && ip link set eth0 up"
}

# cgroup_root K: node K's cgroup namespace root, relative to the host's
# cgroup v2 mount (where exec puts a command before entering the node).
cgroup_root() {
	local l host rel
	l=$(leader "$1")
	host=$(sed -n 's/^0:://p' "/proc/$l/cgroup")
	rel=$(nsenter -t "$l" -C -- sed -n 's/^0:://p' "/proc/$l/cgroup")
	[ "$rel" = / ] && rel=
	echo "${host%"$rel"}"
}

cmd_up() {
	need_root
	local n=${1:-3} k t0=$SECONDS deb
	if ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 200 ]; then
		die "up: want 1..200 nodes, got '$n'"
	fi
	[ ! -e "$work" ] || die "rig $name is up or half up ($work): crig.sh down first"
	[ -n "$cgroup2" ] || die "no cgroup v2 hierarchy mounted (/proc/self/mountinfo)"
	for t in systemd-nspawn unshare nsenter ip flock ssh-keygen; do
		command -v "$t" >/dev/null || die "$t is missing: make deps"
	done
	deb=${MPIPAUSE_CRIG_DEB:-$repo/bin/mpipause_$("$repo/scripts/version.sh")_$(dpkg --print-architecture).deb}
	[ -f "$deb" ] || die "no $deb: make build deb (or MPIPAUSE_CRIG_DEB=FILE)"
	case $deb in
	"$repo"/bin/*) ;;
	*) die "MPIPAUSE_CRIG_DEB: $deb is not in $repo/bin/, which is all the nodes see" ;;
	esac
	[ -x "$repo/bin/apps/xchg.openmpi" ] || die "no $repo/bin/apps: make build"
	[ -x "$repo/bin/mpid" ] || die "no $repo/bin/mpid: make build"
	cmd_image
	say "up $n nodes (rig $name, $work)"
	mkdir -p "$work/src/vagrant/.secrets"
	echo "$n" >"$work/nodes"
	# What the Vagrantfile's trigger makes on the host for provision.sh: the
	# cluster key (mpid keygen) and root's ssh key, the same on every node.
	"$repo/bin/mpid" keygen "$work/src/vagrant/.secrets/cluster.key" >/dev/null
	ssh-keygen -q -t ed25519 -N '' -C "crig-$name" -f "$work/src/vagrant/.secrets/id_rsa"
	cp "$repo/vagrant/provision.sh" "$work/src/vagrant/"
	ip netns add "$netns"
	ip -n "$netns" link set lo up
	ip -n "$netns" link add br0 type bridge
	ip -n "$netns" link set br0 up
	for ((k = 0; k < n; k++)); do start_node "$k"; done
	for ((k = 0; k < n; k++)); do
		find_leader "$k"
		net_node "$k"
	done
	for ((k = 0; k < n; k++)); do
		local state
		state=$(node_do "$k" timeout 120 systemctl is-system-running --wait 2>&1) || {
			node_do "$k" systemctl --failed --no-pager >&2 || true
			die "node$k: systemd is $state after its boot, want running"
		}
		cgroup_root "$k" >"$work/node$k/cgroot"
		mkdir -p "$cgroup2$(cat "$work/node$k/cgroot")/crig-exec"
	done
	say "$n nodes booted: systemd $(node_do 0 systemctl --version | awk 'NR == 1 { print $2 }') as PID 1 on cgroup v2"
	local steps=(env MPIPAUSE_PROVISION_SRC=/mnt/crig MPIPAUSE_MPI_USER=root bash /mnt/crig/vagrant/provision.sh)
	for ((k = 0; k < n; k++)); do
		node_do "$k" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$deb" >"$work/node$k/install.log" 2>&1 ||
			{ tail "$work/node$k/install.log" >&2 && die "node$k: apt-get install $deb (above)"; }
		node_do "$k" "${steps[@]}" --steps hosts,key,mpi,ssh "$k" "$n" "$net" >>"$work/node$k/install.log" 2>&1 ||
			{ tail "$work/node$k/install.log" >&2 && die "node$k: provision.sh (above)"; }
		# The launchers run as root here.
		node_do "$k" sh -c 'printf "OMPI_ALLOW_RUN_AS_ROOT=1\nOMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n" >>/etc/environment'
	done
	say "$(basename "$deb") installed; hosts, key, mpi, ssh provisioned (vagrant/provision.sh)"
	for ((k = 0; k < n; k++)); do
		node_do "$k" "${steps[@]}" --steps mpid "$k" "$n" "$net" >>"$work/node$k/install.log" 2>&1 ||
			{ tail "$work/node$k/install.log" >&2 && die "node$k: provision.sh --steps mpid (above)"; }
	done
	say "mpid active in every node (its unit)"
	# Every node reaches every node by ssh (the launchers' tree spawn):
	# first contact takes the host keys.
	for ((k = 0; k < n; k++)); do
		local j
		for ((j = 0; j < n; j++)); do
			"$self" exec "node$k" -- ssh -o LogLevel=ERROR "node$j" true || die "node$k: ssh node$j fails"
		done
	done
	say "up: $n nodes in $((SECONDS - t0)) s"
}

cmd_exec() {
	need_root
	if [ $# -lt 3 ] || [ "$2" != -- ]; then
		usage
	fi
	local k l root
	k=$(node_index "$1")
	shift 2
	l=$(leader "$k")
	root=$(cat "$work/node$k/cgroot")
	# Into the node's cgroup tree first (from the host's side: nothing in
	# the node may move a process from outside its cgroup namespace), then
	# into a scope of the node's systemd, as a login or a unit would be.
	echo $$ >"$cgroup2$root/crig-exec/cgroup.procs"
	exec nsenter -t "$l" -a -r -w -- "${node_env[@]}" /bin/sh -c "$login_sh" sh \
		systemd-run --scope --quiet --collect -- "$@"
}

# cmd_slurm: munge with one key for every node, slurmctld on node0, slurmd
# on every node, Slurm's cgroup setup (ProctrackType=proctrack/cgroup,
# TaskPlugin=task/cgroup,task/affinity, CgroupPlugin=cgroup/v2,
# ConstrainCores, ConstrainRAMSpace); then srun -N<N> hostname must name
# every node. Debian 12's Slurm 22.05. --no-cgroup: proctrack/linuxproc,
# task/affinity and jobacct_gather/linux instead, no cgroup plugin at all.
cmd_slurm() {
	need_root
	local n k t0=$SECONDS s=$work/src/slurm hw want got
	local cgplugin=cgroup/v2 plugins='ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
JobAcctGatherType=jobacct_gather/cgroup'
	case ${1:-} in
	"") ;;
	--no-cgroup) cgplugin=cgroup/v1 plugins='ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/linux' ;;
	*) usage ;;
	esac
	n=$(nodes)
	[ "$n" -ge 1 ] || die "slurm: rig $name is not up"
	mkdir -p "$s"
	[ -f "$s/munge.key" ] || dd if=/dev/urandom of="$s/munge.key" bs=1024 count=1 status=none
	# The nodes' hardware as slurmd sees it (the same in every node).
	hw=$(node_do 0 slurmd -C | sed -n 's/^NodeName=[^ ]* //p' | sed 's/ *UpTime=.*//')
	[ -n "$hw" ] || die "slurm: slurmd -C in node0 printed no node line"
	cat >"$s/slurm.conf" <<EOF
# crig.sh slurm: rig $name, nodes node0..node$((n - 1))
ClusterName=crig
SlurmctldHost=node0
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
$plugins
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
NodeName=node[0-$((n - 1))] $hw State=UNKNOWN
PartitionName=crig Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
	cat >"$s/cgroup.conf" <<EOF
CgroupPlugin=$cgplugin
ConstrainCores=yes
ConstrainRAMSpace=yes
EOF
	for ((k = 0; k < n; k++)); do
		node_do "$k" sh -c 'install -m 0400 -o munge -g munge /mnt/crig/slurm/munge.key /etc/munge/munge.key &&
			install -m 0644 /mnt/crig/slurm/slurm.conf /mnt/crig/slurm/cgroup.conf /etc/slurm/ &&
			systemctl enable -q munge && systemctl restart munge' || die "slurm: node$k: munge"
	done
	node_do 0 sh -c 'systemctl enable -q slurmctld && systemctl restart slurmctld' || {
		node_do 0 journalctl -u slurmctld --no-pager -n 20 >&2
		die "slurm: slurmctld does not start in node0 (above)"
	}
	for ((k = 0; k < n; k++)); do
		node_do "$k" sh -c 'systemctl enable -q slurmd && systemctl restart slurmd' || {
			node_do "$k" journalctl -u slurmd --no-pager -n 30 >&2
			die "slurm: slurmd does not start in node$k (above)"
		}
	done
	# slurmd is Type=simple: a refusal of its cgroup plugin shows only as
	# its exit, just after the start.
	sleep 2
	for ((k = 0; k < n; k++)); do
		if ! node_do "$k" systemctl is-active -q slurmd; then
			node_do "$k" journalctl -u slurmd --no-pager -o cat -n 15 >&2
			die "slurm: slurmd exited in node$k (above)"
		fi
	done
	say "slurm: munge, slurmctld (node0), slurmd (node0..node$((n - 1))) running"
	local idle=0
	for _ in $(seq 60); do
		idle=$(node_do 0 sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$' || true)
		[ "$idle" -lt "$n" ] || break
		sleep 0.5
	done
	if [ "$idle" -lt "$n" ]; then
		node_do 0 sinfo -N -l >&2 || true
		die "slurm: $idle of $n nodes idle after 30 s (above)"
	fi
	want=$(for ((k = 0; k < n; k++)); do echo "node$k"; done)
	got=$(node_do 0 timeout 60 srun -N"$n" hostname 2>&1 | sort) || die "slurm: srun -N$n hostname: $got"
	[ "$got" = "$want" ] || die "slurm: srun -N$n hostname printed '$got', want node0..node$((n - 1))"
	say "slurm: srun -N$n hostname ran on node0..node$((n - 1)) in $((SECONDS - t0)) s"
}

cmd_status() {
	local n k l d state mpid addr
	n=$(nodes)
	if [ "$n" = 0 ]; then
		echo "rig $name: down"
		ip netns list | grep -q "^$netns\b" && echo "  (netns $netns is left: crig.sh down)"
		[ ! -d "$cgdir" ] || echo "  (cgroup $cgdir is left: crig.sh down)"
		return 0
	fi
	echo "rig $name: $n nodes, $work, bridge br0 in netns $netns, $net.0/24"
	for ((k = 0; k < n; k++)); do
		d=$work/node$k
		l=$(cat "$d/leader" 2>/dev/null || true)
		if ! alive "$l" systemd; then
			echo "node$k: DOWN (systemd-nspawn $(cat "$d/pid" 2>/dev/null))"
			continue
		fi
		state=$(node_do "$k" systemctl is-system-running 2>&1 || true)
		mpid=$(node_do "$k" systemctl is-active mpid 2>&1 || true)
		addr=$(nsenter -t "$l" -n ip -o -4 addr show dev eth0 2>/dev/null | awk '{ print $4 }')
		echo "node$k: systemd $state (pid $l), eth0 $addr, mpid $mpid, $(find "$cgdir/node$k" -name cgroup.procs -exec cat {} + | wc -l) processes"
	done
}

cmd_down() {
	need_root
	local d p k left=0
	# Each node's systemd-nspawn: SIGTERM is an orderly poweroff of its
	# container (SIGRTMIN+3 to its systemd).
	for d in "$work"/node*; do
		[ -d "$d" ] || continue
		p=$(cat "$d/pid" 2>/dev/null || true)
		! alive "$p" systemd-nspawn || kill -TERM "$p"
	done
	for d in "$work"/node*; do
		[ -d "$d" ] || continue
		p=$(cat "$d/pid" 2>/dev/null || true)
		for _ in $(seq 150); do
			alive "$p" systemd-nspawn || break
			sleep 0.1
		done
	done
	# Whatever is left (a node that did not power off, a command exec left
	# running) dies with the rig's cgroups; the nodes' mount namespaces,
	# and so their overlays and bpffs, go with their last process.
	if [ -n "$cgroup2" ] && [ -d "$cgdir" ]; then
		find "$cgdir" -name cgroup.kill -exec sh -c 'for f; do echo 1 >"$f"; done' sh {} + 2>/dev/null || true
		for _ in $(seq 100); do
			find "$cgdir" -depth -type d -exec rmdir {} + 2>/dev/null || true
			[ -d "$cgdir" ] || break
			sleep 0.1
		done
		[ ! -d "$cgdir" ] || {
			echo "crig: $cgdir is still there" >&2
			left=1
		}
		rmdir "$cgroup2/mpipause-crig" 2>/dev/null || true
	fi
	! ip netns list | grep -q "^$netns\b" || ip netns del "$netns"
	if [ -d "$work" ]; then
		if grep -q " $work/" /proc/mounts || [ "$left" = 1 ]; then
			die "down: $work still in use; not removing it"
		fi
		rm -rf "$work"
		rmdir /var/tmp/mpipause-crig 2>/dev/null || true
	fi
	[ "$left" = 0 ] || exit 1
	echo "crig: rig $name is down"
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case $cmd in
up) cmd_up "$@" ;;
exec) cmd_exec "$@" ;;
status) cmd_status ;;
down) cmd_down ;;
image) cmd_image ;;
slurm) cmd_slurm "$@" ;;
*) usage ;;
esac

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-vagrant-boot: the Vagrant cluster, real VMs under
# vagrant-libvirt from the box vagrant/build-box.sh makes here: `vagrant up`
# of node0..node{N-1} (provisioned from vagrant/.prebuilt unless
# --no-provision), each node's kernel, BTF, cgroup v2, private address and
# mpid seen over `vagrant ssh`, then the cluster e2e on them (vagrant/e2e.sh:
# Open MPI and MPICH jobs paused, every VM's connections read from its own
# kernel at each pause), then `vagrant destroy -f`, and nothing of it left:
# no domain, network, volume, storage pool or QEMU process it made, and
# libvirt's daemons stopped if this started them (vagrant/libvirt-host.sh).
# Prints how long each step took and the QEMU processes' peak RSS.
#
#   boot-check.sh [--suite SUITE] [--nodes N] [--no-e2e] [--degraded PROGRAMS] [--slurm | --slurm-suspends] [--sbatch | --sbatch-too] [--hold FILE] [--no-provision] [-- E2E-OPTIONS]
#
# --suite SUITE (default bookworm): the box of vagrant/build-box.sh --suite
# SUITE (bullseye, bookworm, bookworm-stock, trixie), provisioned from
# vagrant/.prebuilt made for that Debian release (make vagrant-prebuilt for
# bookworm's; vagrant/matrix.sh for the others): its own .deb and test apps.
# --nodes N (default 3): the cluster's size; 1 boots node0 alone (no e2e).
# --slurm: then Slurm on the VMs (vagrant provision --provision-with slurm:
# cgroup confinement, the SPANK plugin) and vagrant/slurm-e2e.sh on node0,
# then vagrant/scope-e2e.sh (a job in a systemd scope with MemoryMax).
# --slurm-suspends: Slurm on the VMs too, but of its e2e the scontrol
# suspends alone (slurm-e2e.sh --only suspend: each library paused cleanly
# once, resumed, its result checked), no scope e2e (make test's VM tier).
# --sbatch (with --slurm): instead of those two, slurm-e2e.sh --only sbatch
# (mpirun and mpiexec inside sbatch scripts, suspended and resumed);
# --sbatch-too: that after them.
# --hold FILE: once everything asked for is provisioned (Slurm too, with
# --slurm), write to FILE the environment that reaches the VMs
# (VAGRANT_DOTFILE_PATH and the rest, for `vagrant ssh` from vagrant/) and
# wait while FILE exists, instead of running the e2e that would come next
# (the cluster e2e; with --slurm, the Slurm and scope e2e): a quicker way to
# iterate on an e2e (vagrant rsync, then vagrant ssh node0 -c 'bash
# /vagrant/vagrant/slurm-e2e.sh ...'). Remove FILE to go on to the destroy.
# --degraded PROGRAMS: after the cluster e2e, the same again with every
# node's mpid refusing those BPF programs as an older kernel would
# (MPIPAUSE_BPF_REFUSE in a drop-in, removed after), and both runs' pause
# times from node0's mpid: the degraded observer against the full one on
# the same VMs.
# --no-provision boots the box as it is (no mpid, so no e2e).
# E2E-OPTIONS go to scripts/cluster-e2e.sh (default --pauses 2).
#
# Its VMs are named mpipause-check-nodeK (MPIPAUSE_VM_PREFIX) and its
# Vagrant state is a temporary directory, so a cluster of vagrant/ that is
# up is not touched, but the private network's range (192.168.56.0/24) is
# one for both. One check runs at a time (a lock); a check killed before its
# clean-up leaves its VMs defined, and the next one takes them away first
# (reclaim). Fails, never skips; a guest panic that is the emulator's
# (emulator_panic) runs the whole check once more on fresh VMs, saying so.
# docs/vagrant.md, "The box".
set -euo pipefail
SECONDS=0
cd "$(dirname "$0")"
here=$PWD
args=("$@")

usage() {
	echo "usage: boot-check.sh [--suite SUITE] [--nodes N] [--no-e2e] [--degraded PROGRAMS] [--slurm | --slurm-suspends] [--sbatch | --sbatch-too] [--hold FILE] [--no-provision] [-- E2E-OPTIONS]" >&2
	exit 2
}
provision=1 e2e=1 slurm=0 slurm_only="" sbatch=0 nodes=3 e2e_args=(--pauses 2) hold="" suite=bookworm degraded=""
while [ $# -gt 0 ]; do
	case $1 in
	--slurm) slurm=1 && shift ;;
	--slurm-suspends) slurm=1 slurm_only=suspend && shift ;;
	--sbatch) sbatch=1 && shift ;;
	--sbatch-too) sbatch=2 && shift ;;
	--suite)
		[ $# -ge 2 ] || usage
		suite=$2
		shift 2
		;;
	--degraded)
		{ [ $# -ge 2 ] && [[ $2 =~ ^[a-z_]+(,[a-z_]+)*$ ]]; } || usage
		degraded=$2
		shift 2
		;;
	--no-provision) provision=0 e2e=0 && shift ;;
	--no-e2e) e2e=0 && shift ;;
	--hold)
		[ $# -ge 2 ] || usage
		hold=$2
		shift 2
		;;
	--nodes)
		{ [ $# -ge 2 ] && [[ $2 =~ ^[1-9]$ ]]; } || usage
		nodes=$2
		shift 2
		;;
	--) shift && e2e_args=("$@") && break ;;
	*) usage ;;
	esac
done
[ "$nodes" -ge 2 ] || e2e=0
[ $provision = 1 ] || [ $slurm = 0 ] || usage
[ -z "$hold" ] || [ $provision = 1 ] || usage
[ $sbatch = 0 ] || { [ $slurm = 1 ] && [ -z "$slurm_only" ]; } || usage

say() { echo "check-vagrant-boot: [${SECONDS}s] $*"; }
# why: the failure's reason, said again as the check's last lines (a CI log
# that keeps only its tail keeps it, after the consoles and the clean-up).
why=
# fail_code: the check's exit code when it fails; 75 (EX_TEMPFAIL) marks
# a failure that is the emulator's (emulator_panic), which the check runs
# once more on fresh VMs.
fail_code=1
fail() {
	why=$*
	echo "check-vagrant-boot: FAIL: $*" >&2
	exit $fail_code
}
[ "$(id -u)" = 0 ] || fail "needs root (libvirt's system daemon, the box build)"
for t in vagrant virsh qemu-system-x86_64; do
	command -v "$t" >/dev/null || fail "$t is missing: run make deps"
done
vagrant plugin list 2>/dev/null | grep -q vagrant-libvirt || fail "no vagrant-libvirt plugin: run make deps"
# The Debian release whose packages the suite's box has, and so whose
# .deb and test apps vagrant/.prebuilt must hold.
release=${suite%-stock}
if [ $provision = 1 ]; then
	compgen -G ".prebuilt/mpipause_*.deb" >/dev/null ||
		fail "no vagrant/.prebuilt/mpipause_*.deb: run make vagrant-prebuilt (or --no-provision)"
	built_for=$(cat .prebuilt/release 2>/dev/null) || fail "vagrant/.prebuilt says for no Debian release (no .prebuilt/release): run make vagrant-prebuilt"
	[ "$built_for" = "$release" ] ||
		fail "vagrant/.prebuilt was made for Debian $built_for, the $suite box is $release: vagrant/matrix.sh --suites $suite makes it (make vagrant-prebuilt for bookworm)"
fi

prefix=mpipause-check-
uri=qemu:///system
# One check at a time: checks name their VMs alike and share the private
# network. While a check's VMs may exist, the lock file names its work
# directory; a name there with the lock free is a check that was killed
# before its clean-up, and reclaim takes away what it left.
lockfile=/var/tmp/mpipause-vagrant-boot.lock
exec 9>>"$lockfile"
flock -n 9 || fail "another check-vagrant-boot is running (it holds $lockfile); its VMs would have this one's names: wait for it to end"
work=$(mktemp -d /var/tmp/mpipause-vagrant-boot.XXXXXX)
export VAGRANT_DOTFILE_PATH=$work/dot VAGRANT_CHECKPOINT_DISABLE=1 MPIPAUSE_VM_NODES=$nodes MPIPAUSE_VM_PREFIX=$prefix
# Slurm's daemons, slurmdbd and MariaDB on node0 need more than mpid's
# 768 MiB; the Slurm e2e's job asks 400 MiB a node, the preempting one 256.
[ $slurm = 0 ] || export MPIPAUSE_VM_MEMORY=${MPIPAUSE_VM_MEMORY:-1024}
log=$work/vagrant.log
# Each VM's serial console, shown when the check fails (a VM that stops
# answering says why there, if anywhere). QEMU writes it as libvirt's
# QEMU user where there is one.
export MPIPAUSE_VM_CONSOLE_DIR=$work/console
mkdir "$MPIPAUSE_VM_CONSOLE_DIR"
if id -u libvirt-qemu >/dev/null 2>&1; then
	chmod 0711 "$work"
	chown libvirt-qemu "$MPIPAUSE_VM_CONSOLE_DIR"
fi
ours_libvirtd=0
up=0        # vagrant up was started
destroyed=0 # vagrant destroy was run
ok=0        # every step passed

virsh_names() { { virsh -c "$uri" "$@" --name 2>/dev/null || true; } | sed 's/[[:space:]]*$//; /^$/d' | sort; }
# pool_vols: the volumes of the pool vagrant-libvirt uses (none without it).
pool_vols() { { virsh -c "$uri" vol-list default 2>/dev/null || true; } | awk 'NR > 2 && NF { print $1 }' | sort; }
# vagrant_run ARGS: vagrant, its output to the log without its progress
# bars, each line with the check's seconds (where a slow boot spends them).
vagrant_run() {
	echo "+ vagrant $*" >>"$log"
	vagrant "$@" --no-tty 2>&1 | stdbuf -oL tr '\r' '\n' | while IFS= read -r line; do
		case $line in *'Progress: '*) ;; *) printf '[%ss] %s\n' "$SECONDS" "$line" ;; esac
	done >>"$log"
}

# consoles: the last lines of each VM's console, control characters
# dropped.
consoles() {
	local f
	for f in "$MPIPAUSE_VM_CONSOLE_DIR"/*.log; do
		[ -s "$f" ] || continue
		echo "check-vagrant-boot: the last lines of $(basename "$f" .log)'s console ($f):" >&2
		tail -n 25 "$f" | sed -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' | tr -d '\r' | tr -c '[:print:]\n' '?' | sed 's/^/    /' >&2
	done
}

# reclaim: what a killed check left, taken away before this one looks at
# what is there: its domains (only a check names them $prefix*, and the
# lock says none runs) with their disks, and, by its own lists of what
# was there before it, the networks no domain uses, the box's volume it
# uploaded and the storage pool it made.
reclaim() {
	local old d n v gone=()
	old=$(cat "$lockfile")
	for d in $(virsh_names list --all | grep "^$prefix" || true); do
		virsh -c "$uri" destroy "$d" >/dev/null 2>&1 || true
		virsh -c "$uri" undefine "$d" --remove-all-storage >/dev/null || fail "could not undefine $d, a killed check's domain: virsh -c $uri undefine $d --remove-all-storage"
		gone+=("domain $d")
	done
	if [ -n "$old" ] && [ -s "$old/nets.before" ]; then
		for n in $(comm -13 "$old/nets.before" <(virsh_names net-list --all)); do
			for d in $(virsh_names list --all); do
				virsh -c "$uri" domiflist "$d" 2>/dev/null | awk '{ print $3 }' | grep -qx "$n" && continue 2
			done
			virsh -c "$uri" net-destroy "$n" >/dev/null 2>&1 || true
			virsh -c "$uri" net-undefine "$n" >/dev/null || fail "could not undefine network $n, a killed check's"
			gone+=("network $n")
		done
		for v in $(comm -13 "$old/vols.before" <(pool_vols)); do
			case $v in "$box_vol"*)
				virsh -c "$uri" vol-delete "$v" --pool default >/dev/null || fail "could not delete volume $v, a killed check's"
				gone+=("volume $v")
				;;
			esac
		done
		if ! grep -qx default "$old/pools.before" && [ -z "$(pool_vols)" ] &&
			virsh_names pool-list --all | grep -qx default; then
			virsh -c "$uri" pool-destroy default >/dev/null 2>&1 || true
			virsh -c "$uri" pool-undefine default >/dev/null || fail "could not undefine storage pool default, a killed check's"
			gone+=("pool default")
		fi
	fi
	[ -z "$old" ] || rm -rf "$old"
	: >"$lockfile"
	[ ${#gone[@]} = 0 ] || say "a killed check left these, taken away: ${gone[*]}"
}

cleanup() {
	local rc=$? left=() v p
	[ $rc = 0 ] || consoles
	if [ $up = 1 ] && [ $destroyed = 0 ] && ! vagrant_run destroy -f; then
		echo "check-vagrant-boot: vagrant destroy failed (its log: $log)" >&2
		rc=1
	fi
	if [ $up = 1 ]; then
		# The box's volume stays in the pool for the next `vagrant up`;
		# this check takes away the one it uploaded, and the pool if
		# vagrant-libvirt made it.
		for v in $(comm -13 "$work/vols.before" <(pool_vols)); do
			case $v in "$box_vol"*) virsh -c "$uri" vol-delete "$v" --pool default >/dev/null || rc=1 ;; esac
		done
		if ! grep -qx default "$work/pools.before" && [ -z "$(pool_vols)" ] &&
			virsh_names pool-list --all | grep -qx default; then
			virsh -c "$uri" pool-destroy default >/dev/null 2>&1 || true
			virsh -c "$uri" pool-undefine default >/dev/null || rc=1
		fi
		mapfile -t left < <(
			comm -13 "$work/domains.before" <(virsh_names list --all) | sed 's/^/domain /'
			comm -13 "$work/nets.before" <(virsh_names net-list --all) | sed 's/^/network /'
			comm -13 "$work/vols.before" <(pool_vols) | sed 's/^/volume /'
			comm -13 "$work/pools.before" <(virsh_names pool-list --all) | sed 's/^/pool /'
			for p in $(pgrep -f "qemu-system.*guest=$prefix" || true); do echo "qemu process $p"; done
		)
		if [ ${#left[@]} -gt 0 ]; then
			echo "check-vagrant-boot: left behind: ${left[*]}" >&2
			rc=1
		else
			say "nothing left: no domain, network, volume, pool or QEMU process of this check"
			: >"$lockfile"
		fi
	fi
	if [ $ours_libvirtd = 1 ]; then
		"$here/libvirt-host.sh" stop || rc=1
	fi
	if [ $rc = 0 ]; then
		rm -rf "$work"
		[ $ok = 0 ] || say "ok"
	else
		echo "check-vagrant-boot: Vagrant's log: $log" >&2
		if [ -s "$work/stream.tail" ]; then
			echo "check-vagrant-boot: the last lines of the step that failed:" >&2
			cat "$work/stream.tail" >&2
		fi
		[ -z "$why" ] || echo "check-vagrant-boot: FAIL: $why" >&2
	fi
	if [ $rc = 75 ] && [ -z "${MPIPAUSE_BOOT_AGAIN:-}" ]; then
		say "the failure above is the emulator's, not mpipause's: the whole check once more, on fresh VMs"
		MPIPAUSE_BOOT_AGAIN=1 exec bash "$here/boot-check.sh" "${args[@]}"
	fi
	exit $rc
}
trap cleanup EXIT
trap 'echo "check-vagrant-boot: FAIL: line $LINENO: $BASH_COMMAND" >&2' ERR

say "box ($suite)"
"$here/build-box.sh" --suite "$suite"
box_file=$("$here/build-box.sh" --suite "$suite" --print-path)
box_file=$(basename "$box_file" .box)
export MPIPAUSE_VM_BOX=mpipause/${box_file#mpipause-}
# The volume vagrant-libvirt uploads the box to (/ is VAGRANTSLASH).
box_vol=mpipause-VAGRANTSLASH-${box_file#mpipause-}_vagrant_box_image_
if ! virsh -c "$uri" version >/dev/null 2>&1; then
	ours_libvirtd=1
fi
# Not the lock: daemons it starts may outlive a killed check, and would
# hold it for good.
"$here/libvirt-host.sh" start 9>&-
driver=$(cat "$here/.libvirt-driver")
reclaim
virsh_names list --all >"$work/domains.before"
virsh_names net-list --all >"$work/nets.before"
virsh_names pool-list --all >"$work/pools.before"
pool_vols >"$work/vols.before"

# preload_box: the box's volume in the storage pool before `vagrant up`.
# vagrant-libvirt uploads a box it does not find there through libvirt's
# stream in 250 KiB writes from Ruby: four minutes for this box here, and
# virsh's upload of the same file takes a second. The volume's name and
# size are the ones vagrant-libvirt looks for (a box added without a
# version: version 0 and the image's mtime); if it looks for another
# name, it uploads as before, and the step list below says so.
preload_box() {
	local img t=$SECONDS gb name
	img=${VAGRANT_HOME:-$HOME/.vagrant.d}/boxes/${MPIPAUSE_VM_BOX//\//-VAGRANTSLASH-}/0/libvirt/box.img
	[ -r "$img" ] || return 0
	name=${box_vol}0_$(stat -c %Y "$img")_box.img
	if ! virsh_names pool-list --all | grep -qx default; then
		if ! virsh -c "$uri" pool-define-as default dir --target /var/lib/libvirt/images >/dev/null ||
			! virsh -c "$uri" pool-build default >/dev/null; then
			fail "could not make libvirt's storage pool default"
		fi
	fi
	if ! virsh_names pool-list | grep -qx default; then
		virsh -c "$uri" pool-start default >/dev/null || fail "could not start libvirt's storage pool default"
	fi
	pool_vols | grep -qxF "$name" && return 0
	gb=$(grep -o '"virtual_size": *[0-9]*' "$(dirname "$img")/metadata.json" | grep -o '[0-9]*$') ||
		fail "$(dirname "$img")/metadata.json: no virtual_size"
	if ! virsh -c "$uri" vol-create-as default "$name" "${gb}G" --format qcow2 >/dev/null ||
		! virsh -c "$uri" vol-upload --pool default "$name" "$img"; then
		fail "could not upload $img to libvirt's storage pool default as $name"
	fi
	say "the box's volume $name uploaded in $((SECONDS - t)) s"
}

all=()
for ((k = 0; k < nodes; k++)); do all+=("node$k"); done
echo "$work" >"$lockfile"
up=1
preload_box
say "vagrant up ${all[*]} (driver $driver$([ $provision = 1 ] || echo ', no provisioning'))"
t=$SECONDS
flags=()
[ $provision = 1 ] || flags=(--no-provision)
vagrant_run up "${all[@]}" --provider=libvirt "${flags[@]}" || {
	tail -30 "$log" >&2
	fail "vagrant up (above)"
}
say "vagrant up took $((SECONDS - t)) s; its steps began at:"
grep -E 'Uploading base box|Starting domain|Waiting for domain to get an IP|Waiting for machine to boot|Machine booted and ready|Setting hostname|Rsyncing folder|Configuring and enabling|Running provisioner|provision node[0-9]: mpid' "$log" |
	sed 's/^/    /'
if grep -q 'Uploading base box' "$log"; then
	say "vagrant-libvirt uploaded the box itself: preload_box's volume name is not the one it looks for"
fi

# check_node K: what node K shows over `vagrant ssh`: a kernel of 5.10 or
# later with BTF, cgroup v2, its private address, and (provisioned) mpid.
check_node() {
	local k=$1 n=node$1 out lines release major minor
	t=$SECONDS
	out=$(vagrant ssh "$n" --no-tty -c 'uname -r; cat /sys/kernel/btf/vmlinux | wc -c; stat -fc %T /sys/fs/cgroup; ip -4 -o addr show to 192.168.56.0/24; hostname' 2>>"$log" | tr -d '\r') ||
		fail "vagrant ssh $n: $out"
	mapfile -t lines <<<"$out"
	say "vagrant ssh $n took $((SECONDS - t)) s:"
	printf '    %s\n' "${lines[@]}"
	release=${lines[0]:-}
	major=${release%%.*} minor=${release#*.} && minor=${minor%%.*}
	[[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] || fail "no kernel release from uname -r on $n: '$release'"
	if [ "$major" -lt 5 ] || { [ "$major" -eq 5 ] && [ "$minor" -lt 10 ]; }; then
		fail "$n runs $release; mpipause needs 5.10 or later"
	fi
	[[ ${lines[1]:-} =~ ^[0-9]+$ && ${lines[1]} -gt 0 ]] || fail "$n has no BTF (/sys/kernel/btf/vmlinux: '${lines[1]:-}')"
	[ "${lines[2]:-}" = cgroup2fs ] || fail "$n's /sys/fs/cgroup is '${lines[2]:-}', want cgroup2fs"
	[[ ${lines[3]:-} == *" 192.168.56.$((10 + k))/24 "* ]] || fail "$n has no 192.168.56.$((10 + k))/24 on the private network: '${lines[3]:-}'"
	if [ $provision = 1 ]; then
		[ "${lines[4]:-}" = "$n" ] || fail "$n is named '${lines[4]:-}' (provision.sh's hosts step names it)"
		out=$(vagrant ssh "$n" --no-tty -c 'systemctl is-active mpid; sudo mpipause list >/dev/null && echo answers' 2>>"$log" | tr -d '\r') || true
		[ "$out" = $'active\nanswers' ] || fail "mpid on $n: '$out' (want active, and mpipause list answering)"
		say "mpid active on $n, mpipause list answers"
		mpid_check "$k" "provisioned"
	fi
}

# mpid_check K WHEN: mpid check's table on node K (kept in this check's
# output), which fails the check unless it finds the node ready (exit 0;
# degraded rows, what the VM's kernel or set-up allows, are ready and say
# so; 1 is something missing, 2 a usage error).
mpid_check() {
	local n=node$1 out rc
	out=$(vagrant ssh "$n" --no-tty -c 'sudo mpid check; echo "exit $?"' 2>>"$log" | tr -d '\r') || true
	rc=${out##*exit }
	say "mpid check on $n ($2): exit $rc"
	sed -e '$d' -e 's/^/    /' <<<"$out"
	[ "$rc" = 0 ] || fail "mpid check on $n ($2): not ready (above)"
}
for ((k = 0; k < nodes; k++)); do check_node "$k"; done

# panicked: the VMs whose console shows a kernel panic. Under software
# emulation a guest kernel has panicked (a #DB in kernel mode, EFLAGS
# garbage): the host's ssh to it then waits for hours with no output.
panicked() {
	{ grep -l 'Kernel panic' "$MPIPAUSE_VM_CONSOLE_DIR"/*.log 2>/dev/null || true; } | xargs -r -n1 basename | sed 's/\.log$//' | tr '\n' ' '
}

# emulator_panic VMS: the first register dump on those VMs' consoles whose
# EFLAGS has a bit set that no x86 CPU defines (22 and up), the signature
# of the guest panics software emulation (TCG) causes, whatever the guest
# ran; empty if none shows it. A panic with a sane EFLAGS is the guest's
# own and fails the check like any other failure.
emulator_panic() {
	local v f e _
	for v in $1; do
		f="$MPIPAUSE_VM_CONSOLE_DIR/$v.log"
		while read -r _ e; do
			if (((16#$e >> 22) != 0)); then
				echo "$v: EFLAGS $e"
				return
			fi
		done < <(grep -ao 'EFLAGS: [0-9a-f]\{8,16\}' "$f" 2>/dev/null || true)
	done
}

# kill_tree PID: PID and every process under it.
kill_tree() {
	local c
	for c in $(pgrep -P "$1" || true); do kill_tree "$c"; done
	kill "$1" 2>/dev/null || true
}

# streamed WHAT CMD...: CMD's lines as they come, with this check's seconds,
# so that a slow step shows (no tr in the pipe: it would hold them back in
# its buffer); the check fails if CMD does (with pipefail, the pipeline's
# status is CMD's), and at once if a VM's kernel panics (CMD's whole
# process tree killed).
streamed() {
	local what=$1 t=$SECONDS rc=0 pid dead sig
	shift
	{ "$@" 2>&1 | while IFS= read -r line; do
		printf '    [%ss] %s\n' "$SECONDS" "${line%$'\r'}"
	done | tee "$work/stream.out"; } &
	pid=$!
	while kill -0 "$pid" 2>/dev/null; do
		dead=$(panicked)
		if [ -n "$dead" ]; then
			kill_tree "$pid"
			wait "$pid" 2>/dev/null || true
			sig=$(emulator_panic "$dead")
			if [ -n "$sig" ] && [ -z "${MPIPAUSE_BOOT_AGAIN:-}" ]; then
				fail_code=75
				fail "$what: the kernel of ${dead% } panicked under software emulation ($sig: bits no x86 CPU sets; its console below)"
			fi
			fail "$what: the kernel of ${dead% } panicked (${sig:+$sig, under software emulation; }its console below)"
		fi
		sleep 2
	done
	wait "$pid" || rc=$?
	[ "$rc" = 0 ] || { tail -n 20 "$work/stream.out" >"$work/stream.tail"; fail "$what (exit $rc, above)"; }
	say "$what took $((SECONDS - t)) s"
}

# hold_vms WHAT: with --hold FILE, the environment for vagrant ssh in FILE,
# and a wait while FILE exists; WHAT is what does not run here then.
hold_vms() {
	printf 'cd %q && export VAGRANT_DOTFILE_PATH=%q VAGRANT_CHECKPOINT_DISABLE=1 MPIPAUSE_VM_NODES=%q MPIPAUSE_VM_PREFIX=%q MPIPAUSE_VM_BOX=%q%s\n' \
		"$here" "$VAGRANT_DOTFILE_PATH" "$nodes" "$prefix" "$MPIPAUSE_VM_BOX" "${MPIPAUSE_VM_MEMORY:+ MPIPAUSE_VM_MEMORY=$MPIPAUSE_VM_MEMORY}" >"$hold"
	say "holding the VMs while $hold exists (it holds the environment for vagrant ssh)"
	while [ -e "$hold" ]; do sleep 5; done
	say "$hold removed: no $1 here"
}

# What the matrix's table names of this cluster: the packages of node0.
# shellcheck disable=SC2016 # dpkg-query's ${Version}, on the node
out=$(vagrant ssh node0 --no-tty -c 'printf "kernel=%s " "$(uname -r)"; for p in openmpi-bin mpich slurmd mpipause; do printf "%s=%s " $p "$(dpkg-query -W -f="\${Version}" $p 2>/dev/null || echo none)"; done' 2>>"$log" | tr -d '\r') || true
say "versions on node0 ($suite): $out"

# pause_ms: the total_ms of each pause node0's mpid coordinated since it
# started, one a line.
pause_ms() {
	# shellcheck disable=SC2016 # node0's shell expands it
	vagrant ssh node0 --no-tty -c 'sudo journalctl -u mpid -o cat _PID=$(systemctl show -p MainPID --value mpid)' 2>>"$log" |
		tr -d '\r' | sed -n 's/.*msg=paused .*total_ms=\([0-9.]*\).*/\1/p'
}
# ms_summary: "N pauses, p50 X ms, max Y ms" of the figures on stdin.
ms_summary() { sort -n | awk '{ v[NR] = $1 } END { if (NR == 0) print "no pauses"; else printf "%d pauses, p50 %.0f ms, max %.0f ms", NR, v[int((NR + 1) / 2)], v[NR] }'; }
# refuse_on K LIST: node K's mpid restarted refusing LIST (none: as the
# kernel allows).
refuse_on() {
	local cmd='sudo rm -f /etc/systemd/system/mpid.service.d/refuse.conf'
	[ "$2" = none ] || cmd="sudo mkdir -p /etc/systemd/system/mpid.service.d && printf '[Service]\nEnvironment=MPIPAUSE_BPF_REFUSE=%s\n' $2 | sudo tee /etc/systemd/system/mpid.service.d/refuse.conf >/dev/null"
	vagrant ssh "node$1" --no-tty -c "$cmd && sudo systemctl daemon-reload && sudo systemctl restart mpid && until sudo mpipause list >/dev/null 2>&1; do sleep 0.2; done" >>"$log" 2>&1 ||
		fail "node$1: mpid not restarted with MPIPAUSE_BPF_REFUSE=$2 (its log: $log)"
	[ "$2" != none ] || return 0
	# What the running mpid says of its observer (mpid check probes in a
	# process of its own, without the unit's environment).
	local said
	# shellcheck disable=SC2016 # node K's shell expands it
	said=$(vagrant ssh "node$1" --no-tty -c 'sudo journalctl -u mpid -o cat _PID=$(systemctl show -p MainPID --value mpid) | grep -m1 "kernel observer degraded"' 2>>"$log" | tr -d '\r') ||
		fail "node$1: mpid restarted with MPIPAUSE_BPF_REFUSE=$2 logs no degraded observer"
	say "node$1's mpid: $said"
}
# degraded_run: the cluster e2e again with the observer degraded on every
# node, and each mode's pause times.
degraded_run() {
	local full deg k
	full=$(pause_ms | ms_summary)
	for ((k = 0; k < nodes; k++)); do refuse_on "$k" "$degraded"; done
	streamed "the cluster e2e on the VMs, the observer degraded ($degraded refused)" "$here/e2e.sh" --nodes "$nodes" "${e2e_args[@]}"
	deg=$(pause_ms | ms_summary)
	for ((k = 0; k < nodes; k++)); do refuse_on "$k" none; done
	say "pause times at node0, full observer: $full; degraded ($degraded refused): $deg"
}

if [ $e2e = 1 ] && [ -n "$hold" ] && [ $slurm = 0 ]; then
	hold_vms "cluster e2e"
elif [ $e2e = 1 ]; then
	say "the cluster e2e on ${all[*]}: vagrant/e2e.sh ${e2e_args[*]}"
	streamed "the cluster e2e on the VMs" "$here/e2e.sh" --nodes "$nodes" "${e2e_args[@]}"
	[ -z "$degraded" ] || degraded_run
fi

if [ $slurm = 1 ]; then
	t=$SECONDS
	# One Vagrant per node, at once: `vagrant provision` of several goes
	# one after the other (most of it is apt under emulation).
	pids=()
	for n in "${all[@]}"; do
		vagrant_run provision "$n" --provision-with slurm &
		pids+=($!)
	done
	for p in "${pids[@]}"; do
		wait "$p" || {
			tail -30 "$log" >&2
			fail "vagrant provision --provision-with slurm (above)"
		}
	done
	say "Slurm provisioned in $((SECONDS - t)) s:"
	grep 'provision-slurm node' "$log" | sed 's/^/    /'
	for ((k = 0; k < nodes; k++)); do mpid_check "$k" "with Slurm"; done
	if [ -n "$hold" ]; then
		hold_vms "Slurm e2e"
	elif [ "$slurm_only" = suspend ]; then
		streamed "the Slurm suspends on the VMs" vagrant ssh node0 --no-tty -c "bash /vagrant/vagrant/slurm-e2e.sh --nodes $nodes --only suspend"
	elif [ $sbatch = 1 ]; then
		streamed "the sbatch e2e on the VMs" vagrant ssh node0 --no-tty -c "bash /vagrant/vagrant/slurm-e2e.sh --nodes $nodes --only sbatch"
	else
		streamed "the Slurm e2e on the VMs" vagrant ssh node0 --no-tty -c "bash /vagrant/vagrant/slurm-e2e.sh --nodes $nodes"
		# The same citizenship for a job in a systemd scope of its own.
		streamed "the systemd scope e2e on node0" vagrant ssh node0 --no-tty -c "bash /vagrant/vagrant/scope-e2e.sh"
		[ $sbatch = 0 ] ||
			streamed "the sbatch e2e on the VMs" vagrant ssh node0 --no-tty -c "bash /vagrant/vagrant/slurm-e2e.sh --nodes $nodes --only sbatch"
	fi
fi

total=0
for ((k = 0; k < nodes; k++)); do
	qemu=$(pgrep -f "qemu-system.*guest=${prefix}node$k" | head -1) || fail "no QEMU process of ${prefix}node$k"
	hwm=$(awk '$1 == "VmHWM:" { print int($2 / 1024) }' "/proc/$qemu/status")
	total=$((total + hwm))
	say "QEMU of node$k (pid $qemu): peak RSS $hwm MiB, memory $(virsh -c "$uri" dominfo "${prefix}node$k" | awk '$1 == "Max" { print int($3 / 1024) }') MiB, driver $driver"
done
say "QEMU peak RSS, the $nodes summed: $total MiB"

t=$SECONDS
destroyed=1
vagrant_run destroy -f || fail "vagrant destroy (its log: $log)"
say "vagrant destroy took $((SECONDS - t)) s"
ok=1
# cleanup (the EXIT trap) checks that nothing is left and stops the daemons.

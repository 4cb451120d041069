#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make check-vagrant-boot: one node of the Vagrant cluster (node0), a real
# VM under vagrant-libvirt, from the box vagrant/build-box.sh makes here:
# `vagrant up` (provisioned from vagrant/.prebuilt unless --no-provision),
# the kernel, BTF and cgroup v2 seen over `vagrant ssh`, the private
# network's address, then `vagrant destroy -f`, and nothing of it left:
# no domain, network, volume, storage pool or QEMU process it made, and
# libvirt's daemons stopped if this started them (vagrant/libvirt-host.sh).
# Prints how long each step took and the QEMU process's peak RSS.
#
#   boot-check.sh [--no-provision]
#
# Its VMs are named mpipause-check-node0 (MPIPAUSE_VM_PREFIX) and its
# Vagrant state is a temporary directory, so a cluster of vagrant/ that is
# up is not touched, but the private network's range (192.168.56.0/24) is
# one for both. Fails, never skips. docs/vagrant.md, "The box".
set -euo pipefail
SECONDS=0
cd "$(dirname "$0")"
here=$PWD

provision=1
case ${1:-} in
--no-provision) provision=0 ;;
"") ;;
*)
	echo "usage: boot-check.sh [--no-provision]" >&2
	exit 2
	;;
esac

say() { echo "check-vagrant-boot: [${SECONDS}s] $*"; }
fail() {
	echo "check-vagrant-boot: FAIL: $*" >&2
	exit 1
}
[ "$(id -u)" = 0 ] || fail "needs root (libvirt's system daemon, the box build)"
for t in vagrant virsh qemu-system-x86_64; do
	command -v "$t" >/dev/null || fail "$t is missing: run make deps"
done
vagrant plugin list 2>/dev/null | grep -q vagrant-libvirt || fail "no vagrant-libvirt plugin: run make deps"
if [ $provision = 1 ] && ! compgen -G ".prebuilt/mpipause_*.deb" >/dev/null; then
	fail "no vagrant/.prebuilt/mpipause_*.deb: run make vagrant-prebuilt (or --no-provision)"
fi

prefix=mpipause-check-
uri=qemu:///system
box_vol=mpipause-VAGRANTSLASH-bookworm64-6.12_vagrant_box_image_
work=$(mktemp -d /var/tmp/mpipause-vagrant-boot.XXXXXX)
export VAGRANT_DOTFILE_PATH=$work/dot VAGRANT_CHECKPOINT_DISABLE=1 MPIPAUSE_VM_NODES=1 MPIPAUSE_VM_PREFIX=$prefix
log=$work/vagrant.log
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

cleanup() {
	local rc=$? left=() v p
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
	fi
	exit $rc
}
trap cleanup EXIT
trap 'echo "check-vagrant-boot: FAIL: line $LINENO: $BASH_COMMAND" >&2' ERR

say "box"
"$here/build-box.sh"
if ! virsh -c "$uri" version >/dev/null 2>&1; then
	ours_libvirtd=1
fi
"$here/libvirt-host.sh" start
driver=$(cat "$here/.libvirt-driver")
virsh_names list --all >"$work/domains.before"
virsh_names net-list --all >"$work/nets.before"
virsh_names pool-list --all >"$work/pools.before"
pool_vols >"$work/vols.before"
if grep -q "^$prefix" "$work/domains.before"; then
	fail "a domain named $prefix* exists already (an earlier check's?): $(grep "^$prefix" "$work/domains.before" | tr '\n' ' ')"
fi

say "vagrant up node0 (driver $driver$([ $provision = 1 ] || echo ', no provisioning'))"
up=1
t=$SECONDS
flags=()
[ $provision = 1 ] || flags=(--no-provision)
vagrant_run up node0 --provider=libvirt "${flags[@]}" || {
	tail -30 "$log" >&2
	fail "vagrant up (above)"
}
say "vagrant up took $((SECONDS - t)) s; its steps began at:"
grep -E 'Uploading base box|Starting domain|Waiting for domain to get an IP|Waiting for machine to boot|Machine booted and ready|Setting hostname|Rsyncing folder|Configuring and enabling|Running provisioner|provision node0: mpid' "$log" |
	sed 's/^/    /'

t=$SECONDS
out=$(vagrant ssh node0 --no-tty -c 'uname -r; cat /sys/kernel/btf/vmlinux | wc -c; stat -fc %T /sys/fs/cgroup; ip -4 -o addr show to 192.168.56.0/24' 2>>"$log" | tr -d '\r') ||
	fail "vagrant ssh node0: $out"
mapfile -t lines <<<"$out"
say "vagrant ssh node0 took $((SECONDS - t)) s:"
printf '    %s\n' "${lines[@]}"
release=${lines[0]:-}
major=${release%%.*} minor=${release#*.} && minor=${minor%%.*}
[[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] || fail "no kernel release from uname -r: '$release'"
if [ "$major" -lt 6 ] || { [ "$major" -eq 6 ] && [ "$minor" -lt 3 ]; }; then
	fail "node0 runs $release; mpipause needs 6.3 or later"
fi
[[ ${lines[1]:-} =~ ^[0-9]+$ && ${lines[1]} -gt 0 ]] || fail "node0 has no BTF (/sys/kernel/btf/vmlinux: '${lines[1]:-}')"
[ "${lines[2]:-}" = cgroup2fs ] || fail "node0's /sys/fs/cgroup is '${lines[2]:-}', want cgroup2fs"
[[ ${lines[3]:-} == *" 192.168.56.10/24 "* ]] || fail "node0 has no 192.168.56.10/24 on the private network: '${lines[3]:-}'"
if [ $provision = 1 ]; then
	out=$(vagrant ssh node0 --no-tty -c 'systemctl is-active mpid; sudo mpipause list >/dev/null && echo answers' 2>>"$log" | tr -d '\r') || true
	[ "$out" = $'active\nanswers' ] || fail "mpid on node0: '$out' (want active, and mpipause list answering)"
	say "mpid active on node0, mpipause list answers"
fi

qemu=$(pgrep -f "qemu-system.*guest=${prefix}node0" | head -1) || fail "no QEMU process of ${prefix}node0"
hwm=$(awk '$1 == "VmHWM:" { print int($2 / 1024) }' "/proc/$qemu/status")
say "QEMU (pid $qemu): peak RSS $hwm MiB, memory $(virsh -c "$uri" dominfo "${prefix}node0" | awk '$1 == "Max" { print int($3 / 1024) }') MiB, driver $driver"

t=$SECONDS
destroyed=1
vagrant_run destroy -f || fail "vagrant destroy (its log: $log)"
say "vagrant destroy took $((SECONDS - t)) s"
ok=1
# cleanup (the EXIT trap) checks that nothing is left and stops the daemons.

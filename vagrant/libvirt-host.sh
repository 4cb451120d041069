#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libvirt-host.sh: a host ready for `vagrant up` with vagrant-libvirt, where
# nothing runs libvirt's daemons (no systemd as PID 1: containers, CI
# machines). docs/vagrant.md, "The box".
#
#   libvirt-host.sh start    start virtlogd and libvirtd unless they run, and
#                            write the libvirt driver to vagrant/.libvirt-driver
#   libvirt-host.sh stop     stop the daemons `start` started, nothing else
#   libvirt-host.sh driver   print the driver: kvm, or qemu (software emulation)
#
# The driver is kvm only if KVM runs a guest here: the box's own kernel is
# booted under KVM until it panics for want of a root (a second or two).
# A /dev/kvm that exists is not enough: a host that is itself a guest may
# offer one that runs only its own kind of guest kernel (PVM), and QEMU
# then fails at the first vCPU ("failed to set MSR"). MPIPAUSE_VM_DRIVER
# (kvm or qemu) overrides the probe. The Vagrantfile reads the driver from
# MPIPAUSE_VM_DRIVER, else vagrant/.libvirt-driver, else from /dev/kvm.
#
# The daemons `start` starts run at the lowest CPU and I/O priority, as do
# the VMs they start: this is for machines shared with other work. Their
# ids are kept in /run/mpipause-libvirt-host; `stop` ends those, and, if
# libvirt's firewall chains were not there before it started, removes them
# when libvirt left them empty.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
state=/run/mpipause-libvirt-host
uri=qemu:///system

say() { echo "libvirt-host: $*"; }
die() {
	echo "libvirt-host: $*" >&2
	exit 1
}
usage() {
	sed -n 's/^#   libvirt-host/libvirt-host/p' "$0" >&2
	exit 2
}

# alive PID NAME: PID runs a program named NAME.
alive() { [ -n "$1" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]; }

# kernel: a kernel to probe KVM with: the box's (vagrant/build-box.sh keeps
# it beside the box), else this host's.
kernel() {
	local box
	if box=$("$here/build-box.sh" --print-path 2>/dev/null) && [ -r "$(dirname "$box")/vmlinuz" ]; then
		echo "$(dirname "$box")/vmlinuz"
	elif [ -r "/boot/vmlinuz-$(uname -r)" ]; then
		echo "/boot/vmlinuz-$(uname -r)"
	fi
}

# driver: kvm or qemu, and on stderr why.
driver() {
	case ${MPIPAUSE_VM_DRIVER:-} in
	kvm | qemu)
		echo "$MPIPAUSE_VM_DRIVER"
		echo "libvirt-host: driver $MPIPAUSE_VM_DRIVER (MPIPAUSE_VM_DRIVER)" >&2
		return
		;;
	"") ;;
	*) die "MPIPAUSE_VM_DRIVER: want kvm or qemu, got '$MPIPAUSE_VM_DRIVER'" ;;
	esac
	local why k d rc="exit 0"
	if [ ! -e /dev/kvm ]; then
		why="no /dev/kvm"
	elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
		why="/dev/kvm is not usable by $(id -un)"
	elif ! command -v qemu-system-x86_64 >/dev/null; then
		why="no qemu-system-x86_64 to probe KVM with (apt-get install qemu-system-x86)"
	elif k=$(kernel) && [ -z "$k" ]; then
		why="no kernel to probe KVM with (build the box: vagrant/build-box.sh)"
	else
		d=$(mktemp -d)
		# Without a root the kernel panics; panic=-1 reboots at once,
		# which -no-reboot makes QEMU's exit. A KVM that cannot run the
		# guest stops its vCPU and leaves QEMU waiting forever: its
		# "KVM internal error" is the answer, 50 s before the timeout.
		timeout 60 qemu-system-x86_64 -accel kvm -cpu host -m 256 -nodefaults -display none \
			-no-reboot -monitor none -serial "file:$d/console" -kernel "$k" \
			-append "console=ttyS0 panic=-1" >"$d/qemu" 2>&1 &
		local qpid=$!
		while kill -0 "$qpid" 2>/dev/null &&
			! grep -q 'Kernel panic' "$d/console" 2>/dev/null &&
			! grep -q 'KVM internal error' "$d/qemu"; do
			sleep 0.2
		done
		if kill "$qpid" 2>/dev/null; then
			wait "$qpid" || true
			rc="stopped by this probe"
		else
			wait "$qpid" || rc="exit $?"
		fi
		if grep -q 'Kernel panic' "$d/console"; then
			rm -rf "$d"
			echo kvm
			echo "libvirt-host: driver kvm ($k booted under KVM)" >&2
			return
		fi
		why="KVM did not boot $k (qemu: $rc: $(head -c 300 "$d/qemu" | tr '\n' ' '))"
		rm -rf "$d"
	fi
	echo qemu
	echo "libvirt-host: driver qemu, software emulation: $why" >&2
}

# libvirt_chains: whether libvirt's firewall chains are in this network
# namespace (iptables or ip6tables).
libvirt_chains() {
	local t
	for t in iptables-save ip6tables-save; do
		command -v "$t" >/dev/null && "$t" 2>/dev/null | grep -q '^:LIBVIRT_' && return 0
	done
	return 1
}

# drop_libvirt_chains: libvirt's chains and the jumps to them, in every
# table where no rule is left in them (libvirt makes them at its first
# network and leaves them when it stops).
drop_libvirt_chains() {
	local ipt t chain from to
	for ipt in iptables ip6tables; do
		command -v "$ipt-save" >/dev/null || continue
		for t in filter nat mangle; do
			"$ipt-save" -t "$t" 2>/dev/null | grep -q '^-A LIBVIRT_' && continue
			while read -r from to; do
				"$ipt" -t "$t" -D "$from" -j "$to"
			done < <("$ipt-save" -t "$t" 2>/dev/null | awk '$1 == "-A" && $3 == "-j" && $4 ~ /^LIBVIRT_/ && NF == 4 { print $2, $4 }')
			for chain in $("$ipt-save" -t "$t" 2>/dev/null | sed -n 's/^:\(LIBVIRT_[A-Z]*\) .*/\1/p'); do
				"$ipt" -t "$t" -X "$chain"
			done
		done
	done
}

# kvm_for_libvirt: under software emulation, /dev/kvm opened to libvirt's
# QEMU user (its group, read and write) where it is root's alone, until
# stop puts the mode and group back. libvirtd probes QEMU's capabilities,
# finding KVM, and at every later look at that probe (most API calls
# vagrant-libvirt makes) checks /dev/kvm as its QEMU user: where that user
# cannot open it, libvirtd takes the probe for stale and runs QEMU twice
# again, 4 to 8 s a call and about 50 s of each VM's `vagrant up`. Debian's
# own udev rule gives /dev/kvm to group kvm, read and write; a host without
# udev (a container) leaves it root's. The VMs use no KVM either way.
kvm_for_libvirt() {
	local user=libvirt-qemu group
	[ "$(cat "$here/.libvirt-driver")" = qemu ] && [ -c /dev/kvm ] || return 0
	id -u "$user" >/dev/null 2>&1 || return 0
	setpriv --reuid="$user" --regid="$(id -g "$user")" --init-groups test -r /dev/kvm -a -w /dev/kvm && return 0
	group=$(id -gn "$user")
	stat -c '%a %g' /dev/kvm >"$state/kvm-mode"
	chgrp "$group" /dev/kvm && chmod g+rw /dev/kvm
	say "/dev/kvm: group $group may read and write it until stop (libvirtd's QEMU user; libvirt re-probes QEMU at every call otherwise)"
}

# kvm_back: /dev/kvm's mode and group as kvm_for_libvirt found them.
kvm_back() {
	local mode gid
	[ -e "$state/kvm-mode" ] || return 0
	read -r mode gid <"$state/kvm-mode"
	chgrp "$gid" /dev/kvm && chmod "$mode" /dev/kvm
	rm -f "$state/kvm-mode"
}

start() {
	[ "$(id -u)" = 0 ] || die "start: needs root (libvirtd as the system daemon)"
	local t pid
	for t in libvirtd virtlogd virsh; do
		command -v "$t" >/dev/null || die "$t is missing: run make deps (libvirt-daemon-system)"
	done
	mkdir -p "$state"
	pid=$(cat /run/virtlogd.pid 2>/dev/null || true)
	if alive "$pid" virtlogd; then
		say "virtlogd runs (pid $pid)"
	else
		nice -n 19 ionice -c3 virtlogd -d
		pid=$(cat /run/virtlogd.pid)
		echo "$pid" >"$state/virtlogd"
		say "virtlogd started (pid $pid)"
	fi
	driver >"$here/.libvirt-driver"
	pid=$(cat /run/libvirtd.pid 2>/dev/null || true)
	if alive "$pid" libvirtd; then
		say "libvirtd runs (pid $pid)"
	else
		if libvirt_chains; then touch "$state/had-chains"; else rm -f "$state/had-chains"; fi
		kvm_for_libvirt
		nice -n 19 ionice -c3 libvirtd -d
		pid=$(cat /run/libvirtd.pid)
		echo "$pid" >"$state/libvirtd"
		say "libvirtd started (pid $pid)"
	fi
	for _ in $(seq 100); do
		virsh -c "$uri" version >/dev/null 2>&1 && break
		sleep 0.1
	done
	virsh -c "$uri" version >/dev/null 2>&1 || die "libvirtd does not answer on $uri"
	say "$here/.libvirt-driver: $(cat "$here/.libvirt-driver")"
}

stop() {
	local name pid
	for name in libvirtd virtlogd; do
		pid=$(cat "$state/$name" 2>/dev/null || true)
		[ -n "$pid" ] || continue
		if alive "$pid" "$name"; then
			kill -TERM "$pid"
			for _ in $(seq 100); do
				alive "$pid" "$name" || break
				sleep 0.1
			done
			alive "$pid" "$name" && die "$name (pid $pid) did not stop"
			say "$name stopped (pid $pid)"
		fi
		rm -f "$state/$name"
		if [ "$name" = libvirtd ] && [ ! -e "$state/had-chains" ]; then
			drop_libvirt_chains
		fi
	done
	rm -f "$state/had-chains"
	kvm_back
	rmdir "$state" 2>/dev/null || true
}

[ $# = 1 ] || usage
case $1 in
start) start ;;
stop) stop ;;
driver) driver ;;
*) usage ;;
esac

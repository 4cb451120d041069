#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# box-boot.sh: boots a box that vagrant/build-box.sh built, alone, under
# plain QEMU (no libvirt, no Vagrant; software emulation unless KVM is
# asked for), from its own disk and boot loader, until its serial console
# offers a login: the box comes up, and with which kernel.
#
#   box-boot.sh [--suite SUITE] [--timeout SECONDS] [--kvm]
#
# SUITE as for build-box.sh (default: bookworm); the box must be built
# (build-box.sh --suite SUITE --no-add). The disk is a copy taken from the
# box file, thrown away after; one NIC on QEMU's user network, as eth0
# (DHCP). Prints the box, the kernel and release the console names, and the
# seconds to the login prompt; exit 1 if there is none within the timeout
# (default 600 s), with the console's end.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
suite=bookworm timeout=600 accel=tcg
while [ $# -gt 0 ]; do
	case $1 in
	--suite) suite=${2:?--suite SUITE}; shift ;;
	--timeout) timeout=${2:?--timeout SECONDS}; shift ;;
	--kvm) accel=kvm ;;
	*) echo "usage: box-boot.sh [--suite SUITE] [--timeout SECONDS] [--kvm]" >&2 && exit 2 ;;
	esac
	shift
done
box=$("$here/build-box.sh" --suite "$suite" --print-path)
work=$(mktemp -d /var/tmp/mpipause-box-boot.XXXXXX)
qemu=
cleanup() {
	if [ -n "$qemu" ]; then kill "$qemu" 2>/dev/null || true; wait "$qemu" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT
tar -xf "$box" -C "$work" box.img
console=$work/console.log
start=$SECONDS
nice -n 19 qemu-system-x86_64 -accel "$accel" -cpu max -m 768 -smp 1 -nodefaults -display none \
	-monitor none -serial "file:$console" -drive "file=$work/box.img,format=qcow2,if=virtio" \
	-nic user,model=virtio-net-pci &
qemu=$!
while ! grep -qaE '^[a-z0-9-]+ login: ' "$console" 2>/dev/null; do
	if ! kill -0 "$qemu" 2>/dev/null; then
		tail -20 "$console" >&2
		echo "box-boot: QEMU exited before a login prompt ($box)" >&2
		exit 1
	fi
	if [ $((SECONDS - start)) -ge "$timeout" ]; then
		tail -20 "$console" >&2
		echo "box-boot: no login prompt in $timeout s ($box)" >&2
		exit 1
	fi
	sleep 2
done
took=$((SECONDS - start))
kernel=$(grep -a -m1 -o 'Linux version [^ ]*' "$console" | cut -d' ' -f3)
release=$(grep -a -m1 -E '^Debian GNU/Linux' "$console" | tr -d '\r')
failed=$(grep -a -c 'FAILED' "$console" || true)
echo "box-boot: $suite: $box ($(du -h "$box" | cut -f1))"
echo "box-boot: $suite: kernel $kernel; console: $release; login prompt after $took s; units FAILED at boot: $failed"
[ "$failed" = 0 ] || grep -a 'FAILED' "$console" | tr -d '\r' | sed 's/^/box-boot:   /'

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# build-box.sh: the Vagrant box the cluster's VMs boot (libvirt provider),
# built on this machine from Debian packages only, and added to Vagrant
# (docs/vagrant.md, "The box", "Suites").
#
#   build-box.sh [--suite SUITE] [--no-add]    build (or take from the cache) and add the box
#   build-box.sh [--suite SUITE] --print-path  the cached box file, if this recipe was built
#
# SUITE, the Debian release and its kernel, names the box:
#   bookworm (the default)  Debian 12, bookworm-backports' 6.12  mpipause/bookworm64-6.12
#   bookworm-stock          Debian 12, its own 6.1               mpipause/bookworm64-6.1
#   bullseye                Debian 11, its own 5.10              mpipause/bullseye64-5.10
#   trixie                  Debian 13, its own 6.12              mpipause/trixie64-6.12
#
# The box: that Debian with that kernel (BTF) as its only kernel, so
# provision-kernel.sh finds 5.10 or later and nothing is rebooted;
# systemd, ifupdown (DHCP on eth0, and what Vagrant's Debian guest plugin
# writes for the private network), openssh-server, sudo, rsync, make, Open
# MPI and MPICH with their headers, and what the mpipause .deb needs; a
# `vagrant` user with passwordless sudo and Vagrant's insecure public key.
# Nothing is fetched when a VM comes up.
#
# How: mmdebstrap makes the root tree; mke2fs -d writes it into the
# partition of a raw disk image (no loop device, no mount on the host);
# one boot of that disk under QEMU (software emulation; the kernel and
# initrd given directly) runs grub-install and update-grub inside it, so
# the boot loader is installed by the guest's own tools onto its own disk;
# then qemu-img makes the compressed qcow2 the box carries.
#
# Cached in $MPIPAUSE_BOX_CACHE (default /var/tmp/mpipause-box-cache) under
# a key that is the hash of this script (the package lists and the recipe
# are in it) and the suite: the same script never builds a suite twice.
# Downloaded .debs are kept there too (debs-CODENAME/), so a changed recipe
# downloads only what changed.
#
#   DEBIAN_MIRROR        the mirror (default: the host's apt source for Debian)
#   MPIPAUSE_BOX_CACHE   where built boxes and .debs are kept
#   MPIPAUSE_BOX_PUBKEY  the public key the vagrant user accepts (default:
#                        Vagrant's insecure key, from its installation)
#   VAGRANT_HOME         Vagrant's, as always (where the box is added)
set -euo pipefail
SECONDS=0

self=$(readlink -f "$0")
repo=$(cd "$(dirname "$self")/.." && pwd)
cache=${MPIPAUSE_BOX_CACHE:-/var/tmp/mpipause-box-cache}
size_mib=3072 # the disk's virtual size; the image itself is sparse
# The box's packages, the same names in Debian 11, 12 and 13 (each
# checked against its mirror): the cache key is this file, so changing
# this list builds new boxes.
pkgs=(
	systemd systemd-sysv dbus libpam-systemd udev kmod # init; hostnamectl (Vagrant's hostname); logind
	initramfs-tools grub-pc-bin grub2-common           # boot (grub2-common: update-grub on kernel changes)
	ifupdown isc-dhcp-client iproute2 netbase          # eth0 by DHCP; Vagrant's Debian guest plugin writes ifupdown
	openssh-server openssh-client sudo rsync           # vagrant ssh, the rsync synced folder, the MPI launchers
	ca-certificates curl make                          # provision.sh's tools step finds them present
	openmpi-bin libopenmpi-dev mpich libmpich-dev      # 11: Open MPI 4.1.0, MPICH 3.4.1; 12: 4.1.4, 4.0.2; 13: 5.0.7, 4.2.1
	libcap2-bin jq procps less                         # mpid's capabilities by name; scripts/cluster-e2e.sh
	# Slurm (11: 20.11, 12: 22.05, 13: 24.11) and munge, slurmdbd and
	# MariaDB (sacct) for provision-slurm.sh:
	# installed here, not configured nor started (below), since apt in a
	# VM under software emulation takes minutes.
	slurmd slurmctld slurm-client munge slurmdbd mariadb-server
)
kernel_pkg=linux-image-amd64

# suite_recipe SUITE: the Debian codename, where its kernel comes from, the
# box's name and the apt sources, for build-box.sh's SUITE.
suite_recipe() {
	case $1 in
	bookworm) # Debian 12 with bookworm-backports' kernel: 6.12
		codename=bookworm kernel_from=bookworm-backports box_name=mpipause/bookworm64-6.12
		dists=(bookworm bookworm-updates bookworm-backports) ;;
	bookworm-stock) # Debian 12 with its own kernel: 6.1
		codename=bookworm kernel_from=bookworm box_name=mpipause/bookworm64-6.1
		dists=(bookworm bookworm-updates) ;;
	bullseye) # Debian 11 with its own kernel: 5.10 (the floor); its backports are archived
		codename=bullseye kernel_from=bullseye box_name=mpipause/bullseye64-5.10
		dists=(bullseye bullseye-updates) ;;
	trixie) # Debian 13 with its own kernel: 6.12
		codename=trixie kernel_from=trixie box_name=mpipause/trixie64-6.12
		dists=(trixie trixie-updates) ;;
	*) return 1 ;;
	esac
}

say() { echo "build-box: [${SECONDS}s] $*"; }
die() {
	echo "build-box: $*" >&2
	exit 1
}
usage() {
	sed -n 's/^#   build-box/build-box/p' "$self" >&2
	exit 2
}

# customize ROOT: what mmdebstrap's customize hook runs, on the host, with
# the new root tree as ROOT (its own tools are run in it by chroot).
customize() {
	local r=$1
	echo "${BOX_CODENAME}64" >"$r/etc/hostname"
	printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$r/etc/hosts"
	echo "UUID=$BOX_UUID / ext4 errors=remount-ro 0 1" >"$r/etc/fstab"
	# eth0, as Debian's own Vagrant boxes name it (net.ifnames=0 below):
	# vagrant-libvirt's management network, by DHCP. Vagrant's Debian guest
	# plugin adds the private network to this file between its markers.
	cat >"$r/etc/network/interfaces" <<-'EOF'
		source /etc/network/interfaces.d/*

		auto lo
		iface lo inet loopback

		allow-hotplug eth0
		iface eth0 inet dhcp
	EOF
	# The serial console too: libvirt gives every domain one, and that is
	# where a boot that goes wrong can be read (virsh console).
	cat >"$r/etc/default/grub" <<-'EOF'
		GRUB_DEFAULT=0
		GRUB_TIMEOUT=1
		GRUB_DISTRIBUTOR=Debian
		GRUB_CMDLINE_LINUX_DEFAULT=""
		GRUB_CMDLINE_LINUX="net.ifnames=0 console=tty0 console=ttyS0,115200n8"
		GRUB_TERMINAL="console serial"
		GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
	EOF
	# Each VM gets its own machine id and ssh host keys at its first boot
	# (no RSA key: making one takes 20 s under software emulation, and
	# Vagrant's ssh and OpenSSH agree on ECDSA or Ed25519).
	: >"$r/etc/machine-id"
	rm -f "$r/var/lib/dbus/machine-id" "$r"/etc/ssh/ssh_host_*
	cat >"$r/etc/systemd/system/ssh-hostkeys.service" <<-'EOF'
		[Unit]
		Description=ssh host keys of this machine (the box has none)
		Before=ssh.service
		ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

		[Service]
		Type=oneshot
		ExecStart=/usr/bin/ssh-keygen -q -t ed25519 -N '' -f /etc/ssh/ssh_host_ed25519_key
		ExecStart=/usr/bin/ssh-keygen -q -t ecdsa -N '' -f /etc/ssh/ssh_host_ecdsa_key

		[Install]
		WantedBy=multi-user.target
	EOF
	chroot "$r" systemctl enable ssh-hostkeys.service >/dev/null 2>&1
	# The initramfs holds the drivers of the disks libvirt gives a VM, not
	# every driver Debian has (MODULES=most): a fifth of its size, which a
	# VM under software emulation reads and unpacks at every boot.
	# (MODULES=list is set before the kernel comes: see the essential hook.)
	# virtio_pci: a module in Debian 11's 5.10 (the disk is not found
	# without it), built in later.
	printf '%s\n' virtio_pci virtio_blk virtio_scsi sd_mod ahci ata_piix ext4 crc32c_generic >>"$r/etc/initramfs-tools/modules"
	chroot "$r" update-initramfs -u -k all >/dev/null 2>&1
	# Timers that would fetch or index in the background of a slow VM.
	chroot "$r" systemctl mask apt-daily.timer apt-daily-upgrade.timer man-db.timer >/dev/null 2>&1 || true
	# Slurm's daemons, munge and MariaDB start only where provision-slurm.sh
	# configures them: not at every boot of every VM.
	chroot "$r" systemctl disable slurmd slurmctld slurmdbd munge mariadb >/dev/null 2>&1 || true
	rm -f "$r/etc/munge/munge.key"
	# The vagrant user: Vagrant's insecure key (Vagrant puts a key of the
	# machine's own in its place at the first vagrant up), sudo without a
	# password, no password of its own.
	chroot "$r" useradd --create-home --shell /bin/bash --user-group vagrant
	chroot "$r" usermod --password '*' vagrant
	install -d -m 0700 "$r/home/vagrant/.ssh"
	install -m 0600 "$BOX_PUBKEY" "$r/home/vagrant/.ssh/authorized_keys"
	chroot "$r" chown -R vagrant:vagrant /home/vagrant/.ssh
	echo 'vagrant ALL=(ALL) NOPASSWD: ALL' >"$r/etc/sudoers.d/vagrant"
	chmod 0440 "$r/etc/sudoers.d/vagrant"
	# Run once, as PID 1, by the setup boot (below), then deleted.
	cat >"$r/usr/local/sbin/mpipause-box-setup" <<-'EOF'
		#!/bin/sh
		set -e
		export PATH=/usr/sbin:/usr/bin:/sbin:/bin # Debian 11: /bin is not /usr/bin
		mountpoint -q /proc || mount -t proc proc /proc
		mountpoint -q /sys || mount -t sysfs sysfs /sys
		mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
		mount -o remount,rw /
		grub-install --target=i386-pc /dev/vda
		update-grub
		rm /usr/local/sbin/mpipause-box-setup
		echo "mpipause-box-setup: ok"
		sync
		mount -o remount,ro /
		echo o >/proc/sysrq-trigger
		sleep 60
	EOF
	chmod 0755 "$r/usr/local/sbin/mpipause-box-setup"
	rm -f "$r"/var/cache/apt/archives/*.deb
}

if [ "${1:-}" = --customize ]; then
	customize "$2"
	exit 0
fi

add=1 print=0 suite=bookworm
while [ $# -gt 0 ]; do
	case $1 in
	--no-add) add=0 ;;
	--print-path) print=1 ;;
	--suite)
		[ $# -ge 2 ] || usage
		suite=$2
		shift
		;;
	--suite=*) suite=${1#--suite=} ;;
	*) usage ;;
	esac
	shift
done
suite_recipe "$suite" || die "unknown suite '$suite' (bookworm, bookworm-stock, bullseye, trixie)"

key=$({ cat "$self" && echo "suite=$suite"; } | sha256sum | cut -c1-16)
box=$cache/$key/mpipause-${box_name#mpipause/}.box
if [ $print = 1 ]; then
	[ -f "$box" ] || die "no box built from this recipe yet ($box): run vagrant/build-box.sh --suite $suite"
	echo "$box"
	exit 0
fi

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap makes a root tree with its owners)"
for tool in mmdebstrap qemu-system-x86_64 qemu-img sfdisk mke2fs sha256sum tar; do
	command -v "$tool" >/dev/null || die "$tool is missing: run make deps"
done
[ $add = 0 ] || command -v vagrant >/dev/null || die "vagrant is missing: run make deps (or build-box.sh --no-add)"

build() {
	local mirror pubkey work root uuid disk kver t
	mirror=$(bash "$repo/scripts/debian-mirror.sh") || die "no Debian mirror (above)"
	mirror=${mirror%/}
	pubkey=${MPIPAUSE_BOX_PUBKEY:-}
	if [ -z "$pubkey" ]; then
		# Vagrant's own insecure key, as its installation ships it (Debian's
		# package, or HashiCorp's under /opt/vagrant).
		# (find fails on the roots that do not exist here.)
		pubkey=$({ find /usr/share/rubygems-integration /usr/lib/ruby /usr/share/vagrant /opt/vagrant \
			-path '*/vagrant-*/keys/vagrant.pub' 2>/dev/null || true; } | sort -V | tail -1)
	fi
	[ -s "$pubkey" ] || die "no Vagrant insecure public key (keys/vagrant.pub of Vagrant's installation): set MPIPAUSE_BOX_PUBKEY=FILE"

	work=$(mktemp -d /var/tmp/mpipause-box.XXXXXX)
	# shellcheck disable=SC2064 # work is fixed now
	trap "rm -rf '$work'" EXIT
	root=$work/root
	uuid=$(cat /proc/sys/kernel/random/uuid)
	local debs=$cache/debs-$codename
	mkdir -p "$debs"

	say "mmdebstrap $suite: $codename (+ $kernel_pkg from $kernel_from) from $mirror; log: $work/mmdebstrap.log"
	local include d sources=()
	include=$(
		IFS=,
		echo "${pkgs[*]},$kernel_pkg/$kernel_from"
	)
	for d in "${dists[@]}"; do sources+=("deb $mirror $d main"); done
	# The .debs already downloaded are given to apt first, and what it
	# downloads goes back to the cache (download/empty: kept until then).
	# No manual pages, translations or documentation but the copyright
	# files: a smaller disk, fewer triggers (man-db's) to run.
	# shellcheck disable=SC2016 # the hooks' $1 and $BOX_SELF are mmdebstrap's to expand
	if ! BOX_UUID=$uuid BOX_PUBKEY=$pubkey BOX_SELF=$self BOX_CODENAME=$codename nice -n 19 ionice -c3 \
		mmdebstrap --mode=root --variant=minbase --format=directory \
		--aptopt='APT::Install-Recommends "false"' \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
		--dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--include="$include" --skip=download/empty \
		--setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
		--essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d" && echo MODULES=list >"$1/etc/initramfs-tools/conf.d/mpipause-box"' \
		--setup-hook="sync-in $debs /var/cache/apt/archives" \
		--customize-hook="sync-out /var/cache/apt/archives $debs" \
		--customize-hook='bash "$BOX_SELF" --customize "$1"' \
		"$codename" "$root" "${sources[@]}" \
		>"$work/mmdebstrap.log" 2>&1; then
		tail -20 "$work/mmdebstrap.log" >&2
		die "mmdebstrap failed (above)"
	fi
	kver=$(find "$root/boot" -name 'vmlinuz-*' -printf '%f\n' | sed 's/^vmlinuz-//' | sort -V | tail -1)
	[ -n "$kver" ] || die "no kernel in the root tree's /boot"
	say "root tree: $(du -sh --apparent-size "$root" | cut -f1), kernel $kver, initrd $(du -h "$root/boot/initrd.img-$kver" | cut -f1)"

	# One partition from 1 MiB (room for grub's core image before it),
	# ext4 written from the tree; the disk stays sparse.
	disk=$work/disk.raw
	truncate -s "${size_mib}M" "$disk"
	echo 'start=2048, type=83, bootable' | sfdisk --quiet --label dos "$disk"
	mke2fs -q -t ext4 -L root -U "$uuid" -E offset=$((1024 * 1024)) -d "$root" "$disk" "$((size_mib - 1))M" ||
		die "mke2fs -d failed"
	say "disk image: ext4 of the tree in ${size_mib} MiB ($(du -h "$disk" | cut -f1) used)"

	say "setup boot under QEMU (TCG): grub-install and update-grub in the guest; log: $work/setup.log"
	t=$SECONDS
	nice -n 19 timeout 900 qemu-system-x86_64 -accel tcg -cpu max -m 1024 -smp 1 \
		-nodefaults -display none -no-reboot -monitor none -serial "file:$work/setup.log" \
		-drive "file=$disk,format=raw,if=virtio" -nic none \
		-kernel "$root/boot/vmlinuz-$kver" -initrd "$root/boot/initrd.img-$kver" \
		-append "root=UUID=$uuid ro console=ttyS0 panic=-1 init=/usr/local/sbin/mpipause-box-setup" ||
		die "the setup boot failed: qemu exited $? ($work/setup.log)"
	if ! grep -q '^mpipause-box-setup: ok' "$work/setup.log"; then
		tail -30 "$work/setup.log" >&2
		die "the setup boot did not finish (its console above)"
	fi
	say "boot loader installed in $((SECONDS - t)) s"

	# The kernel, beside the box: libvirt-host.sh probes KVM with it.
	cp "$root/boot/vmlinuz-$kver" "$work/vmlinuz"
	mkdir "$work/box"
	nice -n 19 qemu-img convert -c -O qcow2 "$disk" "$work/box/box.img"
	printf '{"provider":"libvirt","format":"qcow2","virtual_size":%d}\n' $((size_mib / 1024)) >"$work/box/metadata.json"
	cat >"$work/box/Vagrantfile" <<-EOF
		# $box_name, made by vagrant/build-box.sh --suite $suite of mpipause.
		Vagrant.configure("2") do |config|
		  config.vm.provider :libvirt do |lv|
		    lv.disk_bus = "virtio"
		    lv.nic_model_type = "virtio"
		  end
		end
	EOF
	printf '%s\n' "$key" >"$work/box/mpipause-box-key"
	tar -C "$work/box" -cf "$work/box.box" metadata.json Vagrantfile mpipause-box-key box.img
	mkdir -p "$cache/$key"
	mv "$work/vmlinuz" "$cache/$key/vmlinuz"
	echo "$kver" >"$cache/$key/kernel-release"
	echo "$suite" >"$cache/$key/suite"
	mv "$work/box.box" "$box"
	rm -rf "$work"
	trap - EXIT
	say "built $box ($(du -h "$box" | cut -f1), kernel $kver)"
	# Of the suite's boxes from other recipes, the newest is kept (a
	# checkout of another branch finds its box) and the older ones go. A
	# box from before suites has no suite file: it was bookworm's.
	local other=()
	for d in "$cache"/*/; do
		d=${d%/}
		[[ ${d##*/} =~ ^[0-9a-f]{16}$ && ${d##*/} != "$key" ]] || continue
		if [ "$(cat "$d/suite" 2>/dev/null || echo bookworm)" = "$suite" ]; then other+=("$d"); fi
	done
	if [ ${#other[@]} -gt 1 ]; then
		# shellcheck disable=SC2012 # the names are the cache's own hex keys
		ls -dt "${other[@]}" | tail -n +2 | xargs rm -rf
	fi
}

if [ -f "$box" ]; then
	say "cached: $box (key $key)"
else
	build
fi

if [ $add = 1 ]; then
	# Added again only when Vagrant has another build of this box.
	home=${VAGRANT_HOME:-$HOME/.vagrant.d}
	added=$home/boxes/${box_name//\//-VAGRANTSLASH-}/0/libvirt/mpipause-box-key
	if [ "$(cat "$added" 2>/dev/null)" = "$key" ]; then
		say "$box_name (key $key) is already in Vagrant ($home)"
	else
		vagrant box add --force --name "$box_name" --provider libvirt "$box" >/dev/null ||
			die "vagrant box add $box failed"
		say "added $box_name to Vagrant ($home)"
	fi
fi

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what mpipause needs to build and test on Debian 12, and nothing
# that is already there. Idempotent; run as root (make demo / make test call it).
set -euo pipefail

pkgs=(
	make gcc gfortran pkg-config # build (gfortran: the Fortran test program)
	clang-format                 # make check-format: the shim's C layout (libmpi-shim/.clang-format)
	clang llvm libbpf-dev bpftool # BPF objects (make generate) and inspection
	libclang-rt-14-dev           # libFuzzer, for the shim's C fuzz target
	openmpi-bin libopenmpi-dev   # Open MPI 4.1 (mpirun.openmpi, mpicc.openmpi)
	mpich libmpich-dev           # MPICH 4.0 ch4:ucx (mpiexec.mpich, mpicc.mpich)
	iproute2 util-linux procps   # ip netns, unshare/nsenter/setpriv, ps/pkill
	slurmctld slurmd slurm-client libslurm-dev munge # Slurm 22.05 for the SPANK plugin (spank.h) and its e2e test
	systemd                      # systemd-analyze verify of the unit (offline); systemctl (check-install)
	ca-certificates git
	vagrant vagrant-libvirt shellcheck jq # make check-vagrant; jq: scripts/cluster-e2e.sh
	dpkg-dev binutils debootstrap lintian # make deb (dpkg-shlibdeps, strip); check-deb (a fresh Debian 12 root)
	man-db groff-base mandoc       # man pages: render and lint them
	systemd-container            # make check-systemd: systemd-nspawn boots a Debian 12 with mpid's unit
	mmdebstrap fdisk qemu-utils  # vagrant/build-box.sh: the box's root tree, partition table, qcow2
	qemu-system-x86 libvirt-daemon-system dnsmasq-base # make check-vagrant-boot: the VM, libvirt, its networks' DHCP
	busybox-static kmod xz-utils zstd # make check-kernels: the initramfs's busybox, depmod of a Debian kernel's modules
)

missing=()
for p in "${pkgs[@]}"; do
	# dpkg-query prints "install ok installed" only for a fully installed package.
	if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
		missing+=("$p")
	fi
done

if ! command -v go >/dev/null 2>&1 && [ -x /usr/local/go/bin/go ]; then
	echo "deps: go is at /usr/local/go/bin but not on PATH; add it: export PATH=\$PATH:/usr/local/go/bin" >&2
fi
if ! command -v go >/dev/null 2>&1 && [ ! -x /usr/local/go/bin/go ]; then
	missing+=(golang-go)
fi

if [ ${#missing[@]} -eq 0 ]; then
	echo "deps: all present"
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "deps: missing Debian packages: ${missing[*]}; run as root (or: sudo apt-get install ${missing[*]})" >&2
	exit 1
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
echo "deps: installed ${#missing[@]} package(s)"

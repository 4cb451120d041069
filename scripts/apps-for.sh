#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make apps-for SUITE=...: the MPI test programs in C (kernel-tests/apps) and
# libucxfinalize.so, compiled in a build root of a Debian release against
# that release's Open MPI and MPICH, in bin/apps-SUITE/ (libucxfinalize.so
# beside them): what the distribution matrix's VMs of that release run
# (docs/vagrant.md). A program built against another release's MPI would
# not test that release's.
#
#   apps-for.sh SUITE        SUITE: bullseye (Debian 11), bookworm (12), trixie (13)
#
#   DEBIAN_MIRROR        the mirror (default: the host's apt source for Debian)
#   MPIPAUSE_DEB_CACHE   where the build roots' .debs are kept
#                        (default /var/tmp/mpipause-deb-cache)
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
	echo "apps-for: $*" >&2
	exit 1
}
[ $# = 1 ] || die "usage: apps-for.sh SUITE (bullseye, bookworm, trixie)"
suite=$1
case $suite in
bullseye | bookworm | trixie) ;;
*) die "unknown suite '$suite' (bullseye, bookworm, trixie)" ;;
esac
# shellcheck source=scripts/release-root.sh
. scripts/release-root.sh
SECONDS=0
release_root apps-for "$suite" gcc,gfortran,libc6-dev,make,libopenmpi-dev,openmpi-bin,libmpich-dev,mpich
# shellcheck disable=SC2016 # dpkg-query's ${Package} and ${Version}
echo "apps-for: build root in ${SECONDS} s: $(chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' libopenmpi-dev libmpich-dev | paste -sd ' ')"

mkdir -p "$root/src"
cp -r kernel-tests/apps kernel-tests/ucx-finalize "$root/src/"
# The C programs the VMs' e2e run, for each library (the Fortran one is
# the rig's: bullseye's Open MPI has no mpifort wrapper data without its
# Fortran development packages).
progs=()
for p in xchg pingpong mt sideio; do progs+=("/out/apps/$p.openmpi" "/out/apps/$p.mpich"); done
nice -n 19 chroot "$root" make -s -C /src/apps OUT=/out/apps "${progs[@]}"
nice -n 19 chroot "$root" make -s -C /src/ucx-finalize OUT=/out
out=bin/apps-$suite
rm -rf "$out"
mkdir -p "$out"
cp -r "$root/out/apps/." "$out/"
cp "$root/out/libucxfinalize.so" "$out/"
echo "apps-for: $out in ${SECONDS} s: $(find "$out" -type f | wc -l) files"

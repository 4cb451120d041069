#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Vagrant provisioning, step 1 of 3 (as root, in each VM): a kernel mpid can
# use. mpipause needs Linux 5.10 or later with BTF (Debian 11 ships 5.10,
# Debian 12 6.1); an older one is replaced by Debian's own newer kernel
# from the release's backports. The next provisioner reboots into it;
# provision.sh then checks what runs.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
release=$(uname -r)
major=${release%%.*} rest=${release#*.}
minor=${rest%%.*}
if [ "$major" -gt 5 ] || { [ "$major" -eq 5 ] && [ "$minor" -ge 10 ]; }; then
	echo "provision-kernel: running $release (5.10 or later): nothing to do"
	exit 0
fi
codename=$(awk -F= '$1 == "VERSION_CODENAME" { print $2 }' /etc/os-release)
# Backports from the mirror the box already uses (deb822 or one-line sources).
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
	awk '($1 == "URIs:" || $1 == "deb") && !found { for (i = 2; i <= NF; i++) if ($i ~ /^https?:\/\/.*\/debian\/?$/) { print $i; found = 1; break } }')
if [ -z "$mirror" ]; then
	echo "provision-kernel: no Debian mirror in /etc/apt/sources.list*; add one, then vagrant provision" >&2
	exit 1
fi
echo "deb $mirror ${codename}-backports main" >/etc/apt/sources.list.d/backports.list
apt-get update -q >/dev/null
apt-get install -y -q -t "${codename}-backports" linux-image-amd64 >/dev/null
newest=$(printf '%s\n' /boot/vmlinuz-* | sort -V | tail -1)
echo "provision-kernel: installed $newest from ${codename}-backports (running $release); the next step reboots into it"

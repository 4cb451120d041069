#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# validate.sh: `vagrant validate` of vagrant/Vagrantfile for each provider it
# configures, offline and leaving nothing behind (make check-vagrant).
#  - libvirt: with the vagrant-libvirt plugin, which checks the libvirt block.
#  - virtualbox: Vagrant checks the VirtualBox block only if VirtualBox looks
#    installed; a stand-in VBoxManage that answers --version (and nothing
#    else: any other call fails the check) makes it so. Nothing is started.
# Vagrant's state goes to a temporary directory, not vagrant/.vagrant, and as
# root it runs in a network namespace of its own, so it surely reaches no
# network (no box is downloaded, no version check made).
set -euo pipefail
cd "$(dirname "$0")"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
nonet=()
[ "$(id -u)" -ne 0 ] || nonet=(unshare --net)
mkdir "$d/vbox"
cat >"$d/vbox/VBoxManage" <<STUB
#!/bin/sh
[ "\$1" = --version ] && echo 7.0.14r161095 && exit 0
echo "VBoxManage stand-in called with: \$*" >>"$d/vbox/calls"
exit 1
STUB
chmod +x "$d/vbox/VBoxManage"
rc=0
for p in libvirt virtualbox; do
	if ! env VAGRANT_DOTFILE_PATH="$d/dot" VAGRANT_HOME="$d/home" VAGRANT_CHECKPOINT_DISABLE=1 \
		VAGRANT_DEFAULT_PROVIDER=$p PATH="$d/vbox:$PATH" "${nonet[@]}" vagrant validate >"$d/out" 2>&1; then
		echo "vagrant validate ($p): FAILED:" >&2
		cat "$d/out" >&2
		rc=1
		continue
	fi
	if [ -e "$d/vbox/calls" ]; then
		echo "vagrant validate ($p) called VBoxManage beyond --version: $(cat "$d/vbox/calls")" >&2
		rc=1
		continue
	fi
	echo "vagrant validate ($p): $(tail -1 "$d/out")"
done

# boot-check.sh's emulator_panic, on consoles of both kinds: it decides
# whether a guest panic reruns the check or fails it.
eval "$(sed -n '/^emulator_panic() {/,/^}/p' boot-check.sh)"
printf 'BUG: kernel NULL pointer dereference\nRSP: 0018:ffffc90000003e98 EFLAGS: 00010246\nKernel panic - not syncing: Fatal exception\n' >"$d/guest.log"
printf 'RIP: 0010:net_rx_action+0xec/0x3d0\nRSP: 0018:ffffc90000003e98 EFLAGS: 81e81483\nKernel panic - not syncing: Fatal exception in interrupt\n' >"$d/tcg.log"
export MPIPAUSE_VM_CONSOLE_DIR=$d
got=$(emulator_panic guest)/$(emulator_panic "guest tcg")
if [ "$got" = "/tcg: EFLAGS 81e81483" ]; then
	echo "boot-check.sh: a guest's own panic fails the check, an emulator's reruns it"
else
	echo "boot-check.sh: emulator_panic on a guest's own panic and on an emulator's: got \"$got\", want \"/tcg: EFLAGS 81e81483\"" >&2
	rc=1
fi
exit $rc

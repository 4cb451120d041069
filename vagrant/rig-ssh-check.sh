#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# rig-ssh-check.sh: the Vagrant cluster's path as far as it can run without
# VMs, on a 3-node netns rig (as root, after make build; needs ruby, sudo and
# access to a Debian mirror). Not part of make test. It
#   1. runs the Vagrantfile's trigger (with a stand-in for Vagrant's config
#      objects) to make the cluster key and the ssh key, 4 machines at once;
#   2. runs provision.sh's hosts, key, mpi and ssh steps in each node into a
#      scratch root, twice (they must be idempotent), and checks that mpid
#      accepts the key;
#   3. starts an sshd in each node (taken from Debian's openssh-server .deb,
#      not installed) whose sessions get the MPI settings the mpi step wrote
#      (the MCA file; /etc/environment's variables) and the trigger's key;
#   4. runs scripts/cluster-e2e.sh on node0 as vagrant/e2e.sh does on the
#      VMs: --sudo, every node reached with vagrant/node-exec (ssh), the
#      launchers starting remote ranks with ssh.
# What it cannot do: boot the box, the kernel step, make install, mpid under
# systemd, /etc/environment through pam_env (sshd's SetEnv stands in).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rig=$repo/kernel-tests/rig
export MPIPAUSE_RIG=${MPIPAUSE_RIG:-vssh}
[ "$(id -u)" -eq 0 ] || { echo "rig-ssh-check: needs root (a netns rig)" >&2 && exit 1; }
for t in ruby sudo jq apt-get dpkg-deb; do
	command -v "$t" >/dev/null || { echo "rig-ssh-check: needs $t (apt-get install $t)" >&2 && exit 1; }
done
if [ ! -x bin/mpid ] || [ ! -x bin/apps/xchg.mpich ]; then
	echo "rig-ssh-check: run make build first" >&2
	exit 1
fi

w=$(mktemp -d /tmp/mpipause-rig-ssh.XXXXXX)
made_run_sshd=
cleanup() {
	"$rig" down >/dev/null 2>&1 || echo "rig-ssh-check: run MPIPAUSE_RIG=$MPIPAUSE_RIG kernel-tests/rig down" >&2
	[ -z "$made_run_sshd" ] || rmdir /run/sshd 2>/dev/null || true
	rm -rf "$w"
}
trap cleanup EXIT
step() { echo "== $*"; }

step "1. the Vagrantfile's trigger makes the secrets (4 machines at once, then again)"
mkdir -p "$w/src/vagrant"
cp vagrant/Vagrantfile "$w/src/vagrant/"
cat >"$w/stub.rb" <<'EOF'
# Vagrant's config objects, as far as the Vagrantfile uses them: every call
# is accepted, blocks are run, and the trigger's ruby block is kept.
class Stub
  def method_missing(name, *_args, &blk)
    if blk && name == :ruby then $trigger = blk
    elsif blk then blk.call(Stub.new)
    end
    self
  end
  def respond_to_missing?(*) = true
end
module Vagrant
  def self.configure(_version) = yield(Stub.new)
end
load ARGV[0]
4.times.map { Thread.new { $trigger.call(nil, nil) } }.each(&:join)
EOF
ruby "$w/stub.rb" "$w/src/vagrant/Vagrantfile"
sum1=$(cat "$w/src/vagrant/.secrets/"* | sha256sum)
ruby "$w/stub.rb" "$w/src/vagrant/Vagrantfile"
[ "$(cat "$w/src/vagrant/.secrets/"* | sha256sum)" = "$sum1" ] || { echo "FAIL: the trigger replaced an existing secret" && exit 1; }
[ "$(find "$w/src/vagrant/.secrets" -type f | wc -l)" -eq 2 ] || { echo "FAIL: the trigger left extra files: $(ls -A "$w/src/vagrant/.secrets")" && exit 1; }
[ "$(stat -c %a "$w/src/vagrant/.secrets/cluster.key")" = 600 ] || { echo "FAIL: cluster.key is not mode 0600" && exit 1; }
echo "PASS: cluster.key and id_rsa, mode 0600, made once"

step "2. provision.sh's hosts, key, mpi, ssh steps in every node, twice"
"$rig" up 3 >/dev/null
for k in 0 1 2; do
	mkdir -p "$w/root$k/etc/openmpi"
	printf '127.0.0.1\tlocalhost\n127.0.1.1\tnode%s\n' "$k" >"$w/root$k/etc/hosts"
	for _ in 1 2; do
		"$rig" exec "node$k" -- env MPIPAUSE_PROVISION_ROOT="$w/root$k" MPIPAUSE_PROVISION_SRC="$w/src" MPIPAUSE_MPI_USER=root \
			bash vagrant/provision.sh --steps hosts,key,mpi,ssh "$k" 3 10.77.0 >/dev/null
	done
	for f in etc/hosts etc/environment etc/openmpi/openmpi-mca-params.conf root/.ssh/config; do
		[ "$(grep -c '^# mpipause-vagrant begin' "$w/root$k/$f")" -eq 1 ] || { echo "FAIL: node$k: $f has not exactly one block" && exit 1; }
	done
	! grep -q '^127.* node' "$w/root$k/etc/hosts" || { echo "FAIL: node$k: /etc/hosts still names a node by a loopback address" && exit 1; }
	[ "$(wc -l <"$w/root$k/root/.ssh/authorized_keys")" -eq 1 ] || { echo "FAIL: node$k: authorized_keys has the key more than once" && exit 1; }
done
rm -f "$w/ready"
unshare --net bin/mpid --node keycheck --cluster-key "$w/root0/etc/mpipause/cluster.key" --ready-file "$w/ready" \
	--cgroup-parent "mpipause-rig-ssh-keycheck" --state-dir "$w/state" >"$w/mpid.log" 2>&1 &
mpid=$!
for _ in $(seq 100); do [ -e "$w/ready" ] || ! kill -0 $mpid 2>/dev/null && break; sleep 0.1; done
ok=
[ ! -e "$w/ready" ] || ok=yes
kill $mpid 2>/dev/null || true
wait $mpid 2>/dev/null || true
rmdir "$(awk '$(NF-2) == "cgroup2" && $4 == "/" { print $5; exit }' /proc/self/mountinfo)/mpipause-rig-ssh-keycheck" 2>/dev/null || true
[ -n "$ok" ] || { echo "FAIL: mpid does not take the installed key: $(cat "$w/mpid.log")" && exit 1; }
echo "PASS: written once each (run twice), no loopback line for a node, mpid takes the installed key"

step "3. an sshd in each node, with the MPI settings the mpi step wrote"
(cd "$w" && apt-get download -q openssh-server libwrap0 >/dev/null 2>&1) || { echo "FAIL: apt-get download openssh-server libwrap0" && exit 1; }
for d in "$w"/*.deb; do dpkg-deb -x "$d" "$w/pkg"; done
# sshd's privilege separation wants a user "sshd" and /run/sshd; the user is
# added to a copy of /etc/passwd seen only by the sshds (a mount namespace).
if [ ! -d /run/sshd ]; then
	mkdir -m 755 /run/sshd
	made_run_sshd=1
fi
cp /etc/passwd "$w/passwd"
getent passwd sshd >/dev/null || echo 'sshd:x:64999:65534::/run/sshd:/usr/sbin/nologin' >>"$w/passwd"
ssh-keygen -q -t ed25519 -f "$w/hostkey" -N ''
ssh-keygen -y -f "$w/src/vagrant/.secrets/id_rsa" >"$w/authorized_keys"
env_line=$(sed -n '/^# mpipause-vagrant begin/,/^# mpipause-vagrant end/{/^#/d;p}' "$w/root0/etc/environment" | tr '\n' ' ')
printf '#!/bin/sh\nexec ssh -F %s/config "$@"\n' "$w" >"$w/ssh"
chmod +x "$w/ssh"
cat >"$w/sshd_config" <<EOF
Port 22
HostKey $w/hostkey
AuthorizedKeysFile $w/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
PidFile none
LogLevel ERROR
SetEnv PATH=$repo/bin:/usr/sbin:/usr/bin:/sbin:/bin OMPI_MCA_mca_base_param_files=$w/root0/etc/openmpi/openmpi-mca-params.conf OMPI_MCA_plm_rsh_agent=$w/ssh OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=$w/ssh $env_line
EOF
cat >"$w/config" <<EOF
Host node*
	User root
	IdentityFile $w/root0/root/.ssh/id_rsa
	IdentitiesOnly yes
	UserKnownHostsFile $w/known_hosts
$(sed -n '/^Host node\*/,/^#/{/^\t/p}' "$w/root0/root/.ssh/config")
EOF
for k in 0 1 2; do
	# shellcheck disable=SC2016 # sh's $1 and $@
	"$rig" exec "node$k" -- unshare --mount sh -c 'mount --bind "$1" /etc/passwd && shift && exec "$@"' sh "$w/passwd" \
		env LD_LIBRARY_PATH="$w/pkg/usr/lib/x86_64-linux-gnu" "$w/pkg/usr/sbin/sshd" -D -e -f "$w/sshd_config" >>"$w/sshd.log" 2>&1 &
	disown # rig down kills it: no "Killed" from the shell
done
for k in 0 1 2; do
	for _ in $(seq 50); do "$rig" exec node0 -- vagrant/node-exec -F "$w/config" "node$k" true 2>/dev/null && break; sleep 0.2; done
done
# shellcheck disable=SC2016 # expanded on node1
got=$("$rig" exec node0 -- vagrant/node-exec -F "$w/config" node1 sh -c 'echo "$(hostname) $# [$1] [$2]"' sh 'a b' "c'd")
[ "$got" = "node1 2 [a b] [c'd]" ] || { echo "FAIL: node-exec node1 gave '$got'; sshd log: $(cat "$w/sshd.log")" && exit 1; }
echo "PASS: node-exec reaches every node by ssh and passes an argv unchanged"

step "4. scripts/cluster-e2e.sh on node0, over ssh, as vagrant/e2e.sh runs it"
"$rig" exec node0 -- bash scripts/cluster-e2e.sh --sudo -- vagrant/node-exec -F "$w/config" {}

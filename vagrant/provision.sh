#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Vagrant provisioning, step 3 of 3 (as root, in node K of an N-node cluster
# whose node J has the address NET.(10+J)): the project's own install and
# mpid as a service. Idempotent: `vagrant provision` runs it again.
#
#   provision.sh [--steps LIST] K N NET
#
# Steps, in order (all by default):
#   check    the running kernel has BTF and is 5.10 or later
#   hosts    the node's name is nodeK, and /etc/hosts names every node by
#            its private address
#   tools    Go (the version go.mod names, from go.dev) and make
#   install  make deps, make build, make install in the synced tree
# When the host left the .deb and the test apps in vagrant/.prebuilt (make
# vagrant-prebuilt), tools does nothing and install installs those: the VM
# builds nothing and fetches nothing (docs/vagrant.md, "The box").
#   key      the cluster key shared by every node -> /etc/mpipause/cluster.key
#   mpi      Open MPI and MPICH use TCP on the private network only
#   ssh      the MPI user reaches every node by ssh without a password
#   mpid     systemctl enable --now mpid, and wait until it is active
# To try the hosts, key, mpi and ssh steps outside a VM:
# MPIPAUSE_PROVISION_ROOT=DIR puts every file they write under DIR instead of
# /, MPIPAUSE_PROVISION_SRC is the tree instead of /vagrant, and
# MPIPAUSE_MPI_USER the MPI user instead of vagrant.
set -euo pipefail

usage() {
	echo "usage: provision.sh [--steps check,hosts,tools,install,key,mpi,ssh,mpid] K N NET" >&2
	exit 2
}
steps=check,hosts,tools,install,key,mpi,ssh,mpid
if [ "${1:-}" = --steps ]; then
	[ $# -ge 2 ] || usage
	steps=$2
	shift 2
fi
[ $# -eq 3 ] || usage
k=$1 n=$2 net=$3
[[ $k =~ ^[0-9]+$ && $n =~ ^[1-9][0-9]*$ && $k -lt $n ]] || { echo "provision: want node index K < N, got K=$k N=$n" >&2 && exit 2; }
[[ $net =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "provision: NET is the first three octets (192.168.56), got '$net'" >&2 && exit 2; }

root=${MPIPAUSE_PROVISION_ROOT:-}
src=${MPIPAUSE_PROVISION_SRC:-/vagrant} # the synced repository
secrets=$src/vagrant/.secrets           # made on the host by the Vagrantfile's trigger
prebuilt=$src/vagrant/.prebuilt         # made on the host by make vagrant-prebuilt, if at all
mpi_user=${MPIPAUSE_MPI_USER:-vagrant}  # who runs MPI jobs (the user of `vagrant ssh`)
node=node$k
begin="# mpipause-vagrant begin (vagrant/provision.sh)"
end="# mpipause-vagrant end"
export DEBIAN_FRONTEND=noninteractive
export PATH=$PATH:/usr/local/go/bin

say() { echo "provision $node: $*"; }
die() {
	echo "provision $node: $*" >&2
	exit 1
}

# put_block FILE TEXT: FILE with TEXT between the markers, in place of the
# block an earlier run wrote.
put_block() {
	local f=$1 text=$2 tmp
	mkdir -p "$(dirname "$f")"
	touch "$f"
	tmp=$(mktemp "$f.XXXXXX")
	awk -v b="$begin" -v e="$end" '$0 == b { skip = 1 } !skip { print } $0 == e { skip = 0 }' "$f" >"$tmp"
	printf '%s\n%s\n%s\n' "$begin" "$text" "$end" >>"$tmp"
	chmod --reference="$f" "$tmp"
	mv "$tmp" "$f"
}

step_check() {
	local r major minor
	r=$(uname -r)
	major=${r%%.*} minor=${r#*.} && minor=${minor%%.*}
	if [ "$major" -lt 5 ] || { [ "$major" -eq 5 ] && [ "$minor" -lt 10 ]; }; then
		die "running kernel $r; mpipause needs 5.10 or later: provision-kernel.sh installs one, then reboot (vagrant reload --provision)"
	fi
	[ -e /sys/kernel/btf/vmlinux ] || die "kernel $r has no BTF (/sys/kernel/btf/vmlinux); mpid's BPF programs need it"
	say "kernel $r with BTF"
}

step_hosts() {
	local hosts=$root/etc/hosts lines='' j tmp
	for ((j = 0; j < n; j++)); do
		lines+="$net.$((10 + j)) node$j"$'\n'
	done
	# Any other line naming a node (127.0.1.1 node0, say) would make it
	# resolve its own name to loopback, and MPI would hand that to its peers.
	mkdir -p "$(dirname "$hosts")"
	touch "$hosts"
	tmp=$(mktemp "$hosts.XXXXXX")
	awk -v b="$begin" -v e="$end" -v n="$n" '
		$0 == b { skip = 1 } skip { if ($0 == e) skip = 0; next }
		{ for (i = 2; i <= NF; i++) for (j = 0; j < n; j++) if ($i == "node" j) next; print }' "$hosts" >"$tmp"
	chmod 644 "$tmp"
	mv "$tmp" "$hosts"
	put_block "$hosts" "${lines%$'\n'}"
	# Here and not by Vagrant's config.vm.hostname: Vagrant's Debian guest
	# then restarts every interface, 42 s of each VM's boot under software
	# emulation (docs/vagrant.md, "The box").
	if [ -n "$root" ]; then
		echo "$node" >"$root/etc/hostname"
	elif [ "$(hostname)" != "$node" ]; then
		echo "$node" >/etc/hostname
		hostname "$node"
	fi
	say "named $node; /etc/hosts names node0..node$((n - 1)) ($net.10..$net.$((9 + n)))"
}

# prebuilt_deb: deb is the .deb in vagrant/.prebuilt, if the host put one
# there, else empty.
prebuilt_deb() {
	local debs=("$prebuilt"/mpipause_*.deb)
	deb=
	[ -f "${debs[0]}" ] || return 0
	[ ${#debs[@]} = 1 ] || die "more than one .deb in $prebuilt: ${debs[*]##*/} (make vagrant-prebuilt leaves one)"
	deb=${debs[0]}
}

step_tools() {
	local deb
	prebuilt_deb
	if [ -n "$deb" ]; then
		say "no tools needed: mpipause comes built ($(basename "$deb"))"
		return
	fi
	apt-get update -q >/dev/null
	apt-get install -y -q --no-install-recommends make curl ca-certificates rsync >/dev/null
	local want have
	want=$(awk '$1 == "go" { print $2; exit }' "$src/go.mod")
	have=$(/usr/local/go/bin/go env GOVERSION 2>/dev/null || true)
	if [ "$have" = "go$want" ]; then
		say "Go $want already in /usr/local/go"
		return
	fi
	# Debian 12's golang-go (1.19) is too old for go.mod; the official
	# build goes where scripts/deps.sh looks for it.
	local tgz=go$want.linux-amd64.tar.gz d
	d=$(mktemp -d)
	curl -fsSL -o "$d/$tgz" "https://dl.google.com/go/$tgz"
	curl -fsSL -o "$d/$tgz.sha256" "https://dl.google.com/go/$tgz.sha256"
	echo "$(cat "$d/$tgz.sha256")  $d/$tgz" | sha256sum -c --quiet - || die "$tgz does not match its published SHA-256"
	rm -rf /usr/local/go
	tar -C /usr/local -xzf "$d/$tgz"
	rm -rf "$d"
	say "Go $want installed in /usr/local/go"
}

step_install() {
	local deb
	prebuilt_deb
	if [ -n "$deb" ]; then
		# Its dependencies are in the box already: apt fetches nothing.
		# Whatever the host built last is what runs, even if its version
		# sorts lower (two builds of one day order by commit hash) or is
		# the same (a build of uncommitted changes).
		apt-get install -y -q --no-install-recommends --reinstall --allow-downgrades "$deb" >/dev/null
		# Where make build would have put them (bin/ is the VM's own:
		# the rsync leaves it alone).
		install -d "$src/bin"
		rm -rf "$src/bin/apps"
		cp -r "$prebuilt/apps" "$src/bin/apps"
		install -m 0755 "$prebuilt/libucxfinalize.so" "$src/bin/"
		if ! command -v mpid >/dev/null || ! command -v mpipause >/dev/null; then
			die "$(basename "$deb") left no mpid or mpipause on PATH"
		fi
		say "$(basename "$deb") installed; the test apps in $src/bin/apps"
		return
	fi
	cd "$src"
	make deps
	make build
	make install
	if ! command -v mpid >/dev/null || ! command -v mpipause >/dev/null; then
		die "make install left no mpid or mpipause on PATH"
	fi
	say "make deps, build and install done: $(command -v mpipause), $(command -v mpid)"
}

step_key() {
	local key=$secrets/cluster.key dst=$root/etc/mpipause/cluster.key
	[ -s "$key" ] || die "no $key: the Vagrantfile's trigger makes it on the host at vagrant up/provision; run: vagrant provision"
	install -d -m 0755 "$(dirname "$dst")"
	install -m 0600 -o root -g root "$key" "$dst"
	say "cluster key installed: $dst (mode 0600, the same on every node)"
}

step_mpi() {
	local ifc
	ifc=$(ip -o -4 addr show to "$net.0/24" | awk '{ print $2; exit }')
	[ -n "$ifc" ] || die "no interface with an address in $net.0/24: is the private network up?"
	# Open MPI: system-wide MCA parameters, what the netns rig sets in
	# the environment (docs/rig.md): all rank traffic over TCP (also
	# between two ranks of one node), on the private network only.
	put_block "$root/etc/openmpi/openmpi-mca-params.conf" "pml = ob1
btl = tcp,self
btl_tcp_if_include = $net.0/24
oob_tcp_if_include = $net.0/24"
	# Open MPI 5 launches with PRRTE, whose daemons read their own file
	# (4.1's ORTE read the one above). PRRTE binds each rank to a core and
	# refuses to start two ranks on one: a VM has one CPU for its two
	# (4.1 stopped binding when a node had more ranks than cores).
	if [ -e "$root/etc/openmpi/prte-mca-params.conf" ]; then
		put_block "$root/etc/openmpi/prte-mca-params.conf" "prte_if_include = $net.0/24
hwloc_default_binding_policy = none"
	fi
	# MPICH 4.0 (Hydra, ch4:ucx): no configuration file; pam_env gives every
	# ssh session (the launcher's and its remote proxies') these variables.
	put_block "$root/etc/environment" "HYDRA_IFACE=$ifc
UCX_TLS=tcp,self
UCX_NET_DEVICES=$ifc"
	say "MPI over TCP on $ifc ($net.0/24): /etc/openmpi/openmpi-mca-params.conf, /etc/environment"
}

step_ssh() {
	local home dir
	home=$(getent passwd "$mpi_user" | cut -d: -f6)
	[ -n "$home" ] || die "no user $mpi_user (MPIPAUSE_MPI_USER)"
	[ -s "$secrets/id_rsa" ] || die "no $secrets/id_rsa: the Vagrantfile's trigger makes it on the host at vagrant up/provision; run: vagrant provision"
	dir=$root$home/.ssh
	install -d -m 0700 -o "$mpi_user" -g "$(id -gn "$mpi_user")" "$dir"
	install -m 0600 -o "$mpi_user" -g "$(id -gn "$mpi_user")" "$secrets/id_rsa" "$dir/id_rsa"
	ssh-keygen -y -f "$dir/id_rsa" >"$dir/id_rsa.pub"
	touch "$dir/authorized_keys"
	grep -qxF "$(cat "$dir/id_rsa.pub")" "$dir/authorized_keys" || cat "$dir/id_rsa.pub" >>"$dir/authorized_keys"
	# The nodes are new VMs on a private network: their host keys are
	# taken on first use, without a prompt a launcher could not answer.
	put_block "$dir/config" "Host node*
	BatchMode yes
	StrictHostKeyChecking accept-new"
	chown "$mpi_user:" "$dir"/*
	chmod 600 "$dir/config" "$dir/authorized_keys"
	say "$mpi_user reaches every node by ssh with the cluster's key"
}

step_mpid() {
	systemctl daemon-reload
	systemctl enable mpid >/dev/null 2>&1
	# restart, not start: a new binary or key from this run must be used.
	# The unit is Type=notify: restart returns once mpid says it is ready.
	if ! timeout 90 systemctl restart mpid || ! systemctl is-active --quiet mpid; then
		journalctl -u mpid -n 20 --no-pager >&2 || true
		die "mpid is not active: $(systemctl is-active mpid) (see journalctl -u mpid)"
	fi
	local t0=$SECONDS
	until mpipause list >/dev/null 2>&1; do
		[ $((SECONDS - t0)) -lt 30 ] || die "mpid is active but mpipause list has no answer after 30 s"
		sleep 0.2
	done
	say "mpid active (pid $(systemctl show -p MainPID --value mpid)), mpipause list answers"
}

IFS=, read -r -a todo <<<"$steps"
for s in "${todo[@]}"; do
	case $s in
	check | hosts | tools | install | key | mpi | ssh | mpid) "step_$s" ;;
	*) echo "provision: unknown step '$s'" >&2 && usage ;;
	esac
done

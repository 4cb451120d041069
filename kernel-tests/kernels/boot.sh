#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kernel-tests/kernels/boot.sh: boot a Debian distribution kernel under QEMU
# (software emulation, TCG) with an initramfs of its own and run static test
# binaries in it as root, so that the BPF loader is tested on the kernels
# sites run. No disk image: the kernel and its modules come from the suite's
# linux-image-amd64 .deb (apt, from the Debian mirror, with an apt state of
# this script's own: the host's apt sources are not touched), the initramfs
# is busybox (busybox-static), the modules the tests need with their
# dependencies, iproute2's ip and util-linux's setpriv with their libraries
# (from this host), and a small /init.
#
# Usage:
#   boot.sh --suite bullseye|bookworm|trixie [--timeout SECONDS] [--log FILE]
#           [--with PATH]... [--env NAME=VALUE]... [--memlock LIMIT] [--refresh]
#           [--host-root] -- BINARY [ARGS...] [--- BINARY [ARGS...]]...
#
#   --suite    the Debian suite whose kernel boots: bullseye (5.10),
#              bookworm (6.1), trixie (6.12), or any suite or
#              SUITE-backports the mirror has
#   --timeout  seconds the whole boot may take, tests included (1800)
#   --log      where the console goes besides stdout
#              (/var/tmp/mpipause-kernel-cache/SUITE/last.log)
#   --with     a file or directory copied into /work, the tests' working
#              directory (e.g. a package's testdata)
#   --env      a variable set for the tests; MPIPAUSE_REQUIRE_PRIV=1 always
#              is, so privileged Go tests fail instead of skipping
#   --memlock  the tests' RLIMIT_MEMLOCK (ulimit -l: KiB, or unlimited);
#              without it, the kernel's default for init: 64 KiB before
#              5.16 (8 MiB since), which before 5.11 bounds BPF maps and
#              programs too (systemd, since it followed Linux 5.16, gives
#              services 8 MiB on older kernels; bullseye's 247 predates it)
#   --refresh  update the suite's package lists now (else when a week old)
#   --host-root  run the binaries in this machine's own files instead of
#              the initramfs: its / shared read-only over 9p (virtio) and
#              switched into as root, with /tmp, /var/tmp, /run and /root on tmpfs,
#              /etc, /var/lib and /var/log writable (overlays on tmpfs)
#              and the guest's own /proc, /sys, /dev, cgroup v2 and bpffs.
#              BINARY is then a path on this machine, dynamically linked
#              or not, and /work is its working directory's copy of
#              nothing: ARGS name this machine's paths. For the whole
#              product (mpid, the shim, MPI, the netns rig) on the suite's
#              kernel with this machine's userspace
#
# Each BINARY (static: nothing of the host's is in the guest but ip,
# setpriv and their libraries) is copied to /work/bin/I/ (I: 1, 2, ...) and
# run in /work
# with its ARGS, one after the other, stdin /dev/null; `---` separates them.
# In the guest: cgroup v2 alone at /sys/fs/cgroup (every controller enabled
# at the root, as systemd does), bpffs at /sys/fs/bpf, debugfs, tracefs,
# /run (with /run/netns) and /tmp on tmpfs, lo up, PATH with busybox.
#
# Prints the console as it comes (kernel messages of warning level and
# worse, so that a lockup's stacks reach the log; a soft lockup or an RCU
# stall panics the guest, which then fails at once rather than at the
# timeout), then one line
#   boot.sh: result suite=S kernel=UNAME btf=yes|no boot=SECONDS run=SECONDS
#            passed=N failed=N skipped=N rc=N
# (passed/failed/skipped count the top-level Go tests' "--- PASS" etc.
# lines). Exits with the first non-zero exit code of a binary, 0 if all
# passed, and 3 with one line saying why when the kernel panicked, the
# timeout passed, or the guest ended without its end marker; 2 for usage.
#
# Cache: /var/tmp/mpipause-kernel-cache/SUITE/ (MPIPAUSE_KERNEL_CACHE for
# another root): apt/ (package lists, the .deb), kernel-VERSION/ (the
# extracted package), initramfs-KEY.cpio.gz (the base without the tests;
# KEY hashes this script, the kernel package's version and the host files
# copied in, so a changed recipe builds a new one). Remove the directory to
# start again.
set -Eeuo pipefail

prog=boot.sh
die() {
	echo "$prog: $*" >&2
	exit 3
}
usage() {
	echo "usage: $prog --suite SUITE [--timeout SECONDS] [--log FILE] [--with PATH]... [--env NAME=VALUE]... [--memlock LIMIT] [--refresh] [--host-root] -- BINARY [ARGS...] [--- BINARY [ARGS...]]..." >&2
	exit 2
}

# The modules the tests need, by name; each is loaded with what it depends
# on (modules.dep), in order. One built into the kernel is skipped.
# inet_diag, tcp_diag, udp_diag: the sock_diag observer (INET_DIAG dumps);
# veth: the loader tests' pairs of namespaces; virtio_rng: entropy for
# getrandom(2) from the host (-device virtio-rng-pci), and its bus.
# 9p, 9pnet_virtio, overlay: --host-root's view of this machine's files
# (/etc and /var writable over it); bridge: the
# netns rig's (kernel-tests/internal/rig), with sch_netem for its link
# faults.
MODULES=(inet_diag tcp_diag udp_diag veth virtio_pci virtio_rng 9p 9pnet_virtio overlay bridge sch_netem)

suite=
timeout=1800
log=
refresh=0
memlock=
host_root=0
withs=()
envs=()
while [ $# -gt 0 ]; do
	case $1 in
	--suite) suite=${2:?}; shift 2 ;;
	--timeout) timeout=${2:?}; shift 2 ;;
	--log) log=${2:?}; shift 2 ;;
	--with) withs+=("${2:?}"); shift 2 ;;
	--env) envs+=("${2:?}"); shift 2 ;;
	--memlock) memlock=${2:?}; shift 2 ;;
	--refresh) refresh=1; shift ;;
	--host-root) host_root=1; shift ;;
	--) shift; break ;;
	*) usage ;;
	esac
done
if [ -z "$suite" ] || [ $# -eq 0 ]; then usage; fi
[[ $suite =~ ^[a-z]+(-[a-z]+)?$ ]] || die "bad suite name: $suite"
[[ $timeout =~ ^[0-9]+$ ]] || die "--timeout takes seconds: $timeout"
[[ $memlock =~ ^([0-9]+|unlimited)?$ ]] || die "--memlock takes KiB or unlimited: $memlock"
for e in "${envs[@]}"; do
	[[ $e =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env takes NAME=VALUE: $e"
done
[ "$(id -u)" -eq 0 ] || die "run as root (the initramfs holds device nodes and root-owned files)"
for c in qemu-system-x86_64 apt-get dpkg-deb depmod busybox sha256sum gzip xz zstd readelf ip setpriv; do
	command -v "$c" >/dev/null || die "no $c: make deps installs it (qemu-system-x86, kmod, busybox-static, binutils, xz-utils, zstd, iproute2, util-linux)"
done

cache=${MPIPAUSE_KERNEL_CACHE:-/var/tmp/mpipause-kernel-cache}/$suite
mkdir -p "$cache"
log=${log:-$cache/last.log}
mkdir -p "$(dirname "$log")"
work=$(mktemp -d /var/tmp/mpipause-kernel-run.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- The kernel package, with an apt state of our own ----------------------
mirror=$(bash "$(dirname "$0")/../../scripts/debian-mirror.sh") || exit 3
apt_dir=$cache/apt
mkdir -p "$apt_dir"/lists/partial "$apt_dir"/archives/partial "$apt_dir"/parts "$apt_dir"/cache
echo "deb $mirror $suite main" >"$apt_dir/sources.list"
cat >"$apt_dir/apt.conf" <<EOF
Dir::Etc::sourcelist "$apt_dir/sources.list";
Dir::Etc::sourceparts "$apt_dir/parts";
Dir::Etc::preferences "/dev/null";
Dir::Etc::preferencesparts "$apt_dir/parts";
Dir::State::Lists "$apt_dir/lists";
Dir::State::status "/dev/null";
Dir::Cache "$apt_dir/cache";
Dir::Cache::archives "$apt_dir/archives";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
Acquire::IndexTargets::deb::DEP-11::DefaultEnabled "false";
Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled "false";
Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled "false";
Acquire::IndexTargets::deb::CNF::DefaultEnabled "false";
EOF
export APT_CONFIG=$apt_dir/apt.conf
stamp=$apt_dir/updated
if [ "$refresh" = 1 ] || [ -z "$(find "$stamp" -mtime -7 2>/dev/null)" ]; then
	echo "$prog: apt-get update for $suite ($mirror)" >&2
	if apt-get update -q >"$work/apt.log" 2>&1; then
		touch "$stamp"
	elif [ -e "$stamp" ]; then
		echo "$prog: apt-get update failed; using the package lists of $(date -r "$stamp" +%F)" >&2
	else
		cat "$work/apt.log" >&2
		die "apt-get update for $suite failed"
	fi
fi
# linux-image-amd64 depends on the kernel's own package (linux-image-VERSION-amd64).
pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
[ -n "$pkg" ] || die "$suite: linux-image-amd64 depends on no linux-image-VERSION package"
pkgver=$(apt-cache show --no-all-versions "$pkg" | awk '$1 == "Version:" { print $2; exit }')
kdir=$cache/kernel-$pkg-$pkgver
if [ ! -e "$kdir/.done" ]; then
	rm -rf "$kdir" && mkdir -p "$kdir"
	echo "$prog: fetching $pkg $pkgver" >&2
	(cd "$apt_dir/archives" && apt-get download -q "$pkg=$pkgver" >"$work/apt.log" 2>&1) ||
		{ cat "$work/apt.log" >&2; die "apt-get download $pkg failed"; }
	deb=$(find "$apt_dir/archives" -maxdepth 1 -name "${pkg}_*.deb" | sort | tail -1)
	dpkg-deb -x "$deb" "$kdir/root"
	# A merged-/usr package ships usr/lib/modules; depmod reads lib/modules.
	[ -e "$kdir/root/lib" ] || ln -s usr/lib "$kdir/root/lib"
	# modules.dep is not in the package (its postinst runs depmod).
	v=$(find "$kdir/root/boot" -name 'vmlinuz-*' | head -1)
	depmod -b "$kdir/root" "${v##*/vmlinuz-}"
	touch "$kdir/.done"
fi
vmlinuz=$(find "$kdir/root/boot" -name 'vmlinuz-*' | head -1)
[ -n "$vmlinuz" ] || die "$pkg has no /boot/vmlinuz-*"
kver=${vmlinuz##*/vmlinuz-}
config=$kdir/root/boot/config-$kver
moddir=$kdir/root/lib/modules/$kver
[ -e "$moddir/modules.dep" ] || die "$pkg: no lib/modules/$kver/modules.dep (remove $kdir to extract it again)"
btf_config=no
grep -q '^CONFIG_DEBUG_INFO_BTF=y' "$config" && btf_config=yes

# --- The initramfs base: busybox, modules, ip, setpriv, /init --------------
# Host executables copied in, with the shared libraries they load.
host_bins=("$(command -v ip)" "$(command -v setpriv)")
key=$(
	{
		cat "$0"
		echo "$pkg $pkgver"
		sha256sum "$(command -v busybox)" "${host_bins[@]}"
	} | sha256sum | cut -c1-16
)
base=$cache/initramfs-$key.cpio.gz
if [ ! -e "$base" ]; then
	echo "$prog: building the initramfs base $base" >&2
	root=$work/base
	mkdir -p "$root"/{bin,sbin,dev,proc,sys,run,tmp,etc,root,work,lib/modules,usr/bin,usr/sbin}
	cp "$(command -v busybox)" "$root/bin/busybox"
	for a in $(busybox --list); do
		[ -e "$root/bin/$a" ] || ln -s busybox "$root/bin/$a"
	done
	mknod -m 600 "$root/dev/console" c 5 1
	mknod -m 666 "$root/dev/null" c 1 3
	mkdir -p "$root/var" && ln -s /run "$root/var/run"
	printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$root/etc/passwd"
	printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
	printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
	echo mpipause-kernel >"$root/etc/hostname"

	# ip and setpriv replace busybox's (which lack ip netns and
	# setpriv --bounding-set), in /usr/sbin and /usr/bin ahead in PATH.
	for b in "${host_bins[@]}"; do
		case $b in */sbin/*) d=usr/sbin ;; *) d=usr/bin ;; esac
		cp -L "$b" "$root/$d/"
		for lib in $(ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
			mkdir -p "$root$(dirname "$lib")"
			cp -L "$lib" "$root$lib"
		done
	done
	# The modules and their dependencies, in load order (modules.dep lists
	# a module's dependencies, the deepest last), decompressed.
	: >"$root/etc/modules.load"
	declare -A seen=()
	add_module() {
		local path=$1 dep
		[ -n "${seen[$path]:-}" ] && return
		seen[$path]=1
		while read -r dep; do
			add_module "$dep"
		done < <(awk -v m="$path:" '$1 == m { for (i = NF; i >= 2; i--) print $i }' "$moddir/modules.dep")
		local out=${path%.xz}
		out=${out%.zst}
		out=${out%.gz}
		mkdir -p "$root/lib/modules/$kver/$(dirname "$out")"
		case $path in
		*.xz) xz -dc "$moddir/$path" >"$root/lib/modules/$kver/$out" ;;
		*.zst) zstd -qdc "$moddir/$path" >"$root/lib/modules/$kver/$out" ;;
		*.gz) gzip -dc "$moddir/$path" >"$root/lib/modules/$kver/$out" ;;
		*) cp "$moddir/$path" "$root/lib/modules/$kver/$out" ;;
		esac
		echo "$out" >>"$root/etc/modules.load"
	}
	for m in "${MODULES[@]}"; do
		# modules.dep and modules.builtin spell a module's - as _ or -.
		re="/${m//_/[-_]}\\.ko(\\.(xz|zst|gz))?"
		path=$(grep -oE "^[^:]*${re}:" "$moddir/modules.dep" | head -1 || true)
		if [ -n "$path" ]; then
			add_module "${path%:}"
		elif grep -qE "${re}\$" "$moddir/modules.builtin"; then
			echo "$prog: $kver: $m is built in" >&2
		else
			echo "$prog: $kver: no module $m, built in or not (skipped)" >&2
		fi
	done

	cat >"$root/init" <<'EOF'
#!/bin/sh
# The initramfs's init: mount what a systemd host has mounted, load the
# modules, bring lo up, run /work/run.sh (made for each boot), power off.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/netns /run/lock
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
mount -t bpf -o mode=0700 bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
# Every controller enabled at the root, as systemd does.
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
	echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || echo "init: cannot enable cgroup controller $c"
done
while read -r m; do
	insmod "/lib/modules/$(uname -r)/$m" || echo "init: insmod $m failed"
done </etc/modules.load
hostname -F /etc/hostname
ip link set lo up
. /work/run.sh
poweroff -f
EOF
	chmod 755 "$root/init"
	(cd "$root" && find . -mindepth 1 | busybox cpio -o -H newc -R 0:0 2>/dev/null | gzip -1) >"$base.tmp"
	mv "$base.tmp" "$base"
	# Older bases of this suite are of another recipe.
	find "$cache" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "${base##*/}" -delete
fi

# --- This boot's part: the binaries, the --with files, /work/run.sh --------
nonce=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')
mark="@@mpipause-kernel-$nonce"
tests=$work/tests
mkdir -p "$tests/work/bin"
for w in "${withs[@]}"; do
	[ -e "$w" ] || die "--with $w: no such file"
	cp -a "$w" "$tests/work/"
done
{
	echo "# made by $prog"
	echo "cd /work"
	echo "export MPIPAUSE_REQUIRE_PRIV=1"
	for e in "${envs[@]}"; do
		printf 'export %s=%q\n' "${e%%=*}" "${e#*=}"
	done
	[ -z "$memlock" ] || echo "ulimit -l $memlock"
	echo "echo \"$mark uname \$(uname -r)\""
	echo "echo \"$mark memlock \$(ulimit -l)\""
	echo "if [ -e /sys/kernel/btf/vmlinux ]; then echo \"$mark btf yes\"; else echo \"$mark btf no\"; fi"
	if [ "$host_root" = 1 ]; then
		# This machine's files, read-only, with the guest's own kernel
		# filesystems and writable scratch; every later line runs in it.
		cat <<-'EOS'
			mkdir -p /host
			mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /host || { echo "init: no host root over 9p"; poweroff -f; }
			for d in run tmp var/tmp root; do mount -t tmpfs tmpfs /host/$d; done
			mkdir -p /rw && mount -t tmpfs tmpfs /rw
			for d in etc var/lib var/log; do
				mkdir -p "/rw/$d/u" "/rw/$d/w"
				mount -t overlay overlay -o "lowerdir=/host/$d,upperdir=/rw/$d/u,workdir=/rw/$d/w" "/host/$d" || echo "init: /$d not writable"
			done
			mount --rbind /dev /host/dev
			mount -t proc proc /host/proc
			mount -t sysfs sysfs /host/sys
			mount -t cgroup2 -o nsdelegate cgroup2 /host/sys/fs/cgroup
			mount -t bpf -o mode=0700 bpf /host/sys/fs/bpf
			mount -t debugfs debugfs /host/sys/kernel/debug 2>/dev/null
			mount -t tracefs tracefs /host/sys/kernel/tracing 2>/dev/null
			chmod 1777 /host/tmp /host/var/tmp
			mkdir -p /host/run/netns /host/run/lock /host/run/user
		EOS
	fi
	echo "echo \"$mark ready\""
} >"$tests/work/run.sh"
names=()
i=0
while [ $# -gt 0 ]; do
	bin=$1
	shift
	args=()
	while [ $# -gt 0 ] && [ "$1" != --- ]; do
		args+=("$1")
		shift
	done
	[ $# -gt 0 ] && shift # the ---
	if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then die "not an executable file: $bin"; fi
	i=$((i + 1))
	name=${bin##*/}
	names+=("$name")
	if [ "$host_root" = 1 ]; then
		bin=$(readlink -f "$bin")
		{
			printf 'echo "%s start %d %s"\n' "$mark" "$i" "$name"
			printf '/usr/bin/env -C %q PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/go/bin HOME=/root TMPDIR=/tmp %q' "$(pwd)" "$bin"
			[ ${#args[@]} -eq 0 ] || printf ' %q' "${args[@]}"
			printf ' </dev/null\n'
			printf 'echo "%s end %d %s rc=$?"\n' "$mark" "$i" "$name"
		} >>"$tests/work/inner.sh"
		continue
	fi
	if readelf -l "$bin" 2>/dev/null | grep -q 'program interpreter'; then
		die "$bin is dynamically linked: the guest has no libraries for it (build with CGO_ENABLED=0)"
	fi
	# bin/I/NAME: two binaries may have one name.
	mkdir -p "$tests/work/bin/$i"
	cp -L "$bin" "$tests/work/bin/$i/$name"
	{
		printf 'echo "%s start %d %s"\n' "$mark" "$i" "$name"
		printf '/work/bin/%d/%q' "$i" "$name"
		[ ${#args[@]} -eq 0 ] || printf ' %q' "${args[@]}"
		printf ' </dev/null\n'
		printf 'echo "%s end %d %s rc=$?"\n' "$mark" "$i" "$name"
	} >>"$tests/work/run.sh"
done
if [ "$host_root" = 1 ]; then
	# The binaries run with this machine's files as the root of the
	# guest's mount namespace (switch_root, not chroot: a process that
	# enters another mount namespace, as the rig's nsenter does, gets
	# that namespace's root), and the guest powers off by sysrq: this
	# machine's poweroff is systemd's.
	{
		echo "echo \"$mark done\""
		echo "echo o >/proc/sysrq-trigger; sleep 60"
	} >>"$tests/work/inner.sh"
	{
		echo "cp /work/inner.sh /host/run/mpipause-inner.sh"
		echo "exec switch_root /host /bin/sh /run/mpipause-inner.sh"
	} >>"$tests/work/run.sh"
else
	echo "echo \"$mark done\"" >>"$tests/work/run.sh"
fi
(cd "$tests" && find . -mindepth 1 | busybox cpio -o -H newc -R 0:0 2>/dev/null | gzip -1) >"$work/tests.cpio.gz"
# The kernel unpacks concatenated archives in order.
cat "$base" "$work/tests.cpio.gz" >"$work/initrd"

# --- Boot ------------------------------------------------------------------
echo "$prog: booting $pkg $pkgver ($kver; CONFIG_DEBUG_INFO_BTF=$btf_config) under QEMU (TCG), timeout ${timeout}s; console also in $log" >&2
: >"$log"
start=$EPOCHREALTIME
ready=
done_at=
uname=unknown
btf=unknown
rcs=()
set +e
virtfs=()
[ "$host_root" = 1 ] && virtfs=(-virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap")
timeout -k 10 "$timeout" qemu-system-x86_64 -accel tcg -m 4G -smp 2 -nographic -no-reboot \
	-nic none -device virtio-rng-pci "${virtfs[@]}" \
	-kernel "$vmlinuz" -initrd "$work/initrd" \
	-append "console=ttyS0 loglevel=5 softlockup_panic=1 softlockup_all_cpu_backtrace=1 sysctl.kernel.panic_on_rcu_stall=1 panic=-1 rdinit=/init cgroup_no_v1=all" </dev/null 2>&1 |
	while IFS= read -r line || [ -n "$line" ]; do
		line=${line%$'\r'}
		printf '%s\n' "$line"
		printf '%s\n' "$line" >>"$log"
		# A marker may come after the escape sequences of a console reset.
		case $line in
		*"$mark "*) ;;
		*) continue ;;
		esac
		m=${line#*"$mark "}
		case $m in
		ready) echo "$EPOCHREALTIME" >"$work/ready" ;;
		done) echo "$EPOCHREALTIME" >"$work/done" ;;
		"uname "*) echo "${m#uname }" >"$work/uname" ;;
		"btf "*) echo "${m#btf }" >"$work/btf" ;;
		"end "*) echo "${m##*rc=}" >>"$work/rcs" ;;
		esac
	done
qemu_rc=${PIPESTATUS[0]}
set -e
end=$EPOCHREALTIME
[ -e "$work/ready" ] && ready=$(<"$work/ready")
[ -e "$work/done" ] && done_at=$(<"$work/done")
[ -e "$work/uname" ] && uname=$(<"$work/uname")
[ -e "$work/btf" ] && btf=$(<"$work/btf")
[ -e "$work/rcs" ] && mapfile -t rcs <"$work/rcs"

secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }
boot_s=-
run_s=-
[ -n "$ready" ] && boot_s=$(secs "$start" "$ready")s
[ -n "$ready" ] && run_s=$(secs "$ready" "${done_at:-$end}")s
count() { grep -cE "^--- $1: " "$log" || true; }
passed=$(count PASS)
failed=$(count FAIL)
skipped=$(count SKIP)

rc=0
why=
if [ -z "$done_at" ]; then
	rc=3
	if grep -q 'Kernel panic' "$log"; then
		why="the kernel panicked: $(grep -m1 'Kernel panic' "$log")"
	elif [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
		why="timed out after ${timeout}s"
	else
		why="the guest ended (QEMU exit $qemu_rc) without the end marker"
	fi
else
	for r in "${rcs[@]}"; do
		if [ "$r" != 0 ]; then
			rc=$r
			break
		fi
	done
fi
[ -z "$why" ] || echo "$prog: $suite: $why" >&2
echo "$prog: result suite=$suite kernel=$uname btf=$btf boot=$boot_s run=$run_s passed=$passed failed=$failed skipped=$skipped rc=$rc" | tee -a "$log"
exit "$rc"

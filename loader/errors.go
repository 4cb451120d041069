package loader

import (
	"errors"

	"github.com/mpipause/mpipause/internal/cgroupv2"
)

// Sentinel errors, for errors.Is. The errors Open returns wrap them with the
// detail (what is missing, where) and say what to do, on one line.
var (
	// ErrNotPrivileged: the process lacks a capability the BPF observer
	// needs (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN; CAP_SYS_ADMIN to enter
	// other network namespaces).
	ErrNotPrivileged = errors.New("not privileged for BPF")
	// ErrNoBTF: the kernel exposes no BTF (/sys/kernel/btf/vmlinux), which
	// the CO-RE programs and tp_btf attachment need.
	ErrNoBTF = errors.New("kernel BTF not available")
	// ErrBPFUnavailable: the kernel refused to load or attach a program
	// (verifier, missing tracepoint or helper, lockdown).
	ErrBPFUnavailable = errors.New("BPF programs refused by the kernel")
	// ErrNoCgroup: a cgroup given in Config.Cgroup, Config.Cgroups or to
	// Watch does not exist in the cgroup v2 hierarchy.
	ErrNoCgroup = errors.New("no such cgroup v2 directory")
	// ErrBadJob: Config.Job is not a job id, or pinning a set of several
	// cgroups was asked for without one.
	ErrBadJob = errors.New("bad job name")
	// ErrNoCgroupV2: no cgroup v2 hierarchy is mounted.
	ErrNoCgroupV2 = cgroupv2.ErrNotMounted
	// ErrNoBPFFS: pinning was asked for but no bpffs is mounted and none
	// could be mounted at /sys/fs/bpf.
	ErrNoBPFFS = errors.New("no bpffs")
	// ErrNoNetns: a network namespace given in Config.Netns cannot be opened.
	ErrNoNetns = errors.New("no such network namespace")
	// ErrStalePin: the state pinned for the cgroup was made by an
	// incompatible build of mpipause; Unpin it and open again.
	ErrStalePin = errors.New("pinned BPF state does not match this build")
	// ErrClosed: the observer was used after Close or Detach.
	ErrClosed = errors.New("observer closed")
)

// fallbackable reports whether err says BPF cannot run here, as opposed to
// a mistake in the configuration that the sock_diag observer would share.
func fallbackable(err error) bool {
	return errors.Is(err, ErrNotPrivileged) || errors.Is(err, ErrNoBTF) || errors.Is(err, ErrBPFUnavailable)
}

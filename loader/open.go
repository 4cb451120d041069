package loader

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/mpipause/mpipause/internal/cgroupv2"
)

// Observer kinds, as Observer.Kind reports them and Config.Require takes them.
const (
	KindBPF      = "bpf"
	KindSockDiag = "sock_diag"
)

// Config says which job to observe, where, and how.
type Config struct {
	// Cgroup is the job's cgroup v2 directory: an absolute path inside the
	// v2 mount, or a path relative to its root ("/" is the whole hierarchy).
	// Sockets of this cgroup and of its descendants belong to the job.
	Cgroup string

	// Netns lists network namespaces to look in besides the observer's own:
	// a name (a file in /run/netns, as `ip netns` makes) or a path to a
	// namespace file (/proc/PID/ns/net, a bind mount).
	Netns []string

	// FollowJob also looks in every network namespace in which a process of
	// the cgroup tree lives, found anew at each Snapshot. (The sock_diag
	// observer without CAP_SYS_ADMIN leaves out those it cannot enter; see
	// SockDiagObserver.Skipped.)
	FollowJob bool

	// Pin keeps the BPF state under <bpffs>/mpipause/<cgroup-id>/: the
	// programs stay attached and keep registering the job's connections
	// after Close, and the next Open with Pin reuses them. Without Pin nothing is pinned and
	// Close detaches everything. Unpin removes pinned state.
	Pin bool

	// BPFFS is the bpffs mount to pin in. Empty: the first bpf mount in
	// /proc/self/mountinfo, else a bpffs mounted at /sys/fs/bpf.
	BPFFS string

	// Require selects one observer kind (KindBPF or KindSockDiag) and turns
	// the fallback off. Empty: BPF, else sock_diag.
	Require string

	// OnFallback, if set, is called with the reason when Open falls back
	// from BPF to sock_diag.
	OnFallback func(reason error)
}

// Open returns an observer of cfg's job. Unless cfg.Require says otherwise it
// tries the BPF observer and, when BPF cannot run here (ErrNotPrivileged,
// ErrNoBTF, ErrBPFUnavailable), falls back to the sock_diag observer and
// tells cfg.OnFallback why. Configuration mistakes (ErrNoCgroup,
// ErrNoCgroupV2, ErrNoNetns, ErrNoBPFFS) are returned as they are.
func Open(ctx context.Context, cfg Config) (Observer, error) {
	// Each case returns a nil interface on error, never a typed nil.
	switch cfg.Require {
	case KindBPF:
		b, err := OpenBPF(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return b, nil
	case KindSockDiag:
		d, err := OpenSockDiag(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return d, nil
	case "":
	default:
		return nil, fmt.Errorf("observer kind %q: want %q, %q or empty for either", cfg.Require, KindBPF, KindSockDiag)
	}
	b, err := OpenBPF(ctx, cfg)
	if err == nil {
		return b, nil
	}
	if !fallbackable(err) {
		return nil, err
	}
	d, derr := OpenSockDiag(ctx, cfg)
	if derr != nil {
		return nil, fmt.Errorf("%w; fallback: %w", err, derr)
	}
	if cfg.OnFallback != nil {
		cfg.OnFallback(err)
	}
	return d, nil
}

// job is the resolved cgroup of a Config.
type job struct {
	dir string // absolute path in the v2 hierarchy
	id  uint64 // cgroup id (kernfs inode)
}

func resolveJob(cgroup string) (job, error) {
	if cgroup == "" {
		return job{}, fmt.Errorf("%w: no cgroup given; set Config.Cgroup to the job's cgroup v2 path", ErrNoCgroup)
	}
	root, err := cgroupv2.Root()
	if err != nil {
		return job{}, err
	}
	dir, err := cgroupv2.Resolve(cgroup)
	if err != nil {
		return job{}, fmt.Errorf("%w: %q is not a cgroup v2 directory under %s; give the job's cgroup, absolute or relative to %s", ErrNoCgroup, cgroup, root, root)
	}
	id, err := cgroupv2.ID(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return job{}, fmt.Errorf("%w: %s vanished", ErrNoCgroup, dir)
		}
		return job{}, err
	}
	return job{dir: dir, id: id}, nil
}

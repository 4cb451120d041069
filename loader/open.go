package loader

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"iter"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/jobid"
)

// Observer kinds, as Observer.Kind reports them and Config.Require takes them.
const (
	KindBPF      = "bpf"
	KindSockDiag = "sock_diag"
)

// Config says which job to observe, where, and how.
//
// A job's ranks may live in several cgroups (one per rank, as a resource
// manager makes them, appearing as ranks start): the observer watches a set
// of cgroups, Cgroup and Cgroups at Open, changed later with Watch and
// Unwatch (Watcher). Sockets of a watched cgroup, or of a descendant of one,
// belong to the job; sockets of any other cgroup do not.
type Config struct {
	// Job names the job, for the pins: with Pin, the state is kept under
	// <bpffs>/mpipause/job-<Job>/ (dots and '%' escaped, bpffs refuses
	// dots), and the next Open with the same Job finds it, with every
	// cgroup watched then. A job id as internal/jobid accepts it: 1 to 128
	// printable ASCII characters without spaces, '=', ',' or '/'. Empty:
	// the job is its one cgroup, and the pins go under
	// <bpffs>/mpipause/<cgroup-id>/ as before there were sets.
	Job string

	// Cgroup is a cgroup v2 directory of the job: an absolute path inside
	// the v2 mount, or a path relative to its root ("/" is the whole
	// hierarchy). It is one more element of the watched set, for callers
	// that watch one cgroup.
	Cgroup string

	// Cgroups are more cgroup v2 directories of the job, as Cgroup. Without
	// Job the set must be non-empty (and, with Pin, of one cgroup).
	Cgroups []string

	// Netns lists network namespaces to look in besides the observer's own:
	// a name (a file in /run/netns, as `ip netns` makes) or a path to a
	// namespace file (/proc/PID/ns/net, a bind mount).
	Netns []string

	// FollowJob also looks in every network namespace in which a process of
	// the cgroup tree lives, found anew at each Snapshot. (The sock_diag
	// observer without CAP_SYS_ADMIN leaves out those it cannot enter; see
	// SockDiagObserver.Skipped.)
	FollowJob bool

	// Pin keeps the BPF state under the job's pin directory (see Job):
	// the programs stay attached to every watched cgroup and keep
	// registering the job's connections after Close, and the next Open
	// with Pin and the same Job reuses them, its watched set included.
	// Without Pin nothing is pinned and Close detaches everything. Unpin
	// removes pinned state.
	Pin bool

	// BPFFS is the bpffs mount to pin in. Empty: the first bpf mount in
	// /proc/self/mountinfo, else a bpffs mounted at /sys/fs/bpf.
	BPFFS string

	// Unbounded lifts MaxBelow and MaxMembers: the caller named the trees
	// and pays for their walk itself (`mpipause observe`, a test's reader
	// of a whole rig). mpid's observers of a user's job never set it: the
	// user makes the cgroups below a job's and the daemon would pay.
	Unbounded bool

	// Require selects one observer kind (KindBPF or KindSockDiag) and turns
	// the fallback off. Empty: BPF, else sock_diag.
	Require string

	// OnFallback, if set, is called with the reason when Open falls back
	// from BPF to sock_diag.
	OnFallback func(reason error)
}

// Open returns an observer of cfg's job; it is a Watcher too. Unless cfg.Require says otherwise it
// tries the BPF observer and, when BPF cannot run here (ErrNotPrivileged,
// ErrNoBTF, ErrBPFUnavailable), falls back to the sock_diag observer and
// tells cfg.OnFallback why. Configuration mistakes (ErrNoCgroup,
// ErrNoCgroupV2, ErrBadJob, ErrNoNetns, ErrNoBPFFS) are returned as they are.
func Open(ctx context.Context, cfg Config) (Observer, error) {
	// Each case returns a nil interface on error, never a typed nil.
	switch cfg.Require {
	case KindBPF:
		return openComplemented(ctx, cfg)
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
	b, err := openComplemented(ctx, cfg)
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

// job is one resolved cgroup of a Config.
type job struct {
	dir string // absolute path in the v2 hierarchy
	id  uint64 // cgroup id (kernfs inode)
}

// resolveSet resolves the cgroups of cfg (Cgroup, then Cgroups),
// dropping repeats of one cgroup, and checks Job.
func resolveSet(cfg Config) ([]job, error) {
	if cfg.Job != "" && !jobid.Valid(cfg.Job) {
		return nil, fmt.Errorf("%w: Config.Job %q: %s", ErrBadJob, cfg.Job, jobid.Rule)
	}
	dirs := cfg.Cgroups
	if cfg.Cgroup != "" {
		dirs = append([]string{cfg.Cgroup}, cfg.Cgroups...)
	}
	if len(dirs) == 0 && cfg.Job == "" {
		return nil, fmt.Errorf("%w: no cgroup given; set Config.Cgroup to the job's cgroup v2 path (or Config.Job and Config.Cgroups)", ErrNoCgroup)
	}
	var set []job
	seen := map[uint64]bool{}
	for _, d := range dirs {
		j, err := resolveJob(d)
		if err != nil {
			return nil, err
		}
		if !seen[j.id] {
			seen[j.id] = true
			set = append(set, j)
		}
	}
	return set, nil
}

// pinName is the name of cfg's pin directory under <bpffs>/mpipause/:
// job-<Job> with '.' and '%' escaped as %2e and %25 (bpffs refuses a name
// with a dot), or jobh-<sha256 of Job> when that would be longer than a
// file name may be; without Job, the cgroup id of the one cgroup of set.
func pinName(cfg Config, set []job) (string, error) {
	if cfg.Job != "" {
		return jobPinName(cfg.Job), nil
	}
	if len(set) != 1 {
		return "", fmt.Errorf("%w: pinning a set of %d cgroups needs Config.Job to name the job", ErrBadJob, len(set))
	}
	return strconv.FormatUint(set[0].id, 10), nil
}

func jobPinName(id string) string {
	var b strings.Builder
	b.WriteString("job-")
	for i := 0; i < len(id); i++ {
		switch c := id[i]; c {
		case '.':
			b.WriteString("%2e")
		case '%':
			b.WriteString("%25")
		default:
			b.WriteByte(c)
		}
	}
	if b.Len() > 200 {
		sum := sha256.Sum256([]byte(id))
		return "jobh-" + hex.EncodeToString(sum[:])
	}
	return b.String()
}

func resolveJob(cgroup string) (job, error) {
	if cgroup == "" {
		return job{}, fmt.Errorf("%w: an empty cgroup path; give the job's cgroup v2 path", ErrNoCgroup)
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

// findWatched returns the id of dir in watched (id, path pairs): by the
// path it was watched under, so that a cgroup already removed is found,
// else by the id of the cgroup at dir now.
func findWatched(dir string, watched iter.Seq2[uint64, string]) (uint64, bool) {
	abs := dir
	if root, err := cgroupv2.Root(); err == nil && !strings.HasPrefix(dir, root+"/") && dir != root {
		abs = filepath.Join(root, dir)
	}
	abs = filepath.Clean(abs)
	for id, d := range watched {
		if d == abs {
			return id, true
		}
	}
	j, err := resolveJob(dir)
	if err != nil {
		return 0, false
	}
	for id := range watched {
		if id == j.id {
			return id, true
		}
	}
	return 0, false
}

// Watcher is what both observers add to Observer: the job's set of
// cgroups, changed while the observer runs. Open's observer is one too.
type Watcher interface {
	// Watch adds the cgroup dir (as Config.Cgroup) to the job: its
	// connections, and those its processes had already established, show
	// in the next Snapshot. Watching a watched cgroup does nothing; a dir
	// that is not a cgroup is an error (ErrNoCgroup) and changes nothing.
	Watch(dir string) error
	// Unwatch removes the cgroup dir from the job: its connections leave
	// the next Snapshot. Unwatching a cgroup not watched does nothing; a
	// watched cgroup already removed from the hierarchy is found by the
	// path it was watched under.
	Unwatch(dir string) error
	// Watched returns the absolute paths of the watched cgroups, sorted.
	Watched() []string
}

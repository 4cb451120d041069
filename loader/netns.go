package loader

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
)

// netnsDir is where `ip netns` keeps its named namespaces.
var netnsDir = "/run/netns"

// netns is one network namespace an observer looks in.
type netns struct {
	label string // Conn.Netns: "" for the observer's own
	ino   uint64 // nsfs inode: the namespace's identity
	f     *os.File
}

// netnsSet is the namespaces an observer watches: its own, the explicit
// ones, and (FollowJob) those the job's processes live in.
type netnsSet struct {
	own      netns
	explicit []netns
	follow   bool
	jobDirs  []string // the watched cgroup trees, followed when follow
	followed map[uint64]netns
	limits   cgroupv2.Bound // of each list's walk of jobDirs
	// denied lists, as of the last list, the job's processes whose network
	// namespace this process may not even name (EACCES: another user's
	// process, no CAP_SYS_PTRACE). Their connections are not seen, and an
	// observer must say so rather than report the rest as the whole job.
	denied []int
	// last is what the last walk of jobDirs listed, at lastAt: what a
	// pacing Snapshot may reuse (listFor). Nil until a walk, and again
	// when the dirs change.
	last   []netns
	lastAt time.Time
	walks  int // of jobDirs, for the tests
}

// openNetnsSet opens the observer's own namespace (that of the calling
// thread) and the explicit ones. Namespaces are deduplicated by inode.
// The observer sets the cgroups to follow (setDirs).
func openNetnsSet(paths []string, follow bool, limits cgroupv2.Bound) (*netnsSet, error) {
	own, err := openNetns("/proc/thread-self/ns/net", "")
	if err != nil {
		return nil, fmt.Errorf("open own network namespace: %w", err)
	}
	s := &netnsSet{own: own, follow: follow, followed: map[uint64]netns{}, limits: limits}
	seen := map[uint64]bool{own.ino: true}
	for _, p := range paths {
		path, label := netnsPath(p)
		ns, err := openNetns(path, label)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("%w: %s: %v; give a name from %s or a path such as /proc/PID/ns/net", ErrNoNetns, p, err, netnsDir)
		}
		if seen[ns.ino] {
			ns.f.Close()
			continue
		}
		seen[ns.ino] = true
		s.explicit = append(s.explicit, ns)
	}
	return s, nil
}

// setDirs sets the watched cgroups whose processes' namespaces list
// follows. A cgroup below another of dirs is left out: the walk of its
// ancestor covers it.
func (s *netnsSet) setDirs(dirs []string) {
	s.jobDirs = outermost(dirs)
	s.last = nil
}

// outermost returns the dirs that are not below another of dirs.
func outermost(dirs []string) []string {
	var out []string
	for _, d := range dirs {
		inner := false
		for _, a := range dirs {
			if a != d && strings.HasPrefix(d, a+"/") {
				inner = true
				break
			}
		}
		if !inner {
			out = append(out, d)
		}
	}
	return out
}

// netnsPath turns a Config.Netns entry into a path and a label: a bare name
// is a file in /run/netns and is its own label; a path is labelled with its
// name when it is in /run/netns, else with itself.
func netnsPath(p string) (path, label string) {
	if !strings.Contains(p, "/") {
		return filepath.Join(netnsDir, p), p
	}
	if filepath.Dir(filepath.Clean(p)) == netnsDir {
		return p, filepath.Base(p)
	}
	return p, p
}

func openNetns(path, label string) (netns, error) {
	f, err := os.Open(path)
	if err != nil {
		return netns{}, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return netns{}, err
	}
	var fsst unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fsst); err != nil || uint32(fsst.Type) != unix.NSFS_MAGIC {
		f.Close()
		return netns{}, errors.New("not a namespace file")
	}
	return netns{label: label, ino: st.Ino, f: f}, nil
}

// listFor returns the namespaces to look in for a Snapshot of ctx: the
// last walk's if ctx is Pacing and the walk is younger than PacingReuse,
// else list's.
func (s *netnsSet) listFor(ctx context.Context) ([]netns, error) {
	if s.last != nil && pacing(ctx) && time.Since(s.lastAt) < PacingReuse {
		return s.last, nil
	}
	return s.list()
}

// list returns the namespaces to look in now, refreshing the followed ones.
func (s *netnsSet) list() ([]netns, error) {
	out := append([]netns{s.own}, s.explicit...)
	if !s.follow {
		return out, nil
	}
	s.walks++
	defer func() { s.lastAt = time.Now() }()
	inos, denied, err := jobNetns(s.jobDirs, s.limits)
	if err != nil {
		return nil, err
	}
	s.denied = denied
	known := map[uint64]bool{}
	for _, ns := range out {
		known[ns.ino] = true
	}
	var names map[uint64]string
	live := map[uint64]bool{}
	for ino, pid := range inos {
		if known[ino] {
			continue
		}
		live[ino] = true
		if _, ok := s.followed[ino]; ok {
			continue
		}
		if names == nil {
			names = namedNetns()
		}
		label, ok := names[ino]
		if !ok {
			label = "net:[" + strconv.FormatUint(ino, 10) + "]"
		}
		ns, err := openNetns("/proc/"+strconv.Itoa(pid)+"/ns/net", label)
		if isDenied(err) {
			s.denied = append(s.denied, pid)
		}
		if err != nil || ns.ino != ino {
			// The process exited or moved meanwhile; the next Snapshot
			// sees where it went.
			if err == nil {
				ns.f.Close()
			}
			delete(live, ino)
			continue
		}
		s.followed[ino] = ns
	}
	for ino, ns := range s.followed {
		if !live[ino] {
			ns.f.Close()
			delete(s.followed, ino)
			continue
		}
		out = append(out, ns)
	}
	s.last = out
	return out, nil
}

func (s *netnsSet) close() {
	s.own.f.Close()
	for _, ns := range s.explicit {
		ns.f.Close()
	}
	for _, ns := range s.followed {
		ns.f.Close()
	}
}

// MaxBelow bounds the cgroups below a job's watched cgroups that one
// Snapshot reads (the watched cgroups themselves are a job's places,
// bounded by its ranks). A rank watched where its launcher put it (mpid's
// "own" placement) may be in a cgroup its user owns, below which they can
// make any number of cgroups at any time, and each Snapshot of a pause
// would walk them all under mpid's real-time priority. A job needs none:
// its ranks are watched in their own cgroups, and the cgroups a rank's own
// children make are a few, so 64 is more than a real job ever has below
// its places. Past it a Snapshot fails (cgroupv2.ErrTooMany) naming the
// cgroup: a view of part of the tree could miss a job connection, and a
// pause must check every one.
const MaxBelow = 64

// MaxMembers bounds the processes one Snapshot reads in a job's cgroup
// trees to follow their network namespaces (FollowJob): a job's ranks on a
// node are at most 4,096 a user (ranks.MaxRanksPerUID) and their cgroups
// hold them and a few children each; more are a user's own making. Past it
// a Snapshot fails, as past MaxBelow.
const MaxMembers = 16384

// jobNetns maps the network namespace inode of every process in the cgroup
// trees at dirs to one pid living in it. A watched cgroup removed (its rank
// ended before it was unwatched) has no processes. The trees are read
// within limits (Config.limits), all of them together.
func jobNetns(dirs []string, limits cgroupv2.Bound) (map[uint64]int, []int, error) {
	out := map[uint64]int{}
	var denied []int
	b := &limits
	root, _ := cgroupv2.Root()
	for _, dir := range dirs {
		if dir == root {
			// The whole node, asked for by name (`mpipause observe`'s
			// default): every process, from /proc, and no cgroup walk
			// (mpid never watches the root).
			pids, err := allPids()
			if err != nil {
				return nil, nil, err
			}
			addNetns(pids, out, &denied)
			continue
		}
		if err := walkJobNetns(b, dir, out, &denied); err != nil {
			return nil, nil, err
		}
	}
	return out, denied, nil
}

// walkJobNetns adds the network namespaces of the processes in dir's tree.
// The Bound walks it past cgroups removed meanwhile and past threaded ones
// (libvirt's), whose processes their threaded domain lists.
func walkJobNetns(b *cgroupv2.Bound, dir string, out map[uint64]int, denied *[]int) error {
	pids, err := b.Members(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if errors.Is(err, cgroupv2.ErrTooMany) {
		return err // it names the cgroup
	}
	if err != nil {
		return fmt.Errorf("follow job %s: %w", dir, err)
	}
	addNetns(pids, out, denied)
	return nil
}

// addNetns adds the network namespaces of pids to out, and to denied the
// pids whose namespace this process may not name.
func addNetns(pids []int, out map[uint64]int, denied *[]int) {
	for _, pid := range pids {
		ino, err := netnsInode("/proc/" + strconv.Itoa(pid) + "/ns/net")
		switch {
		case err == nil:
			if _, ok := out[ino]; !ok {
				out[ino] = pid
			}
		case isDenied(err):
			*denied = append(*denied, pid)
		}
		// Any other error: the process exited during the walk.
	}
}

// allPids lists every process of the node (of this pid namespace).
func allPids() ([]int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, n)
		}
	}
	return pids, nil
}

func isDenied(err error) bool {
	return errors.Is(err, fs.ErrPermission)
}

// deniedSkipped appends to skipped, as one entry for Skipped, the processes
// whose namespace could not be read.
func (s *netnsSet) deniedSkipped(skipped []string) []string {
	if len(s.denied) == 0 {
		return skipped
	}
	pids := make([]string, len(s.denied))
	for i, pid := range s.denied {
		pids[i] = strconv.Itoa(pid)
	}
	return append(skipped, "the network namespace of pid "+strings.Join(pids, ", ")+" (not readable: another user's process; its connections are shown only if it is this observer's own)")
}

// netnsInode reads a namespace's inode from its magic link ("net:[INODE]")
// without opening it.
func netnsInode(path string) (uint64, error) {
	l, err := os.Readlink(path)
	if err != nil {
		return 0, err
	}
	s, ok := strings.CutPrefix(l, "net:[")
	if !ok || !strings.HasSuffix(s, "]") {
		return 0, fmt.Errorf("%s: unexpected link %q", path, l)
	}
	return strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64)
}

// namedNetns maps the inode of each namespace named in /run/netns to its name.
func namedNetns() map[uint64]string {
	out := map[uint64]string{}
	ents, err := os.ReadDir(netnsDir)
	if err != nil {
		return out
	}
	for _, e := range ents {
		var st unix.Stat_t
		if unix.Stat(filepath.Join(netnsDir, e.Name()), &st) == nil {
			out[st.Ino] = e.Name()
		}
	}
	return out
}

// inNetns runs fn on an OS thread that has entered ns, for calls whose
// effect depends on the caller's network namespace (creating a tcp
// iterator binds it to current->nsproxy->net_ns). The thread goes back to
// its namespace afterwards; if that fails it stays locked, and the runtime
// ends it when the goroutine exits, so no goroutine ever runs in ns by
// accident.
func inNetns(ns netns, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		cur, err := netnsInode("/proc/thread-self/ns/net")
		if err == nil && cur == ns.ino {
			err := fn()
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		back, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open thread's network namespace: %w", err)
			return
		}
		defer back.Close()
		if err := unix.Setns(int(ns.f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter network namespace %s: %w", nsName(ns), err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(back.Fd()), unix.CLONE_NEWNET); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- ferr
	}()
	return <-errc
}

func nsName(ns netns) string {
	if ns.label == "" {
		return "(own)"
	}
	return ns.label
}

// limits is the bound of a Snapshot's walks of the watched trees.
func (cfg Config) limits() cgroupv2.Bound {
	if cfg.Unbounded {
		// Procs: every pid the kernel can have (pid_max is at most 2^22).
		return cgroupv2.Bound{Below: math.MaxInt32, Procs: 1 << 22}
	}
	return cgroupv2.Bound{Below: MaxBelow, Procs: MaxMembers}
}

// Package cgroupv2 finds the cgroup v2 hierarchy through /proc/self/mountinfo
// (it is at /sys/fs/cgroup on unified systems and /sys/fs/cgroup/unified on
// hybrid ones such as this project's machines) and makes, fills, freezes and
// removes cgroups in it.
package cgroupv2

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/mountinfo"
)

// ErrNotMounted says no cgroup2 filesystem is mounted in this mount namespace.
var ErrNotMounted = errors.New("cgroup v2 is not mounted (no cgroup2 entry in /proc/self/mountinfo); mount it with: mount -t cgroup2 none /sys/fs/cgroup/unified")

// Root returns the mount point of the cgroup v2 hierarchy.
func Root() (string, error) {
	f, err := os.Open(mountinfo.Self)
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	return rootFrom(f)
}

// rootFrom is the first cgroup2 mount of the whole hierarchy in a mountinfo
// listing: a bind mount of a sub-tree (a container's) is not the root.
func rootFrom(r io.Reader) (string, error) {
	ms, err := mountinfo.Parse(r)
	if err != nil {
		return "", err
	}
	for _, m := range ms {
		if m.FSType == "cgroup2" && m.Root == "/" {
			return m.Point, nil
		}
	}
	return "", ErrNotMounted
}

// Resolve turns a cgroup given by a user into an absolute directory in the
// v2 hierarchy: an absolute path inside the mount is taken as is, anything
// else is relative to the hierarchy's root. It fails with one clear error if
// the directory does not exist or is not a cgroup v2 directory.
func Resolve(p string) (string, error) {
	root, err := Root()
	if err != nil {
		return "", err
	}
	abs := p
	if !strings.HasPrefix(p, root+"/") && p != root {
		abs = filepath.Join(root, p)
	}
	if _, err := os.Stat(filepath.Join(abs, "cgroup.procs")); err != nil {
		return "", fmt.Errorf("cgroup %q: not a cgroup v2 directory under %s", p, root)
	}
	return abs, nil
}

// ID returns the cgroup id of dir: the inode number of the directory in
// cgroupfs, which is what bpf_get_current_cgroup_id and kernfs ids report.
func ID(dir string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return 0, fmt.Errorf("stat cgroup %s: %w", dir, err)
	}
	return st.Ino, nil
}

// TreeIDs returns the cgroup ids of dir and of every cgroup below it, dir's
// first: the set a job's sockets may carry as their cgroup, since a process
// may move into a child cgroup of the job's. A cgroup removed during the walk
// is left out; one created after it is not seen, so callers walk again for
// each snapshot.
func TreeIDs(dir string) ([]uint64, error) {
	var ids []uint64
	err := walk(dir, func(p string) error {
		id, err := ID(p)
		if err == nil {
			ids = append(ids, id)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return ids, nil
}

// Create makes the cgroup dir (and its parents) in the v2 hierarchy.
func Create(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create cgroup %s: %w", dir, err)
	}
	return nil
}

// AddProc moves pid into the cgroup dir.
func AddProc(dir string, pid int) error {
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		return fmt.Errorf("move pid %d into %s: %w", pid, dir, err)
	}
	return nil
}

// Procs lists the pids in the cgroup dir (not its descendants).
func Procs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("read procs of %s: %w", dir, err)
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	return pids, nil
}

// ErrTooMany says a cgroup held more than a bounded read takes: what is
// in a cgroup a user owns is the user's to choose, and mpid (and the
// observer, in `mpipause observe`) reads no more of it than a job could
// need.
var ErrTooMany = errors.New("more than mpipause reads")

// ProcsMax lists the pids in the cgroup dir (not its descendants), at
// most max of them: more fail with ErrTooMany, read no further.
func ProcsMax(dir string, max int) ([]int, error) {
	f, err := os.Open(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("read procs of %s: %w", dir, err)
	}
	defer f.Close()
	// A pid is 7 digits at most (pid_max is 2^22) and a newline.
	b, err := io.ReadAll(io.LimitReader(f, int64(max)*8+1))
	if err != nil {
		return nil, fmt.Errorf("read procs of %s: %w", dir, err)
	}
	pids := make([]int, 0, bytes.Count(b, []byte{'\n'}))
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	if len(b) > max*8 || len(pids) > max {
		return nil, fmt.Errorf("cgroup %s holds more than %d processes: %w", dir, max, ErrTooMany)
	}
	return pids, nil
}

// Descendants is the number of live cgroups below dir (cgroup.stat's
// nr_descendants): the kernel's count, read without walking them.
func Descendants(dir string) (int, error) {
	v, err := field(dir, "cgroup.stat", "nr_descendants")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(v)
}

// Populated says whether any process lives in dir or below
// (cgroup.events' populated), read without walking the tree.
func Populated(dir string) (bool, error) {
	v, err := field(dir, "cgroup.events", "populated")
	return v == "1", err
}

// field is the value of key in dir's flat-keyed interface file.
func field(dir, file, key string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		return "", fmt.Errorf("read %s of %s: %w", file, dir, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+" "); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("%s/%s has no %s field", dir, file, key)
}

// Remove deletes the cgroup dir after moving any process still in it to the
// hierarchy's root. Removing a cgroup that does not exist is not an error.
func Remove(dir string) error {
	root, err := Root()
	if err != nil {
		return err
	}
	pids, err := Procs(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	for _, pid := range pids {
		_ = AddProc(root, pid) // the process may have exited meanwhile
	}
	return RemoveEmpty(dir)
}

// RemoveEmpty deletes the cgroup dir if no process is left in it (or
// below), and moves nobody: a process is only ever where its launcher or
// mpid put it. Removing a cgroup that does not exist is not an error.
func RemoveEmpty(dir string) error {
	// rmdir fails with EBUSY for a moment after the last process leaves.
	for i := 0; ; i++ {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || i == 100 {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		if busy, perr := Populated(dir); perr == nil && busy {
			return fmt.Errorf("remove cgroup %s: processes are still in it", dir)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Members lists the pids in the cgroup dir and in every cgroup below it.
func Members(dir string) ([]int, error) { return MembersMax(dir, -1) }

// MembersMax is Members walking at most max cgroups (dir included; no
// bound if max < 0): a larger tree fails with ErrTooMany, walked no
// further.
func MembersMax(dir string, max int) ([]int, error) {
	var pids []int
	seen := 0
	err := walk(dir, func(path string) error {
		if seen++; max >= 0 && seen > max {
			return fmt.Errorf("cgroup %s has more than %d cgroups in its tree: %w", dir, max, ErrTooMany)
		}
		ps, err := Procs(path)
		if err != nil {
			return err
		}
		pids = append(pids, ps...)
		return nil
	})
	return pids, err
}

// Bound bounds walks of cgroup trees whose owners choose their size (a
// user makes any number of cgroups below a cgroup delegated to them, and
// puts any number of processes in them): at most Below cgroups below the
// walked trees' roots and Procs processes read, in all the walks of one
// Bound. Past either, a walk fails with ErrTooMany, walked no further,
// and the error names the cgroup where it stopped and the bound: a caller
// that must see the whole tree (a pause's kernel check) fails rather
// than go on with part of it. The roots themselves are not counted: their
// caller chose them.
type Bound struct {
	Below, Procs int
	below, procs int // used so far
}

// cgroup counts one more cgroup below a root, path.
func (b *Bound) cgroup(root, path string) error {
	if path == root {
		return nil
	}
	if b.below++; b.below > b.Below {
		return fmt.Errorf("cgroup %s: more than %d cgroups below it and the job's other cgroups: %w", root, b.Below, ErrTooMany)
	}
	return nil
}

// TreeIDs is cgroupv2.TreeIDs within b.
func (b *Bound) TreeIDs(dir string) ([]uint64, error) {
	var ids []uint64
	err := walk(dir, func(p string) error {
		if err := b.cgroup(dir, p); err != nil {
			return err
		}
		id, err := ID(p)
		if err != nil {
			return err
		}
		ids = append(ids, id)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return ids, nil
}

// Members is cgroupv2.Members within b.
func (b *Bound) Members(dir string) ([]int, error) {
	var pids []int
	err := walk(dir, func(p string) error {
		if err := b.cgroup(dir, p); err != nil {
			return err
		}
		ps, err := ProcsMax(p, b.Procs-b.procs)
		if errors.Is(err, ErrTooMany) {
			return fmt.Errorf("cgroup %s: more than %d processes in it, below it and in the job's other cgroups: %w", dir, b.Procs, ErrTooMany)
		}
		if err != nil {
			return err
		}
		b.procs += len(ps)
		pids = append(pids, ps...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return pids, nil
}

// walk calls visit on dir and on every cgroup below it, dir first, until
// visit fails. A cgroup removed during the walk is passed over (it failing
// with ErrNotExist), and so is a threaded one (libvirt's emulator and vcpu
// ones refuse cgroup.procs with EOPNOTSUPP): its processes are listed by
// its threaded domain, above it, and so is everything below it.
func walk(dir string, visit func(path string) error) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p != dir && errors.Is(err, fs.ErrNotExist) {
				return nil // removed while we walked
			}
			return fmt.Errorf("walk cgroup tree %s: %w", dir, err)
		}
		if !d.IsDir() {
			return nil
		}
		err = visit(p)
		if p != dir && (errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.EOPNOTSUPP)) {
			return fs.SkipDir
		}
		return err
	})
}

// Freeze freezes every process of the cgroup dir and its descendants
// (cgroup.freeze) and returns once the kernel reports the whole tree frozen
// ("frozen 1" in cgroup.events), or ctx ends. Freezing is not instant: a
// task in the middle of a system call is frozen when it leaves the kernel.
func Freeze(ctx context.Context, dir string) error { return setFrozen(ctx, dir, true) }

// Thaw undoes Freeze and returns once the kernel reports the tree thawed.
func Thaw(ctx context.Context, dir string) error { return setFrozen(ctx, dir, false) }

// Freezer is Freeze and Thaw as methods, for a caller that takes a
// freezer (internal/node's Role.Freezer) to call this package directly.
type Freezer struct{}

func (Freezer) Freeze(ctx context.Context, dir string) error { return Freeze(ctx, dir) }
func (Freezer) Thaw(ctx context.Context, dir string) error   { return Thaw(ctx, dir) }

// Of is process pid's cgroup v2 directory, from /proc/PID/cgroup ("0::/path").
func Of(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	root, err := Root()
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return filepath.Join(root, p), nil
		}
	}
	return "", errors.New("no cgroup v2 entry")
}

// Frozen reports whether the kernel says the cgroup dir is frozen.
func Frozen(dir string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		return false, fmt.Errorf("read events of %s: %w", dir, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "frozen "); ok {
			return v == "1", nil
		}
	}
	return false, fmt.Errorf("%s/cgroup.events has no frozen field (kernel older than 5.2?)", dir)
}

func setFrozen(ctx context.Context, dir string, freeze bool) error {
	verb, v := "thaw", "0"
	if freeze {
		verb, v = "freeze", "1"
	}
	// cgroup.events raises POLLPRI when it changes (cgroup-v2.rst): open it
	// before writing, so the change cannot slip between write and wait.
	ev, err := unix.Open(filepath.Join(dir, "cgroup.events"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%s %s: %w", verb, dir, err)
	}
	defer unix.Close(ev)
	if err := os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte(v), 0); err != nil {
		return fmt.Errorf("%s %s: %w", verb, dir, err)
	}
	buf := make([]byte, 256)
	for {
		// Reading re-arms the notification; the content is read from the
		// file by name for clarity.
		unix.Pread(ev, buf, 0)
		frozen, err := Frozen(dir)
		if err != nil {
			return fmt.Errorf("%s: %w", verb, err)
		}
		if frozen == freeze {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%s %s: not done: %w", verb, dir, err)
		}
		// Bounded waits so that ctx is seen even if no event comes.
		unix.Poll([]unix.PollFd{{Fd: int32(ev), Events: unix.POLLPRI}}, 50)
	}
}

// fileidKernfs is the file handle type of a kernfs node (include/linux/exportfs.h
// FILEID_KERNFS): its 8 bytes are the node's id, the cgroup id.
const fileidKernfs = 0xfe

// PathOf returns the absolute path of the cgroup whose id is id, found by
// its file handle (open_by_handle_at(2), which takes CAP_DAC_READ_SEARCH),
// not by walking the hierarchy. A cgroup that no longer exists gives an
// error that is os.ErrNotExist.
func PathOf(id uint64) (string, error) {
	root, err := Root()
	if err != nil {
		return "", err
	}
	mnt, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open %s: %w", root, err)
	}
	defer unix.Close(mnt)
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], id)
	fd, err := unix.OpenByHandleAt(mnt, unix.NewFileHandle(fileidKernfs, b[:]), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC)
	if err != nil {
		if errors.Is(err, unix.ESTALE) || errors.Is(err, unix.ENOENT) {
			return "", fmt.Errorf("cgroup id %d: %w", id, os.ErrNotExist)
		}
		return "", fmt.Errorf("open cgroup id %d: %w", id, err)
	}
	defer unix.Close(fd)
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", fmt.Errorf("cgroup id %d: %w", id, err)
	}
	if strings.HasSuffix(p, " (deleted)") {
		return "", fmt.Errorf("cgroup id %d: %w", id, os.ErrNotExist)
	}
	return p, nil
}

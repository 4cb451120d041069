package loader

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net/netip"
	"os"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/caps"
	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/sockdiag"
)

// SockDiagObserver observes a job through sock_diag netlink (INET_DIAG):
// the kernel's rqueue/wqueue for every connected TCP socket of the job's
// cgroup trees (every watched cgroup and its descendants), filtered by
// cgroup id in the kernel. It needs no BPF and no
// privilege for the observer's own network namespace; entering others takes
// CAP_SYS_ADMIN. Without it, explicit Config.Netns are refused at open, and
// namespaces found by FollowJob that it cannot enter are left out of
// Snapshot (Skipped names them). It reads no sequence numbers and keeps no
// counters: those Conn fields are zero and Counted is false.
type SockDiagObserver struct {
	ns *netnsSet

	mu      sync.Mutex        // serializes Snapshot, Watch, Unwatch and Close
	cgroups map[uint64]string // the watched cgroups' paths, by id
	closed  bool
	diag    map[uint64]*sockdiag.DiagConn // by netns inode
	skipped []string                      // namespaces the last Snapshot could not enter
}

var (
	_ Observer = (*SockDiagObserver)(nil)
	_ Watcher  = (*SockDiagObserver)(nil)
)

// OpenSockDiag returns the sock_diag observer of cfg's job, watching its
// cgroups (Cgroup and Cgroups). cfg.Job, cfg.Pin, cfg.BPFFS, cfg.Require
// and cfg.OnFallback are ignored.
func OpenSockDiag(ctx context.Context, cfg Config) (*SockDiagObserver, error) {
	set, err := resolveSet(cfg)
	if err != nil {
		return nil, err
	}
	if len(cfg.Netns) > 0 {
		missing, err := caps.Missing(caps.SysAdmin)
		if err != nil {
			return nil, err
		}
		if len(missing) > 0 {
			return nil, fmt.Errorf("%w: entering network namespaces %v needs CAP_SYS_ADMIN; run as root or watch only the own namespace", ErrNotPrivileged, cfg.Netns)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ns, err := openNetnsSet(cfg.Netns, cfg.FollowJob, cfg.limits())
	if err != nil {
		return nil, err
	}
	d := &SockDiagObserver{ns: ns, cgroups: map[uint64]string{}, diag: map[uint64]*sockdiag.DiagConn{}}
	for _, j := range set {
		d.cgroups[j.id] = j.dir
	}
	d.ns.setDirs(d.dirs())
	return d, nil
}

// Watch adds the cgroup dir to the job (Watcher): the next Snapshot
// filters by its tree's cgroup ids too.
func (d *SockDiagObserver) Watch(dir string) error {
	j, err := resolveJob(dir)
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	if _, ok := d.cgroups[j.id]; !ok {
		d.cgroups[j.id] = j.dir
		d.ns.setDirs(d.dirs())
	}
	return nil
}

// Unwatch removes the cgroup dir from the job (Watcher).
func (d *SockDiagObserver) Unwatch(dir string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	if id, ok := findWatched(dir, maps.All(d.cgroups)); ok {
		delete(d.cgroups, id)
		d.ns.setDirs(d.dirs())
	}
	return nil
}

// Watched returns the paths of the watched cgroups, sorted (Watcher).
func (d *SockDiagObserver) Watched() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dirs()
}

func (d *SockDiagObserver) dirs() []string {
	return slices.Sorted(maps.Values(d.cgroups))
}

// treeIDs returns the cgroup ids of the watched trees, never nil (an
// empty set matches no socket) but when the hierarchy's root is watched
// (every socket is the job's: no filter, no walk). A watched cgroup
// already removed from the hierarchy (its rank ended before it was
// unwatched) counts by its own id: sockets its processes made may outlive
// it. The trees are read within the Config's limits, all of them
// together: past them the Snapshot fails rather than filter by part of
// them.
func (d *SockDiagObserver) treeIDs() ([]uint64, error) {
	ids := []uint64{}
	seen := map[uint64]bool{}
	outer := outermost(d.dirs())
	root, _ := cgroupv2.Root()
	if slices.Contains(outer, root) {
		return nil, nil
	}
	b := &cgroupv2.Bound{Below: d.ns.limits.Below}
	for id, dir := range d.cgroups {
		if !slices.Contains(outer, dir) {
			continue // in a watched tree walked below
		}
		tree, err := b.TreeIDs(dir)
		if err != nil {
			if _, serr := os.Stat(dir); !errors.Is(serr, fs.ErrNotExist) {
				return nil, err
			}
			tree = []uint64{id}
		}
		for _, t := range tree {
			if !seen[t] {
				seen[t] = true
				ids = append(ids, t)
			}
		}
	}
	return ids, nil
}

// Snapshot returns the job's connected TCP sockets (LISTEN, SYN_RECV,
// TIME_WAIT and CLOSE left out) in every watched network namespace: one
// dump per namespace and address family.
func (d *SockDiagObserver) Snapshot(ctx context.Context) ([]Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	// A job may create child cgroups at any time: walk its trees each time.
	ids, err := d.treeIDs()
	if err != nil {
		return nil, err
	}
	nss, err := d.ns.list()
	if err != nil {
		return nil, err
	}
	live := make(map[uint64]bool, len(nss))
	d.skipped = d.skipped[:0]
	var out []Conn
	for _, ns := range nss {
		live[ns.ino] = true
		dc, ok := d.diag[ns.ino]
		if !ok {
			fd := int(ns.f.Fd())
			if ns.label == "" {
				fd = -1 // the own namespace: no setns, no privilege needed
			}
			if dc, err = sockdiag.DialDiag(fd); err != nil {
				if errors.Is(err, unix.EPERM) && d.followed(ns) {
					d.skipped = append(d.skipped, "network namespace "+ns.label+" (entering it needs CAP_SYS_ADMIN)")
					continue
				}
				return nil, fmt.Errorf("sock_diag in %s: %w", nsName(ns), err)
			}
			d.diag[ns.ino] = dc
		}
		socks, err := dc.DumpTCP(ctx, sockdiag.Filter{States: sockdiag.StatesConnected, Cgroups: ids})
		if err != nil {
			return nil, fmt.Errorf("sock_diag in %s: %w", nsName(ns), err)
		}
		for i := range socks {
			out = append(out, diagConn(&socks[i], ns.label))
		}
	}
	d.skipped = d.ns.deniedSkipped(d.skipped)
	for ino, dc := range d.diag {
		if !live[ino] {
			dc.Close()
			delete(d.diag, ino)
		}
	}
	return out, nil
}

// followed reports whether ns was found by FollowJob, not asked for.
func (d *SockDiagObserver) followed(ns netns) bool {
	_, ok := d.ns.followed[ns.ino]
	return ok
}

// Skipped names the network namespaces of the job that the last Snapshot
// left out because the observer may not enter them (no CAP_SYS_ADMIN) or
// may not even name them (another user's process, no CAP_SYS_PTRACE).
func (d *SockDiagObserver) Skipped() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.skipped...)
}

// diagConn converts a sock_diag socket; v4-mapped addresses are unmapped,
// as the BPF observer does.
func diagConn(s *sockdiag.TCPSocket, netns string) Conn {
	return Conn{
		Cookie:    s.Cookie,
		Local:     netip.AddrPortFrom(s.Local.Addr().Unmap(), s.Local.Port()),
		Remote:    netip.AddrPortFrom(s.Remote.Addr().Unmap(), s.Remote.Port()),
		State:     TCPState(s.State),
		Netns:     netns,
		Cgroup:    s.Cgroup,
		SendQueue: s.WQueue,
		Unread:    s.RQueue,
	}
}

// Kind returns KindSockDiag.
func (d *SockDiagObserver) Kind() string { return KindSockDiag }

// Close releases the observer's sockets and namespace handles.
func (d *SockDiagObserver) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	for ino, dc := range d.diag {
		dc.Close()
		delete(d.diag, ino)
	}
	d.ns.close()
	return nil
}

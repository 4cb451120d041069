package loader

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// The cgroups an observer watches: a sockops program attached by a
// bpf_link to each, beside whatever else is attached there.

// watch is one watched cgroup.
type watch struct {
	dir   string
	link  link.Link // sockops, attached to dir
	fresh bool      // attached by OpenBPF, which detaches it if it fails
}

// watch attaches sockops to the cgroup j and adds it to the watched set
// (a no-op if it is there already), pinning the link when o pins. On error
// it undoes what it did.
//
// The link is a bpf_link (BPF_LINK_CREATE), never a BPF_PROG_ATTACH:
// the kernel attaches a cgroup link as BPF_F_ALLOW_MULTI, beside whatever
// else is attached there, so the programs a resource manager attached to
// its cgroups (systemd's cgroup_skb and device programs, Slurm's device
// program) stay in place and keep running; and where a program was
// attached without ALLOW_MULTI, or an ancestor's forbids more, the attach
// fails (EPERM) instead of replacing it. link.AttachCgroup would fall back
// to a plain BPF_PROG_ATTACH with ALLOW_OVERRIDE on a kernel without
// cgroup links, which replaces a program attached without flags; every
// kernel that runs the other programs has cgroup links, so nothing is lost
// by refusing that fallback.
func (o *BPFObserver) watch(j job, fresh bool) error {
	if _, ok := o.cgroups[j.id]; ok {
		return nil
	}
	if max := int(o.watched.MaxEntries()); len(o.cgroups) >= max {
		return fmt.Errorf("watch cgroup %s: the job watches %d cgroups already, the most one observer can", j.dir, max)
	}
	f, err := os.Open(j.dir)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNoCgroup, err)
	}
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(f.Fd()), Program: o.sockops, Attach: ebpf.AttachCGroupSockOps})
	f.Close()
	if err != nil {
		return fmt.Errorf("%w: attach sockops to %s: %w", ErrBPFUnavailable, j.dir, err)
	}
	if err := o.watched.Put(j.id, uint8(1)); err != nil {
		l.Close()
		return fmt.Errorf("watch cgroup %s: %w", j.dir, err)
	}
	if o.pinDir != "" {
		if err := o.pin(l, pinSockops+strconv.FormatUint(j.id, 10)); err != nil {
			o.watched.Delete(j.id)
			l.Close()
			return fmt.Errorf("pin sockops link of %s: %w", j.dir, err)
		}
	}
	o.cgroups[j.id] = &watch{dir: j.dir, link: l, fresh: fresh}
	// What the cgroup's processes established before the attach is
	// adopted by the next Snapshot's iter/tcp pass, in every namespace.
	clear(o.adopted)
	clear(o.belongs)
	return nil
}

// Watch adds the cgroup dir to the job (Watcher): sockops is attached to
// it with a link of its own (pinned in the job's pin directory when
// Config.Pin), its id goes into the watched map, and the next Snapshot runs
// the adoption pass again in each namespace, which takes in the
// connections the cgroup's processes had established. Snapshot's own pass
// does not grow with the number of cgroups.
func (o *BPFObserver) Watch(dir string) error {
	j, err := resolveJob(dir)
	if err != nil {
		return err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return ErrClosed
	}
	if err := o.watch(j, false); err != nil {
		return err
	}
	o.ns.setDirs(o.dirs())
	return nil
}

// Unwatch removes the cgroup dir from the job (Watcher): its id leaves the
// watched map, its sockops link is detached and unpinned, and the next
// Snapshot runs the iter/tcp pass again in each namespace, which forgets
// the connections of sockets not in a watched cgroup any more (those of a
// cgroup below another watched one stay).
func (o *BPFObserver) Unwatch(dir string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return ErrClosed
	}
	id, ok := o.find(dir)
	if !ok {
		return nil
	}
	w := o.cgroups[id]
	if err := o.watched.Delete(id); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("unwatch cgroup %s: %w", w.dir, err)
	}
	// The pin is what keeps a pinned link attached past Close; the
	// detach makes it go now rather than after a grace period.
	if o.pinDir != "" {
		if err := os.Remove(filepath.Join(o.pinDir, pinSockops+strconv.FormatUint(id, 10))); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("unpin sockops link of %s: %w", w.dir, err)
		}
	}
	if err := w.link.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("detach sockops from %s: %w", w.dir, err)
	}
	w.link.Close()
	delete(o.cgroups, id)
	o.ns.setDirs(o.dirs())
	clear(o.adopted)
	clear(o.belongs)
	return nil
}

// find returns the id of the watched cgroup dir: by the path it was
// watched under (so that a cgroup already removed is found), else by its
// id.
func (o *BPFObserver) find(dir string) (uint64, bool) {
	return findWatched(dir, func(yield func(uint64, string) bool) {
		for id, w := range o.cgroups {
			if !yield(id, w.dir) {
				return
			}
		}
	})
}

// Watched returns the paths of the watched cgroups, sorted (Watcher).
func (o *BPFObserver) Watched() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.dirs()
}

// WatchedIDs returns the ids of the watched cgroups, sorted.
func (o *BPFObserver) WatchedIDs() []uint64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	ids := make([]uint64, 0, len(o.cgroups))
	for id := range o.cgroups {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

func (o *BPFObserver) dirs() []string {
	dirs := make([]string, 0, len(o.cgroups))
	for _, w := range o.cgroups {
		dirs = append(dirs, w.dir)
	}
	slices.Sort(dirs)
	return dirs
}

package loader

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/jobid"
	"golang.org/x/sys/unix"
)

// Pins: with a bpffs, the observer's maps, links and per-cgroup watches
// are pinned under a directory of its own, so that a restarted mpid takes
// them over (and the records of the job's connections with them) instead of
// starting blind; Unpin and UnpinID remove them.

func pinDirOf(bpffs string, id uint64) string {
	return filepath.Join(bpffs, pinRoot, strconv.FormatUint(id, 10))
}

// pin pins obj as name in the pin directory, noting it for abort.
func (o *BPFObserver) pin(obj interface{ Pin(string) error }, name string) error {
	path := filepath.Join(o.pinDir, name)
	if err := obj.Pin(path); err != nil {
		return err
	}
	o.madePins = append(o.madePins, path)
	return nil
}

// loadPinnedMaps loads the pinned maps if all are there and fit this
// build's specs; it leaves o.conns nil if any is missing.
func (o *BPFObserver) loadPinnedMaps(specs collectionSpecs) error {
	names := mapPins
	mapSpecs := []*ebpf.MapSpec{specs.sockops.Maps[pinConns], specs.sockops.Maps[pinWatched], specs.conniter.Maps[pinRecords],
		specs.sockops.Maps[pinList], specs.sockops.Maps[pinLost]}
	var maps [5]*ebpf.Map
	for i, name := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(o.pinDir, name), nil)
		if errors.Is(err, fs.ErrNotExist) {
			closeAll(maps[:i])
			return nil
		}
		if err != nil {
			closeAll(maps[:i])
			return fmt.Errorf("load pinned map %s: %w", filepath.Join(o.pinDir, name), err)
		}
		maps[i] = m
		if err := mapSpecs[i].Compatible(m); err != nil {
			closeAll(maps[:i+1])
			return fmt.Errorf("%w: map %s: %v; remove it with loader.Unpin and open again", ErrStalePin, filepath.Join(o.pinDir, name), err)
		}
	}
	o.conns, o.watched, o.records, o.list, o.lost = maps[0], maps[1], maps[2], maps[3], maps[4]
	return nil
}

// mapRecords maps the records array into memory, read-only.
func (o *BPFObserver) mapRecords() error {
	size := int(o.records.MaxEntries()) * recordSize
	size = (size + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	mem, err := unix.Mmap(o.records.FD(), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("%w: mmap map records: %w", ErrBPFUnavailable, err)
	}
	o.recMem = mem
	return nil
}

func closeAll(maps []*ebpf.Map) {
	for _, m := range maps {
		if m != nil {
			m.Close()
		}
	}
}

// loadPinnedLinks loads the job's pinned links and reports whether all were
// there. A partial set (a crash between two pins, or a build without one of
// them) is removed: its links detach, and setUp attaches a complete new
// set over the pinned maps.
func (o *BPFObserver) loadPinnedLinks() bool {
	loaded := map[string]link.Link{}
	for _, name := range linkPins {
		l, err := link.LoadPinnedLink(filepath.Join(o.pinDir, name), nil)
		if err != nil {
			continue
		}
		loaded[name] = l
	}
	// Complete: the links this kernel's programs make (Probe), no more
	// and no fewer, so that a set cut short by a crash is made anew
	// rather than run in a weaker mode than the kernel allows.
	ti, tiOK := loaded[pinTCPIter].(*link.Iter)
	ci, ciOK := loaded[pinConnIter].(*link.Iter)
	_, stOK := loaded[pinState]
	complete := tiOK == o.features.Adoption && stOK == o.features.State &&
		(ciOK || loaded[pinConnIter] == nil) && ciOK == (o.features.ConnIter != "")
	if complete {
		o.links, o.tcpIter, o.connIter = loaded, ti, ci
		o.scanTCP = o.connIter == nil
		return true
	}
	for name, l := range loaded {
		l.Close()
		unpinLink(filepath.Join(o.pinDir, name))
	}
	for _, name := range retiredLinkPins {
		unpinLink(filepath.Join(o.pinDir, name))
	}
	return false
}

// loadPinnedWatches takes over the sockops links pinned for the job's
// cgroups, with their cgroups' paths. The link of a cgroup removed since
// (the kernel detached it then) goes, and so does an id in the watched map
// without a link (a Watch cut short).
func (o *BPFObserver) loadPinnedWatches() error {
	ents, err := os.ReadDir(o.pinDir)
	if err != nil {
		return fmt.Errorf("read pin directory: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		var id uint64
		switch {
		case name == pinSockopsOld:
		case strings.HasPrefix(name, pinSockops):
			if id, err = strconv.ParseUint(strings.TrimPrefix(name, pinSockops), 10, 64); err != nil {
				unpinLink(filepath.Join(o.pinDir, name))
				continue
			}
		default:
			continue
		}
		path := filepath.Join(o.pinDir, name)
		l, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			os.Remove(path) // not a link: debris
			continue
		}
		var attached uint64 // the link's cgroup id; 0 once the kernel detached it
		if info, err := l.Info(); err == nil && info.Cgroup() != nil {
			attached = info.Cgroup().CgroupId
		}
		if name == pinSockopsOld {
			id = attached
		}
		dir, perr := "", error(nil)
		if attached != 0 {
			dir, perr = cgroupv2.PathOf(attached)
		}
		if _, dup := o.cgroups[id]; attached == 0 || attached != id || perr != nil || dup {
			l.Close()
			if err := unpinLink(path); err != nil {
				return err
			}
			if id != 0 {
				o.watched.Delete(id)
			}
			continue
		}
		if name == pinSockopsOld {
			// A pin directory of a build before sets: the link keeps
			// its attachment under the new name.
			if err := l.Pin(filepath.Join(o.pinDir, pinSockops+strconv.FormatUint(id, 10))); err != nil {
				l.Close()
				return fmt.Errorf("rename pin %s: %w", path, err)
			}
		}
		if err := o.watched.Put(id, uint8(1)); err != nil {
			l.Close()
			return fmt.Errorf("watch cgroup %s: %w", dir, err)
		}
		o.cgroups[id] = &watch{dir: dir, link: l}
	}
	var (
		id   uint64
		v    uint8
		gone []uint64
		iter = o.watched.Iterate()
	)
	for iter.Next(&id, &v) {
		if _, ok := o.cgroups[id]; !ok {
			gone = append(gone, id)
		}
	}
	if err := iter.Err(); err != nil {
		return fmt.Errorf("read map watched: %w", err)
	}
	for _, id := range gone {
		o.watched.Delete(id)
	}
	return nil
}

// Unpin removes the state pinned for cfg's job (cfg.Job, else its one
// cgroup cfg.Cgroup) under cfg.BPFFS (or the bpffs found in mountinfo):
// the whole pin directory, the sockops link of every cgroup watched
// included, which detaches the programs once no process holds them open.
// Nothing pinned is not an error.
func Unpin(cfg Config) error {
	var name string
	if cfg.Job != "" {
		if !jobid.Valid(cfg.Job) {
			return fmt.Errorf("%w: Config.Job %q: %s", ErrBadJob, cfg.Job, jobid.Rule)
		}
		name = jobPinName(cfg.Job)
	} else {
		j, err := resolveJob(cfg.Cgroup)
		if err != nil {
			return err
		}
		name = strconv.FormatUint(j.id, 10)
	}
	bpffs, err := findBPFFS(cfg.BPFFS, false)
	if err != nil || bpffs == "" {
		return err
	}
	return removePinDir(filepath.Join(bpffs, pinRoot, name))
}

// UnpinID is Unpin for a job pinned by its one cgroup, given by id, for a
// cgroup already removed.
func UnpinID(cfg Config, cgroupID uint64) error {
	bpffs, err := findBPFFS(cfg.BPFFS, false)
	if err != nil || bpffs == "" {
		return err
	}
	return removePinDir(pinDirOf(bpffs, cgroupID))
}

// removePinDir detaches the pinned links in dir and removes the pins. The
// explicit detach matters: a link whose last reference was a pin is
// released only after an RCU grace period and a workqueue run, so without
// it the sockops programs would linger for a while after Unpin returns.
// Tracing and iterator links cannot be detached (EOPNOTSUPP); they go away
// on that deferred path, and nothing reads their maps any more.
func removePinDir(dir string) error {
	if err := clearPinDir(dir); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("unpin %s: %w", dir, err)
	}
	os.Remove(filepath.Dir(dir)) // the mpipause directory, if now empty
	return nil
}

// clearPinDir detaches and unpins every link pinned in dir and removes
// the maps' pins, leaving dir.
func clearPinDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unpin %s: %w", dir, err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "link_") {
			if err := unpinLink(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	for _, name := range mapPins {
		os.Remove(filepath.Join(dir, name))
	}
	return nil
}

// unpinLink detaches the link pinned at path, if there is one, and removes
// the pin.
func unpinLink(path string) error {
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return nil // nothing pinned there, or not a link: RemoveAll's job
	}
	defer l.Close()
	if err := l.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("detach %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("unpin %s: %w", path, err)
	}
	return nil
}

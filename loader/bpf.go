package loader

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/jobid"
)

// Variables for tests: the kernel's own BTF, and the size of the records
// array (0: MAX_RECORDS) so that a test can make conniter spill.
var (
	btfPath           = "/sys/kernel/btf/vmlinux"
	recordsMaxEntries uint32
)

// Names of the pins in a job's pin directory.
const (
	pinConns    = "conns"
	pinWatched  = "watched"
	pinRecords  = "records"
	pinState    = "link_state"
	pinTCPIter  = "link_tcpiter"
	pinConnIter = "link_conniter"
	// pinSockops + a cgroup id: the sockops link of one watched cgroup.
	pinSockops = "link_sockops_"
	// pinSockopsOld is the one sockops link of a pin directory made before
	// sets of cgroups (named by its cgroup's id); Open renames it.
	pinSockopsOld = "link_sockops"
)

var mapPins = []string{pinConns, pinWatched, pinRecords}

// linkPins are the links of the whole job, beside the sockops link of each
// watched cgroup; a kernel that refuses a program (Probe) has no link of
// it.
var linkPins = []string{pinState, pinTCPIter, pinConnIter}

// retiredLinkPins are the pins of the per-call counting programs of earlier
// builds. Their maps no longer fit (ErrStalePin), but a pin directory
// restarted from debris must not keep them: a pinned tracing link stays
// attached, and those ran on every socket call of the machine.
var retiredLinkPins = []string{"link_send", "link_recv", "link_retransmit"}

// BPFObserver observes a job with mpipause's BPF programs: sockops, attached
// to each watched cgroup by a link of its own, registers the job's
// connections in the conns map (socket local storage), a tp_btf program on
// state changes forgets them at close and notes their FINs, an iter/tcp
// pass per network namespace adopts the connections established before
// attach, and an iterator over the conns map reads every connection's
// sequence numbers, and the byte and retransmission counters the kernel
// keeps in tcp_sock, in one pass, however many cgroups the job spans.
type BPFObserver struct {
	pinDir string // "" when not pinned
	reused bool

	conns    *ebpf.Map
	watched  *ebpf.Map // ids of the watched cgroups, read by tcpiter
	records  *ebpf.Map // conniter's output, mapped at recMem
	recMem   []byte
	links    map[string]link.Link // the job's links, by pin name (linkPins)
	sockops  *ebpf.Program        // what Watch attaches
	cgroups  map[uint64]*watch    // the watched cgroups, by id
	tcpIter  *link.Iter           // adoption pass, per network namespace
	connIter *link.Iter           // Snapshot's pass, all namespaces at once; nil: scanTCP
	scanTCP  bool                 // the kernel refused conniter (ScansTCP)
	features Features             // what this kernel loads (Probe)
	belongs  map[uint64]bool      // without adoption: cgroup ids of sockets, in a watched tree or not
	ns       *netnsSet
	adopted  map[uint64]bool // netns inodes tcpIter has run in since the last Watch or Unwatch
	skipped  []string        // what the last Snapshot could not see (SockDiagObserver.Skipped)
	madePins []string        // pins made by OpenBPF, removed if it fails
	madeDir  bool            // OpenBPF made the pin directory

	mu     sync.Mutex // serializes Snapshot, Watch, Unwatch, Close and Detach
	closed bool
	lock   *os.File // the pin directory, flocked around a conniter pass
	buf    []record // records of the last pass, when not in recMem
	tail   []byte   // the seq_file output of the last conniter pass
}

// watch is one watched cgroup.
type watch struct {
	dir   string
	link  link.Link // sockops, attached to dir
	fresh bool      // attached by OpenBPF, which detaches it if it fails
}

// record is one iterator record, struct tcp_record of bpf/include/mpipause.h.
type record = conniterTcpRecord

var (
	_ Observer = (*BPFObserver)(nil)
	_ Watcher  = (*BPFObserver)(nil)
)

// OpenBPF loads the BPF observer for cfg's job and attaches it to every
// cgroup of the set, or, with cfg.Pin, reuses the state a previous OpenBPF
// pinned for the same job (cfg.Job, else its one cgroup): every cgroup
// watched then is watched still (those since removed from the hierarchy
// are let go), and cfg's cgroups are added. On error nothing it attached
// stays attached and nothing it pinned stays pinned. cfg.Require and
// cfg.OnFallback are ignored.
func OpenBPF(ctx context.Context, cfg Config) (*BPFObserver, error) {
	set, err := resolveSet(cfg)
	if err != nil {
		return nil, err
	}
	features, err := CheckBPF(len(cfg.Netns) > 0 || cfg.FollowJob)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var name string
	if cfg.Pin {
		if name, err = pinName(cfg, set); err != nil {
			return nil, err
		}
	}
	ns, err := openNetnsSet(cfg.Netns, cfg.FollowJob, cfg.limits())
	if err != nil {
		return nil, err
	}
	o := &BPFObserver{ns: ns, links: map[string]link.Link{}, cgroups: map[uint64]*watch{}, adopted: map[uint64]bool{}, features: features}
	if cfg.Pin {
		bpffs, err := findBPFFS(cfg.BPFFS, true)
		if err != nil {
			ns.close()
			return nil, err
		}
		o.pinDir = filepath.Join(bpffs, pinRoot, name)
	}
	if err := o.setUp(set); err != nil {
		o.abort()
		ns.close()
		return nil, err
	}
	if o.pinDir != "" {
		if o.lock, err = os.Open(o.pinDir); err != nil {
			o.abort()
			ns.close()
			return nil, fmt.Errorf("open pin directory: %w", err)
		}
	}
	o.madePins, o.madeDir = nil, false
	for _, w := range o.cgroups {
		w.fresh = false
	}
	o.ns.setDirs(o.dirs())
	return o, nil
}

func pinDirOf(bpffs string, id uint64) string {
	return filepath.Join(bpffs, pinRoot, strconv.FormatUint(id, 10))
}

// setUp loads and attaches, reusing pinned state if there is some, and
// watches set. On error the caller undoes what setUp left in o (abort).
func (o *BPFObserver) setUp(set []job) error {
	specs, err := loadSpecs()
	if err != nil {
		return err
	}
	pinnedMaps := false
	if o.pinDir != "" {
		if _, err := os.Stat(o.pinDir); errors.Is(err, fs.ErrNotExist) {
			o.madeDir = true
		}
		if err := os.MkdirAll(o.pinDir, 0o700); err != nil {
			return fmt.Errorf("create pin directory: %w", err)
		}
		if err := o.loadPinnedMaps(specs); err != nil {
			return err
		}
		pinnedMaps = o.conns != nil
		if !pinnedMaps {
			// Pins of a partial set (a crash between two pins) are
			// debris: start the set afresh. Links over other maps
			// must not stay attached.
			if err := clearPinDir(o.pinDir); err != nil {
				return err
			}
		}
	}
	if !pinnedMaps {
		if o.conns, err = ebpf.NewMap(specs.sockops.Maps[pinConns]); err != nil {
			return fmt.Errorf("%w: create map conns: %w", ErrBPFUnavailable, err)
		}
		if o.watched, err = ebpf.NewMap(specs.sockops.Maps[pinWatched]); err != nil {
			return fmt.Errorf("%w: create map watched: %w", ErrBPFUnavailable, err)
		}
		if o.records, err = ebpf.NewMap(specs.conniter.Maps[pinRecords]); err != nil {
			return fmt.Errorf("%w: create map records: %w", ErrBPFUnavailable, err)
		}
	}
	if err := o.mapRecords(); err != nil {
		return err
	}
	if pinnedMaps && o.loadPinnedLinks() {
		o.reused = true
	} else if err := o.attach(specs); err != nil {
		return err
	}
	if err := o.loadSockops(specs); err != nil {
		return err
	}
	if pinnedMaps {
		// The first Snapshot's iter/tcp passes forget the connections
		// of cgroups let go here.
		if err := o.loadPinnedWatches(); err != nil {
			return err
		}
	}
	for _, j := range set {
		if err := o.watch(j, true); err != nil {
			return err
		}
	}
	if o.pinDir != "" && !pinnedMaps {
		// Last: a directory without its maps is debris to the next Open.
		for name, m := range map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinRecords: o.records} {
			if err := o.pin(m, name); err != nil {
				return fmt.Errorf("pin map %s: %w", name, err)
			}
		}
	}
	return nil
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

type collectionSpecs struct {
	sockops, sockstat, tcpiter, conniter *ebpf.CollectionSpec
}

func loadSpecs() (collectionSpecs, error) {
	var s collectionSpecs
	var err error
	if s.sockops, err = loadSockops(); err != nil {
		return s, err
	}
	if s.tcpiter, err = loadTcpiter(); err != nil {
		return s, err
	}
	if s.sockstat, err = loadSockstat(); err != nil {
		return s, err
	}
	if s.conniter, err = loadConniter(); err != nil {
		return s, err
	}
	if recordsMaxEntries != 0 {
		s.conniter.Maps[pinRecords].MaxEntries = recordsMaxEntries
	}
	return s, nil
}

// loadPinnedMaps loads the pinned maps if all are there and fit this
// build's specs; it leaves o.conns nil if any is missing.
func (o *BPFObserver) loadPinnedMaps(specs collectionSpecs) error {
	names := mapPins
	mapSpecs := []*ebpf.MapSpec{specs.sockops.Maps[pinConns], specs.sockops.Maps[pinWatched], specs.conniter.Maps[pinRecords]}
	var maps [3]*ebpf.Map
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
	o.conns, o.watched, o.records = maps[0], maps[1], maps[2]
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

// attach loads the programs of the whole job that this kernel allows
// (Probe) over o's maps, attaches them and, when pinning, pins their links.
func (o *BPFObserver) attach(specs collectionSpecs) error {
	maps := map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinRecords: o.records}
	// The state program before any sockops: a connection sockops
	// registers must not reach FIN_WAIT1 or CLOSE_WAIT unseen, or its
	// byte counts would include the FIN.
	if o.features.State {
		p, err := loadProgram(specs.sockstat, sockstatProgMpipauseState, maps)
		if err != nil {
			return loadError(ProgState, err)
		}
		l, err := link.AttachTracing(link.TracingOptions{Program: p})
		p.Close()
		if err != nil {
			return fmt.Errorf("%w: attach %s: %w", ErrBPFUnavailable, ProgState, err)
		}
		o.links[pinState] = l
	}
	if o.features.Adoption {
		p, err := loadProgram(specs.tcpiter, tcpiterProgMpipauseTcpiter, maps)
		if err != nil {
			return loadError(ProgTCPIter, err)
		}
		it, err := link.AttachIter(link.IterOptions{Program: p})
		p.Close()
		if err != nil {
			return fmt.Errorf("%w: attach iter/tcp: %w", ErrBPFUnavailable, err)
		}
		o.links[pinTCPIter], o.tcpIter = it, it
	}
	if name := o.connIterProg(); name != "" {
		p, err := loadProgram(specs.conniter, name, maps)
		if err != nil {
			return loadError(o.features.ConnIter, err)
		}
		it, err := link.AttachIter(link.IterOptions{Program: p, Map: o.conns})
		p.Close()
		if err != nil {
			return fmt.Errorf("%w: attach iter/bpf_sk_storage_map: %w", ErrBPFUnavailable, err)
		}
		o.links[pinConnIter], o.connIter = it, it
	}
	o.scanTCP = o.connIter == nil
	if o.pinDir == "" {
		return nil
	}
	for _, name := range linkPins {
		if o.links[name] == nil {
			continue // not on this kernel (features)
		}
		if err := o.pin(o.links[name], name); err != nil {
			return fmt.Errorf("pin %s: %w", name, err)
		}
	}
	return nil
}

// connIterProg is the generated name of the Snapshot pass's program, ""
// for the iter/tcp scan (the kernel has neither conniter).
func (o *BPFObserver) connIterProg() string {
	switch {
	case o.features.ConnIter == ProgConnIter:
		return conniterProgMpipauseConniter
	case o.features.ConnIter == ProgConnIterSkc:
		return conniterProgMpipauseConniterSkc
	}
	return ""
}

// loadSockops loads the sockops program over o's maps, for Watch to
// attach. Every Open loads it, pins reused or not: the links of cgroups
// watched before keep the program they were made with, which works on the
// same maps.
func (o *BPFObserver) loadSockops(specs collectionSpecs) error {
	var so sockopsObjects
	opts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched}}
	if err := specs.sockops.LoadAndAssign(&so, opts); err != nil {
		return loadError("sockops", err)
	}
	defer so.Close()
	p, err := so.MpipauseSockops.Clone()
	if err != nil {
		return fmt.Errorf("%w: sockops: %w", ErrBPFUnavailable, err)
	}
	o.sockops = p
	return nil
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

// loadError wraps a load failure. A verifier error prints as one line (its
// last: the reason); %+v on it, via errors.As, gives the whole log.
func loadError(obj string, err error) error {
	return fmt.Errorf("%w: load %s: %w", ErrBPFUnavailable, obj, err)
}

// abort undoes a failed OpenBPF: links it attached are detached at once (a
// pin it removed may otherwise hold one for a grace period), links it
// reused from pins are left alone, the pins it made are removed, and every
// handle is closed.
func (o *BPFObserver) abort() {
	if !o.reused {
		for _, l := range o.links {
			l.Detach()
		}
	}
	for id, w := range o.cgroups {
		if w.fresh {
			w.link.Detach()
			o.watched.Delete(id)
		}
	}
	for _, p := range o.madePins {
		os.Remove(p)
	}
	o.release()
	if o.madeDir {
		os.Remove(o.pinDir)
		os.Remove(filepath.Dir(o.pinDir)) // fails unless empty, as it should
	}
}

// release closes every handle o holds; links that are not pinned detach.
func (o *BPFObserver) release() {
	for name, l := range o.links {
		l.Close()
		delete(o.links, name)
	}
	for id, w := range o.cgroups {
		w.link.Close()
		delete(o.cgroups, id)
	}
	o.tcpIter, o.connIter = nil, nil
	if o.sockops != nil {
		o.sockops.Close()
		o.sockops = nil
	}
	if o.recMem != nil {
		unix.Munmap(o.recMem)
		o.recMem = nil
	}
	for _, m := range []**ebpf.Map{&o.conns, &o.watched, &o.records} {
		if *m != nil {
			(*m).Close()
			*m = nil
		}
	}
}

// Kind returns KindBPF.
func (o *BPFObserver) Kind() string { return KindBPF }

// PinDir returns the directory holding the observer's pins, or "" if it
// pins nothing.
func (o *BPFObserver) PinDir() string { return o.pinDir }

// Features reports the programs this observer runs with (Probe).
func (o *BPFObserver) Features() Features { return o.features }

// ScansTCP reports whether Snapshot reads the job's connections with an
// iter/tcp pass per network namespace (a walk of the whole TCP table), the
// kernel having refused the iterator over the job's own sockets.
func (o *BPFObserver) ScansTCP() bool { return o.scanTCP }

// Reused reports whether OpenBPF found the programs already attached and
// pinned (by an earlier process) and took them over, with the connections
// they had registered.
func (o *BPFObserver) Reused() bool { return o.reused }

// Close releases the observer. Without Config.Pin it detaches every
// program; with it the programs stay attached and pinned for the next Open.
func (o *BPFObserver) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil
	}
	o.closed = true
	o.release()
	o.ns.close()
	if o.lock != nil {
		o.lock.Close()
	}
	return nil
}

// Detach closes the observer and removes its pinned state, so that every
// program is detached whether or not it was pinned.
func (o *BPFObserver) Detach() error {
	dir := o.pinDir
	if err := o.Close(); err != nil {
		return err
	}
	if dir == "" {
		return nil
	}
	return removePinDir(dir)
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

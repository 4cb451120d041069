package loader

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/mpipause/mpipause/internal/sockdiag"
	"golang.org/x/sys/unix"
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
	pinList     = "connlist"
	pinLost     = "connlist_lost"
	pinState    = "link_state"
	pinTCPIter  = "link_tcpiter"
	pinConnIter = "link_conniter"
	// pinSockops + a cgroup id: the sockops link of one watched cgroup.
	pinSockops = "link_sockops_"
	// pinSockopsOld is the one sockops link of a pin directory made before
	// sets of cgroups (named by its cgroup's id); Open renames it.
	pinSockopsOld = "link_sockops"
)

var mapPins = []string{pinConns, pinWatched, pinRecords, pinList, pinLost}

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
	list     *ebpf.Map // connlist: the job's connections by cookie (listed)
	lost     *ebpf.Map // connlist_lost: entries connlist could not take
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
	// listFrom is connlist_lost as the last walk of every namespace
	// found it before it began (ok: there was one): a listed read
	// stands for a walk only while the list has lost nothing since.
	listFrom struct {
		ok   bool
		lost uint64
	}
	walks    int      // Snapshots that walked (walkCost; the tests)
	skipped  []string // what the last Snapshot could not see (SockDiagObserver.Skipped)
	madePins []string // pins made by OpenBPF, removed if it fails
	madeDir  bool     // OpenBPF made the pin directory

	mu     sync.Mutex // serializes Snapshot, Watch, Unwatch, Close and Detach
	closed bool
	lock   *os.File                      // the pin directory, flocked around a conniter pass
	buf    []record                      // records of the last pass, when not in recMem
	tail   []byte                        // the seq_file output of the last conniter pass
	lastNS []netns                       // the namespaces the last Snapshot looked in (Recheck)
	diag   map[uint64]*sockdiag.DiagConn // Recheck's, by namespace inode
	// walkCost is what the last Snapshot that walked took, and
	// lookupCost a socket's share of the last Recheck or listed read
	// (0 before one): both decline where the walk is the cheaper.
	walkCost, lookupCost time.Duration
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
		if o.list, err = ebpf.NewMap(specs.sockops.Maps[pinList]); err != nil {
			return fmt.Errorf("%w: create map connlist: %w", ErrBPFUnavailable, err)
		}
		if o.lost, err = ebpf.NewMap(specs.sockops.Maps[pinLost]); err != nil {
			return fmt.Errorf("%w: create map connlist_lost: %w", ErrBPFUnavailable, err)
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
		for name, m := range o.maps() {
			if err := o.pin(m, name); err != nil {
				return fmt.Errorf("pin map %s: %w", name, err)
			}
		}
	}
	return nil
}

// maps are the observer's maps by pin name, which is also their name in
// every object.
func (o *BPFObserver) maps() map[string]*ebpf.Map {
	return map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinRecords: o.records, pinList: o.list, pinLost: o.lost}
}

type collectionSpecs struct {
	sockops, sockstat, tcpiter, conniter, signals *ebpf.CollectionSpec
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
	if s.signals, err = loadSignals(); err != nil {
		return s, err
	}
	if recordsMaxEntries != 0 {
		s.conniter.Maps[pinRecords].MaxEntries = recordsMaxEntries
	}
	return s, nil
}

// attach loads the programs of the whole job that this kernel allows
// (Probe) over o's maps, attaches them and, when pinning, pins their links.
func (o *BPFObserver) attach(specs collectionSpecs) error {
	maps := o.maps()
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
	opts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinList: o.list, pinLost: o.lost}}
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
	for _, m := range []**ebpf.Map{&o.conns, &o.watched, &o.records, &o.list, &o.lost} {
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
	o.closeDiag()
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

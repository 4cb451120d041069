package loader

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/caps"
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
	pinSockops  = "link_sockops"
	pinState    = "link_state"
	pinTCPIter  = "link_tcpiter"
	pinConnIter = "link_conniter"
)

var mapPins = []string{pinConns, pinWatched, pinRecords}

var linkPins = []string{pinSockops, pinState, pinTCPIter, pinConnIter}

// optionalLinkPins may be missing from a complete set: conniter, on a
// kernel that refuses map iterators (scanTCP).
var optionalLinkPins = map[string]bool{pinConnIter: true}

// forceScanTCP makes OpenBPF behave as on a kernel that refuses map
// iterators, so that tests cover Snapshot's per-namespace pass anywhere.
var forceScanTCP bool

// retiredLinkPins are the pins of the per-call counting programs of earlier
// builds. Their maps no longer fit (ErrStalePin), but a pin directory
// restarted from debris must not keep them: a pinned tracing link stays
// attached, and those ran on every socket call of the machine.
var retiredLinkPins = []string{"link_send", "link_recv", "link_retransmit"}

// BPFObserver observes a job with mpipause's BPF programs: sockops on the
// job's cgroup registers its connections in the conns map (socket local
// storage), a tp_btf program on state changes forgets them at close and
// notes their FINs, an iter/tcp pass per network namespace adopts the
// connections established before attach, and an iterator over the conns map
// reads every connection's sequence numbers, and the byte and
// retransmission counters the kernel keeps in tcp_sock, in one pass.
type BPFObserver struct {
	job    job
	pinDir string // "" when not pinned
	reused bool

	conns    *ebpf.Map
	watched  *ebpf.Map
	records  *ebpf.Map // conniter's output, mapped at recMem
	recMem   []byte
	links    map[string]link.Link
	tcpIter  *link.Iter // adoption pass, per network namespace
	connIter *link.Iter // Snapshot's pass, all namespaces at once; nil: scanTCP
	scanTCP  bool       // the kernel refused conniter (ScansTCP)
	ns       *netnsSet
	adopted  map[uint64]bool // netns inodes tcpIter has run in
	skipped  []string        // what the last Snapshot could not see (SockDiagObserver.Skipped)

	mu     sync.Mutex // serializes Snapshot, Close and Detach
	closed bool
	lock   *os.File // the pin directory, flocked around a conniter pass
	buf    []record // records of the last pass, when not in recMem
	tail   []byte   // the seq_file output of the last conniter pass
}

// record is one iterator record, struct tcp_record of bpf/include/mpipause.h.
type record = conniterTcpRecord

var _ Observer = (*BPFObserver)(nil)

// OpenBPF loads and attaches the BPF observer for cfg's job, or, with
// cfg.Pin, reuses the state a previous OpenBPF pinned for the same cgroup.
// On error nothing it attached stays attached and nothing it pinned stays
// pinned. cfg.Require and cfg.OnFallback are ignored.
func OpenBPF(ctx context.Context, cfg Config) (*BPFObserver, error) {
	j, err := resolveJob(cfg.Cgroup)
	if err != nil {
		return nil, err
	}
	want := []caps.Cap{caps.BPF, caps.Perfmon, caps.NetAdmin}
	if len(cfg.Netns) > 0 || cfg.FollowJob {
		want = append(want, caps.SysAdmin) // setns(2)
	}
	missing, err := caps.Missing(want...)
	if err != nil {
		return nil, err
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: missing %s; run as root or grant them", ErrNotPrivileged, strings.Join(missing, ", "))
	}
	if _, err := os.Stat(btfPath); err != nil {
		return nil, fmt.Errorf("%w: %v; the BPF observer needs a kernel built with CONFIG_DEBUG_INFO_BTF=y", ErrNoBTF, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ns, err := openNetnsSet(cfg.Netns, j.dir, cfg.FollowJob)
	if err != nil {
		return nil, err
	}
	o := &BPFObserver{job: j, ns: ns, links: map[string]link.Link{}, adopted: map[uint64]bool{}}
	if cfg.Pin {
		bpffs, err := findBPFFS(cfg.BPFFS, true)
		if err != nil {
			ns.close()
			return nil, err
		}
		o.pinDir = pinDirOf(bpffs, j.id)
	}
	if err := o.setUp(); err != nil {
		o.abort()
		ns.close()
		return nil, err
	}
	if o.pinDir != "" {
		if o.lock, err = os.Open(o.pinDir); err != nil {
			if !o.reused {
				removePinDir(o.pinDir)
			}
			o.abort()
			ns.close()
			return nil, fmt.Errorf("open pin directory: %w", err)
		}
	}
	return o, nil
}

func pinDirOf(bpffs string, id uint64) string {
	return filepath.Join(bpffs, pinRoot, strconv.FormatUint(id, 10))
}

// setUp loads and attaches, reusing pinned state if there is some. On error
// the caller releases what setUp left in o; setUp itself unpins what it
// pinned.
func (o *BPFObserver) setUp() error {
	specs, err := loadSpecs()
	if err != nil {
		return err
	}
	if o.pinDir != "" {
		if err := o.loadPinnedMaps(specs); err != nil {
			return err
		}
		if o.conns != nil && o.loadPinnedLinks() {
			o.reused = true
			if err := o.mapRecords(); err != nil {
				return err
			}
			return o.watch()
		}
	}
	pinnedMaps := o.conns != nil
	if o.pinDir != "" && !pinnedMaps {
		// Pins of a partial set (a crash between two pins) are debris:
		// start the set afresh.
		for _, name := range mapPins {
			os.Remove(filepath.Join(o.pinDir, name))
		}
		for _, name := range append(linkPins, retiredLinkPins...) {
			unpinLink(filepath.Join(o.pinDir, name))
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
	if err := o.watch(); err != nil {
		return err
	}
	if err := o.attach(specs); err != nil {
		return err
	}
	if o.pinDir == "" {
		return nil
	}
	return o.pin(!pinnedMaps)
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

// watch adds the job's cgroup to the watched set.
func (o *BPFObserver) watch() error {
	if err := o.watched.Put(o.job.id, uint8(1)); err != nil {
		return fmt.Errorf("watch cgroup %s: %w", o.job.dir, err)
	}
	return nil
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

// loadPinnedLinks loads every pinned link and reports whether all were
// there. A partial set (a crash between two pins) is removed: its links
// detach, and setUp attaches a complete new set.
func (o *BPFObserver) loadPinnedLinks() bool {
	loaded := map[string]link.Link{}
	for _, name := range linkPins {
		l, err := link.LoadPinnedLink(filepath.Join(o.pinDir, name), nil)
		if err != nil {
			continue
		}
		loaded[name] = l
	}
	ti, ok1 := loaded[pinTCPIter].(*link.Iter)
	ci, ok2 := loaded[pinConnIter].(*link.Iter)
	complete := ok1
	for _, name := range linkPins {
		if loaded[name] == nil && !optionalLinkPins[name] {
			complete = false
		}
	}
	if complete && (ok2 || loaded[pinConnIter] == nil) {
		o.links, o.tcpIter, o.connIter = loaded, ti, ci
		if forceScanTCP {
			o.connIter = nil
		}
		o.scanTCP = o.connIter == nil
		return true
	}
	for name, l := range loaded {
		l.Close()
		unpinLink(filepath.Join(o.pinDir, name))
	}
	return false
}

// attach loads the four objects over o's maps and attaches every program.
func (o *BPFObserver) attach(specs collectionSpecs) error {
	opts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched}}
	ciOpts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinRecords: o.records}}

	var so sockopsObjects
	if err := specs.sockops.LoadAndAssign(&so, opts); err != nil {
		return loadError("sockops", err)
	}
	defer so.Close()
	var ti tcpiterObjects
	if err := specs.tcpiter.LoadAndAssign(&ti, opts); err != nil {
		return loadError("tcpiter", err)
	}
	defer ti.Close()
	var ss sockstatObjects
	if err := specs.sockstat.LoadAndAssign(&ss, opts); err != nil {
		return loadError("sockstat", err)
	}
	defer ss.Close()
	// Some kernels refuse an iterator over a map with EPERM even to root
	// (a locked-down 6.18 build does, while iter/tcp loads): Snapshot then
	// reads the job's connections with the iter/tcp pass of each
	// namespace, which walks the whole TCP table instead of the job's
	// sockets alone (scanTCP), slower but the same records.
	var ci conniterObjects
	if err := o.loadConnIter(specs, ciOpts, &ci); err != nil {
		return err
	}
	defer ci.Close()

	// The state program first: a connection sockops registers must not
	// reach FIN_WAIT1 or CLOSE_WAIT unseen, or its byte counts would
	// include the FIN.
	l, err := link.AttachTracing(link.TracingOptions{Program: ss.MpipauseState})
	if err != nil {
		return fmt.Errorf("%w: attach %s: %w", ErrBPFUnavailable, ss.MpipauseState, err)
	}
	o.links[pinState] = l
	l, err = link.AttachCgroup(link.CgroupOptions{Path: o.job.dir, Attach: ebpf.AttachCGroupSockOps, Program: so.MpipauseSockops})
	if err != nil {
		return fmt.Errorf("%w: attach sockops to %s: %w", ErrBPFUnavailable, o.job.dir, err)
	}
	o.links[pinSockops] = l
	it, err := link.AttachIter(link.IterOptions{Program: ti.MpipauseTcpiter})
	if err != nil {
		return fmt.Errorf("%w: attach iter/tcp: %w", ErrBPFUnavailable, err)
	}
	o.links[pinTCPIter], o.tcpIter = it, it
	if ci.MpipauseConniter == nil {
		o.scanTCP = true
		return nil
	}
	it, err = link.AttachIter(link.IterOptions{Program: ci.MpipauseConniter, Map: o.conns})
	if err != nil {
		return fmt.Errorf("%w: attach iter/bpf_sk_storage_map: %w", ErrBPFUnavailable, err)
	}
	o.links[pinConnIter], o.connIter = it, it
	return nil
}

// loadConnIter loads conniter into ci, or leaves ci empty where the kernel
// refuses map iterators (or forceScanTCP says to act as if it did).
func (o *BPFObserver) loadConnIter(specs collectionSpecs, opts *ebpf.CollectionOptions, ci *conniterObjects) error {
	if forceScanTCP {
		return nil
	}
	err := specs.conniter.LoadAndAssign(ci, opts)
	if errors.Is(err, unix.EPERM) {
		*ci = conniterObjects{}
		return nil
	}
	if err != nil {
		return loadError("conniter", err)
	}
	return nil
}

// loadError wraps a load failure. A verifier error prints as one line (its
// last: the reason); %+v on it, via errors.As, gives the whole log.
func loadError(obj string, err error) error {
	return fmt.Errorf("%w: load %s: %w", ErrBPFUnavailable, obj, err)
}

// pin pins every link, and the maps when newMaps. On error it removes what
// it pinned.
func (o *BPFObserver) pin(newMaps bool) (err error) {
	created := false
	if _, serr := os.Stat(o.pinDir); errors.Is(serr, fs.ErrNotExist) {
		created = true
	}
	if err := os.MkdirAll(o.pinDir, 0o700); err != nil {
		return fmt.Errorf("create pin directory: %w", err)
	}
	type pinner interface{ Unpin() error }
	var done []pinner
	defer func() {
		if err == nil {
			return
		}
		for _, p := range done {
			p.Unpin()
		}
		if created {
			os.Remove(o.pinDir)
			os.Remove(filepath.Dir(o.pinDir)) // fails unless empty, as it should
		}
	}()
	if newMaps {
		for name, m := range map[string]*ebpf.Map{pinConns: o.conns, pinWatched: o.watched, pinRecords: o.records} {
			if err := m.Pin(filepath.Join(o.pinDir, name)); err != nil {
				return fmt.Errorf("pin map %s: %w", name, err)
			}
			done = append(done, m)
		}
	}
	for _, name := range linkPins {
		if o.links[name] == nil && optionalLinkPins[name] {
			continue
		}
		if err := o.links[name].Pin(filepath.Join(o.pinDir, name)); err != nil {
			return fmt.Errorf("pin %s: %w", name, err)
		}
		done = append(done, o.links[name])
	}
	return nil
}

// abort undoes a failed OpenBPF: links it attached are detached at once (a
// pin it removed may otherwise hold one for a grace period), links it
// reused from pins are left alone, and every handle is closed.
func (o *BPFObserver) abort() {
	if !o.reused {
		for _, l := range o.links {
			l.Detach()
		}
	}
	o.release()
}

// release closes every handle o holds; links that are not pinned detach.
func (o *BPFObserver) release() {
	for name, l := range o.links {
		l.Close()
		delete(o.links, name)
	}
	o.tcpIter, o.connIter = nil, nil
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

// CgroupID returns the cgroup id of the observed job.
func (o *BPFObserver) CgroupID() uint64 { return o.job.id }

// PinDir returns the directory holding the observer's pins, or "" if it
// pins nothing.
func (o *BPFObserver) PinDir() string { return o.pinDir }

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

// Unpin removes the state pinned for cfg.Cgroup under cfg.BPFFS (or the
// bpffs found in mountinfo), which detaches its programs once no process
// holds them open. Nothing pinned is not an error.
func Unpin(cfg Config) error {
	j, err := resolveJob(cfg.Cgroup)
	if err != nil {
		return err
	}
	return UnpinID(cfg, j.id)
}

// UnpinID is Unpin for a cgroup given by id, for a cgroup already removed.
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
// it the sockops program would linger for a while after Unpin returns.
// Tracing and iterator links cannot be detached (EOPNOTSUPP); they go away
// on that deferred path, and nothing reads their maps any more.
func removePinDir(dir string) error {
	for _, name := range linkPins {
		if err := unpinLink(filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("unpin %s: %w", dir, err)
	}
	os.Remove(filepath.Dir(dir)) // the mpipause directory, if now empty
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

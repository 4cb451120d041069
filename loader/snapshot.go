package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"
	"unsafe"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"golang.org/x/sys/unix"
)

// recordSize is the size of one iterator record, struct tcp_record in
// bpf/include/mpipause.h; TestRecordLayout checks it against BTF.
const recordSize = int(unsafe.Sizeof(record{}))

// Snapshot returns the job's TCP connections in every watched network
// namespace. A namespace seen for the first time gets one iter/tcp pass,
// which adopts the connections the job established before the programs
// were attached; after that a single pass over the conns map reads every
// connection of every namespace, counters included (read from tcp_sock).
// With ctx Pacing, and conniter loaded, the namespaces of the job's
// processes may be those of a walk up to PacingReuse old, unless a
// connection shows one it did not list.
func (o *BPFObserver) Snapshot(ctx context.Context) ([]Conn, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil, ErrClosed
	}
	t0, walks := time.Now(), o.walks
	cs, unknown, err := o.snapshot(ctx)
	if err == nil && o.walks != walks {
		o.walkCost = time.Since(t0)
	}
	if err == nil && unknown && pacing(ctx) {
		// A connection in a namespace the reused walk did not list (a
		// rank that moved, a new one): walk again, as without Pacing.
		cs, _, err = o.snapshot(exact(ctx))
	}
	return cs, err
}

// snapshot is Snapshot's one read; unknown says that some record was in a
// namespace the list did not have (left out of cs).
func (o *BPFObserver) snapshot(ctx context.Context) ([]Conn, bool, error) {
	if o.connIter == nil {
		// Without conniter a pass reads only the listed namespaces: a
		// connection in one the reused walk missed would never show, so
		// Pacing cannot hold here and every Snapshot walks.
		ctx = exact(ctx)
	}
	nss, err := o.ns.listFor(ctx)
	if err != nil {
		return nil, false, err
	}
	o.skipped = o.ns.deniedSkipped(o.skipped[:0])
	labels := make(map[uint32]string, len(nss))
	for _, ns := range nss {
		labels[uint32(ns.ino)] = ns.label
	}
	if o.canList(nss) {
		o.keepDiag(nss)
		cs, unknown, err := o.listed(ctx, labels)
		if !errors.Is(err, errNoList) {
			return cs, unknown, err
		}
	}
	var lost uint64
	if o.connIter == nil && o.list != nil {
		if lost, err = o.lostCount(); err != nil {
			return nil, false, err
		}
	}
	var scanned []record // scanTCP: every namespace's pass
	for _, ns := range nss {
		if (o.adopted[ns.ino] || o.tcpIter == nil) && o.connIter != nil {
			continue // adopted already, or no adoption on this kernel
		}
		if err := ctx.Err(); err != nil {
			return nil, false, err
		}
		recs, err := o.readTCPIter(ns)
		if err != nil {
			return nil, false, err
		}
		scanned = append(scanned, recs...)
		o.adopted[ns.ino] = true
	}
	o.keepDiag(nss)
	for ino := range o.adopted {
		if _, ok := labels[uint32(ino)]; !ok {
			delete(o.adopted, ino) // gone: a new namespace may reuse the inode
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	if o.connIter == nil {
		o.walks++
		if o.list != nil && o.tcpIter != nil {
			o.listFrom.ok, o.listFrom.lost = true, lost
		}
		cs, unknown := conns(scanned, labels, bootOffset())
		return cs, unknown, nil
	}
	recs, err := o.readConnIter()
	if err != nil {
		return nil, false, err
	}
	if o.tcpIter == nil {
		recs = o.watchedOnly(recs)
	}
	cs, unknown := conns(recs, labels, bootOffset())
	return cs, unknown, nil
}

// watchedOnly drops the records of sockets whose cgroup is not in a
// watched tree any more. With iter/tcp the adoption pass after an Unwatch
// forgets them in the kernel; without it (Features.Adoption false) their
// entries stay until the socket closes. A cgroup's path is looked up once
// (by its id, no walk) until the watched set changes. A socket whose
// cgroup is gone stays: it was a job's, and the kernel check must see
// every connection that may be one.
func (o *BPFObserver) watchedOnly(recs []record) []record {
	if o.belongs == nil {
		o.belongs = map[uint64]bool{}
	}
	keep := make([]record, 0, len(recs)) // recs may be the read-only mapping
	for _, r := range recs {
		in, ok := o.belongs[r.CgroupId]
		if !ok {
			in = o.inWatchedTree(r.CgroupId)
			o.belongs[r.CgroupId] = in
		}
		if in {
			keep = append(keep, r)
		}
	}
	return keep
}

func (o *BPFObserver) inWatchedTree(id uint64) bool {
	if _, ok := o.cgroups[id]; ok {
		return true
	}
	path, err := cgroupv2.PathOf(id)
	if err != nil {
		return true // gone, or unknown: keep
	}
	for _, w := range o.cgroups {
		if path == w.dir || strings.HasPrefix(path, w.dir+"/") {
			return true
		}
	}
	return false
}

// Skipped names what the last Snapshot left out: the network namespaces of
// the job's processes that this process may not name (another user's
// process, no CAP_SYS_PTRACE). The programs see their connections, but
// without the namespace there is no label for them.
func (o *BPFObserver) Skipped() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.skipped...)
}

// conns turns the records of a pass into Conns, leaving out those of
// namespaces without a label (not watched by this observer).
//
// This is the user-space share of a Snapshot, and at 10,000 sockets it was
// more than a millisecond, most of it the garbage collector's: each Conn
// built apart and then copied into the slice was a typed copy of a struct
// with pointers, which runs a bulk write barrier over it while a GC cycle
// is on (and a 1.8 MB slice each Snapshot keeps one on often). Filled in
// place, field by field, only its four pointers take a barrier: that about
// halved the CPU time of BenchmarkConvert10k, the collector's included. The
// label is looked up once per run of records of one namespace, not once per
// record.
func conns(recs []record, labels map[uint32]string, boot time.Duration) ([]Conn, bool) {
	out := make([]Conn, len(recs))
	n := 0
	var (
		ino     uint32
		label   string
		ok      bool
		unknown bool
	)
	for i := range recs {
		r := &recs[i]
		if i == 0 || r.Netns != ino {
			ino = r.Netns
			label, ok = labels[ino]
		}
		if !ok {
			unknown = true
			continue // a namespace this observer does not watch
		}
		r.fill(&out[n], label, boot)
		n++
	}
	return out[:n], unknown
}

// readTCPIter runs the iter/tcp program once in ns (adopting the job's
// connections there) and returns its records, which live in o.buf until the
// next read.
func (o *BPFObserver) readTCPIter(ns netns) ([]record, error) {
	var rc io.ReadCloser
	err := inNetns(ns, func() error {
		var err error
		rc, err = o.tcpIter.Open()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("open tcp iterator in %s: %w", nsName(ns), err)
	}
	defer rc.Close()
	o.buf, err = readRecords(rc, o.buf)
	if err != nil {
		return nil, fmt.Errorf("read tcp iterator in %s: %w", nsName(ns), err)
	}
	return o.buf, nil
}

// readConnIter runs the conns map iterator once and returns its records,
// for every namespace. They live in the mmapped records array (or o.buf)
// until the next pass.
func (o *BPFObserver) readConnIter() ([]record, error) {
	if o.lock != nil {
		// Another process may run the same pinned iterator, and the
		// records array has room for one pass at a time.
		if err := unix.Flock(int(o.lock.Fd()), unix.LOCK_EX); err != nil {
			return nil, fmt.Errorf("lock %s: %w", o.pinDir, err)
		}
		defer unix.Flock(int(o.lock.Fd()), unix.LOCK_UN)
	}
	rc, err := o.connIter.Open()
	if err != nil {
		return nil, fmt.Errorf("open conns iterator: %w", err)
	}
	defer rc.Close()
	o.tail, err = readAll(rc, o.tail[:0])
	if err != nil {
		return nil, fmt.Errorf("read conns iterator: %w", err)
	}
	return splitPass(o.recMem[:int(o.records.MaxEntries())*recordSize], o.tail, &o.buf)
}

// splitPass assembles the records of one conniter pass: the first ones in
// the mapped array mem, any spill in the seq_file output tail. tail is
// framed (bpf/conniter.bpf.c): an 8-byte mark if there was an object, the
// spilled records, and the index of the last object as a little-endian
// uint64.
func splitPass(mem, tail []byte, buf *[]record) ([]record, error) {
	if len(tail) == 8 {
		return nil, nil
	}
	if len(tail) < 16 || (len(tail)-16)%recordSize != 0 {
		return nil, fmt.Errorf("conns iterator output of %d bytes is not framed records", len(tail))
	}
	n := binary.LittleEndian.Uint64(tail[len(tail)-8:]) + 1
	spilled := tail[8 : len(tail)-8]
	spill := len(spilled) / recordSize
	inMem := len(mem) / recordSize
	if n > uint64(inMem+spill) || n != uint64(min(int(n), inMem)+spill) {
		return nil, fmt.Errorf("conns iterator saw %d objects but wrote %d to the array (room %d) and %d to the seq_file", n, min(int(n), inMem), inMem, spill)
	}
	var arr []record
	if k := min(int(n), inMem); k > 0 {
		arr = unsafe.Slice((*record)(unsafe.Pointer(&mem[0])), k)
	}
	if spill == 0 {
		return arr, nil
	}
	recs := append((*buf)[:0], arr...)
	for i := range spill {
		var r record
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&r)), recordSize), spilled[i*recordSize:])
		recs = append(recs, r)
	}
	*buf = recs
	return recs, nil
}

// readAll reads r to EOF, appending to buf.
func readAll(r io.Reader, buf []byte) ([]byte, error) {
	if cap(buf) < 4096 {
		buf = make([]byte, 0, 4096)
	}
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		m, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+m]
		if errors.Is(err, io.EOF) || (m == 0 && err == nil) {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}

// readRecords reads fixed-size records until EOF into buf's backing array
// (grown as needed), viewed as bytes: no copy, no per-record decoding. The
// records are laid out in memory exactly as the program wrote them.
func readRecords(r io.Reader, buf []record) ([]record, error) {
	if cap(buf) == 0 {
		buf = make([]record, 256)
	}
	buf = buf[:cap(buf)]
	n := 0 // bytes read
	for {
		if n == len(buf)*recordSize {
			grown := make([]record, 2*len(buf))
			copy(grown, buf)
			buf = grown
		}
		b := unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), len(buf)*recordSize)
		m, err := r.Read(b[n:])
		n += m
		if errors.Is(err, io.EOF) || (m == 0 && err == nil) {
			break
		}
		if err != nil {
			return buf[:0], err
		}
	}
	if n%recordSize != 0 {
		return buf[:0], fmt.Errorf("%d bytes is not a whole number of %d-byte records", n, recordSize)
	}
	return buf[:n/recordSize], nil
}

// bootOffset returns wall-clock time minus CLOCK_BOOTTIME, to turn the
// programs' bpf_ktime_get_boot_ns stamps into times.
func bootOffset() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0
	}
	return time.Duration(time.Now().UnixNano() - ts.Nano())
}

const (
	afInet  = 2
	afInet6 = 10
)

// connFActive is CONN_F_ACTIVE of a record's flags (bpf/include/mpipause.h):
// bpf2go generates no constants for the enum.
const connFActive = 1 << 4

// conn turns a record into a Conn; the netns label and the boot offset
// come from the caller.
func (r *record) conn(netns string, boot time.Duration) Conn {
	var c Conn
	r.fill(&c, netns, boot)
	return c
}

// fill sets every field of c, which must be zero, from r: conn without a
// copy of the Conn (see conns).
func (r *record) fill(c *Conn, netns string, boot time.Duration) {
	t := &r.Tuple
	c.Cookie = r.Cookie
	c.Local = netip.AddrPortFrom(addrOf(t.Family, &t.Saddr), t.Sport)
	c.Remote = netip.AddrPortFrom(addrOf(t.Family, &t.Daddr), t.Dport)
	c.State = TCPState(r.State)
	c.Netns = netns
	c.Cgroup = r.CgroupId
	c.WriteSeq = r.WriteSeq
	c.SndNxt = r.SndNxt
	c.SndUna = r.SndUna
	c.RcvNxt = r.RcvNxt
	c.CopiedSeq = r.CopiedSeq
	c.SendQueue = r.WriteSeq - r.SndUna // uint32: wraps like the kernel's
	c.Unread = r.RcvNxt - r.CopiedSeq
	c.Counted = r.Flags != 0
	c.Active = r.Flags&connFActive != 0
	c.BytesSent = r.BytesSent
	c.BytesRecv = r.BytesRecv
	c.Retransmits = r.Retransmits
	if r.EstablishedNs != 0 {
		c.Established = time.Unix(0, int64(r.EstablishedNs)+int64(boot))
	}
}

// addrOf returns an address as the kernel stores it; IPv4-mapped IPv6
// addresses (a dual-stack socket talking IPv4) are unmapped, so that both
// ends of one connection print alike.
func addrOf(family uint16, a *[16]uint8) netip.Addr {
	if family == afInet {
		return netip.AddrFrom4([4]byte(a[:4]))
	}
	return netip.AddrFrom16(*a).Unmap()
}

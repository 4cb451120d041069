package loader

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/mpipause/mpipause/internal/sockdiag"
)

// A listed read: where the kernel refuses iterators over maps (no
// conniter), a Snapshot that walks is an iter/tcp pass over a namespace's
// whole established hash table, whatever the job holds. connlist
// (bpf/include/mpipause.h) lists the job's connections by cookie instead:
// sockops lists a connection when it is established, before its process
// can send a byte on it, and the programs take it off where they forget
// it. After a walk has adopted, in every namespace, what was established
// before the programs were attached, a Snapshot reads the list and looks
// each connection up by sock_diag (LookupTCP, with its tcp_info): it
// costs what the job holds. It stands for a walk only where it reads what
// a walk would: every listed connection found ESTABLISHED, registered by
// sockops (whose counts' base tcp_info's counters share exactly), its
// counts read when no ACK or segment moved them between two lookups
// (exactLookups), and nothing lost to a full list since the walk began.
// Anything else, and the Snapshot walks (errNoList).

// errNoList says a listed read cannot stand for a walk here.
var errNoList = errors.New("the listed connections cannot stand for a walk")

// connFSockops is CONN_F_SOCKOPS of bpf/include/mpipause.h.
const connFSockops = 1 << 0

// listEntry is one connlist entry.
type listEntry = sockopsConnKey

// lostCount reads connlist_lost: the entries the list could not take.
func (o *BPFObserver) lostCount() (uint64, error) {
	var n uint64
	if err := o.lost.Lookup(uint32(0), &n); err != nil {
		return 0, fmt.Errorf("read map connlist_lost: %w", err)
	}
	return n, nil
}

// canList says whether a Snapshot over nss may try the list: a walk has
// adopted every namespace's connections since the last Watch or Unwatch,
// and counted the list's losses before it began.
func (o *BPFObserver) canList(nss []netns) bool {
	if o.connIter != nil || o.tcpIter == nil || o.list == nil || !o.listFrom.ok {
		return false
	}
	for _, ns := range nss {
		if !o.adopted[ns.ino] {
			return false
		}
	}
	return true
}

// listed is a Snapshot's read from the list (see above): the connections
// of the namespaces labels names, and whether the list had one in another.
func (o *BPFObserver) listed(ctx context.Context, labels map[uint32]string) ([]Conn, bool, error) {
	lost, err := o.lostCount()
	if err != nil {
		return nil, false, err
	}
	if lost != o.listFrom.lost {
		return nil, false, fmt.Errorf("%w: %d connections not listed since the last walk", errNoList, lost-o.listFrom.lost)
	}
	byNS := map[uint32][]listed{}
	unknown := false
	var (
		cookie uint64
		e      listEntry
	)
	it := o.list.Iterate()
	for n := 0; it.Next(&cookie, &e); n++ {
		if n == listMax {
			return nil, false, fmt.Errorf("%w: more than %d entries", errNoList, listMax)
		}
		if _, ok := labels[e.Netns]; !ok {
			unknown = true
			continue
		}
		if e.Flags&connFSockops == 0 {
			return nil, false, fmt.Errorf("%w: connection %d adopted after it was established", errNoList, cookie)
		}
		byNS[e.Netns] = append(byNS[e.Netns], listed{cookie, e})
	}
	if err := it.Err(); err != nil {
		return nil, false, fmt.Errorf("read map connlist: %w", err)
	}
	n := 0
	for _, ls := range byNS {
		n += len(ls)
	}
	per := o.lookupCost
	if per == 0 {
		per = lookupCostGuess
	}
	if o.walkCost > 0 && time.Duration(2*n)*per > o.walkCost {
		// Two lookups a connection at least (exactLookups), each a
		// system call of a few microseconds; a walk costs the hash
		// table whatever the job holds: past some hundreds of
		// connections the walk is the cheaper.
		return nil, false, fmt.Errorf("%w: %d connections to look up twice, %v each, against a walk of %v", errNoList, n, per, o.walkCost)
	}
	t0 := time.Now()
	boot := bootOffset()
	var out []Conn
	for ino, ls := range byNS {
		if err := ctx.Err(); err != nil {
			return nil, false, err
		}
		label := labels[ino]
		d, err := o.diagIn(label)
		if err != nil {
			return nil, false, err
		}
		ids := make([]sockdiag.ID, len(ls))
		for i, l := range ls {
			ids[i] = l.id()
		}
		got, err := exactLookups(ctx, d, ids)
		var gone notFound
		if errors.As(err, &gone) {
			// Closed since the list was read (its TCP_CLOSE took the
			// entry off already), or freed while the programs were
			// not attached, which leaves its entry: off with it, or
			// every read would walk. The walk this read falls back to
			// lists again any socket of the job it passes.
			o.list.Delete(uint64(gone))
		}
		if err != nil {
			return nil, false, fmt.Errorf("%w: in %s: %w", errNoList, labelName(label), err)
		}
		for i, l := range ls {
			g := &got[i]
			t := &l.e.Tuple
			c := Conn{
				Cookie:      l.cookie,
				Local:       netip.AddrPortFrom(addrOf(t.Family, &t.Saddr), t.Sport),
				Remote:      netip.AddrPortFrom(addrOf(t.Family, &t.Daddr), t.Dport),
				State:       StateEstablished,
				Netns:       label,
				Cgroup:      l.e.CgroupId,
				SendQueue:   g.WQueue,
				Unread:      g.RQueue,
				Counted:     true,
				Active:      l.e.Flags&connFActive != 0,
				BytesRecv:   g.Info.BytesReceived - uint64(g.RQueue),
				Retransmits: uint64(g.Info.TotalRetrans),
			}
			c.BytesSent = uint64(g.WQueue) + g.Info.BytesAcked
			if c.Active {
				c.BytesSent-- // the SYN (exactLookups: bytes_acked counts it)
			}
			// The sequence numbers a walk reads besides write_seq, from
			// the queues: written and not acknowledged, written and not
			// sent. Those of the other direction are not read (zero):
			// nothing but a walk's reader uses them.
			c.WriteSeq = l.e.SndBase + uint32(c.BytesSent)
			c.SndUna = c.WriteSeq - c.SendQueue
			c.SndNxt = c.WriteSeq - g.Info.NotsentBytes
			if l.e.EstablishedNs != 0 {
				c.Established = time.Unix(0, int64(l.e.EstablishedNs)+int64(boot))
			}
			out = append(out, c)
		}
	}
	if n >= lookupCostMin {
		o.lookupCost = time.Since(t0) / time.Duration(2*n)
	}
	return out, unknown, nil
}

// exactRetries bounds the lookups of one connection after the first two
// (exactLookups): each is a system call of a few microseconds, and a
// connection whose counts move in every one of them is walked instead.
const exactRetries = 4

// exactLookups looks every connection of ids up until two lookups in a
// row find the same bytes acknowledged and received, and returns the
// second of those for each. The counts a Snapshot reads are sums of a
// queue and a counter (sent: the send queue plus bytes_acked; read:
// bytes_received less the receive queue), and the kernel reads the
// queues without the socket's lock and tcp_info after taking it, so an
// ACK or a segment arriving between the two counts in both: a count
// ahead of any the socket had, which the next read would go back on.
// bytes_acked and bytes_received move with snd_una and rcv_nxt, under
// the socket's lock; unchanged from one lookup's tcp_info to the next's,
// neither moved in between, so the second lookup's sums are the counts
// at the instant it read the queues. tcp_info's bytes_sent is no such
// count: it counts again every byte of a transmit the device refused
// (TestTakenAheadOfWalk). A connection not found, or not ESTABLISHED,
// fails the whole read.
func exactLookups(ctx context.Context, d *sockdiag.DiagConn, ids []sockdiag.ID) ([]sockdiag.TCPSocket, error) {
	prev, err := lookupAll(ctx, d, ids)
	if err != nil {
		return nil, err
	}
	got, err := lookupAll(ctx, d, ids)
	if err != nil {
		return nil, err
	}
	for i := range got {
		for try := 0; !sameCounters(&prev[i], &got[i]); try++ {
			if try == exactRetries {
				return nil, fmt.Errorf("connection %d's counts moved at each of %d lookups", ids[i].Cookie, try+2)
			}
			// Back to back, one at a time: the window an ACK can
			// fall in is one lookup's, not the batch's.
			again, err := lookupAll(ctx, d, ids[i:i+1])
			if err != nil {
				return nil, err
			}
			prev[i], got[i] = got[i], again[0]
		}
	}
	return got, nil
}

// lookupAll is LookupTCP that fails on a connection not found or not
// ESTABLISHED, or a tcp_info without the counters.
func lookupAll(ctx context.Context, d *sockdiag.DiagConn, ids []sockdiag.ID) ([]sockdiag.TCPSocket, error) {
	got, ok, err := d.LookupTCP(ctx, ids)
	if err != nil {
		return nil, fmt.Errorf("look up: %w", err)
	}
	for i := range got {
		switch {
		case !ok[i]:
			return nil, notFound(ids[i].Cookie)
		case TCPState(got[i].State) != StateEstablished:
			return nil, fmt.Errorf("connection %d %v", ids[i].Cookie, TCPState(got[i].State))
		case !got[i].Info.HasBytesAcked():
			return nil, fmt.Errorf("connection %d: tcp_info without bytes_acked", ids[i].Cookie)
		}
	}
	return got, nil
}

// notFound names a listed connection a lookup did not find, by cookie.
type notFound uint64

func (n notFound) Error() string { return fmt.Sprintf("connection %d not found", uint64(n)) }

func sameCounters(a, b *sockdiag.TCPSocket) bool {
	return a.Info.BytesAcked == b.Info.BytesAcked && a.Info.BytesReceived == b.Info.BytesReceived
}

// listMax bounds the entries a listed read looks at: MAX_LISTED.
const listMax = 16384

type listed struct {
	cookie uint64
	e      listEntry
}

// id names l's socket for sock_diag in its own family: an IPv6 socket
// talking IPv4 by its v4-mapped addresses.
func (l listed) id() sockdiag.ID {
	t := &l.e.Tuple
	local, remote := netip.AddrFrom16(t.Saddr), netip.AddrFrom16(t.Daddr)
	if t.Family == afInet {
		local, remote = netip.AddrFrom4([4]byte(t.Saddr[:4])), netip.AddrFrom4([4]byte(t.Daddr[:4]))
	}
	return sockdiag.ID{Local: netip.AddrPortFrom(local, t.Sport), Remote: netip.AddrPortFrom(remote, t.Dport), Cookie: l.cookie}
}

package loader

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mpipause/mpipause/internal/sockdiag"
)

// Rechecker is an Observer that can read again, at a cost proportional to
// them, connections an earlier Snapshot listed.
type Rechecker interface {
	// Recheck returns cs (a Snapshot's, or an earlier Recheck's) with
	// each established connection's State, SendQueue and Unread read
	// again from the kernel; a connection no longer there comes back in
	// StateClose. BytesSent is read again, Counted, where it is the same
	// count as cs's and exact: a connection still ESTABLISHED, with
	// nothing in its send queue, that sockops registered.
	// Then it is the count a Snapshot would have read at some instant of
	// the lookup (countFromInfo). BytesRecv, Retransmits and the sequence
	// numbers are zero. A connection made since cs was read is not in
	// the answer: only a Snapshot lists it.
	//
	// A recheck that counts lets a drain check count the bytes sent
	// through closed gates without a walk (internal/node/kernelreport.go).
	// errors.Is(err, ErrNoRecheck) says a Snapshot is the way here.
	Recheck(ctx context.Context, cs []Conn) ([]Conn, error)
}

// ErrNoRecheck says Recheck would not save anything (Snapshot already
// costs what the job holds), or cannot name a connection's namespace.
var ErrNoRecheck = errors.New("no recheck: take a snapshot")

var _ Rechecker = (*BPFObserver)(nil)

// lookupCostGuess is a lookup's cost until a Recheck of at least
// lookupCostMin sockets has measured it (fewer are dominated by the
// costs of the call itself): 3.9 µs a socket for 96 sockets on this
// project's machine (BenchmarkRecheck).
const (
	lookupCostGuess = 4 * time.Microsecond
	lookupCostMin   = 32
)

// Recheck is Rechecker's. Without conniter each Snapshot runs iter/tcp,
// which walks the namespace's whole established hash table (262,144
// buckets on a 24 GiB machine: about 2 ms whatever the job holds), so
// there each connection is instead looked up by sock_diag (its 4-tuple and
// cookie: a hash lookup), one netlink socket per namespace, kept open, as
// long as the lookups cost less than the last walk did (each costs its
// reply's system call). With conniter, Snapshot reads only the job's
// sockets already.
func (o *BPFObserver) Recheck(ctx context.Context, cs []Conn) ([]Conn, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil, ErrClosed
	}
	if o.connIter != nil {
		return nil, ErrNoRecheck
	}
	n := 0
	for _, c := range cs {
		if c.State == StateEstablished {
			n++
		}
	}
	per := o.lookupCost
	if per == 0 {
		per = lookupCostGuess
	}
	if o.walkCost > 0 && time.Duration(n)*per > o.walkCost {
		// Each lookup costs a reply's system call (about 4 µs here),
		// the walk a pass over the hash table whatever the job holds:
		// past some hundreds of sockets the walk is the cheaper.
		return nil, fmt.Errorf("%w: %d connections to look up, %v each, against a walk of %v", ErrNoRecheck, n, per, o.walkCost)
	}
	t0 := time.Now()
	defer func() {
		if n >= lookupCostMin {
			o.lookupCost = time.Since(t0) / time.Duration(n)
		}
	}()
	out := make([]Conn, len(cs))
	copy(out, cs)
	byNS := map[string][]int{}
	for i, c := range out {
		if c.State != StateEstablished {
			continue
		}
		byNS[c.Netns] = append(byNS[c.Netns], i)
	}
	for label, idx := range byNS {
		d, err := o.diagIn(label)
		if err != nil {
			return nil, err
		}
		ids := make([]sockdiag.ID, len(idx))
		for k, i := range idx {
			ids[k] = sockdiag.ID{Local: out[i].Local, Remote: out[i].Remote, Cookie: out[i].Cookie}
		}
		got, ok, err := d.LookupTCP(ctx, ids)
		if err != nil {
			return nil, fmt.Errorf("recheck in %s: %w", labelName(label), err)
		}
		for k, i := range idx {
			c := &out[i]
			// Registered by sockops: the counts' base and Active are
			// exact (one adopted after the fact may be a byte off), and
			// stay known through a Recheck that could not count.
			counted := !c.Established.IsZero()
			*c = Conn{Cookie: c.Cookie, Local: c.Local, Remote: c.Remote, Netns: c.Netns, Cgroup: c.Cgroup,
				Established: c.Established, Active: c.Active, State: StateClose}
			if !ok[k] {
				continue
			}
			g := &got[k]
			c.State = TCPState(g.State)
			c.SendQueue, c.Unread = g.WQueue, g.RQueue
			if n, can := countFromInfo(g, c.Active); can && counted && c.State == StateEstablished {
				c.Counted, c.BytesSent = true, n
			}
		}
	}
	return out, nil
}

// countFromInfo returns the bytes an ESTABLISHED socket's process handed
// to the kernel, as a Snapshot counts them (write_seq less where the data
// starts, bpf/include/mpipause.h), from a sock_diag lookup: the send queue
// (write_seq - snd_una) plus the bytes acknowledged, less the SYN on the
// end that sent it (active), which bytes_acked counts. It can only where
// the send queue is empty: the kernel reads the queue without the socket
// lock and tcp_info's counters after taking it, so an ACK arriving between
// the two would be counted in both, a count ahead of any the socket had.
// With nothing queued no ACK can advance snd_una past where the queue was
// read, and the sum is the count at some instant between the two reads.
// Not tcp_info's bytes_sent: it counts again every byte of a transmit the
// device refused (TestTakenAheadOfWalk).
func countFromInfo(g *sockdiag.TCPSocket, active bool) (uint64, bool) {
	if g.Info == nil || g.WQueue != 0 || !g.Info.HasBytesAcked() {
		return 0, false
	}
	n := g.Info.BytesAcked
	if active {
		if n == 0 {
			return 0, false
		}
		n--
	}
	return n, true
}

// diagIn returns the observer's sock_diag socket in the namespace the last
// Snapshot labelled label, dialing it the first time.
func (o *BPFObserver) diagIn(label string) (*sockdiag.DiagConn, error) {
	for _, ns := range o.lastNS {
		if ns.label != label {
			continue
		}
		if d, ok := o.diag[ns.ino]; ok {
			return d, nil
		}
		d, err := sockdiag.DialDiag(int(ns.f.Fd()))
		if err != nil {
			return nil, fmt.Errorf("recheck in %s: %w", nsName(ns), err)
		}
		if o.diag == nil {
			o.diag = map[uint64]*sockdiag.DiagConn{}
		}
		o.diag[ns.ino] = d
		return d, nil
	}
	return nil, fmt.Errorf("%w: namespace %s not in the last snapshot", ErrNoRecheck, labelName(label))
}

// keepDiag records the namespaces a Snapshot looked in and closes the
// sock_diag sockets of those it no longer does.
func (o *BPFObserver) keepDiag(nss []netns) {
	o.lastNS = append(o.lastNS[:0], nss...)
	for ino, d := range o.diag {
		live := false
		for _, ns := range nss {
			live = live || ns.ino == ino
		}
		if !live {
			d.Close()
			delete(o.diag, ino)
		}
	}
}

func (o *BPFObserver) closeDiag() {
	for ino, d := range o.diag {
		d.Close()
		delete(o.diag, ino)
	}
	o.lastNS = nil
}

func labelName(label string) string {
	if label == "" {
		return "(own)"
	}
	return label
}

package node

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// The kernel's word on a job's connections at each drain check and after
// the freeze: what holds bytes, with its ranks, and the bytes sent through
// closed gates since the last read that every gate was closed for.

// kernelRead is one kernel read of the job's connections on this node,
// with what tells whose they are.
type kernelRead struct {
	conns []loader.Conn
	d     *drainSet
	sides sides
}

// check is what a kernel report is taken under.
type check int

const (
	// checkOpen: some gate of the node's ranks was open, or a socket
	// mid-message, when it was asked: nothing sent is counted.
	checkOpen check = iota
	// checkGated: every gate closed: bytes sent since the previous gated
	// report are counted, and told apart (late): late ones are drained
	// again, the others fail the pause at this round. Telling them apart
	// walks /proc (20-30 ms), only in a check that counted bytes: a late
	// call lands once, and a sender past the shim ends the pause.
	checkGated
	// checkFrozen: after the freeze: the same count, from the node's last
	// drain answer.
	checkFrozen
)

// kernelReport reads the job's connections on this node, counting bytes
// sent through closed gates as under says.
func (l *Role) kernelReport(ctx context.Context, job string, rep quiesce.NodeReport, under check) (quiesce.NodeReport, kernelRead, error) {
	return l.kernelReportBy(ctx, job, rep, under, under == checkFrozen, false)
}

// kernelReportBy is kernelReport, its read a walk (a Snapshot) if walk,
// else a recheck of the last read's connections where the observer has
// one (loader.Rechecker: where a Snapshot walks the kernel's hash tables,
// a drain check then costs what the job holds). A recheck that counts
// (every connection it read still established, with the same count as
// the walk's: recounted) takes the count of bytes sent through closed
// gates as a walk does. One that cannot count leaves the count to the
// reads that walk, and its clean answer (what the coordinator freezes on)
// is confirmed by one, which takes the count. Either way a connection made
// since the last walk is the next walk's, at the latest the check after
// the freeze's, which counts every byte such a connection took when it
// was made after the count began (violations). Drain checks after a
// confirmed clean answer, clean too (another node's rounds), need no walk:
// nothing was unclean since. FREEZE's
// settle check (quiesce.Settling) only waits for the node's queues to
// empty: it never walks to confirm, and its counts move nothing, so the
// check after the freeze counts every byte sent through the gates since
// the node's last drain answer (docs/guarantees.md, "FREEZE and VERIFY in
// one round"): late bytes the settle check absorbed could have reached a
// node that had already frozen and checked. With first, the read (a walk) is PREPARE's
// too (Role.Prepare): the job's drain set and the connections the next
// reads are compared with start from it.
func (l *Role) kernelReportBy(ctx context.Context, job string, rep0 quiesce.NodeReport, under check, walk, first bool) (quiesce.NodeReport, kernelRead, error) {
	rep := rep0
	began := time.Now()
	all, rechecked, err := l.read(ctx, job, under, walk, first)
	if err != nil {
		return rep, kernelRead{}, err
	}
	d, sd := l.sidesOf(job, all, first)
	mine, own := sd.checked(all)
	rep.Own = own
	rs := l.Ranks.Ranks(job)
	rep.Ranks = len(rs)
	// After the read and the count of ranks, before anything is made of
	// them: a rank that left meanwhile fails the step, naming it, instead
	// of the report counting fewer ranks (which the coordinator can only
	// call missing) or its sockets' ends counting as bytes sent past the
	// gates.
	if err := l.gone(job, l.closing(job, all, first, !rechecked)); err != nil {
		return quiesce.NodeReport{Node: l.Name}, kernelRead{}, err
	}
	var held []loader.Conn
	rep.Counted = true
	recounted := rechecked
	for _, c := range mine {
		// A listening socket sends nothing: it needs no count.
		rep.Counted = rep.Counted && (c.Counted || c.State == loader.StateListen)
		// A recheck passes on what it did not read again (a connection
		// the last read found closing) as that read had it.
		recounted = recounted && (c.State == loader.StateListen || c.State == loader.StateEstablished && c.Counted)
		if c.State != loader.StateEstablished {
			continue
		}
		rep.Checked++
		if !c.Empty() {
			held = append(held, c)
		}
	}
	// The settle check takes no count of its own: the check after the
	// freeze counts from the node's last drain answer.
	settling := quiesce.Settling(ctx)
	l.mu.Lock()
	if l.sentAt == nil {
		l.sentAt = map[string]map[uint64]uint64{}
	}
	var sent map[uint64]uint64
	var through []violation
	switch {
	case under == checkOpen:
		delete(l.sentAt, job)
		delete(l.countFrom, job)
	case rechecked && !recounted:
		// The count since the read that took sentAt is the next walk's.
		rep.Counted = l.sentAt[job] != nil && l.counted[job]
	default:
		from := l.countFrom[job]
		if from.IsZero() && !settling {
			from = began
			if l.countFrom == nil {
				l.countFrom = map[string]time.Time{}
			}
			l.countFrom[job] = from
		}
		sent, through = violations(l.sentAt[job], mine, from)
		if !settling {
			l.sentAt[job] = sent
			if l.counted == nil {
				l.counted = map[string]bool{}
			}
			l.counted[job] = rep.Counted
		}
	}
	l.mu.Unlock()
	// Every check that counts sorts what it counted: late bytes are in
	// order and drained again; the others may have overtaken held bytes,
	// and fail the pause whichever check counted them. The next count
	// starts from this one, so a violation is kept until the pause ends
	// (violated): a drain check's answer would otherwise be the only one
	// to say it.
	var hs holdings
	if len(through) > 0 {
		prs := make([]pageRank, 0, len(rs))
		for _, r := range rs {
			prs = append(prs, pageRank{r.Pid, r})
		}
		hs = heldSockets(prs, socketOf)
	}
	var violated uint64
	for _, v := range through {
		l.Metrics.Violations(v.bytes)
		why := late(v, hs)
		if why == "" {
			rep.Late += v.bytes
			l.Log.Info("bytes sent through a closed gate, in order (late): drained again", "job", job, "node", l.Name,
				"local", v.c.Local.String(), "remote", v.c.Remote.String(), "bytes", v.bytes)
			continue
		}
		violated += v.bytes
		l.Log.Warn("bytes sent through a closed gate", "job", job, "node", l.Name,
			"local", v.c.Local.String(), "remote", v.c.Remote.String(), "bytes", v.bytes, "not_late", why, "settle", settling)
	}
	l.mu.Lock()
	rep.Violations = l.violated[job] + violated
	if violated > 0 && !settling {
		if l.violated == nil {
			l.violated = map[string]uint64{}
		}
		l.violated[job] += violated
	}
	l.mu.Unlock()
	now := make(map[[2]netip.AddrPort]heldConn, len(held))
	lookup := false
	t := time.Now()
	l.mu.Lock()
	for _, c := range held {
		k := [2]netip.AddrPort{unmap(c.Local), unmap(c.Remote)}
		h, ok := l.held[job][k]
		if !ok {
			h = heldConn{since: t, rank: -1}
		}
		now[k] = h
		lookup = lookup || (!h.looked && t.Sub(h.since) >= stuckAfter)
	}
	l.mu.Unlock()
	if lookup {
		pids := make(map[int]int, len(rs))
		for _, r := range rs {
			pids[r.Pid] = r.Rank
		}
		own := owners(pids)
		for k, h := range now {
			if t.Sub(h.since) < stuckAfter {
				continue
			}
			h.looked = true
			if rank, ok := own[k]; ok {
				h.rank = rank
			}
			now[k] = h
		}
	}
	l.mu.Lock()
	if l.held == nil {
		l.held = map[string]map[[2]netip.AddrPort]heldConn{}
	}
	l.held[job] = now
	l.mu.Unlock()
	for _, c := range held {
		rank := now[[2]netip.AddrPort{unmap(c.Local), unmap(c.Remote)}].rank
		rep.Conns = append(rep.Conns, quiesce.Conn{Node: l.Name, Local: c.Local.String(), Remote: c.Remote.String(),
			SendQueue: uint64(c.SendQueue), Unread: uint64(c.Unread), Rank: rank})
	}
	rep.Empty = len(rep.Conns) == 0 && rep.Ungated == 0
	clean := under == checkGated && rep.Empty && rep.Violations == 0 && rep.Late == 0
	l.mu.Lock()
	confirmed := l.confirmed[job]
	l.mu.Unlock()
	if rechecked && !recounted && clean && !confirmed && !settling {
		return l.kernelReportBy(ctx, job, rep0, under, true, first)
	}
	l.mu.Lock()
	if l.confirmed == nil {
		l.confirmed = map[string]bool{}
	}
	l.confirmed[job] = clean && (confirmed || !rechecked || recounted)
	if first && !clean {
		// PREPARE's read, moments after the gates closed, counts from
		// nothing: a send that read its gate open just before it closed
		// and reaches the kernel late (its thread preempted), as it may,
		// would count at the next walk and cost the pause a round. The
		// count starts at a clean answer, the one the coordinator may
		// freeze on, or at the next walk.
		delete(l.sentAt, job)
	}
	l.mu.Unlock()
	l.remember(job, all)
	return rep, kernelRead{conns: all, d: d, sides: sd}, nil
}

// read is a kernel read of the job's connections on this node: a recheck
// of the last read's unless walk, or the observer cannot (or need not)
// recheck; rechecked says which it was.
func (l *Role) read(ctx context.Context, job string, under check, walk, first bool) (conns []loader.Conn, rechecked bool, err error) {
	if under != checkFrozen && !first {
		// A drain check only says when the pause goes on: it may look in
		// the namespaces PREPARE's read walked. PREPARE's read finds them,
		// and the check after the freeze proves the pause: both walk the
		// job's cgroups again (loader.Pacing).
		ctx = loader.Pacing(ctx)
	}
	if !walk {
		l.mu.Lock()
		prev, ok := l.last[job]
		l.mu.Unlock()
		obs, err := l.Jobs.Observer(job)
		if err != nil {
			return nil, false, err
		}
		if rc, can := obs.(loader.Rechecker); ok && can {
			cs, err := rc.Recheck(ctx, prev)
			if err == nil {
				return cs, true, nil
			}
			if !errors.Is(err, loader.ErrNoRecheck) {
				return nil, false, err
			}
		}
	}
	conns, err = l.conns(ctx, job)
	return conns, false, err
}

// remember keeps conns as the job's last kernel read here.
func (l *Role) remember(job string, conns []loader.Conn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last = map[string][]loader.Conn{}
	}
	l.last[job] = conns
}

// violation is a connection that took bytes from its process while every
// gate was closed.
type violation struct {
	c     loader.Conn
	bytes uint64
}

// late says whether v's bytes, sent through a closed gate, can only have
// gone in order: "" when no rank's page shows bytes held for its socket,
// or every rank that holds some holds bytes that go after everything the
// kernel has taken (hs, heldSockets), else why not (the log says it).
//
// A send call reads its gate once, before the system call. One that read
// it open just before it closed, its thread preempted in between, reaches
// the kernel late, legitimately; a process that is not a rank (a rank's
// forked child, with a gate of its own) or a path past the shim (a raw
// system call) reaches it at any time. Either way, bytes that reach a
// socket for which nothing is held cannot overtake held bytes: the stream
// is in the order the kernel took it (G4), and the bytes are in flight
// like any others, for another drain (G1). Held bytes only grow while the
// gates stay closed and the page says so before the holding call returns,
// so nothing held at this check means nothing held when they were sent.
// Where bytes are held, the page says where they go in the stream: the
// kernel's count of the bytes the socket took before the shim began to
// hold, as tcp_info gives it (libmpi-shim/tcpsent.c). It is compared with
// the same count read now through the holder's descriptor, never with the
// observer's: tcp_info's count runs ahead of the observer's by every byte
// of a transmit the local device refused (sockdiag.TCPInfo.Taken), so the
// two would hide that many bytes, and it only grows, by every byte the
// socket takes. A count that has not passed the place means every byte
// the kernel took came before the held ones, as the rank's calls did: a
// late call, then the held one after it (the same thread's next message).
// A count past it is a byte that went ahead of held bytes written before
// it, or a refused transmit since (then the pause fails needlessly, never
// wrongly). Where the pages cannot say (a rank without one, a held
// descriptor that could not be named, a shim too old to record where, a
// kernel whose tcp_info does not count), the pause fails rather than
// claim G4.
func late(v violation, hs holdings) (whyNot string) {
	if hs.cannot != "" {
		return hs.cannot
	}
	for _, h := range hs.by[[2]netip.AddrPort{unmap(v.c.Local), unmap(v.c.Remote)}] {
		if h.from == ranks.FromUnknown || !h.sock.counted {
			return fmt.Sprintf("pid %d holds %d bytes for fd %d, and its page or the kernel cannot say where they go in the stream", h.pid, h.held, h.fd)
		}
		if h.sock.taken > h.from {
			return fmt.Sprintf("pid %d holds %d bytes for fd %d that go after byte %d of the stream, and the kernel has taken %d", h.pid, h.held, h.fd, h.from, h.sock.taken)
		}
	}
	return ""
}

// sentOf is what c's process has handed the kernel to send: the kernel's
// count, not the shim's. BytesSent where the observer counts it, which
// leaves out the FIN a close queues (a socket closed under a closed gate,
// or by a rank's death, sent nothing); else write_seq, which counts the
// FIN as a byte.
func sentOf(c loader.Conn) uint64 {
	if c.Counted {
		return c.BytesSent
	}
	return uint64(c.WriteSeq)
}

// violations compares what each connection's process has handed to the
// kernel (sentOf) with sent, the values of the previous report taken with
// every gate closed, and returns the values to compare the next report
// with. A connection not in sent (new, or the first gated report) gets its
// value recorded; one established after from, the time the first read
// that counted began (after every gate had closed), took every byte it
// has through closed gates, and they count. from is a read's start and
// Established the kernel's time of the handshake, both wall clock: a
// connection established just before from and not listed by that read
// (made during a walk), counted from nothing, costs a round, not a
// violation unless bytes are held on it. Where the observer cannot say
// when a connection was made (one adopted after the fact, the sock_diag
// observer), its value is only recorded, and bytes it took before its
// first read are not counted.
//
// Each check counts from the last one that counted. A send call that read
// the gate open just before it closed can reach the kernel much later (a
// thread preempted between the shim's load and the system call; most
// likely what a count since the first check once saw: 16 KiB from an Open
// MPI job with its progress thread, on the loaded rig), legitimately: on a
// socket for which nothing is held, or whose held bytes go after them,
// its bytes are late, in order, and cost one more round; if the call was short its socket shows as not gated
// until the rest is sent, so no message is left half-sent. Bytes on a
// socket with bytes held, or one no page vouches for, may have gone ahead
// of held bytes (a path past the shim: a call it does not wrap): whichever
// check counts them, the node says them until the pause ends
// (Role.violated) and the pause fails, a rollback that names the node and
// the bytes, never a wrong commit.
func violations(sent map[uint64]uint64, conns []loader.Conn, from time.Time) (map[uint64]uint64, []violation) {
	next := make(map[uint64]uint64, len(conns))
	var out []violation
	for _, c := range conns {
		n := sentOf(c)
		next[c.Cookie] = n
		was, ok := sent[c.Cookie]
		if !ok && c.Counted && !from.IsZero() && c.Established.After(from) {
			was, ok = 0, true
		}
		switch {
		case !ok || n == was:
		case c.Counted:
			out = append(out, violation{c, n - was})
		default:
			out = append(out, violation{c, uint64(uint32(n) - uint32(was))}) // wraps like the kernel's
		}
	}
	return next, out
}

package node

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// rechecking is fakeObserver with loader.Rechecker's Recheck: each
// connection asked for as the test has it now, without byte counts, or
// with its sent count where the loader's would count (counts: a
// connection still established, with nothing queued to send, that has a
// time it was made).
type rechecking struct {
	*fakeObserver
	counts              bool
	snapshots, rechecks int
}

func (o *rechecking) Snapshot(ctx context.Context) ([]loader.Conn, error) {
	o.snapshots++
	return o.fakeObserver.Snapshot(ctx)
}

func (o *rechecking) Recheck(ctx context.Context, cs []loader.Conn) ([]loader.Conn, error) {
	o.rechecks++
	o.mu.Lock()
	defer o.mu.Unlock()
	out := slices.Clone(cs)
	for i := range out {
		c := &out[i]
		if c.State != loader.StateEstablished {
			continue
		}
		counted := o.counts && !c.Established.IsZero()
		*c = loader.Conn{Cookie: c.Cookie, Local: c.Local, Remote: c.Remote, Netns: c.Netns, Established: c.Established, State: loader.StateClose}
		for _, now := range o.conns {
			if now.Cookie == c.Cookie {
				c.State, c.SendQueue, c.Unread = now.State, now.SendQueue, now.Unread
				if counted && now.State == loader.StateEstablished && now.SendQueue == 0 {
					c.Counted, c.BytesSent = true, now.BytesSent
				}
			}
		}
	}
	return out, nil
}

// TestRecheckedDrainAsWalked: a node whose drain checks recheck the last
// read's connections (loader.Rechecker) answers a pause as one whose
// checks all walk, over generated drains: connections that empty at
// random, new ones, closed ones, bytes sent through the closed gates at
// any point. With rechecks that cannot count, its clean answers are the
// walking node's: it walks at the first drain check (whose read is
// PREPARE's: Prepare reads nothing), at each clean answer after an
// unclean one, and after the freeze. With rechecks that count, it counts
// at every check as the walking node does, for the connections its last
// walk listed, and walks only at the first check and where a recheck
// could not count (a connection it listed closed): its clean answer may
// miss a connection made since, which the check after the freeze finds.
// Either way the check after the freeze says every byte sent through a
// gate since its first count, as the walking node's does: those its
// checks counted, the settle check's among them, and those sent since
// (the count a FREEZE that checks in its own round relies on), a
// connection made since the count began with every byte it took.
// MPIPAUSE_RECHECK_SEED replays one drain.
func TestRecheckedDrainAsWalked(t *testing.T) {
	seeds := []uint64{}
	if s := os.Getenv("MPIPAUSE_RECHECK_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("MPIPAUSE_RECHECK_SEED=%q: %v", s, err)
		}
		seeds = append(seeds, v)
	} else {
		base := uint64(time.Now().UnixNano())
		for i := range 60 {
			seeds = append(seeds, base+uint64(i))
		}
	}
	ctx, s, job := quietRank(t, "recheck")
	for _, counts := range []bool{false, true} {
		for _, seed := range seeds {
			if err := recheckedDrain(ctx, s, job, seed, counts); err != nil {
				t.Fatalf("seed %d, rechecks that count %v: %v\nrerun: MPIPAUSE_RECHECK_SEED=%d go test -count=1 -run '^TestRecheckedDrainAsWalked$' ./internal/node/", seed, counts, err, seed)
			}
		}
	}
}

func recheckedDrain(ctx context.Context, s *ranks.Server, job string, seed uint64, counts bool) error {
	rng := rand.New(rand.NewPCG(seed, 11))
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	walkObs := &fakeObserver{}
	reObs := &rechecking{fakeObserver: &fakeObserver{}, counts: counts}
	walker := &Role{Name: "n1", Ranks: s, Jobs: observed{walkObs}, Log: log}
	checker := &Role{Name: "n1", Ranks: s, Jobs: observed{reObs}, Log: log}
	// The same connections in both observers, changed alike.
	var conns []loader.Conn
	next := uint64(0x10)
	checks, fresh := 0, 0 // drain checks; those after an unclean answer (or the first)
	// Bytes through the gates on each connection since each one's last
	// read that counted them (every walker check, the checker's walks and
	// counting rechecks), for the connections that read listed, and for
	// a connection made after the first check (the count began at it):
	// one made before and not listed only gets its count recorded by the
	// next (violations).
	pendW, pendC := map[uint64]uint64{}, map[uint64]uint64{}
	add := func(q uint32) {
		next++
		c := conn(next, fmt.Sprintf("10.0.0.1:%d", 5000+next), fmt.Sprintf("10.0.0.1:%d", 6000+next))
		peer := conn(next+1000, c.Remote.String(), c.Local.String())
		for _, x := range []*loader.Conn{&c, &peer} {
			x.Counted, x.WriteSeq, x.BytesSent = true, uint32(rng.Uint64()), uint64(rng.IntN(1<<20))
			x.Established = time.Now().Add(-time.Hour)
			if checks > 0 {
				// Made since the count began: it took every byte
				// through closed gates, and has none yet.
				x.Established, x.BytesSent = time.Now(), 0
				pendW[x.Cookie], pendC[x.Cookie] = 0, 0
			}
		}
		c.SendQueue, peer.Unread = q, q
		conns = append(conns, c, peer)
	}
	set := func() {
		for _, o := range []*fakeObserver{walkObs, reObs.fakeObserver} {
			o.mu.Lock()
			o.conns = slices.Clone(conns)
			o.mu.Unlock()
		}
	}
	for range 1 + rng.IntN(4) {
		add(uint32(rng.IntN(3)) * 4096)
	}
	set()
	var trail []string
	fail := func(f string, a ...any) error {
		return fmt.Errorf("after %v: %s", trail, fmt.Sprintf(f, a...))
	}
	for _, l := range []*Role{walker, checker} {
		if err := l.Prepare(ctx, job); err != nil {
			return err
		}
	}
	if reObs.snapshots != 0 || reObs.rechecks != 0 {
		return fail("Prepare read the kernel (%d walks, %d rechecks): its read is the first drain check's", reObs.snapshots, reObs.rechecks)
	}
	// What each node's checks counted: bytes through the gates on
	// connections no rank's page vouches for (these fakes are no rank's
	// sockets) are violations, and every later answer of the pause says
	// them, the check after the freeze's too.
	var stickyW, stickyC uint64
	// listed: the connections the checker's last walk listed, what its
	// rechecks read.
	listed := map[uint64]bool{}
	live := func(ck uint64) bool {
		for _, c := range conns {
			if c.Cookie == ck {
				return true
			}
		}
		return false
	}
	pending := func(m map[uint64]uint64, only map[uint64]bool) (n uint64) {
		for _, c := range conns {
			if only == nil || only[c.Cookie] {
				n += m[c.Cookie]
			}
		}
		return n
	}
	// baseline takes the count of the connections read (all if read is
	// nil), whose values the read recorded; the others' counts go on.
	baseline := func(m map[uint64]uint64, sticky *uint64, read map[uint64]bool) {
		*sticky += pending(m, read)
		for _, c := range conns {
			if read == nil || read[c.Cookie] {
				m[c.Cookie] = 0
			}
		}
		for ck := range m {
			if !live(ck) {
				delete(m, ck)
			}
		}
	}
	through := func(i int, n uint64) {
		conns[i].BytesSent += n
		conns[i].WriteSeq += uint32(n)
		for _, m := range []map[uint64]uint64{pendW, pendC} {
			if v, ok := m[conns[i].Cookie]; ok {
				m[conns[i].Cookie] = v + n
			}
		}
	}
	empty := func(only map[uint64]bool) bool {
		for _, c := range conns {
			if (only == nil || only[c.Cookie]) && !c.Empty() {
				return false
			}
		}
		return true
	}
	// check runs one drain check on both nodes and holds the walker's
	// answer to what it must be; walked says whether the checker walked,
	// read which connections its read listed, and recounted whether its
	// recheck counted. The walker's count starts at each check but the
	// first unclean one (PREPARE's read, which counts from nothing):
	// rebase is what the checks say, for after the checker's answer is
	// judged.
	check := func(ctx context.Context, what string, first bool) (c quiesce.NodeReport, walked, recounted bool, read map[uint64]bool, rebase func(), err error) {
		before := reObs.snapshots
		w, werr := walker.Drain(ctx, job)
		c, cerr := checker.Drain(ctx, job)
		if werr != nil || cerr != nil {
			return c, false, false, nil, nil, fail("%s: walker %v, checker %v", what, werr, cerr)
		}
		trail = append(trail, what)
		if w.Clean() != (empty(nil) && pending(pendW, nil) == 0 && stickyW == 0) {
			return c, false, false, nil, nil, fail("the walker's %s clean %v: %+v", what, w.Clean(), w)
		}
		walked = reObs.snapshots > before
		read = map[uint64]bool{}
		// A recheck counts only where every connection it reads is
		// still there with nothing queued to send (loader, Recheck).
		uncountable := false
		for ck := range listed {
			uncountable = uncountable || !live(ck)
		}
		for _, cn := range conns {
			uncountable = uncountable || listed[cn.Cookie] && cn.SendQueue != 0
		}
		for _, cn := range conns {
			if walked || listed[cn.Cookie] {
				read[cn.Cookie] = true
			}
		}
		if walked && counts && !uncountable && !first {
			return c, walked, false, nil, nil, fail("the checker walked where its recheck could count")
		}
		recounted = counts && !walked && !uncountable && !first
		return c, walked, recounted, read, func() {
			if !first || w.Clean() {
				baseline(pendW, &stickyW, nil)
			}
			if (walked || recounted) && (!first || c.Clean()) {
				baseline(pendC, &stickyC, read)
			}
			if walked {
				listed = read
			}
		}, nil
	}
	lastClean := false
	// confirmed: the checker's last answer was clean, and it or one
	// before it walked or counted with nothing unclean since.
	confirmed := false
	for step := range 2 + rng.IntN(12) {
		switch k := rng.IntN(6); {
		case k == 0 && len(conns) < 16:
			add(uint32(rng.IntN(2)) * 1024)
			trail = append(trail, "new")
		case k == 1 && len(conns) > 2:
			i := rng.IntN(len(conns)/2) * 2
			conns = slices.Delete(conns, i, i+2)
			trail = append(trail, "closed")
		case k == 2:
			i := rng.IntN(len(conns))
			n := uint64(1 + rng.IntN(8192))
			through(i, n)
			trail = append(trail, fmt.Sprintf("sent %d through", n))
		default:
			for i := range conns {
				if rng.IntN(2) == 0 {
					conns[i].SendQueue, conns[i].Unread = 0, 0
				}
			}
			trail = append(trail, "drained")
		}
		set()
		if step > 0 && rng.IntN(3) == 0 {
			continue // changes between two checks
		}
		c, walked, recounted, read, rebase, err := check(ctx, "check", checks == 0)
		if err != nil {
			return err
		}
		if checks == 0 && !walked {
			return fail("the first drain check after Prepare did not walk: its read is PREPARE's")
		}
		checks++
		if !confirmed {
			fresh++
		}
		// The answer the coordinator freezes on has counted what went
		// through and read every queue its read listed: a walk's, or a
		// recheck's that counted.
		if c.Clean() && !confirmed && !((walked || recounted) && empty(read) && pending(pendC, read) == 0) {
			return fail("the checker answered clean (walked %v, counted %v) after an unclean answer: %+v", walked, recounted, c)
		}
		if c.Clean() && recounted && pending(pendC, read) != 0 {
			return fail("the checker's counting recheck answered clean with %d bytes through the gates", pending(pendC, read))
		}
		if c.Clean() && stickyC > 0 {
			return fail("the checker answered clean with %d bytes counted through the gates before", stickyC)
		}
		if walked && confirmed {
			return fail("the checker walked for a check after a clean answer with nothing unclean since")
		}
		rebase()
		confirmed, lastClean = c.Clean(), c.Clean()
	}
	if drainWalks := reObs.snapshots; drainWalks > fresh {
		return fail("%d walks in %d drain checks, %d of them after an unclean answer", drainWalks, checks, fresh)
	}
	if !lastClean {
		return nil // no FREEZE without a clean answer
	}
	if rng.IntN(2) == 0 {
		n := uint64(1 + rng.IntN(100))
		through(0, n)
		set()
		trail = append(trail, fmt.Sprintf("sent %d through before the settle check", n))
	}
	// FREEZE's settle check only waits for the queues: it takes no count
	// (the check after the freeze counts from the last drain answer's),
	// and the checker rechecks for it.
	_, walked, _, _, _, err := check(quiesce.WithSettling(ctx), "settle", false)
	if err != nil {
		return err
	}
	if walked {
		return fail("the checker's settle check walked")
	}
	if rng.IntN(2) == 0 {
		n := uint64(1 + rng.IntN(100))
		through(0, n)
		set()
		trail = append(trail, fmt.Sprintf("sent %d through before the freeze", n))
	}
	wv, werr := walker.Verify(ctx, job)
	cv, cerr := checker.Verify(ctx, job)
	if werr != nil || cerr != nil {
		return fail("verify: walker %v, checker %v", werr, cerr)
	}
	if got, want := cv.Violations+cv.Late, stickyC+pending(pendC, nil); got != want {
		return fail("after the freeze the checker said %d bytes through the gates; %d were counted by its checks, %d sent since", got, stickyC, pending(pendC, nil))
	}
	if got, want := wv.Violations+wv.Late, stickyW+pending(pendW, nil); got != want {
		return fail("after the freeze the walker said %d bytes through the gates; %d were counted by its checks, %d sent since", got, stickyW, pending(pendW, nil))
	}
	if cv.Empty != wv.Empty || len(cv.Conns) != len(wv.Conns) {
		return fail("after the freeze: empty %v (%d held), the walker's %v (%d)", cv.Empty, len(cv.Conns), wv.Empty, len(wv.Conns))
	}
	return nil
}

// readers are the ways a node's drain checks read the kernel: every one
// walks, or they recheck without counting, or recheck and count.
var readers = []string{"walks", "rechecks", "counting rechecks"}

// counting is a node role over one connection between two of the job's
// sockets, both with byte counts (1,000 bytes sent from the first), whose
// checks read as reads (one of readers) says; set changes the first end
// as the kernel has it.
func counting(s *ranks.Server, reads string, log *slog.Logger) (*Role, func(func(*loader.Conn))) {
	base := &fakeObserver{}
	var obs loader.Observer = base
	if reads != "walks" {
		obs = &rechecking{fakeObserver: base, counts: reads == "counting rechecks"}
	}
	c, peer := conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"), conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000")
	c.Counted, c.BytesSent, peer.Counted = true, 1000, true
	c.Established = time.Now().Add(-time.Hour)
	peer.Established = c.Established
	return &Role{Name: "n1", Ranks: s, Jobs: observed{obs}, Log: log}, func(f func(*loader.Conn)) {
		f(&c)
		base.mu.Lock()
		base.conns = []loader.Conn{c, peer}
		base.mu.Unlock()
	}
}

// TestLateSendAfterPrepareRead: bytes that reach the kernel after
// PREPARE's read (the first drain check's) and before the node's first
// clean answer are not counted as sent through a closed gate: a send
// that read its gate open just before it closed reaches the kernel late
// when its thread is preempted, legitimately, and counted it cost the
// pause a DRAIN round (seen on the rig: an Open MPI ring's pause took one
// round more, its DRAIN phase 0-1 ms before, 10-16 ms after, when the
// first check's read took the count). Bytes after the clean answer are
// counted, by a node whose checks walk and by one that rechecks (counting
// or not).
func TestLateSendAfterPrepareRead(t *testing.T) {
	ctx, s, job := quietRank(t, "latesend")
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, rechecks := range readers {
		l, set := counting(s, rechecks, log)
		set(func(c *loader.Conn) { c.SendQueue = 8 })
		if err := l.Prepare(ctx, job); err != nil {
			t.Fatal(err)
		}
		if rep, err := l.Drain(ctx, job); err != nil || rep.Clean() {
			t.Fatalf("%s: PREPARE's check with 8 bytes queued: clean %v (%v), want unclean", rechecks, rep.Clean(), err)
		}
		set(func(c *loader.Conn) { c.BytesSent += 4096; c.SendQueue = 0 })
		rep, err := l.Drain(ctx, job)
		if err != nil || !rep.Clean() || rep.Violations != 0 {
			t.Fatalf("%s: a late send after PREPARE's read, then the queues empty: clean %v, %d bytes through the gates (%v); want clean, none", rechecks, rep.Clean(), rep.Violations, err)
		}
		set(func(c *loader.Conn) { c.BytesSent += 100 })
		if _, err = l.Drain(quiesce.WithSettling(ctx), job); err != nil {
			t.Fatal(err)
		}
		if rep, err = l.Verify(ctx, job); err != nil || rep.Violations != 100 {
			t.Fatalf("%s: 100 bytes sent after the clean answer: %d counted after the freeze (%v), want 100", rechecks, rep.Violations, err)
		}
	}
}

// TestViolationKept: bytes sent through a closed gate on a socket no page
// vouches for, counted by a drain check, are said by every later report of
// the pause, the check after the freeze's included; sent after the node's
// last drain answer, they are counted by the check after the freeze,
// whatever FREEZE's settle check saw before it (the agent drops its
// answer). By a node whose checks walk and by one that rechecks (counting
// or not); the next pause starts without them.
func TestViolationKept(t *testing.T) {
	ctx, s, job := quietRank(t, "kept")
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, rechecks := range readers {
		for _, at := range []string{"drain", "settle"} {
			name := fmt.Sprintf("%s, sent before the %s check", rechecks, at)
			l, set := counting(s, rechecks, log)
			set(func(*loader.Conn) {})
			if err := l.Prepare(ctx, job); err != nil {
				t.Fatal(err)
			}
			if rep, err := l.Drain(ctx, job); err != nil || !rep.Clean() {
				t.Fatalf("%s: PREPARE's check: clean %v (%v), want clean", name, rep.Clean(), err)
			}
			if at == "drain" {
				// Queued, so that a node whose rechecks do not count walks
				// to confirm the clean answer after, and counts there.
				set(func(c *loader.Conn) { c.BytesSent += 100; c.SendQueue = 100 })
				if rep, err := l.Drain(ctx, job); err != nil || rep.Clean() {
					t.Fatalf("%s: 100 bytes queued: clean %v (%v), want unclean", name, rep.Clean(), err)
				}
				set(func(c *loader.Conn) { c.SendQueue = 0 })
				for i := range 2 {
					if rep, err := l.Drain(ctx, job); err != nil || rep.Clean() || rep.Violations != 100 {
						t.Fatalf("%s: drain check %d after the queue emptied: clean %v, %d violations (%v); want unclean, 100", name, i+1, rep.Clean(), rep.Violations, err)
					}
				}
			} else {
				set(func(c *loader.Conn) { c.BytesSent += 100 })
				if _, err := l.Drain(quiesce.WithSettling(ctx), job); err != nil {
					t.Fatal(err)
				}
			}
			rep, err := l.Verify(ctx, job)
			if err != nil || rep.Violations != 100 || rep.Clean() {
				t.Fatalf("%s: the check after the freeze: %d violations, clean %v (%v); want 100, unclean", name, rep.Violations, rep.Clean(), err)
			}
			if err := l.Prepare(ctx, job); err != nil {
				t.Fatal(err)
			}
			if rep, err := l.Drain(ctx, job); err != nil || !rep.Clean() {
				t.Fatalf("%s: the next pause's first check: clean %v, %d violations (%v); want clean", name, rep.Clean(), rep.Violations, err)
			}
		}
	}
}

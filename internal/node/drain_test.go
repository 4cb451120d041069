package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// fakeObserver is the job's kernel observer with connections the test sets.
type fakeObserver struct {
	mu    sync.Mutex
	conns []loader.Conn
	paced []bool // each Snapshot's loader.IsPacing
}

func (o *fakeObserver) Snapshot(ctx context.Context) ([]loader.Conn, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.paced = append(o.paced, loader.IsPacing(ctx))
	return slices.Clone(o.conns), nil
}
func (o *fakeObserver) Kind() string { return "fake" }
func (o *fakeObserver) Close() error { return nil }

func (o *fakeObserver) add(c loader.Conn) {
	o.mu.Lock()
	o.conns = append(o.conns, c)
	o.mu.Unlock()
}

func conn(cookie uint64, local, remote string) loader.Conn {
	return loader.Conn{Cookie: cookie, Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote), State: loader.StateEstablished}
}

// oneRank serves a rank socket of the test's own (name tells it apart) with
// one fake rank 3 of job "j" registered on it; it returns the test's
// context, the server, the job's key and the lines the rank gets.
func oneRank(t *testing.T, name string, event *atomic.Pointer[string]) (context.Context, *ranks.Server, string, <-chan string) {
	t.Helper()
	return oneRankHolding(t, name, event, nil)
}

// quietRank is oneRank for a test that reads nothing of the rank's channel:
// its lines are read and dropped.
func quietRank(t *testing.T, name string) (context.Context, *ranks.Server, string) {
	t.Helper()
	ctx, s, job, lines := oneRank(t, name, new(atomic.Pointer[string]))
	go func() {
		for range lines {
		}
	}()
	return ctx, s, job
}

// oneRankHolding is oneRank whose shim runs beforeState (if set) before
// each STATE answer: a shim slow to answer, or one that never does.
func oneRankHolding(t *testing.T, name string, event *atomic.Pointer[string], beforeState func()) (context.Context, *ranks.Server, string, <-chan string) {
	t.Helper()
	return oneRankWith(t, name, event, beforeState, nil)
}

// oneRankWith is oneRankHolding whose shim also runs beforeDrain (if set)
// before each DRAIN answer.
func oneRankWith(t *testing.T, name string, event *atomic.Pointer[string], beforeState, beforeDrain func()) (context.Context, *ranks.Server, string, <-chan string) {
	t.Helper()
	addr := fmt.Sprintf("@mpipause-mpid-%s-%d", name, os.Getpid())
	s, err := ranks.Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	go s.Serve(ctx)
	lines := fakeRank(t, addr, "j", 3, event, beforeState, beforeDrain)
	if err := s.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	return ctx, s, jobid.Key(uint32(os.Getuid()), "j"), lines
}

// TestJobConns: a connection whose other end is on this node is the job's
// only if that end is a socket of the job too; one to another host is the
// job's if its port is one of the job's ports on some node, and neither
// drained nor left out of the check while those ports are not known.
func TestJobConns(t *testing.T) {
	conns := []loader.Conn{
		conn(1, "10.0.0.1:5000", "10.0.0.1:6000"),          // two ranks of the node
		conn(2, "10.0.0.1:6000", "10.0.0.1:5000"),          //
		conn(3, "10.0.0.1:5001", "10.0.0.2:7000"),          // a rank on another node
		conn(4, "10.0.0.1:5002", "10.0.0.1:5432"),          // the program's database on the node
		conn(5, "127.0.0.1:40000", "127.0.0.1:9100"),       // a monitoring agent on loopback
		conn(6, "[::1]:40001", "[::1]:40002"),              // loopback pair, both the job's
		conn(7, "[::1]:40002", "[::1]:40001"),              //
		conn(8, "[::ffff:10.0.0.1]:5003", "10.0.0.1:6000"), // mapped: same end as 2's local
		conn(10, "10.0.0.1:5004", "10.0.0.3:5432"),         // the program's database on another host
		{Cookie: 9, Local: netip.MustParseAddrPort("10.0.0.1:6000"), State: loader.StateListen},
	}
	d := &drainSet{here: map[netip.Addr]bool{netip.MustParseAddr("10.0.0.1"): true}}
	unknown := newSides(d, conns)
	if got := unknown.jobConns(conns); !slices.Equal(got, []uint64{1, 2, 6, 7, 8}) {
		t.Errorf("before the job's ports are known: job connections %v, want [1 2 6 7 8]", got)
	}
	if got, _ := unknown.checked(conns); len(got) != 8 {
		t.Errorf("before the job's ports are known: %d connections checked, want 8 (all but 4 and 5)", len(got))
	}
	d.peers = quiesce.PortsOf([]uint16{5000, 5001, 6000, 7000})
	known := newSides(d, conns)
	if got := known.jobConns(conns); !slices.Equal(got, []uint64{1, 2, 3, 6, 7, 8}) {
		t.Errorf("job connections %v, want [1 2 3 6 7 8]", got)
	}
	conns[8].Unread = 10
	got, own := known.checked(conns)
	var cookies []uint64
	for _, c := range got {
		cookies = append(cookies, c.Cookie)
	}
	if !slices.Equal(cookies, []uint64{1, 2, 3, 6, 7, 8, 9}) || !slices.Equal(own, quiesce.Ports{5432}) {
		t.Errorf("checked %v, own far ports %v; want [1 2 3 6 7 8 9], [5432]", cookies, own)
	}
}

// fakeRank registers as rank of job at addr, answers CLOSE, STATE and
// DRAIN, and sends every line it is asked on the channel it returns; with
// event set, it sends that line (an EVENT) before each STATE answer, with
// beforeState set it runs it first, and with beforeDrain set it runs that
// before each DRAIN answer.
func fakeRank(t *testing.T, addr, job string, rank int, event *atomic.Pointer[string], beforeState, beforeDrain func()) <-chan string {
	t.Helper()
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "HELLO 2 job=%s rank=%d size=4 pid=%d host=n1 key=k\n", job, rank, os.Getpid())
	lines := make(chan string, 64)
	go func() {
		br := bufio.NewReader(c)
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return
			}
			l = strings.TrimSuffix(l, "\n")
			lines <- l
			switch {
			case l == "CLOSE":
				fmt.Fprint(c, "CLOSED gate=closed gated=0 closing=0 held=0\n")
			case l == "STATE":
				if beforeState != nil {
					beforeState()
				}
				if ev := event.Load(); ev != nil {
					fmt.Fprint(c, *ev+"\n")
				}
				fmt.Fprint(c, "STATE gate=closed gated=0 closing=0 held=0\n")
			case strings.HasPrefix(l, "DRAIN "):
				if beforeDrain != nil {
					beforeDrain()
				}
				fmt.Fprint(c, "DRAINING sockets=1 stashed=0\n")
			case l == "REOPEN":
				fmt.Fprint(c, "REOPENED\n")
			}
		}
	}()
	return lines
}

func expectLines(t *testing.T, lines <-chan string, want ...string) {
	t.Helper()
	for _, w := range want {
		select {
		case l := <-lines:
			if l != w {
				t.Fatalf("the shim was asked %q, want %q", l, w)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("the shim was not asked %q", w)
		}
	}
}

// TestNodeRoleDrainSet: the first drain check after PREPARE (whose read
// is PREPARE's) tells the ranks to drain the job's own connections on the
// node, by cookie, once they have answered for their gates, and nothing
// else of their processes;
// those to other hosts follow once the coordinator has sent the job's
// ports, and only those whose far port is one; a job connection made
// during the pause is named in a new DRAIN at the next round; a shim whose stash is full fails the pause at the next round,
// and the failure report names its rank and says why.
func TestNodeRoleDrainSet(t *testing.T) {
	var full atomic.Pointer[string]
	ctx, s, job, lines := oneRank(t, "drain", &full)
	var err error
	obs := &fakeObserver{conns: []loader.Conn{
		conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"),
		conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000"),
		conn(0x13, "10.0.0.1:5001", "10.0.0.2:7000"),
		conn(0x14, "10.0.0.1:5002", "10.0.0.1:5432"), // the program's own database client
		conn(0x15, "127.0.0.1:40000", "127.0.0.1:9100"),
	}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}

	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	expectLines(t, lines, "CLOSE", "STATE", "DRAIN 2", "C 11 12")
	l.Peers(job, quiesce.Ports{5000, 5001, 6000, 7000})
	obs.add(conn(0x18, "10.0.0.1:5005", "10.0.0.3:5432")) // the program's own, on another host
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	expectLines(t, lines, "STATE", "DRAIN 3", "C 11 12 13")
	// A new job connection during the pause: the whole set again. The
	// program's own new connection alone changes nothing.
	obs.add(conn(0x16, "10.0.0.1:5003", "127.0.0.1:6000"))
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	obs.add(conn(0x17, "10.0.0.1:5004", "10.0.0.3:7000"))
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	expectLines(t, lines, "STATE", "STATE", "DRAIN 4", "C 11 12 13 17")

	ev := "EVENT stash full bytes=268435456 max=268435456"
	full.Store(&ev)
	if _, err := l.Drain(ctx, job); err != nil { // the event arrives with this round's STATE answer
		t.Fatal(err)
	}
	_, err = l.Drain(ctx, job)
	if !errors.Is(err, ErrStashFull) {
		t.Fatalf("Drain with a full stash: %v, want ErrStashFull", err)
	}
	// What the coordinator gets back: the rank and the code, beside the
	// text that says why (mpid's failure report: TestFailureBlamesRank).
	var rf quiesce.RankFault
	if !errors.As(err, &rf) {
		t.Fatalf("Drain with a full stash: %v blames no rank", err)
	}
	if fa := rf.Fault(); fa.Code != FaultStashFull || fa.Rank != 3 {
		t.Errorf("fault %+v; want %s of rank 3 (%v)", fa, FaultStashFull, err)
	}
	for _, want := range []string{"rank 3", "stash is full", "256 MiB", "MPIPAUSE_STASH_MAX_MB", "stays in the kernel"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	// A new pause starts with a clear report.
	full.Store(nil)
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Drain(ctx, job); err != nil {
		t.Errorf("the next pause's drain: %v", err)
	}
}

// TestNodeRoleCounted: a DRAIN answer says the node counts the bytes sent
// through closed gates (so that FREEZE may check in its own round) only
// while every job connection it reads has the kernel's byte counts; one
// read through sock_diag, without them, takes that away. A program's own
// connection does not count either way.
func TestNodeRoleCounted(t *testing.T) {
	ctx, s, job, lines := oneRank(t, "counted", new(atomic.Pointer[string]))
	counted := func(c loader.Conn) loader.Conn { c.Counted = true; return c }
	obs := &fakeObserver{conns: []loader.Conn{
		counted(conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000")),
		counted(conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000")),
		conn(0x14, "10.0.0.1:5002", "10.0.0.3:5432"), // the program's own, uncounted
		{Cookie: 0x15, Local: netip.MustParseAddrPort("10.0.0.1:5000"), State: loader.StateListen},
	}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	go func() {
		for range lines {
		}
	}()
	// The first check, PREPARE's read, before the coordinator has the
	// job's ports: the program's own connection counts as the job's.
	if rep, err := l.Drain(ctx, job); err != nil || rep.Counted {
		t.Fatalf("an uncounted connection not yet known as the program's own: Counted %v (%v), want false", rep.Counted, err)
	}
	l.Peers(job, quiesce.Ports{5000, 5001, 6000})
	rep, err := l.Drain(ctx, job)
	if err != nil || !rep.Counted {
		t.Fatalf("every job connection counted: Counted %v (%v), want true", rep.Counted, err)
	}
	obs.add(conn(0x13, "10.0.0.1:5001", "10.0.0.1:5000")) // a job connection from sock_diag
	if rep, err = l.Drain(ctx, job); err != nil || rep.Counted {
		t.Fatalf("a job connection without byte counts: Counted %v (%v), want false", rep.Counted, err)
	}
}

// TestNodeRoleUnheld: a shim's report of a call it could not hold under
// the closed gate fails the pause at the next round when the call was on a
// job connection, naming the rank, the call, the descriptor and the
// socket; on the program's own connection it changes nothing.
func TestNodeRoleUnheld(t *testing.T) {
	var event atomic.Pointer[string]
	ctx, s, job, lines := oneRank(t, "unheld", &event)
	obs := &fakeObserver{conns: []loader.Conn{
		conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"),
		conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000"),
		conn(0x14, "10.0.0.1:5002", "10.0.0.1:5432"), // the program's own database client
	}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	expectLines(t, lines, "CLOSE", "STATE", "DRAIN 2", "C 11 12")
	own := "EVENT unheld call=msg-zerocopy fd=5 cookie=14"
	event.Store(&own)
	for i := 0; i < 2; i++ { // the event arrives with the first round's STATE answer
		if _, err := l.Drain(ctx, job); err != nil {
			t.Fatalf("an unheld call on the program's own connection: %v", err)
		}
	}
	mine := "EVENT unheld call=sendmsg-ancillary fd=9 cookie=12"
	event.Store(&mine)
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	_, err := l.Drain(ctx, job)
	if !errors.Is(err, ErrUnheld) {
		t.Fatalf("Drain after an unheld call on a job connection: %v, want ErrUnheld", err)
	}
	var rf quiesce.RankFault
	if !errors.As(err, &rf) || rf.Fault() != (quiesce.Fault{Code: FaultUnheld, Rank: 3}) {
		t.Errorf("error %v blames %+v, want %s of rank 3", err, rf, FaultUnheld)
	}
	for _, want := range []string{"rank 3", "sendmsg with ancillary data on fd 9", "cookie 0x12", "rolls back"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	// A new pause starts with no report.
	event.Store(nil)
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Drain(ctx, job); err != nil {
		t.Errorf("the next pause's drain: %v", err)
	}
}

// TestVerifyIgnoresProgramsOwn: bytes unread on the program's own
// connection to a server on the node (which the drain leaves alone) do not
// keep a pause from being empty; the same bytes on a job connection do.
func TestVerifyIgnoresProgramsOwn(t *testing.T) {
	// A name of its own per run: the server is never served, so nothing
	// closes its listener before -count's next run binds.
	s, err := ranks.Listen(fmt.Sprintf("@mpipause-mpid-verify-%d-%d", os.Getpid(), time.Now().UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	unread := func(c loader.Conn) loader.Conn { c.Unread = 100; return c }
	obs := &fakeObserver{conns: []loader.Conn{
		conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"),
		conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000"),
		conn(0x13, "10.0.0.1:5001", "10.0.0.2:7000"),
		unread(conn(0x14, "10.0.0.1:5002", "10.0.0.1:5432")),    // the program's own database client
		unread(conn(0x15, "127.0.0.1:40000", "127.0.0.1:9100")), // and its metrics agent
	}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	ctx := context.Background()
	rep, err := l.Verify(ctx, "0:j")
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Empty || rep.Checked != 3 {
		t.Errorf("with bytes unread on the program's own connections: empty %v, %d checked (%v); want empty, 3", rep.Empty, rep.Checked, rep.Conns)
	}
	obs.add(unread(conn(0x16, "10.0.0.1:5003", "10.0.0.3:7000")))
	if rep, err = l.Verify(ctx, "0:j"); err != nil {
		t.Fatal(err)
	}
	if rep.Empty || len(rep.Conns) != 1 || rep.Conns[0].Unread != 100 {
		t.Errorf("with bytes unread on a connection to another host, the job's ports not known: empty %v, held %v; want that one held", rep.Empty, rep.Conns)
	}
	if p := l.Ports("0:j"); !slices.Equal(p, quiesce.Ports{5000, 5001, 5002, 5003, 6000, 40000}) {
		t.Errorf("the node's ports %v, want its job sockets' local ports", p)
	}
	// No node has a socket on port 7000: 10.0.0.3:7000 is a server of the
	// program's own, whose unread bytes the coordinator hears of (Own).
	l.Peers("0:j", quiesce.Ports{5000, 6000})
	if rep, err = l.Verify(ctx, "0:j"); err != nil {
		t.Fatal(err)
	}
	if !rep.Empty || !slices.Equal(rep.Own, quiesce.Ports{7000}) {
		t.Errorf("with bytes unread on a connection to a server of the program's own on another host: empty %v, own %v (%v); want empty, [7000]", rep.Empty, rep.Own, rep.Conns)
	}
	l.Peers("0:j", quiesce.Ports{5000, 6000, 7000})
	if rep, err = l.Verify(ctx, "0:j"); err != nil {
		t.Fatal(err)
	}
	if rep.Empty || len(rep.Conns) != 1 || rep.Own != nil {
		t.Errorf("with bytes unread on a job connection to another host: empty %v, held %v, own %v; want that one held", rep.Empty, rep.Conns, rep.Own)
	}
}

// TestOnlyDrainChecksPace: the drain's checks may reuse the observer's
// walk of the job's namespaces (loader.Pacing); PREPARE's read (the first
// drain check's, Role.Prepare), the baseline of the counts of bytes sent
// through closed gates, and the check after the freeze, which proves the
// pause, may not.
func TestOnlyDrainChecksPace(t *testing.T) {
	var event atomic.Pointer[string]
	ctx, s, job, _ := oneRank(t, "pace", &event)
	obs := &fakeObserver{conns: []loader.Conn{conn(0x11, "10.0.0.1:5000", "10.0.0.2:6000")}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs}, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	last := func() bool {
		obs.mu.Lock()
		defer obs.mu.Unlock()
		if len(obs.paced) == 0 {
			t.Fatal("no Snapshot")
		}
		p := obs.paced[len(obs.paced)-1]
		obs.paced = nil
		return p
	}
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	obs.mu.Lock()
	if n := len(obs.paced); n != 0 {
		t.Errorf("Prepare read the kernel %d times; its read is the first drain check's", n)
	}
	obs.mu.Unlock()
	for i, want := range []bool{false, true} {
		if _, err := l.Drain(ctx, job); err != nil {
			t.Fatal(err)
		}
		if got := last(); got != want {
			t.Errorf("drain check %d after Prepare: Pacing %v, want %v (the first is PREPARE's read)", i+1, got, want)
		}
	}
	if _, err := l.Verify(ctx, job); err != nil {
		t.Fatal(err)
	}
	if last() {
		t.Errorf("the check after the freeze was Pacing")
	}
}

// TestDrainFailsOnHeldRank: a rank with bytes unread on this node that
// something else holds still (a SIGSTOP, a freeze above the job's cgroups)
// fails the drain at once, naming the rank and what holds it, and so does
// one with a message of its own half sent; a held rank with nothing
// waiting for it, and a rank with bytes unread that runs, do not.
func TestDrainFailsOnHeldRank(t *testing.T) {
	_, s, job, _ := oneRank(t, "held", new(atomic.Pointer[string]))
	var how atomic.Value
	how.Store("")
	l := &Role{Name: "n1", Ranks: s, HeldBy: func(pid int) string {
		if pid != os.Getpid() {
			t.Errorf("asked about pid %d, not a rank's", pid)
		}
		return how.Load().(string)
	}}
	unread := quiesce.NodeReport{Conns: []quiesce.Conn{{Node: "n1", Rank: 3, Unread: 100}}}
	if err := l.heldStill(job, unread, nil); err != nil {
		t.Errorf("a running rank with bytes unread: %v, want no failure", err)
	}
	how.Store("stopped by a signal (state T)")
	for _, rep := range []quiesce.NodeReport{
		{},
		{Conns: []quiesce.Conn{{Node: "n1", Rank: 3, SendQueue: 100}}},
		{Conns: []quiesce.Conn{{Node: "n1", Rank: -1, Unread: 100}}},
		{Conns: []quiesce.Conn{{Node: "n1", Rank: 2, Unread: 100}}},
	} {
		if err := l.heldStill(job, rep, map[int]bool{2: true}); err != nil {
			t.Errorf("held rank 3, report %+v: %v, want no failure (nothing unread is rank 3's)", rep, err)
		}
	}
	err := l.heldStill(job, unread, nil)
	if !errors.Is(err, ErrHeld) {
		t.Fatalf("held rank with bytes unread: %v, want ErrHeld", err)
	}
	// A message of its own half sent waits for it as much.
	if err := l.heldStill(job, quiesce.NodeReport{}, map[int]bool{3: true}); !errors.Is(err, ErrHeld) {
		t.Errorf("held rank with its gate closing: %v, want ErrHeld", err)
	}
	var rf quiesce.RankFault
	if !errors.As(err, &rf) || rf.Fault().Code != FaultHeld || rf.Fault().Rank != 3 {
		t.Errorf("held rank's failure %v blames %+v; want %s of rank 3", err, rf, FaultHeld)
	}
	for _, want := range []string{"rank 3", "on n1", "stopped by a signal", "rolls back now"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

// observed is Jobs with one observer for every job, no cgroups, every job
// ready, and nothing to tell.
type observed struct{ obs loader.Observer }

func (o observed) Observer(string) (loader.Observer, error) { return o.obs, nil }
func (observed) Cgroups(string) ([]string, error)           { return nil, nil }
func (observed) Unready(string) string                      { return "" }
func (observed) Committed(string)                           {}
func (observed) Thawing(string)                             {}
func (observed) WithJob(_ string, fn func(uint32, string) error) error {
	return fn(0, "")
}

// TestDrainGivesUpOnHeldShim: a rank whose shim does not answer the drain's
// gate-state request because something else holds it still (Slurm froze
// the step during the request, on the VMs) fails the drain as a held rank
// at once, not when the drain's deadline ends 30 s later; a shim that is
// merely slow to answer, and not held, is waited for.
func TestDrainGivesUpOnHeldShim(t *testing.T) {
	answer := make(chan struct{}, 1)
	ctx, s, job, _ := oneRankHolding(t, "heldshim", new(atomic.Pointer[string]), func() {
		select { // answered by the test, or not while the test runs
		case <-answer:
		case <-time.After(30 * time.Second):
		}
	})
	var held atomic.Bool
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{&fakeObserver{}}, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		HeldBy: func(int) string {
			if held.Load() {
				return "frozen by its cgroup or one above it (the test's)"
			}
			return ""
		}}

	// Slow, not held: answered after several looks.
	go func() {
		time.Sleep(3 * heldPoll)
		answer <- struct{}{}
	}()
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatalf("a shim slow to answer: %v", err)
	}

	held.Store(true)
	step, stepCancel := context.WithTimeout(ctx, 5*time.Second)
	defer stepCancel()
	_, err := l.Drain(step, job)
	if !errors.Is(err, ErrHeld) {
		t.Fatalf("a held shim that does not answer: %v, want ErrHeld (not the step's deadline)", err)
	}
	for _, want := range []string{"rank 3", "frozen by its cgroup"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

// TestDrainWake: the node's drain wake (quiesce.DrainWaker) is closed
// once the job's ranks on the node have answered the last DRAIN, and not
// before; there is none before any DRAIN, nor once a check began after
// the answers.
func TestDrainWake(t *testing.T) {
	release := make(chan struct{})
	ctx, s, job, lines := oneRankWith(t, "wake", new(atomic.Pointer[string]), nil, func() { <-release })
	obs := &fakeObserver{conns: []loader.Conn{
		conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"),
		conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000"),
	}}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := l.Prepare(ctx, job); err != nil {
		t.Fatal(err)
	}
	if w := l.DrainWake(job); w != nil {
		t.Fatal("a drain wake before any DRAIN went")
	}
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	// The shim holds its answer from the DRAIN line on (its cookies stay
	// unread until it answers).
	expectLines(t, lines, "CLOSE", "STATE", "DRAIN 2")
	wake := l.DrainWake(job)
	if wake == nil {
		t.Fatal("no drain wake after a DRAIN")
	}
	select {
	case <-wake:
		t.Fatal("the drain wake closed before the rank answered its DRAIN")
	default:
	}
	close(release)
	expectLines(t, lines, "C 11 12")
	select {
	case <-wake:
	case <-time.After(5 * time.Second):
		t.Fatal("the rank answered its DRAIN, and 5 s later the drain wake was still open")
	}
	// A check after the answers saw what they did: the wake is spent.
	if _, err := l.Drain(ctx, job); err != nil {
		t.Fatal(err)
	}
	if w := l.DrainWake(job); w != nil {
		t.Error("the drain wake outlived the check after it")
	}
}

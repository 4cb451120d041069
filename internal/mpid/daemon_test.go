package mpid

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// memCgroups is Cgroups in memory: where each pid was moved, which dirs
// are frozen. A Freeze waits for hold, if set, to close.
type memCgroups struct {
	mu     sync.Mutex
	dirs   map[string]bool
	procs  map[int]string
	frozen map[string]bool
	hold   chan struct{}
	// refuse, if set, fails the next Freeze (after hold).
	refuse error
	// deny refuses Create at and below it, as systemd's 0555 hierarchy
	// root does to a root daemon without CAP_DAC_OVERRIDE (mpid's unit).
	deny string
	// walked counts the cgroups Members visited.
	walked int
}

func newMemCgroups() *memCgroups {
	return &memCgroups{dirs: map[string]bool{}, procs: map[int]string{}, frozen: map[string]bool{}}
}

// memRoot is memCgroups' hierarchy: a process it was told nothing of lives
// in its root, where nobody placed it.
const memRoot = "/cg"

func (c *memCgroups) Root() (string, error) { return memRoot, nil }

func (c *memCgroups) Of(pid int) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d, ok := c.procs[pid]; ok {
		return d, nil
	}
	return memRoot, nil
}

// put places pid in dir, as a resource manager would have before mpid
// heard of it.
func (c *memCgroups) put(pid int, dir string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dirs[dir] = true
	c.procs[pid] = dir
}

// Descendants counts the cgroups below dir; walked counts how many a
// Members visited, which nothing under load may do.
func (c *memCgroups) Descendants(dir string) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.dirs[dir] {
		return 0, fmt.Errorf("read cgroup.stat of %s: %w", dir, os.ErrNotExist)
	}
	n := 0
	for d := range c.dirs {
		if strings.HasPrefix(d, dir+"/") {
			n++
		}
	}
	return n, nil
}

func (c *memCgroups) Populated(dir string) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.dirs[dir] {
		return false, fmt.Errorf("read cgroup.events of %s: %w", dir, os.ErrNotExist)
	}
	for _, d := range c.procs {
		if d == dir || strings.HasPrefix(d, dir+"/") {
			return true, nil
		}
	}
	return false, nil
}

func (c *memCgroups) Members(dir string) ([]int, error) {
	if dir == memRoot {
		// On a node, that walk crosses every cgroup there is (libvirt's
		// threaded ones refuse cgroup.procs): mpid must never need it.
		return nil, errors.New("memCgroups: Members of the hierarchy's root")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.walked++
	tree := 1
	for d := range c.dirs {
		if strings.HasPrefix(d, dir+"/") {
			c.walked++
			tree++
		}
	}
	// As the kernel's (KernelCgroups.Members, cgroupv2.MembersMax).
	if tree > MaxWalk {
		return nil, fmt.Errorf("cgroup %s has more than %d cgroups in its tree: %w", dir, MaxWalk, cgroupv2.ErrTooMany)
	}
	var out []int
	for pid, d := range c.procs {
		if d == dir || strings.HasPrefix(d, dir+"/") {
			out = append(out, pid)
		}
	}
	return out, nil
}

func (c *memCgroups) Create(dir string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.deny != "" && (dir == c.deny || strings.HasPrefix(dir, c.deny+"/")) {
		return fmt.Errorf("create cgroup %s: %w", dir, os.ErrPermission)
	}
	c.dirs[dir] = true
	return nil
}

func (c *memCgroups) Remove(dir string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for pid, d := range c.procs {
		if d == dir || strings.HasPrefix(d, dir+"/") {
			return fmt.Errorf("remove %s: pid %d is in it", dir, pid)
		}
	}
	delete(c.dirs, dir)
	return nil
}

// exit is pid's end: it leaves its cgroup.
func (c *memCgroups) exit(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.procs, pid)
}

func (c *memCgroups) exists(dir string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dirs[dir]
}

func (c *memCgroups) Procs(dir string) ([]int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.dirs[dir] {
		return nil, fmt.Errorf("read procs of %s: %w", dir, os.ErrNotExist)
	}
	var out []int
	for pid, d := range c.procs {
		if d == dir {
			out = append(out, pid)
		}
	}
	// As the kernel's (KernelCgroups.Procs, cgroupv2.ProcsMax).
	if len(out) > MaxProcs {
		return nil, fmt.Errorf("cgroup %s holds more than %d processes: %w", dir, MaxProcs, cgroupv2.ErrTooMany)
	}
	return out, nil
}

func (c *memCgroups) Holds(dir string, pid int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.procs[pid] != dir {
		return fmt.Errorf("pid %d is in %q, not in %s", pid, c.procs[pid], dir)
	}
	return nil
}

func (c *memCgroups) Move(p *ranks.Proc, dir string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.dirs[dir] {
		return fmt.Errorf("no cgroup %s", dir)
	}
	c.procs[p.Pid] = dir
	return nil
}

func (c *memCgroups) Freeze(ctx context.Context, dir string) error {
	c.mu.Lock()
	hold := c.hold
	c.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.refuse; err != nil {
		c.refuse = nil
		return err
	}
	c.frozen[dir] = true
	return nil
}

func (c *memCgroups) Thaw(ctx context.Context, dir string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.frozen, dir)
	return nil
}

func (c *memCgroups) Frozen(dir string) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.frozen[dir], nil
}

// memObservers opens observers that see no connection: every drain is
// clean at once, every kernel check empty.
type memObservers struct{}

func (memObservers) Open(string, []string) (loader.Observer, error) { return emptyObserver{}, nil }
func (memObservers) Unpin(string) error                             { return nil }

type emptyObserver struct{}

func (emptyObserver) Snapshot(context.Context) ([]loader.Conn, error) { return nil, nil }
func (emptyObserver) Kind() string                                    { return "test" }
func (emptyObserver) Close() error                                    { return nil }

// testNode is one daemon of an in-process cluster, served by Run.
type testNode struct {
	*Daemon
	cgroups           *memCgroups
	rankAddr, ctlAddr string
	log               *testutil.Buffer
	// stop ends this mpid and waits for it.
	stop func()
}

// startNode runs a whole mpid named node on the in-process network net,
// with memory cgroups and observers, abstract sockets of its own and the
// cluster key k, until the test ends.
func startNode(t *testing.T, node string, net *quiesce.MemNetwork, k *quiesce.Keyring) *testNode {
	t.Helper()
	return restartNode(t, node, net, k, newMemCgroups(), t.TempDir())
}

// restartNode is startNode for an mpid that finds the cgroups and the state
// directory a previous one left.
func restartNode(t *testing.T, node string, net *quiesce.MemNetwork, k *quiesce.Keyring, cgroups *memCgroups, state string) *testNode {
	t.Helper()
	return startNodeWith(t, node, net, k, cgroups, state, memObservers{})
}

// startNodeWith is restartNode with observers of the test's own.
func startNodeWith(t *testing.T, node string, net *quiesce.MemNetwork, k *quiesce.Keyring, cgroups *memCgroups, state string, obs Observers) *testNode {
	t.Helper()
	n := &testNode{cgroups: cgroups, log: &testutil.Buffer{},
		rankAddr: fmt.Sprintf("@mpipause-test-%d-%s-%s-rank", os.Getpid(), t.Name(), node),
		ctlAddr:  fmt.Sprintf("@mpipause-test-%d-%s-%s-ctl", os.Getpid(), t.Name(), node)}
	d, err := New(Config{Node: node, ClusterKey: k, RankSocket: n.rankAddr, CtlSocket: n.ctlAddr, StateDir: state,
		Cgroups: n.cgroups, Observers: obs, Network: net, Drain: 5 * time.Second,
		Log: slog.New(slog.NewTextHandler(n.log, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	n.Daemon = d
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() { done <- d.Run(ctx, func() error { close(ready); return nil }) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("mpid %s: %v", node, err)
	}
	var once sync.Once
	n.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("mpid %s: %v", node, err)
			}
		})
	}
	t.Cleanup(n.stop)
	return n
}

// testShim plays a rank's shim on a node: JOIN, then HELLO, then the gate
// requests, answered as the shim does.
type testShim struct {
	mu   sync.Mutex
	conn net.Conn
	gate string
	// closes counts the CLOSE requests mpid sent.
	closes int
}

func (n *testNode) rank(t *testing.T, job, key string, rank, size int) *testShim {
	t.Helper()
	return n.rankWith(t, job, key, rank, size, "")
}

// rankWith is rank whose HELLO ends with extra (" hosts=...").
func (n *testNode) rankWith(t *testing.T, job, key string, rank, size int, extra string) *testShim {
	t.Helper()
	pid := os.Getpid()
	j, err := net.Dial("unix", n.rankAddr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(j, "JOIN 2 job=%s pid=%d key=%s\n", job, pid, key)
	reply, err := bufio.NewReader(j).ReadString('\n')
	j.Close()
	if reply != "OK\n" {
		t.Fatalf("JOIN on %s: %q, %v", n.cfg.Node, reply, err)
	}
	return n.hello(t, job, key, rank, size, extra)
}

// hello registers a rank (HELLO) without its JOIN, and answers mpid's gate
// requests as the shim does.
func (n *testNode) hello(t *testing.T, job, key string, rank, size int, extra string) *testShim {
	t.Helper()
	pid := os.Getpid()
	c, err := net.Dial("unix", n.rankAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	s := &testShim{conn: c, gate: "open"}
	s.send("HELLO 2 job=%s rank=%d size=%d pid=%d host=%s key=%s%s\n", job, rank, size, pid, n.cfg.Node, key, extra)
	go func() {
		br := bufio.NewReader(c)
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return
			}
			l = strings.TrimSpace(l)
			if strings.HasPrefix(l, "DRAIN ") {
				l = "DRAIN" // the set's lines that follow ("C ...") get no answer
			}
			switch l {
			case "CLOSE":
				s.mu.Lock()
				s.closes++
				s.mu.Unlock()
				s.gate = "closed"
				s.send("CLOSED gate=closed gated=1 closing=0 held=0\n")
			case "STATE":
				s.send("STATE gate=%s gated=1 closing=0 held=0\n", s.gate)
			case "DRAIN":
				s.send("DRAINING sockets=0 stashed=0\n")
			case "REOPEN":
				s.gate = "open"
				s.send("REOPENED\nEVENT flushed bytes=0 errors=0 errno=0\n")
			}
		}
	}()
	key2 := jobid.Key(uint32(os.Getuid()), job)
	if err := n.reg.ranks.Wait(context.Background(), func(all []*ranks.Rank) bool {
		return slices.ContainsFunc(all, func(r *ranks.Rank) bool { return r.JobKey() == key2 && r.Rank == rank })
	}); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s *testShim) send(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fmt.Fprintf(s.conn, format, args...)
}

// ask sends one request to node's control socket, as the CLI does.
func (n *testNode) ask(t *testing.T, op, job string) ctl.Reply {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := ctl.Do(ctx, n.ctlAddr, ctl.Request{Op: op, Job: job}, nil)
	if r == nil {
		t.Fatalf("%s %s: %v", op, job, err)
	}
	return *r
}

// TestPauseInProcess: three whole mpids over the in-process network, the
// job created on node0 as `mpipause run` does, one rank on each node
// joining with the job key it was given: the nodes register with the
// coordinator, and a pause asked of node2 is forwarded to node0, gates
// every rank, freezes every node's job cgroup and commits; a resume thaws
// and reopens everything. No privilege, no kernel: milliseconds.
func TestPauseInProcess(t *testing.T) {
	nodes, mem, created := startThree(t)
	var shims []*testShim
	for i, n := range nodes {
		shims = append(shims, n.rank(t, "j1", created.Token, i, 3))
	}
	key := jobid.Key(uint32(os.Getuid()), "j1")
	dir := func(n *testNode) string { return n.reg.jobDir(key) }
	waitNodes(t, mem, nodes[0], "j1", "node0,node1,node2")

	start := time.Now()
	rep := nodes[2].ask(t, ctl.OpPause, "j1")
	if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StatePaused {
		t.Fatalf("pause: %+v %+v", rep.Err, rep.Job)
	}
	t.Logf("pause of 3 nodes in %v", time.Since(start))
	for i, n := range nodes {
		if f, _ := n.cgroups.Frozen(dir(n)); !f {
			t.Errorf("node%d: the job's cgroup is not frozen", i)
		}
		shims[i].mu.Lock()
		if shims[i].gate != "closed" {
			t.Errorf("node%d: rank %d's gate is %s", i, i, shims[i].gate)
		}
		shims[i].mu.Unlock()
	}
	if again := nodes[0].ask(t, ctl.OpPause, "j1"); again.Err == nil || again.Err.Code != ctl.CodeState {
		t.Errorf("a second pause: %+v", again.Err)
	}

	rep = nodes[1].ask(t, ctl.OpResume, "j1")
	if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StateRunning {
		t.Fatalf("resume: %+v %+v", rep.Err, rep.Job)
	}
	for i, n := range nodes {
		if f, _ := n.cgroups.Frozen(dir(n)); f {
			t.Errorf("node%d: still frozen after the resume", i)
		}
		shims[i].mu.Lock()
		if shims[i].gate != "open" {
			t.Errorf("node%d: gate %s after the resume", i, shims[i].gate)
		}
		shims[i].mu.Unlock()
	}
}

// TestPauseRankLeftBeforePrepare: a rank whose channel closed (killed)
// while the pause was on its way to its node fails the pause at that
// node's PREPARE, with the rank named and the rank-gone code, not at the
// drain deadline (or as "only 5 of the job's 6 ranks") as when the node
// knew only the ranks still registered.
func TestPauseRankLeftBeforePrepare(t *testing.T) {
	nodes, mem, created := startThree(t)
	var shims []*testShim
	for i, n := range nodes {
		for r := 2 * i; r < 2*i+2; r++ {
			shims = append(shims, n.rank(t, "j1", created.Token, r, 6))
		}
	}
	waitNodes(t, mem, nodes[0], "j1", "node0,node1,node2")
	shims[5].conn.Close()
	if err := nodes[2].reg.ranks.Wait(context.Background(), func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}

	rep := nodes[0].ask(t, ctl.OpPause, "j1")
	if rep.Err == nil || rep.Job == nil || rep.Job.Failure == nil {
		t.Fatalf("pause with rank 5 gone: %+v %+v; want it to fail", rep.Err, rep.Job)
	}
	f := rep.Job.Failure
	if rep.Err.Code != ctl.CodeRankGone || f.Rank != 5 || f.Phase != "PREPARE" || f.Node != "node2" || !strings.Contains(f.Reason, "rank 5 ") {
		t.Errorf("pause with rank 5 gone: code %s, failure %+v; want %s in PREPARE on node2, naming rank 5", rep.Err.Code, f, ctl.CodeRankGone)
	}
	for i, n := range nodes {
		if fr, _ := n.cgroups.Frozen(n.reg.jobDir(jobid.Key(uint32(os.Getuid()), "j1"))); fr {
			t.Errorf("node%d: frozen after the rollback", i)
		}
	}
}

// waitNodes waits for coord to list nodes (comma-separated) as job's.
// startThree starts three in-process mpids, node0..node2, on one
// in-memory network, and has node0 create job j1 (what `mpipause run`
// does there): the nodes, their network and the creation's reply.
func startThree(t *testing.T) ([]*testNode, *quiesce.MemNetwork, ctl.Reply) {
	t.Helper()
	k := testKeys(t)
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	var nodes []*testNode
	for _, name := range []string{"node0", "node1", "node2"} {
		nodes = append(nodes, startNode(t, name, mem, k))
	}
	created := nodes[0].ask(t, ctl.OpCreate, "j1")
	if created.Err != nil || created.Token == "" {
		t.Fatalf("create: %+v", created)
	}
	return nodes, mem, created
}

func waitNodes(t *testing.T, mem *quiesce.MemNetwork, coord *testNode, job, nodes string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		st := coord.ask(t, ctl.OpStatus, job)
		if st.Job != nil && strings.Join(st.Job.Nodes, ",") == nodes {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the coordinator never listed every node: %+v", st.Job)
		}
		mem.Drain()
	}
}

// waitFor waits, delivering the in-process network's messages, for cond.
func waitFor(t *testing.T, mem *quiesce.MemNetwork, cond func() bool, format string, args ...any) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf(format, args...)
		}
		mem.Drain()
		time.Sleep(time.Millisecond)
	}
}

// TestRankEventsOneAtATime: a rank that repeats its SIGTSTP event (or
// floods the line) gets one pause of its job under way, not one per line.
func TestRankEventsOneAtATime(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rank(t, "j1", created.Token, 0, 1)
	hold := make(chan struct{})
	n.cgroups.mu.Lock()
	n.cgroups.hold = hold // the first pause stays in FREEZE
	n.cgroups.mu.Unlock()
	const events = 200
	for range events {
		s.send("EVENT pause\n")
	}
	// Events are read in order: once this one is logged, every pause
	// event before it has been handled.
	s.send("EVENT flushed bytes=7 errors=0 errno=0\n")
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(n.log.String(), "flushed=7"); {
		if time.Now().After(deadline) {
			t.Fatal("the marker event never arrived")
		}
		time.Sleep(time.Millisecond)
	}
	got := strings.Count(n.log.String(), `msg="rank event"`)
	close(hold)
	if got != 1 {
		t.Errorf("%d pause requests for %d events, want 1 under way at a time", got, events)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		st := n.ask(t, ctl.OpStatus, "j1")
		if st.Job != nil && st.Job.State == ctl.StatePaused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the rank's pause did not complete: %+v", st.Job)
		}
		time.Sleep(time.Millisecond)
	}
}

// handled returns once every event s sent before it has been handled by
// n: events are read in order, and a request's refusal is logged at once.
// marks counts the markers sent so far on s.
func (s *testShim) handled(t *testing.T, n *testNode, marks *int) {
	t.Helper()
	*marks++
	s.send("EVENT flushed bytes=%d errors=0 errno=0\n", 1000+*marks)
	want := fmt.Sprintf("flushed=%d", 1000+*marks)
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(n.log.String(), want); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the marker event never arrived")
		}
	}
}

// pauseResumeHolding pauses and resumes job on n with hold(true) while
// the job is paused: what the fakes show the thaw's looks (a signal
// pending or framed on the frozen rank), gone again after the resume.
func (n *testNode) pauseResumeHolding(t *testing.T, job string, hold func(bool)) {
	t.Helper()
	if rep := n.ask(t, ctl.OpPause, job); rep.Err != nil {
		t.Fatalf("pause: %+v", rep.Err)
	}
	hold(true)
	if rep := n.ask(t, ctl.OpResume, job); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
	hold(false)
}

// rankRequestChecks gives the checks of a rank's requests to n about job:
// handled returns once every event s sent before it is handled;
// waitState once the job is in state want and the rank's request that
// took it there has ended (the next one would be dropped as one under way
// otherwise); requests counts the rank events mpid acted on.
func rankRequestChecks(t *testing.T, n *testNode, s *testShim, job string) (handled func(), waitState func(want string), requests func() int) {
	var marks int
	handled = func() { t.Helper(); s.handled(t, n, &marks) }
	waitState = func(want string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; {
			st := n.ask(t, ctl.OpStatus, job)
			n.coord.evMu.Lock()
			idle := len(n.coord.events) == 0
			n.coord.evMu.Unlock()
			if st.Job != nil && st.Job.State == want && idle {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the job did not become %s: %+v", want, st.Job)
			}
			time.Sleep(time.Millisecond)
		}
	}
	requests = func() int { return strings.Count(n.log.String(), `msg="rank event"`) }
	return handled, waitState, requests
}

// TestRankRequestAnsweredSince: a rank's SIGTSTP is the user's action at
// the moment of the signal. A rank frozen by the pause another rank asked
// for sends its own request after the resume (seen in TestPauseResume,
// 2 ms after it): that resume answered it, and the job must not pause
// again; a signal after the resume pauses it. The same for a SIGCONT
// signalled before a pause committed. A SIGTSTP that reached the rank
// while it was frozen (pending at the thaw; seen with MPICH, whose rank
// ran its handler 96 ms after the other's, after the resume) is stamped
// after the resume: the look at the rank's pending signals answers it.
func TestRankRequestAnsweredSince(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	var held atomic.Bool // this test's rank is not frozen: its pending SIGTSTP is told
	n.reg.procs = fakeProcs{tstp: func(int) bool { return held.Load() }}
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rank(t, "j1", created.Token, 0, 1)
	handled, waitState, requests := rankRequestChecks(t, n, s, "j1")

	signalled := monotonic() // the rank's SIGTSTP, its thread frozen before it sends
	if rep := n.ask(t, ctl.OpPause, "j1"); rep.Err != nil {
		t.Fatalf("pause: %+v", rep.Err)
	}
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
	s.send("EVENT pause at=%d\n", signalled)
	handled()
	if got := requests(); got != 0 {
		t.Fatalf("a pause signalled before the resume was acted on (%d requests)", got)
	}
	if !strings.Contains(n.log.String(), "pause request left alone: signalled before the last resume") {
		t.Errorf("the stale request is not logged:\n%s", n.log.String())
	}
	if st := n.ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State != ctl.StateRunning {
		t.Fatalf("after a stale pause request: %+v", st.Job)
	}

	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	if got := requests(); got != 1 {
		t.Fatalf("a pause signalled after the resume: %d requests, want 1", got)
	}
	waitState(ctl.StatePaused)

	// A SIGCONT handled before the pause committed (the rank ran then),
	// sent only now.
	s.send("EVENT resume at=%d\n", signalled)
	handled()
	if !strings.Contains(n.log.String(), "resume request left alone: signalled before the last pause") {
		t.Errorf("a resume signalled before the pause was not left alone:\n%s", n.log.String())
	}
	// An older shim's request carries no stamp: taken as it comes.
	s.send("EVENT resume\n")
	handled()
	waitState(ctl.StateRunning)

	n.pauseResumeHolding(t, "j1", held.Store)
	before := requests()
	s.send("EVENT pause at=%d\n", monotonic()) // the held signal's handler, after the thaw
	handled()
	if got := requests() - before; got != 0 {
		t.Fatalf("a SIGTSTP held while frozen paused the job again after the resume (%d requests)", got)
	}
	if got := strings.Count(n.log.String(), "pause request left alone: signalled before the last resume"); got != 2 {
		t.Errorf("%d stale pause requests logged, want 2", got)
	}
	s.send("EVENT pause at=%d\n", monotonic()) // the user's next Ctrl-Z
	handled()
	waitState(ctl.StatePaused)
}

// TestRankRequestFramedAtThaw: a SIGTSTP the kernel delivered to a rank's
// thread just as the pause froze it has its handler's frame built and out
// of the pending set; the resume's SIGCONT, taken by another thread, does
// not cancel it, and its handler stamps it after the thaw (on the VMs the
// job paused again 76 ms after Slurm's resume and stayed paused). The
// look at the rank's threads when the thaw begins (a thread about to run
// the handler its HELLO names) answers that request; the shim's
// "overtaken" report answers it where the SIGCONT interrupted that frame;
// a signal after either pauses the job.
func TestRankRequestFramedAtThaw(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	const entry = 0x7f0012345678
	var framed atomic.Bool
	n.reg.procs = fakeProcs{
		tstp:  func(int) bool { return false },
		frame: func(_ int, e uint64) bool { return framed.Load() && e == entry },
	}
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rankWith(t, "j1", created.Token, 0, 1, fmt.Sprintf(" tstp=%x", entry))
	handled, waitState, requests := rankRequestChecks(t, n, s, "j1")
	pauseResumeFramed := func() { t.Helper(); n.pauseResumeHolding(t, "j1", framed.Store) }

	pauseResumeFramed()
	before := requests()
	s.send("EVENT pause at=%d\n", monotonic()) // the framed handler, after the thaw
	handled()
	if got := requests() - before; got != 0 {
		t.Fatalf("a SIGTSTP framed at the freeze paused the job again after the resume (%d requests)", got)
	}
	if st := n.ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State != ctl.StateRunning {
		t.Fatalf("after the framed SIGTSTP's request: %+v", st.Job)
	}
	s.send("EVENT pause at=%d\n", monotonic()) // the user's next suspend
	handled()
	waitState(ctl.StatePaused)
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
	waitState(ctl.StateRunning)

	// The SIGCONT interrupted the framed handler on its own thread: the
	// shim reports the stop as overtaken, which answers what the thaw saw.
	pauseResumeFramed()
	before = requests()
	s.send("EVENT pause at=%d overtaken\n", monotonic())
	handled()
	if got := requests() - before; got != 0 {
		t.Fatalf("an overtaken stop was acted on (%d requests)", got)
	}
	s.send("EVENT pause at=%d\n", monotonic()) // the user's next suspend
	handled()
	waitState(ctl.StatePaused)
}

// TestRankContinuedWhileFrozen: Slurm's proctrack/cgroup resumes a step by
// thawing its own cgroup and sending SIGCONT to the tasks alone; the ranks
// stay frozen in theirs (mpid's freeze), their handlers cannot run, and
// the SIGCONT waits in the kernel's pending set. mpid must take it there
// as the rank's request to resume (on the VMs the job stayed paused after
// `scontrol resume`), and nothing else may resume the job.
func TestRankContinuedWhileFrozen(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	var cont atomic.Bool
	var looks atomic.Int64
	n.reg.procs = fakeProcs{cont: func(int) bool { looks.Add(1); return cont.Load() }}
	created := n.ask(t, ctl.OpCreate, "j1")
	n.rank(t, "j1", created.Token, 0, 1)
	state := func() string {
		st := n.ask(t, ctl.OpStatus, "j1")
		if st.Job == nil {
			t.Fatalf("status: %+v", st)
		}
		return st.Job.State
	}
	waitState := func(want string, why string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); state() != want; {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the job is %s, want %s\n%s", why, state(), want, n.log.String())
			}
			time.Sleep(time.Millisecond)
		}
	}

	if rep := n.ask(t, ctl.OpPause, "j1"); rep.Err != nil {
		t.Fatalf("pause: %+v", rep.Err)
	}
	// Looked at, nothing pending: paused it stays.
	for deadline := time.Now().Add(10 * time.Second); looks.Load() < 3; {
		if time.Now().After(deadline) {
			t.Fatal("the paused job's ranks were never looked at for a SIGCONT")
		}
		time.Sleep(time.Millisecond)
	}
	if got := state(); got != ctl.StatePaused {
		t.Fatalf("with no SIGCONT pending: %s", got)
	}
	cont.Store(true)
	waitState(ctl.StateRunning, "a SIGCONT pending on the frozen rank")
	if !strings.Contains(n.log.String(), "a SIGCONT waits on a frozen rank") {
		t.Errorf("the resume's cause is not logged:\n%s", n.log.String())
	}

	// The next pause: looked at again, and held while nothing is pending.
	cont.Store(false)
	if rep := n.ask(t, ctl.OpPause, "j1"); rep.Err != nil {
		t.Fatalf("second pause: %+v", rep.Err)
	}
	for seen, deadline := looks.Load(), time.Now().Add(10*time.Second); looks.Load() < seen+3; {
		if time.Now().After(deadline) {
			t.Fatal("the second pause's ranks were never looked at for a SIGCONT")
		}
		time.Sleep(time.Millisecond)
	}
	if got := state(); got != ctl.StatePaused {
		t.Fatalf("second pause, no SIGCONT pending: %s", got)
	}
}

func TestStatusPending(t *testing.T) {
	status := "Name:\tcpi\nSigQ:\t1/63541\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000080000\nSigBlk:\t0000000000000000\n"
	if !statusPending(status, syscall.SIGTSTP) {
		t.Error("SIGTSTP in ShdPnd not seen")
	}
	if statusPending(status, syscall.SIGCONT) || statusPending(strings.Replace(status, "80000", "00000", 1), syscall.SIGTSTP) {
		t.Error("a signal not pending seen")
	}
	if !statusPending("SigPnd:\t0000000000080000\nShdPnd:\t0000000000000000\n", syscall.SIGTSTP) {
		t.Error("SIGTSTP in SigPnd not seen")
	}
}

// newTestDaemon is a daemon with no kernel and no sockets behind it, its
// roles wired but not served: the tests call them directly. Its peers are
// on net (nil: a network of its own), sharing key (nil: a fresh one).
func newTestDaemon(t *testing.T, node string, net *quiesce.MemNetwork, k *quiesce.Keyring) *Daemon {
	t.Helper()
	if k == nil {
		k = testKeys(t)
	}
	if net == nil {
		net = quiesce.NewMemNetwork(1, quiesce.Faults{})
		t.Cleanup(net.Close)
	}
	d, err := New(Config{Node: node, ClusterKey: k, StateDir: t.TempDir(), Cgroups: newMemCgroups(), Observers: memObservers{},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	d.wire(ranks.NewServer(nil), net, done)
	net.Register(node, d.peer.handle)
	return d
}

// testKeys is a fresh cluster key.
func testKeys(t *testing.T) *quiesce.Keyring {
	t.Helper()
	k, err := quiesce.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return quiesce.NewKeyring(k)
}

// fakeProcs is the look at processes a test sets: the pending SIGTSTP and
// SIGCONT of its ranks (which are not frozen) and made-up parents; the
// kernel's where it sets none.
type fakeProcs struct {
	tstp, cont func(pid int) bool
	frame      func(pid int, entry uint64) bool
	parentOf   func(pid int) int
}

func (f fakeProcs) framed(pid int, entry uint64) bool {
	if f.frame != nil {
		return f.frame(pid, entry)
	}
	return kernelProcs{}.framed(pid, entry)
}

func (f fakeProcs) pending(pid int, sig syscall.Signal) bool {
	switch {
	case sig == syscall.SIGTSTP && f.tstp != nil:
		return f.tstp(pid)
	case sig == syscall.SIGCONT && f.cont != nil:
		return f.cont(pid)
	}
	return kernelProcs{}.pending(pid, sig)
}

func (f fakeProcs) parent(pid int) int {
	if f.parentOf != nil {
		return f.parentOf(pid)
	}
	return kernelProcs{}.parent(pid)
}

// fakeClock is a signal clock whose signals the test sends: every watched
// process gets them.
type fakeClock struct {
	mu      sync.Mutex
	times   map[int]loader.SignalTimes
	watches int
}

func (f *fakeClock) Watch(pid int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.times == nil {
		f.times = map[int]loader.SignalTimes{}
	}
	if _, ok := f.times[pid]; !ok {
		f.times[pid] = loader.SignalTimes{}
	}
	f.watches++
	return nil
}

func (f *fakeClock) Forget(pid int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.times, pid)
}

func (f *fakeClock) Last(pid int) (loader.SignalTimes, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, ok := f.times[pid]
	return t, ok
}

// send is the kernel generating sig for every watched process, now.
func (f *fakeClock) send(sig syscall.Signal) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := monotonic()
	for pid, t := range f.times {
		if sig == syscall.SIGTSTP {
			t.Tstp = now
		} else {
			t.Cont = now
		}
		f.times[pid] = t
	}
}

// TestRankRequestOrderedByKernel: where the kernel times a rank's signals,
// a request is ordered by when its signal was generated, not by when its
// handler ran. On the VMs a pause lost Slurm's race and was rolled back;
// Slurm's freeze then held a rank whose SIGTSTP handler's frame was built,
// and after `scontrol resume` (SIGCONT, thaw) the handler asked, stamped
// after the resume, and the job paused again: mpid had thawed nothing
// itself, so none of its looks ran.
func TestRankRequestOrderedByKernel(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	clock := &fakeClock{}
	n.reg.signals = clock
	var held atomic.Bool
	n.reg.procs = fakeProcs{tstp: func(int) bool { return held.Load() }, frame: func(int, uint64) bool { return false }}
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rank(t, "j1", created.Token, 0, 1)
	handled, waitState, requests := rankRequestChecks(t, n, s, "j1")
	if clock.watches != 1 {
		t.Fatalf("the rank's registration watched %d processes, want 1", clock.watches)
	}
	noRequest := func(what string) {
		t.Helper()
		before := requests()
		handled()
		if got := requests() - before; got != 0 {
			t.Fatalf("%s was acted on (%d requests)", what, got)
		}
		if st := n.ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State != ctl.StateRunning {
			t.Fatalf("after %s: %+v", what, st.Job)
		}
	}

	// Slurm's suspend and resume while mpid does nothing: the handler of
	// the SIGTSTP runs after both.
	clock.send(syscall.SIGTSTP)
	clock.send(syscall.SIGCONT)
	s.send("EVENT pause at=%d\n", monotonic())
	noRequest("a SIGTSTP generated before the SIGCONT")

	// The next suspend is the user's.
	clock.send(syscall.SIGTSTP)
	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	waitState(ctl.StatePaused)

	// A SIGCONT generated before a pause began, its handler after.
	clock.send(syscall.SIGCONT)
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
	if rep := n.ask(t, ctl.OpPause, "j1"); rep.Err != nil {
		t.Fatalf("pause: %+v", rep.Err)
	}
	before := requests()
	s.send("EVENT resume at=%d\n", monotonic())
	handled()
	if got := requests() - before; got != 0 {
		t.Fatalf("a SIGCONT generated before the pause was acted on (%d requests)", got)
	}

	// A SIGTSTP generated while this node's pause held, its handler after
	// this node's resume (no SIGCONT): the look at the thaw is not needed.
	clock.send(syscall.SIGTSTP)
	held.Store(true)
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}
	held.Store(false)
	s.send("EVENT pause at=%d\n", monotonic())
	noRequest("a SIGTSTP generated before this node's resume")

	// A SIGTSTP pending at this node's thaw that a SIGCONT then discarded
	// (its handler never runs): the user's next suspend still pauses.
	n.pauseResumeHolding(t, "j1", held.Store)
	clock.send(syscall.SIGCONT)
	clock.send(syscall.SIGTSTP)
	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	waitState(ctl.StatePaused)
}

// TestRankRequestAnsweredWhileWaiting: a rank's request that waited for an
// operation under way is made after it only if nothing answered it
// meanwhile. Here a user's pause fails (Slurm's freeze won the race), the
// rank's SIGTSTP request waited for it, and Slurm's resume sent SIGCONT
// meanwhile: the request must not pause the job after the resume.
func TestRankRequestAnsweredWhileWaiting(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	clock := &fakeClock{}
	n.reg.signals = clock
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rank(t, "j1", created.Token, 0, 1)
	handled, waitState, requests := rankRequestChecks(t, n, s, "j1")
	hold := make(chan struct{})
	n.cgroups.mu.Lock()
	n.cgroups.hold, n.cgroups.refuse = hold, errors.New("frozen by its cgroup (the test's)")
	n.cgroups.mu.Unlock()
	user := make(chan ctl.Reply, 1)
	go func() { user <- n.ask(t, ctl.OpPause, "j1") }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if st := n.ask(t, ctl.OpStatus, "j1"); st.Job != nil && st.Job.State == ctl.StatePausing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the user's pause never began")
		}
	}
	clock.send(syscall.SIGTSTP)
	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	if got := requests(); got != 1 {
		t.Fatalf("the rank's request was not taken up (%d requests)", got)
	}
	clock.send(syscall.SIGCONT)
	n.cgroups.mu.Lock()
	n.cgroups.hold = nil
	n.cgroups.mu.Unlock()
	close(hold)
	if rep := <-user; rep.Err == nil {
		t.Fatal("the user's pause did not fail")
	}
	waitState(ctl.StateRunning)
	if !strings.Contains(n.log.String(), "pause request left alone: answered while it waited") {
		t.Fatalf("the waiting request was not left alone:\n%s", n.log.String())
	}
}

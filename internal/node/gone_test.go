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
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// connectorEnv makes the test binary a rank's stand-in (TestMain): it
// connects to the rank socket the variable names, hands the connection to
// its parent over fd 3 and waits to be killed. The connection's
// credentials are then its own, and the parent, holding the only other
// copy, decides when mpid reads its end.
const connectorEnv = "MPIPAUSE_TEST_CONNECTOR"

func TestMain(m *testing.M) {
	if addr := os.Getenv(connectorEnv); addr != "" {
		os.Exit(connector(addr))
	}
	os.Exit(m.Run())
}

func connector(addr string) int {
	c, err := net.Dial("unix", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	f, err := c.(*net.UnixConn).File()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	parent, err := net.FileConn(os.NewFile(3, "parent"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if _, _, err := parent.(*net.UnixConn).WriteMsgUnix([]byte{0}, syscall.UnixRights(int(f.Fd())), nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	io.Copy(io.Discard, parent) // until the parent goes, if not killed first
	return 0
}

// killableRank is a rank whose process (a child of the test) can be
// SIGKILLed while the test holds its channel open, and whose channel the
// test closes when it chooses: the kill, the end of the channel and what
// the kernel shows of its sockets reach mpid in any order.
type killableRank struct {
	cmd    *exec.Cmd
	parent net.Conn // the child lives while this is open, or until killed
	mu     sync.Mutex
	conn   net.Conn
}

// startKillableRank registers rank of job (size ranks) with the rank socket
// at addr from a child process, and answers mpid's requests as a shim with
// nothing to drain does.
func startKillableRank(t *testing.T, addr, job string, rank, size int) *killableRank {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "mine"), os.NewFile(uintptr(fds[1]), "theirs")
	defer mine.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), connectorEnv+"="+addr)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	k := &killableRank{cmd: cmd}
	t.Cleanup(func() { k.kill(); k.closeChannel() })
	pc, err := net.FileConn(mine)
	if err != nil {
		t.Fatal(err)
	}
	k.parent = pc
	oob := make([]byte, syscall.CmsgSpace(4))
	_, oobn, _, _, err := pc.(*net.UnixConn).ReadMsgUnix(make([]byte, 1), oob)
	if err != nil {
		t.Fatalf("the connector's connection: %v", err)
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatalf("the connector's connection: %v", err)
	}
	got, err := syscall.ParseUnixRights(&msgs[0])
	if err != nil || len(got) != 1 {
		t.Fatalf("the connector's connection: %v", err)
	}
	f := os.NewFile(uintptr(got[0]), "channel")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	k.conn = c
	fmt.Fprintf(c, "HELLO 2 job=%s rank=%d size=%d pid=%d host=n1 key=k\n", job, rank, size, cmd.Process.Pid)
	go answer(c)
	return k
}

// answer plays a shim with nothing to drain on c until c closes.
func answer(c net.Conn) {
	br := bufio.NewReader(c)
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			return
		}
		switch l = strings.TrimSuffix(l, "\n"); {
		case l == "CLOSE":
			fmt.Fprint(c, "CLOSED gate=closed gated=0 closing=0 held=0\n")
		case l == "STATE":
			fmt.Fprint(c, "STATE gate=closed gated=0 closing=0 held=0\n")
		case strings.HasPrefix(l, "DRAIN "):
			fmt.Fprint(c, "DRAINING sockets=0 stashed=0\n")
		}
	}
}

// kill SIGKILLs the rank's process and reaps it.
func (k *killableRank) kill() {
	if k.cmd.ProcessState == nil {
		k.cmd.Process.Kill()
		k.cmd.Wait()
	}
	if k.parent != nil {
		k.parent.Close()
	}
}

// closeChannel is the end of the rank's channel reaching mpid.
func (k *killableRank) closeChannel() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.conn != nil {
		k.conn.Close()
		k.conn = nil
	}
}

// The events of a rank's death that reach mpid on their own paths, in an
// order nothing fixes: its sockets closing as the kernel shows them (one
// reset, so gone; one in FIN_WAIT1, its peer's end in CLOSE_WAIT), the FINs
// in the kernel's byte counters (the dying rank's, and the survivor's that
// closed its end), and the end of its channel to mpid.
const (
	evSockets  = "sockets close"
	evCounters = "FINs counted"
	evEOF      = "channel EOF"
)

// dyingConns is what the kernel shows of the node's job connections, the
// victim's (rank 1, ports 5001 and 5002) and the survivor's (rank 0, 6000
// and 6001), once the events in ev have happened.
func dyingConns(ev map[string]bool) []loader.Conn {
	c := func(cookie uint64, local, remote string, seq uint32, sent uint64) loader.Conn {
		return loader.Conn{Cookie: cookie, Local: netip.MustParseAddrPort(local), Remote: netip.MustParseAddrPort(remote),
			State: loader.StateEstablished, Counted: true, WriteSeq: seq, SndUna: seq, BytesSent: sent}
	}
	fin := c(0x21, "10.0.0.1:5001", "10.0.0.1:6000", 1000, 5000)  // the victim's end: FIN
	peer := c(0x22, "10.0.0.1:6000", "10.0.0.1:5001", 2000, 7000) // the survivor's end of it
	reset := c(0x23, "10.0.0.1:5002", "10.0.0.2:7000", 3000, 9000)
	reset.Unread = 40 // a close with bytes unread resets
	other := c(0x24, "10.0.0.1:6001", "10.0.0.2:7001", 4000, 11000)
	if ev[evSockets] {
		fin.State, peer.State = loader.StateFinWait1, loader.StateCloseWait
	}
	if ev[evCounters] {
		// A FIN takes a sequence number: write_seq moves, the bytes sent
		// do not.
		fin.WriteSeq++
		peer.WriteSeq++
		if ev[evSockets] {
			peer.State = loader.StateLastAck
		}
	}
	out := []loader.Conn{fin, peer, other}
	if !ev[evSockets] {
		out = append(out, reset)
	}
	return out
}

// orders are every order of the three events.
var orders = [][]string{
	{evSockets, evCounters, evEOF}, {evSockets, evEOF, evCounters},
	{evCounters, evSockets, evEOF}, {evCounters, evEOF, evSockets},
	{evEOF, evSockets, evCounters}, {evEOF, evCounters, evSockets},
}

// blamesVictim fails the test unless err is the node's step failing on
// rank 1, the rank that was killed, by name.
func blamesVictim(t *testing.T, step string, err error) {
	t.Helper()
	var rf quiesce.RankFault
	if !errors.As(err, &rf) {
		t.Fatalf("%s: %v; want it to fail on rank 1, killed", step, err)
	}
	if fa := rf.Fault(); fa.Code != FaultRankGone || fa.Rank != 1 || !strings.Contains(err.Error(), "rank 1 ") || strings.Contains(err.Error(), "rank 0 ") {
		t.Fatalf("%s: %v (fault %+v); want rank 1 gone, and only it", step, err, fa)
	}
}

// TestRankKilledAnyOrder: a rank killed just before PREPARE fails the
// node's PREPARE, naming it, whatever part of its death has reached mpid
// by then; a rank killed after it fails the first DRAIN step that any of
// those parts reaches, naming it, in every order. No step takes the FINs
// of the closing sockets for bytes sent through closed gates, and no step
// answers with fewer ranks than it gated without saying which one went
// (the coordinator could only call it missing).
func TestRankKilledAnyOrder(t *testing.T) {
	for _, order := range orders {
		for before := 0; before <= len(order); before++ {
			name := fmt.Sprintf("killed before PREPARE, %s | PREPARE | %s", strings.Join(order[:before], ", "), strings.Join(order[before:], ", "))
			t.Run(name, func(t *testing.T) { killedRank(t, order, before, true) })
		}
		name := "killed after PREPARE, " + strings.Join(order, ", ")
		t.Run(name, func(t *testing.T) { killedRank(t, order, 0, false) })
	}
}

var trials atomic.Int64

func killedRank(t *testing.T, order []string, before int, killFirst bool) {
	addr := fmt.Sprintf("@mpipause-node-killed-%d-%d", os.Getpid(), trials.Add(1))
	s, err := ranks.Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go s.Serve(ctx)
	const job = "j"
	key := jobid.Key(uint32(os.Getuid()), job)
	survivor := fakeRank(t, addr, job, 0, new(atomic.Pointer[string]), nil, nil)
	go func() {
		for range survivor {
		}
	}()
	victim := startKillableRank(t, addr, job, 1, 4)
	if err := s.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 2 }); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ev := map[string]bool{}
	obs := &eventObserver{conns: func() []loader.Conn { mu.Lock(); defer mu.Unlock(); return dyingConns(ev) }}
	l := &Role{Name: "n1", Ranks: s, Jobs: observed{obs},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	happen := func(e string) {
		mu.Lock()
		ev[e] = true
		mu.Unlock()
		if e == evEOF {
			victim.closeChannel()
			// mpid has read it once the rank is no longer registered.
			if err := s.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
				t.Fatal(err)
			}
		}
	}
	clean := func(step string, rep quiesce.NodeReport) {
		t.Helper()
		if rep.Violations != 0 {
			t.Fatalf("%s: %d bytes counted as sent through closed gates: the FINs of closing sockets are no bytes", step, rep.Violations)
		}
		if rep.Ranks != 2 {
			t.Fatalf("%s answered for %d ranks of the 2 it gated, without naming the one missing", step, rep.Ranks)
		}
	}

	if killFirst {
		victim.kill()
		for _, e := range order[:before] {
			happen(e)
		}
		blamesVictim(t, "PREPARE", l.Prepare(ctx, key))
		return
	}
	if err := l.Prepare(ctx, key); err != nil {
		t.Fatal(err)
	}
	rep, err := l.Drain(ctx, key) // what the next ones compare with
	if err != nil {
		t.Fatal(err)
	}
	clean("the first DRAIN", rep)
	victim.kill()
	// Nothing of the death has reached mpid but the kill itself: the step
	// may pass, but not with a wrong report.
	if rep, err := l.Drain(ctx, key); err == nil {
		clean("a DRAIN right after the kill", rep)
	} else {
		blamesVictim(t, "a DRAIN right after the kill", err)
	}
	for i, e := range order {
		happen(e)
		step := fmt.Sprintf("the DRAIN after %s", strings.Join(order[:i+1], ", "))
		rep, err := l.Drain(ctx, key)
		if err == nil {
			clean(step, rep)
		}
		blamesVictim(t, step, err)
	}
}

// eventObserver is the job's kernel observer, its connections those of
// the events so far.
type eventObserver struct{ conns func() []loader.Conn }

func (o *eventObserver) Snapshot(context.Context) ([]loader.Conn, error) { return o.conns(), nil }
func (o *eventObserver) Kind() string                                    { return "fake" }
func (o *eventObserver) Close() error                                    { return nil }

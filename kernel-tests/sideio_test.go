package kerneltests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
	"github.com/mpipause/mpipause/loader"
)

// sideServerEnv makes the test binary sideio's server (sideServe), writing
// its report to the file it names; with sideBackEnv (bytes a second) it
// also sends that stream back on every rank's own connection.
const (
	sideServerEnv = "MPIPAUSE_KT_SIDESERVER"
	sideBackEnv   = "MPIPAUSE_KT_SIDEBACK"
)

// TestPauseSideIO is the end-to-end test of "nothing lost, whatever the
// program does": a real 3 x 2 job of each library (apps/sideio.c) whose
// ranks, besides an all-to-all exchange over MPI, each keep a TCP
// connection of their own to a server outside the job (the test binary in
// node1, in a cgroup of its own: no shim, never frozen) and send it a
// numbered, checkable stream of records by send, write, writev, sendmsg and
// sendfile, and fork children that send records on connections of their
// own and exit. `mpipause run` launches it; it is paused and resumed 50
// times at random moments. Every pause must commit with nothing in flight
// (mpipause's summary, and the test's own BPF and sock_diag readers); at the
// end the server must have seen every byte of every connection, parents'
// and children's, once and in order up to its END record and end of stream,
// every child each parent says it forked, and rank 0 must print the
// checksum of an unpaused run.
func TestPauseSideIO(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testPauseSideIO(t, lib, 0) })
	}
}

// TestPauseSideIOTalkBack is TestPauseSideIO with a server that talks back
// (the receive-side drain takes bytes only from the job's own
// connections): on every rank's own connection it also sends a numbered
// stream, all the time, paused or not, which the rank reads with raw
// read/recvfrom syscalls the shim does not wrap, every 2 ms, and checks
// byte by byte (apps/sideio.c -B). Four of the six ranks reach the server in
// node1 from another node, where the kernel alone cannot tell their
// connection from one to a rank. Every pause must still commit with the
// job's connections empty (the server's unread bytes on the ranks' own
// connections are not the job's, and stay in the kernel), and every rank
// must have read the server's whole stream, once and in order: a byte the
// drain stashed is one the raw reader never sees, and it reports the gap.
func TestPauseSideIOTalkBack(t *testing.T) {
	for _, lib := range mpiLibs {
		// 2 MB/s a rank: some of it is always waiting in the kernel for
		// the reader's next read when a pause comes.
		t.Run(lib.name, func(t *testing.T) { testPauseSideIO(t, lib, 2<<20) })
	}
}

// testPauseSideIO runs the side I/O job through 50 pauses; back > 0 is the
// rate (bytes a second a rank) of the server's stream back.
func testPauseSideIO(t *testing.T, lib mpiLib, back int) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	t0 := time.Now()

	srv := startSideServer(ctx, t, lib.name, back)
	obs, check := rigReaders(ctx, t)
	name := "side"
	if back > 0 {
		name = "sideback"
	}
	id := fmt.Sprintf("%s-%s-%d", name, lib.name, os.Getpid())
	app := filepath.Join(bin, "apps", "sideio."+lib.name)
	stop := t.TempDir()
	// -z: a record every 2 ms or so per rank (6 x ~8 MB/s for the server to
	// check on 2 cores); -F: a child about every 80 ms per rank, so that
	// every pause finds some children alive, some being forked.
	args := []string{"-s", "64K", "-H", "node1:" + srv.port, "-D", t.TempDir(), "-F", "40", "-z", "2000"}
	if back > 0 {
		args = append(args, "-B", "2000")
	}
	// At a COMMIT the job's connections are empty; the ranks' own ones to
	// the server are not the job's, and mpid does not wait for them: what
	// the server sent and a rank has not read yet, or a send from before
	// the gate closed not yet acknowledged, is the program's business, as
	// on an unpaused job. What the server received (and the rank read) is
	// checked at the end.
	jobOnly := []loader.Observer{exceptConnsTo(obs, srv.addr), exceptConnsTo(check, srv.addr)}
	// To tell one send path's failure from another's: MPIPAUSE_SIDE_ARGS,
	// e.g. "-k swvm -F 0" (no sendfile, no children); see apps/sideio.c.
	args = append(args, strings.Fields(os.Getenv("MPIPAUSE_SIDE_ARGS"))...)
	job := runJob(ctx, t, lib, id, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	cgs := nodeJobCgroups(t, id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitFor(t, "every rank's connection to reach the server", time.Minute, job.done, func() bool {
		return strings.Count(srv.out.String(), "\nparent ") == 6
	})
	waitProgress(ctx, t, obs, job.done, sentBytes(ctx, obs), 4<<20)
	started := time.Since(t0)

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	t.Logf("random moments from seed %d", seed)
	cycles := envCount("MPIPAUSE_SIDE_CYCLES", 50)
	var pauseMs, resumeMs []float64
	failed, tried := 0, 0
	// Three failed pauses are enough to say why; what the server saw says
	// the rest.
cycles:
	for c := 1; c <= cycles && failed < 3; c++ {
		tried = c
		select {
		case <-job.done:
			// A rank the server hung up on dies of SIGPIPE (a record out of
			// order): the server's report says which.
			t.Errorf("the job ended after %d of %d pauses\n%s", c-1, cycles, job.out.String())
			break cycles
		default:
		}
		// A random moment of the job's I/O, 0 to 100 ms after the last resume.
		time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
		j, r := jobJSON(ctx, t, "pause", id, "--timeout", "10s")
		if r.code != 0 {
			// Go on to the end: what the server saw says what was lost.
			failed++
			t.Errorf("pause %d: exit %d, state %q: %s%s", c, r.code, j.State, r.stderr, failureText(j.Failure))
			if j.State == ctl.StatePaused {
				cli(ctx, t, "node0", nil, "resume", id)
			}
			continue
		}
		checkPaused(ctx, t, fmt.Sprintf("pause %d", c), j, cgs, jobOnly...)
		pauseMs = append(pauseMs, j.TotalMs)
		j, r = jobJSON(ctx, t, "resume", id)
		if r.code != 0 || j.State != ctl.StateRunning {
			t.Fatalf("resume %d: exit %d, state %q: %s", c, r.code, j.State, r.stderr)
		}
		resumeMs = append(resumeMs, j.TotalMs)
	}
	paused := time.Since(t0) - started

	if err := os.WriteFile(filepath.Join(stop, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-job.done:
	case <-ctx.Done():
		t.Fatalf("the job did not end after it was told to stop: %v\n%s", ctx.Err(), job.out.String())
	}
	rep := srv.report(ctx, t)
	checkSideReport(t, rep, 6)
	if back > 0 {
		checkBack(t, rep, job.out.String(), 6)
	}

	m := itersRE.FindStringSubmatch(job.out.String())
	if job.err != nil || m == nil {
		for _, l := range strings.Split(strings.TrimSpace(job.out.String()), "\n") {
			t.Logf("  job: %s", l)
		}
		t.Fatalf("the job failed: %v (its output above)", job.err)
	}
	want := serial(t, app, 6, append(slices.Clone(args[:2]), "-n", m[1])...)
	if got, w := checksum(job.out.String()), checksum(want); got == "" || got != w {
		t.Errorf("the job printed %q, an unpaused run of %s iterations %q:\n%s", got, m[1], w, job.out.String())
	}
	var nbytes, recs uint64
	for _, c := range rep.Conns {
		nbytes += c.Bytes
		recs += c.Records
	}
	var backBytes uint64
	for _, c := range rep.Conns {
		backBytes += c.BackSent
	}
	t.Logf("%s: %d pauses (%d failed): pause p50 %.1f ms max %.1f ms, resume p50 %.1f ms; server checked %d connections (%d children), %d records, %.1f MiB, sent back %.1f MiB; %s iterations; start %v, pauses %v, end %v",
		lib.name, tried, failed, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1), bench.Percentile(resumeMs, 0.5),
		len(rep.Conns), len(rep.Conns)-6, recs, float64(nbytes)/(1<<20), float64(backBytes)/(1<<20), m[1],
		started.Round(time.Millisecond), paused.Round(time.Millisecond), (time.Since(t0) - started - paused).Round(time.Millisecond))
}

func failureText(f *ctl.Failure) string {
	if f == nil {
		return ""
	}
	b, _ := json.Marshal(f)
	return "\nfailure: " + string(b)
}

// sideServer is sideServe running in node1.
type sideServer struct {
	*proc
	port, path string
	addr       netip.AddrPort // as the ranks' connections name it
}

var listeningRE = regexp.MustCompile(`(?m)^listening (\d+)$`)

// startSideServer runs the test binary as sideio's server in node1, in a
// cgroup of its own (outside the rig's, so neither the job's nor the
// readers'), and waits for it to listen.
func startSideServer(ctx context.Context, t *testing.T, name string, back int) *sideServer {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	s := &sideServer{path: filepath.Join(t.TempDir(), "report.json")}
	env := []string{"MPIPAUSE_RIG=" + jobRig, sideServerEnv + "=" + s.path, fmt.Sprintf("%s=%d", sideBackEnv, back)}
	// The cgroup is this run's alone (NewCgroup's names are random): a test
	// of another rig's that kills its own server's cgroup at its end must
	// not kill this one.
	cg := testutil.NewCgroup(t)
	s.proc = start(ctx, t, cg, env, filepath.Join(binDir(t), "rig"), "exec", "node1", "--", exe)
	waitFor(t, "the side server to listen", time.Minute, s.done, func() bool {
		m := listeningRE.FindStringSubmatch(s.out.String())
		if m != nil {
			s.port = m[1]
		}
		return m != nil
	})
	port, err := strconv.ParseUint(s.port, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	// node1 is 10.77.0.2 (docs/rig.md), the address "node1" resolves to.
	s.addr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 77, 0, 2}), uint16(port))
	return s
}

// connsNotTo is an observer of the job's connections but those to server
// (the side server, outside the job).
type connsNotTo struct {
	loader.Observer
	server netip.AddrPort
}

func exceptConnsTo(o loader.Observer, server netip.AddrPort) loader.Observer {
	return connsNotTo{o, server}
}

func (o connsNotTo) Snapshot(ctx context.Context) ([]loader.Conn, error) {
	cs, err := o.Observer.Snapshot(ctx)
	return slices.DeleteFunc(cs, func(c loader.Conn) bool {
		return netip.AddrPortFrom(c.Remote.Addr().Unmap(), c.Remote.Port()) == o.server
	}), err
}

var sideBackRE = regexp.MustCompile(`(?m)^sideio rank=(\d+) side .* back=(\d+)`)

// checkBack: every rank read the server's whole stream back, as much as the
// server sent on its connection (a byte not as sent the rank itself
// reports, and fails).
func checkBack(t *testing.T, r *sideReport, out string, ranks int) {
	t.Helper()
	read := map[int]uint64{}
	for _, m := range sideBackRE.FindAllStringSubmatch(out, -1) {
		rank, _ := strconv.Atoi(m[1])
		n, _ := strconv.ParseUint(m[2], 10, 64)
		read[rank] = n
	}
	var bad []string
	for _, c := range r.Conns {
		if c.Child != 0 || c.Rank < 0 {
			continue
		}
		n, ok := read[c.Rank]
		switch {
		case c.BackErr != "":
			bad = append(bad, fmt.Sprintf("rank %d: the server's stream back ended after %d bytes: %s", c.Rank, c.BackSent, c.BackErr))
		case c.BackSent == 0:
			bad = append(bad, fmt.Sprintf("rank %d: the server sent nothing back", c.Rank))
		case !ok:
			bad = append(bad, fmt.Sprintf("rank %d: no line saying how much of the server's %d bytes it read", c.Rank, c.BackSent))
		case n != c.BackSent:
			bad = append(bad, fmt.Sprintf("rank %d read %d bytes of the %d the server sent back", c.Rank, n, c.BackSent))
		}
		delete(read, c.Rank)
	}
	for rank := range read {
		bad = append(bad, fmt.Sprintf("rank %d: a line saying what it read, but no connection at the server", rank))
	}
	if len(bad) > 0 {
		slices.Sort(bad)
		t.Errorf("the server's stream back:\n%s", strings.Join(bad, "\n"))
	}
}

// report ends the server (SIGTERM) and reads what it verified.
func (s *sideServer) report(ctx context.Context, t *testing.T) *sideReport {
	t.Helper()
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-ctx.Done():
		t.Fatalf("the side server did not end: %v\n%s", ctx.Err(), s.out.String())
	}
	b, err := os.ReadFile(s.path)
	if err != nil {
		t.Fatalf("side server (%v): %v\n%s", s.err, err, s.out.String())
	}
	var r sideReport
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("side server report: %v", err)
	}
	return &r
}

// checkSideReport: one connection per rank and one per child each rank
// says it forked, each one whole: every record in order and as sent, its
// END, then end of stream.
func checkSideReport(t *testing.T, r *sideReport, ranks int) {
	t.Helper()
	parents := map[int]*sideConn{}
	kids := map[[2]int]*sideConn{}
	var bad []string
	for i := range r.Conns {
		c := &r.Conns[i]
		if !c.whole() {
			bad = append(bad, c.String())
		}
		if c.Rank < 0 {
			continue // said in its String above
		}
		k := [2]int{c.Rank, int(c.Child)}
		if c.Child == 0 {
			if parents[c.Rank] != nil {
				bad = append(bad, fmt.Sprintf("rank %d: a second connection of its own", c.Rank))
			}
			parents[c.Rank] = c
		} else if kids[k] != nil {
			bad = append(bad, fmt.Sprintf("rank %d child %d: a second connection", c.Rank, c.Child))
		}
		kids[k] = c
	}
	for rank := range ranks {
		p := parents[rank]
		if p == nil {
			bad = append(bad, fmt.Sprintf("rank %d: no connection of its own", rank))
			continue
		}
		if !p.End {
			continue // how many children it forked is not known
		}
		missing := 0
		for k := 1; k <= int(p.Children); k++ {
			if kids[[2]int{rank, k}] == nil {
				missing++
			}
		}
		if missing > 0 {
			bad = append(bad, fmt.Sprintf("rank %d: %d of the %d children it forked never said HELLO to the server", rank, missing, p.Children))
		}
	}
	if len(bad) > 0 {
		var badParents, badKids, emptyKids int
		for _, c := range r.Conns {
			switch {
			case c.whole():
			case c.Child == 0 && c.Rank >= 0:
				badParents++
			default:
				badKids++
				if c.Bytes == 0 {
					emptyKids++
				}
			}
		}
		bad = append([]string{fmt.Sprintf("ranks' own connections not whole: %d of %d; children's: %d of %d (%d received nothing)",
			badParents, len(parents), badKids, len(r.Conns)-len(parents), emptyKids)}, bad...)
		n := len(bad) - 1
		if len(bad) > 21 {
			bad = append(bad[:21], "...")
		}
		// One call a line: a log that keeps only the lines with a test's
		// file and line (CI's excerpt) keeps every problem.
		t.Errorf("side connections: %d problems among %d connections:", n, len(r.Conns))
		for _, b := range bad {
			t.Errorf("  %s", b)
		}
	}
}

// The record format of apps/sideio.c.
const (
	sideRecMagic = 0x45444953
	sideRecSize  = 40
	sideFileSize = 1 << 20
	sideMaxBody  = 32768
)

const (
	kHello = 1 + iota
	kSend
	kWrite
	kWritev
	kSendmsg
	kSendfile
	kEnd
)

var kindName = map[uint16]string{kHello: "HELLO", kSend: "send", kWrite: "write", kWritev: "writev", kSendmsg: "sendmsg", kSendfile: "sendfile", kEnd: "END"}

type sideReport struct {
	Conns []sideConn `json:"conns"`
}

// sideConn is what the server verified of one connection.
type sideConn struct {
	Remote   string `json:"remote"`
	Rank     int    `json:"rank"` // -1 before a HELLO
	Child    uint32 `json:"child"`
	Bytes    uint64 `json:"bytes"`    // received
	Records  uint64 `json:"records"`  // whole and as sent, HELLO and END included
	Mismatch int64  `json:"mismatch"` // first byte not as sent, -1 if none
	Why      string `json:"why,omitempty"`
	End      bool   `json:"end"` // END, with the byte count it says
	EOF      bool   `json:"eof"` // end of stream right after END
	Children uint64 `json:"children"`
	// The server's stream back on a rank's own connection: bytes the
	// kernel took, and why it stopped before the rank's end of stream.
	BackSent uint64 `json:"back_sent,omitempty"`
	BackErr  string `json:"back_err,omitempty"`
}

func (c *sideConn) whole() bool { return c.Mismatch < 0 && c.End && c.EOF }

func (c *sideConn) String() string {
	s := fmt.Sprintf("rank %d child %d (%s): %d bytes, %d records whole", c.Rank, c.Child, c.Remote, c.Bytes, c.Records)
	if c.Mismatch >= 0 {
		s += fmt.Sprintf(", first byte not as sent at offset %d: %s", c.Mismatch, c.Why)
	} else if !c.End {
		s += ", no END"
	}
	if c.End && !c.EOF {
		s += ", no end of stream after END"
	}
	return s
}

// The streams of apps/stream.h and apps/sideio.c.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func fillStream(b []byte, seed uint64) {
	x := seed | 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	for ; i < len(b); i++ {
		b[i] = byte(x >> (8 * (i % 8)))
	}
}

func fileSeed(rank int) uint64 { return mix64(0x73656e6466696c65 + uint64(rank)) }

func bodySeed(rank int, child uint32, seq uint64) uint64 {
	return mix64(mix64(0x626f6479^uint64(rank)<<40^uint64(child)<<8) ^ seq)
}

// sideFiles are the ranks' sendfile bodies, made once.
var sideFiles sync.Map

func sideFile(rank int) []byte {
	if b, ok := sideFiles.Load(rank); ok {
		return b.([]byte)
	}
	b := make([]byte, sideFileSize)
	fillStream(b, fileSeed(rank))
	sideFiles.Store(rank, b)
	return b
}

// sideServe is sideio's server: it verifies every connection's records as
// they come and, at SIGTERM (the job has ended), writes what it found to
// path. It says "listening PORT" once it listens, "parent R" when rank R's
// own connection says HELLO and "first child R.K" at the first child's.
func sideServe(path string, back int) int {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		fmt.Println("listen:", err)
		return 1
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	fmt.Printf("listening %d\n", ln.Addr().(*net.TCPAddr).Port)

	var (
		mu        sync.Mutex
		conns     []*sideConn
		wg        sync.WaitGroup
		open      = map[net.Conn]bool{}
		someChild bool
	)
	said := func(c *sideConn) {
		mu.Lock()
		defer mu.Unlock()
		if c.Child == 0 {
			fmt.Printf("parent %d\n", c.Rank)
		} else if !someChild {
			someChild = true
			fmt.Printf("first child %d.%d\n", c.Rank, c.Child)
		}
	}
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			c := &sideConn{Remote: nc.RemoteAddr().String(), Rank: -1, Mismatch: -1}
			mu.Lock()
			conns = append(conns, c)
			open[nc] = true
			mu.Unlock()
			stop := make(chan struct{})
			var talking sync.WaitGroup
			hello := func(c *sideConn) {
				said(c)
				if back > 0 && c.Child == 0 {
					talking.Go(func() { sendBack(nc, c, back, stop) })
				}
			}
			wg.Go(func() {
				verifyConn(nc, c, hello)
				// The rank's end of stream: the stream back ends too,
				// with what the kernel took of it, before our close.
				close(stop)
				nc.SetWriteDeadline(time.Unix(1, 0))
				talking.Wait()
				nc.Close()
				mu.Lock()
				delete(open, nc)
				mu.Unlock()
			})
		}
	}()
	<-term
	ln.Close()
	// The job has ended, so every connection has its end of stream on the
	// way; one still open after that is reported as it is.
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		mu.Lock()
		for nc := range open {
			nc.Close()
		}
		mu.Unlock()
		<-done
	}
	rep := sideReport{}
	for _, c := range conns {
		rep.Conns = append(rep.Conns, *c)
	}
	b, _ := json.Marshal(rep)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		fmt.Println("report:", err)
		return 1
	}
	return 0
}

// sendBack sends rank c's stream back on nc, rate bytes a second in a
// piece every 2 ms, until stop: while the rank does not read (paused), the
// kernel's buffers fill and the write waits.
func sendBack(nc net.Conn, c *sideConn, rate int, stop <-chan struct{}) {
	const every = 2 * time.Millisecond
	buf := make([]byte, max(rate/int(time.Second/every), 8))
	seed := backSeed(c.Rank)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		fillBack(buf, seed, c.BackSent)
		n, err := nc.Write(buf)
		c.BackSent += uint64(n)
		if err != nil {
			select {
			case <-stop:
			default:
				c.BackErr = err.Error()
			}
			return
		}
	}
}

// The stream back of apps/sideio.c: byte off is byte off%8 of the
// little-endian word mix64(seed + off/8).
func backSeed(rank int) uint64 { return mix64(0x6261636b73747265 + uint64(rank)) }

func fillBack(b []byte, seed, off uint64) {
	w, wi := uint64(0), ^uint64(0)
	for i := range b {
		o := off + uint64(i)
		if o/8 != wi {
			wi = o / 8
			w = mix64(seed + wi)
		}
		b[i] = byte(w >> (8 * (o % 8)))
	}
}

// verifyConn reads one connection to its end, checking each record against
// what apps/sideio.c sends; after the first byte not as sent it only counts.
func verifyConn(nc net.Conn, c *sideConn, said func(*sideConn)) {
	br := bufio.NewReaderSize(nc, 256<<10)
	var off uint64
	hdr := make([]byte, sideRecSize)
	body := make([]byte, sideMaxBody)
	want := make([]byte, sideMaxBody)
	fail := func(at uint64, why string, args ...any) {
		c.Mismatch, c.Why = int64(at), fmt.Sprintf(why, args...)
	}
	for seq := uint64(0); ; seq++ {
		n, err := io.ReadFull(br, hdr)
		c.Bytes += uint64(n)
		if n == 0 && errors.Is(err, io.EOF) {
			if !c.End {
				fail(off, "end of stream before END")
			}
			c.EOF = c.End
			return
		}
		if err != nil {
			fail(off, "end of stream inside a record header (%v)", err)
			return
		}
		if c.End {
			fail(off, "bytes after END")
			break
		}
		magic := binary.LittleEndian.Uint32(hdr)
		kind := binary.LittleEndian.Uint16(hdr[4:])
		rank := int(binary.LittleEndian.Uint16(hdr[6:]))
		child := binary.LittleEndian.Uint32(hdr[8:])
		ln := binary.LittleEndian.Uint32(hdr[12:])
		rseq := binary.LittleEndian.Uint64(hdr[16:])
		arg := binary.LittleEndian.Uint64(hdr[24:])
		aux := binary.LittleEndian.Uint64(hdr[32:])
		if magic != sideRecMagic || kindName[kind] == "" || ln > sideMaxBody {
			fail(off, "record %d: not a record header (magic %#x, kind %d, len %d)%s", seq, magic, kind, ln, whatBytes(hdr, c.Rank))
			break
		}
		if seq == 0 {
			if kind != kHello || rseq != 0 {
				fail(off, "first record is %s %d, not HELLO", kindName[kind], rseq)
				break
			}
			c.Rank, c.Child = rank, child
			said(c)
		} else if rank != c.Rank || child != c.Child || rseq != seq || kind == kHello {
			fail(off, "record %d: header says %s of rank %d child %d record %d", seq, kindName[kind], rank, child, rseq)
			break
		}
		if kind == kEnd && (arg != off || ln != 0) {
			fail(off, "END says %d bytes before it, %d arrived", arg, off)
			break
		}
		if kind == kSendfile && arg+uint64(ln) > sideFileSize {
			fail(off, "record %d: sendfile of [%d, %d) past the file's end", seq, arg, arg+uint64(ln))
			break
		}
		n, err = io.ReadFull(br, body[:ln])
		c.Bytes += uint64(n)
		if err != nil {
			fail(off+sideRecSize+uint64(n), "end of stream inside the body of record %d (%s, %d of %d bytes)", seq, kindName[kind], n, ln)
			return
		}
		exp := want[:ln]
		if kind == kSendfile {
			exp = sideFile(c.Rank)[arg : arg+uint64(ln)]
		} else {
			fillStream(exp, bodySeed(c.Rank, c.Child, seq))
		}
		if i := firstDiff(body[:ln], exp); i >= 0 {
			fail(off+sideRecSize+uint64(i), "record %d (%s, %d bytes): body differs from byte %d", seq, kindName[kind], ln, i)
			break
		}
		off += sideRecSize + uint64(ln)
		c.Records++
		if kind == kEnd {
			c.End, c.Children = true, aux
		}
	}
	// Count the rest, so that the report says how much arrived.
	k, _ := io.Copy(io.Discard, br)
	c.Bytes += uint64(k)
}

// whatBytes says where bytes found in place of a header come from when
// they are part of a rank's sendfile body (rank's, or any of the 6 when
// the connection's HELLO did not arrive): a body that overtook its header.
func whatBytes(b []byte, rank int) string {
	ranks := []int{rank}
	if rank < 0 {
		ranks = []int{0, 1, 2, 3, 4, 5}
	}
	for _, r := range ranks {
		if i := bytes.Index(sideFile(r), b); i >= 0 {
			return fmt.Sprintf(": bytes %d.. of rank %d's sendfile body", i, r)
		}
	}
	return ""
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// sideServerMain is TestMain's hook: non-zero when the binary was run as
// the server.
func sideServerMain() (int, bool) {
	path := os.Getenv(sideServerEnv)
	if path == "" {
		return 0, false
	}
	back, _ := strconv.Atoi(os.Getenv(sideBackEnv))
	return sideServe(path, back), true
}

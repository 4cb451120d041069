package quiesce

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil/benchrec"
)

// BenchmarkScale measures how the protocol's cost grows with the job: whole
// pauses (PREPARE to COMMIT) of 16 to 4096 simulated nodes, over the
// in-memory transport and over loopback TCP with the cluster key (one
// listener per node, as mpid serves its peer port), each with the binomial
// tree and with a star in which the first node calls every other one.
// Simulated nodes answer at once with an empty report, so what is measured
// is the protocol and its transport, not a kernel.
//
// Every simulated node runs on this machine, so a pause costs the CPU of
// its n-1 requests a round (over TCP: a connection each, handshake,
// authentication, JSON) on the cores here, and its time grows with n for
// both fan-outs. What tells them apart is the root's load, which is
// recorded too: Depth(n)+1 requests a round for the tree, n for the star.
// On a cluster, where each node has its own cores, that is what bounds a
// round: Depth(n) hops for the tree, the root's n-1 requests one core at a
// time for the star. The process's CPU time per pause is recorded beside
// the wall time, as it carries less of the machine's other load.
//
// The options are mpid's but for two things: retransmissions come after
// 30 s, not DefaultRetry's 50 ms, and every phase may take 2 minutes. With
// every node's work queued on two cores a hop takes as long as the whole
// round, and a timer sized for a LAN of independent daemons fires on every
// edge: each retransmission is one more connection to serve, which slows
// the round, which fires more of them (measured with DefaultRetry: TCP,
// 1024 nodes, 2.7 requests per edge and 2.6 times the CPU, and a PREPARE
// that outran its 5 s). That collapse belongs to the simulation, not to a
// cluster.
//
// MPIPAUSE_SCALE_CYCLES sets the measured pause and resume cycles per case
// (default 5), after one that warms up; MPIPAUSE_SCALE_NODES (e.g.
// "1024,4096"), MPIPAUSE_SCALE_TRANSPORTS ("mem", "tcp") and
// MPIPAUSE_SCALE_FANOUTS ("tree", "star") narrow the cases, to profile one.
//
// It writes scale.csv (every measured cycle) and the summary rows of
// section "scale" to the results directory; benchplot
// (kernel-tests/tools/bench) draws scale-pause.svg and
// scale-root-messages.svg from the CSV.
func BenchmarkScale(b *testing.B) {
	dir, err := benchrec.Dir()
	if err != nil {
		b.Fatal(err)
	}
	cycles := envInt("MPIPAUSE_SCALE_CYCLES", 5)
	sizes := []int{16, 64, 256, 1024, 4096}
	if v := os.Getenv("MPIPAUSE_SCALE_NODES"); v != "" {
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 2 {
				b.Fatalf("MPIPAUSE_SCALE_NODES=%q: want node counts of 2 or more, separated by commas", v)
			}
			sizes = append(sizes, n)
		}
	}
	transports := []string{"mem", "tcp"}
	if v := os.Getenv("MPIPAUSE_SCALE_TRANSPORTS"); v != "" {
		transports = strings.Split(v, ",")
	}
	fanouts := []Fanout{FanoutTree, FanoutStar}
	if v := os.Getenv("MPIPAUSE_SCALE_FANOUTS"); v != "" {
		fanouts = nil
		for _, f := range strings.Split(v, ",") {
			switch strings.TrimSpace(f) {
			case "tree":
				fanouts = append(fanouts, FanoutTree)
			case "star":
				fanouts = append(fanouts, FanoutStar)
			default:
				b.Fatalf("MPIPAUSE_SCALE_FANOUTS=%q: want tree, star or both, separated by commas", v)
			}
		}
	}

	// The tables go to stderr, a line at a time as "bench: ..." (what make
	// bench shows): go test keeps only the first ten lines of a
	// benchmark's log, which is for the verdicts.
	logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...) }
	// The TCP cases' floor, measured here: what the kernel's loopback TCP
	// alone costs a request and its reply, in CPU (see loopbackRoundTrip).
	var rtCPU time.Duration
	if slices.Contains(transports, "tcp") {
		if rtCPU, err = loopbackRoundTrip(20000); err != nil {
			b.Fatal(err)
		}
		logf("scale tcp: a bare loopback TCP request and reply costs %.1f us of CPU (%d cores)", float64(rtCPU.Nanoseconds())/1e3, runtime.NumCPU())
	}
	var raw [][]string
	var rows []benchrec.Row
	results := map[string]map[int]scaleCase{} // "mem/tree" -> nodes -> figures
	for _, transport := range transports {
		for _, n := range sizes {
			sim, err := newScaleSim(transport, n)
			if err != nil {
				var skip *fdShortage
				if errors.As(err, &skip) {
					b.Logf("scale %s/%d nodes: skipped: %v", transport, n, err)
					continue
				}
				b.Fatalf("scale %s/%d nodes: %v", transport, n, err)
			}
			for _, f := range fanouts {
				c := sim.run(b, f, cycles)
				key := transport + "/" + fanoutName(f)
				if results[key] == nil {
					results[key] = map[int]scaleCase{}
				}
				results[key][n] = c
				for i := range c.pauseMs {
					raw = append(raw, []string{transport, fanoutName(f), strconv.Itoa(n), strconv.Itoa(i + 1),
						ff(c.pauseMs[i]), ff(c.roundMs[i]), ff(c.cpuMs[i]), ff(c.msgMean[i]), ff(c.msgMax[i]), ff(c.msgRoot[i])})
				}
			}
			if err := sim.close(); err != nil {
				b.Fatalf("scale %s/%d nodes: %v", transport, n, err)
			}
			if transport == "tcp" {
				logf("scale tcp/%d nodes: at most %d connections open at once, %d listeners", n, sim.peakConns.Load(), n)
			}
		}
	}

	const goalMs = 250.0
	for _, transport := range transports {
		for _, f := range fanouts {
			key := transport + "/" + fanoutName(f)
			byN := results[key]
			if len(byN) == 0 {
				continue
			}
			logf("scale %s: %6s %4s %11s %11s %11s %9s %8s %8s", key, "nodes", "hops", "pause p50", "round p50", "CPU/pause", "msgs mean", "msgs max", "root")
			for _, n := range sizes {
				c, ok := byN[n]
				if !ok {
					continue
				}
				pause, round, cpu := benchrec.Percentile(c.pauseMs, 0.5), benchrec.Percentile(c.roundMs, 0.5), benchrec.Percentile(c.cpuMs, 0.5)
				mean, most, root := avg(c.msgMean), benchrec.Max(c.msgMax), avg(c.msgRoot)
				_, hops := f.split(n)
				logf("scale %s: %6d %4d %8.2f ms %8.2f ms %8.1f ms %9.2f %8.1f %8.1f", key, n, hops, pause, round, cpu, mean, most, root)
				row := func(metric string, v float64, unit string) benchrec.Row {
					return benchrec.Row{Section: "scale", Case: fmt.Sprintf("%s/%d nodes", key, n), Metric: metric, Value: v, Unit: unit}
				}
				pr := row("pause p50", pause, "ms")
				if f == FanoutTree && n == 4096 {
					pr = pr.Goal(fmt.Sprintf("< %.0f ms", goalMs), pause < goalMs)
					b.ReportMetric(pause, transport+"-tree-4096-pause-ms")
					b.Logf("scale %s/4096 nodes: pause p50 %.1f ms, goal < %.0f ms: %v", key, pause, goalMs, pause < goalMs)
				}
				rows = append(rows, pr,
					row("round p50", round, "ms"),
					row("pause CPU p50", cpu, "ms"),
					row("messages per node (max)", most, "per round"))
				if f == FanoutStar {
					rows = append(rows, row("messages at the root", root, "per round"))
				}
				if transport == "tcp" && rtCPU > 0 {
					// Every simulated node's requests share this machine's
					// cores, so no pause can take less than its exchanges'
					// bare TCP cost spread over them.
					floor := avg(c.exchanges) * float64(rtCPU.Nanoseconds()) / 1e6 / float64(runtime.NumCPU())
					rows = append(rows, row("floor: bare loopback TCP exchanges / cores", floor, "ms"),
						row("pause / floor", pause/floor, "x"))
					logf("scale %s/%d nodes: %.0f exchanges a pause; bare TCP floor %.1f ms; pause / floor %.1fx; CPU a pause %.1f ms, %.1f in the kernel (p50)",
						key, n, avg(c.exchanges), floor, pause/floor, cpu, benchrec.Percentile(c.sysMs, 0.5))
				}
			}
			// The figure: how much a pause and the root's load grow
			// from the smallest job to the largest, beside how much the tree's
			// levels (log2) and the nodes (linear) do.
			lo, hi := sizes[0], sizes[len(sizes)-1]
			if a, ok := byN[lo]; ok {
				if z, ok := byN[hi]; ok {
					g := benchrec.Percentile(z.pauseMs, 0.5) / benchrec.Percentile(a.pauseMs, 0.5)
					gr := avg(z.msgRoot) / avg(a.msgRoot)
					rows = append(rows,
						benchrec.Row{Section: "scale", Case: key, Metric: fmt.Sprintf("pause %d / pause %d nodes", hi, lo), Value: g, Unit: "x"},
						benchrec.Row{Section: "scale", Case: key, Metric: fmt.Sprintf("root messages %d / %d nodes", hi, lo), Value: gr, Unit: "x"})
					b.Logf("scale %s: from %d to %d nodes, pause x%.1f, messages at the root x%.1f (tree levels x%.1f, nodes x%d)",
						key, lo, hi, g, gr, float64(Depth(hi))/float64(Depth(lo)), hi/lo)
				}
			}
		}
	}
	header := []string{"transport", "fanout", "nodes", "cycle", "pause_ms", "round_ms", "cpu_ms", "msgs_per_node_mean", "msgs_per_node_max", "root_msgs"}
	if err := benchrec.WriteCSV(dir, "scale.csv", header, raw); err != nil {
		b.Fatal(err)
	}
	if err := benchrec.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
}

// scaleCase holds one case's figures, one entry per measured cycle. The
// message counts are per node and per round: requests the node received
// plus requests it sent (attempts, so retransmissions count), which is what
// it has to handle. In the tree a node sends to its children only, at most
// Depth(n); in the star the root sends to everyone.
type scaleCase struct {
	pauseMs, roundMs, cpuMs  []float64
	sysMs                    []float64 // the part of cpuMs spent in the kernel
	msgMean, msgMax, msgRoot []float64
	exchanges                []float64 // requests answered in a pause, all nodes
}

// scaleSim is a job of n simulated nodes on one transport: an Agent over
// a nullNode per node, with counters of what each receives and sends.
type scaleSim struct {
	transport string
	names     []string
	nodes     []*nullNode
	agents    []*Agent
	tr        Transport // the coordinator's
	in, out   []atomic.Int64
	index     map[string]int // node name to index, read-only once built

	cancel    context.CancelFunc
	serving   sync.WaitGroup
	serveErr  chan error
	openConns atomic.Int64
	peakConns atomic.Int64
}

// countingTransport counts the requests one node sends (from, -1 for the
// coordinator) and its peer receives, retransmissions included. Both are
// counted here, on the sending side, so that the count costs the receiver
// no frame of its own.
type countingTransport struct {
	tr   Transport
	from int
	sim  *scaleSim
}

func (t countingTransport) Call(ctx context.Context, to string, req Message) (Message, error) {
	if t.from >= 0 {
		t.sim.out[t.from].Add(1)
	}
	if i, ok := t.sim.index[to]; ok {
		t.sim.in[i].Add(1)
	}
	return t.tr.Call(ctx, to, req)
}

func newScaleSim(transport string, n int) (*scaleSim, error) {
	s := &scaleSim{transport: transport, in: make([]atomic.Int64, n), out: make([]atomic.Int64, n), index: make(map[string]int, n)}
	switch transport {
	case "mem":
		mem := NewMemNetwork(1, Faults{})
		s.tr = countingTransport{mem, -1, s}
		s.cancel = mem.Close
		for i := range n {
			name := fmt.Sprintf("node%d", i)
			a := s.add(name, countingTransport{mem, i, s})
			mem.Register(name, a.Handle)
		}
	case "tcp":
		// Each node holds a listener, and every edge of a round a
		// connection whose two ends are both here: with the star, the
		// root's n-1 at once.
		if err := raiseNoFile(uint64(4*n + 256)); err != nil {
			return nil, err
		}
		key, err := GenerateKey()
		if err != nil {
			return nil, err
		}
		// As mpid: TLS under the cluster key on both ends, each node
		// certified with its name (here its address).
		keys := NewKeyring(key)
		client, err := NewIdentity("bench", keys)
		if err != nil {
			return nil, err
		}
		tcp := &TCPTransport{Identity: client}
		s.tr = countingTransport{tcp, -1, s}
		ctx, cancel := context.WithCancel(context.Background())
		s.cancel = cancel
		s.serveErr = make(chan error, n)
		for i := range n {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				s.close()
				return nil, fmt.Errorf("listen for node %d: %w", i, err)
			}
			id, err := NewIdentity(ln.Addr().String(), keys)
			if err != nil {
				s.close()
				return nil, err
			}
			a := s.add(ln.Addr().String(), countingTransport{tcp, i, s})
			s.serving.Go(func() {
				if err := ServeTCPWith(ctx, &countingListener{ln, &s.peakConns, &s.openConns}, a.Handle, ServerOptions{Identity: id}); err != nil {
					s.serveErr <- err
				}
			})
		}
	default:
		return nil, fmt.Errorf("unknown transport %q", transport)
	}
	return s, nil
}

func (s *scaleSim) add(name string, tr Transport) *Agent {
	nn := &nullNode{}
	a := NewAgent(nn, tr, scaleRetry)
	s.index[name] = len(s.names)
	s.names = append(s.names, name)
	s.nodes = append(s.nodes, nn)
	s.agents = append(s.agents, a)
	return a
}

// check returns what is wrong with the nodes' state: each paused, or each
// running, and no step out of order.
func (s *scaleSim) check(paused bool) error {
	for i, nn := range s.nodes {
		if b := nn.breaches.Load(); b > 0 {
			return fmt.Errorf("%s: %d steps out of order", s.names[i], b)
		}
		if nn.gated.Load() != paused || nn.frozen.Load() != paused {
			return fmt.Errorf("%s: gated %v frozen %v, want both %v", s.names[i], nn.gated.Load(), nn.frozen.Load(), paused)
		}
	}
	return nil
}

// nullNode is a simulated node: every step succeeds at once and every
// report is empty, so that what BenchmarkScale measures is the protocol.
// It keeps just enough state to check that pauses and resumes took effect
// (fakeNode's bookkeeping would cost more than the protocol's own step).
type nullNode struct {
	gated, frozen atomic.Bool
	breaches      atomic.Int64
}

func (z *nullNode) Prepare(ctx context.Context, job string) error {
	z.gated.Store(true)
	return nil
}

func (z *nullNode) Drain(ctx context.Context, job string) (NodeReport, error) {
	if !z.gated.Load() {
		z.breaches.Add(1)
	}
	return NodeReport{Empty: true}, nil
}

func (z *nullNode) Freeze(ctx context.Context, job string) error {
	if !z.gated.Load() {
		z.breaches.Add(1)
	}
	z.frozen.Store(true)
	return nil
}

func (z *nullNode) Verify(ctx context.Context, job string) (NodeReport, error) {
	if !z.frozen.Load() {
		z.breaches.Add(1)
	}
	return NodeReport{Empty: true}, nil
}

func (z *nullNode) Thaw(ctx context.Context, job string) error {
	z.frozen.Store(false)
	return nil
}

func (z *nullNode) Open(ctx context.Context, job string) error {
	if z.frozen.Load() {
		z.breaches.Add(1)
	}
	z.gated.Store(false)
	return nil
}

// close stops the listeners (or the network) and waits until no request is
// served anywhere.
func (s *scaleSim) close() error {
	s.cancel()
	s.serving.Wait()
	for _, a := range s.agents {
		a.Wait()
	}
	if s.serveErr != nil {
		close(s.serveErr)
		return <-s.serveErr // nil when no listener failed
	}
	return nil
}

// scaleOptions are mpid's options (waiting DRAIN answers) but for the
// retransmissions and deadlines, see BenchmarkScale.
func scaleOptions(f Fanout) Options {
	const phase = 2 * time.Minute
	return Options{
		Prepare: phase, Drain: phase, Freeze: phase, Verify: phase, Commit: phase, Abort: phase, Resume: phase,
		DrainWait: 20 * time.Millisecond, Retry: scaleRetry, Fanout: f,
	}
}

var scaleRetry = RetryPolicy{Initial: 30 * time.Second, Max: 30 * time.Second}

// run pauses and resumes the job cycles+1 times with fan-out f, the first
// cycle to warm up, and returns the figures of the others.
func (s *scaleSim) run(b *testing.B, f Fanout, cycles int) scaleCase {
	b.Helper()
	n := len(s.names)
	co := NewCoordinator(s.tr, scaleOptions(f))
	ctx := context.Background()
	job := "scale-" + fanoutName(f)
	ms := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }
	fmt.Fprintf(os.Stderr, "bench: scale %s/%s/%d nodes: %d pauses and resumes\n", s.transport, fanoutName(f), n, cycles+1)
	var c scaleCase
	for i := 0; i <= cycles; i++ {
		for j := range s.in {
			s.in[j].Store(0)
			s.out[j].Store(0)
		}
		cpu0, sys0 := cpuTime(), sysTime()
		res, err := co.Pause(ctx, job, s.names)
		cpu, sys := cpuTime()-cpu0, sysTime()-sys0
		if err != nil {
			b.Fatalf("%s/%s/%d nodes: pause %d: %v", s.transport, fanoutName(f), n, i, err)
		}
		rounds := 0
		var verify time.Duration
		for _, p := range res.Phases {
			rounds += p.Rounds
			if p.Phase == KindVerify {
				verify = p.Elapsed
			}
		}
		var sum, most float64
		for j := range s.in {
			m := float64(s.in[j].Load()+s.out[j].Load()) / float64(rounds)
			sum += m
			most = max(most, m)
		}
		root := float64(s.in[0].Load()+s.out[0].Load()) / float64(rounds)
		var exch int64 // read before the resume adds its own
		for j := range s.in {
			exch += s.in[j].Load()
		}
		if err := s.check(true); err != nil {
			b.Fatalf("%s/%s/%d nodes: pause %d: %v", s.transport, fanoutName(f), n, i, err)
		}
		if _, err := co.Resume(ctx, job, s.names); err != nil {
			b.Fatalf("%s/%s/%d nodes: resume %d: %v", s.transport, fanoutName(f), n, i, err)
		}
		if i == 0 {
			continue // warm-up: connections, goroutine stacks, first allocations
		}
		c.pauseMs = append(c.pauseMs, ms(res.Total))
		c.roundMs = append(c.roundMs, ms(verify))
		c.cpuMs = append(c.cpuMs, ms(cpu))
		c.sysMs = append(c.sysMs, ms(sys))
		c.msgMean = append(c.msgMean, sum/float64(n))
		c.msgMax = append(c.msgMax, most)
		c.msgRoot = append(c.msgRoot, root)
		c.exchanges = append(c.exchanges, float64(exch))
	}
	if err := s.check(false); err != nil {
		b.Fatalf("%s/%s/%d nodes: after the last resume: %v", s.transport, fanoutName(f), n, err)
	}
	return c
}

// loopbackRoundTrip returns the process CPU one request and its reply cost
// over loopback TCP with nothing of the protocol: 64-byte frames echoed on
// kept connections by as many client/server pairs as there are cores, so
// that, as in a pause, both sides' syscalls, the kernel's TCP path and the
// goroutine wake-ups are all there and nothing else is.
func loopbackRoundTrip(n int) (time.Duration, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	pairs := runtime.NumCPU() * 2
	errc := make(chan error, 2*pairs)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 64)
				for {
					if _, err := io.ReadFull(c, buf); err != nil {
						return
					}
					if _, err := c.Write(buf); err != nil {
						return
					}
				}
			}()
		}
	}()
	per := n / pairs
	var wg sync.WaitGroup
	cpu0 := cpuTime()
	for range pairs {
		wg.Go(func() {
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				errc <- err
				return
			}
			defer c.Close()
			buf := make([]byte, 64)
			for range per {
				if _, err := c.Write(buf); err != nil {
					errc <- err
					return
				}
				if _, err := io.ReadFull(c, buf); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	cpu := cpuTime() - cpu0
	close(errc)
	if err := <-errc; err != nil {
		return 0, fmt.Errorf("loopback round trips: %w", err)
	}
	return cpu / time.Duration(per*pairs), nil
}

// countingListener tracks how many accepted connections are open at once,
// to show how close a case came to the file descriptor limit.
type countingListener struct {
	net.Listener
	peak, open *atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	n := l.open.Add(1)
	for p := l.peak.Load(); n > p && !l.peak.CompareAndSwap(p, n); p = l.peak.Load() {
	}
	return &countedConn{Conn: c, open: l.open}, nil
}

type countedConn struct {
	net.Conn
	open *atomic.Int64
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.open.Add(-1) })
	return c.Conn.Close()
}

// fdShortage is why a TCP case cannot run: not enough file descriptors.
type fdShortage struct{ need, have uint64 }

func (e *fdShortage) Error() string {
	return fmt.Sprintf("needs about %d file descriptors and RLIMIT_NOFILE cannot be raised above %d (raise the hard limit: ulimit -Hn)", e.need, e.have)
}

// raiseNoFile raises RLIMIT_NOFILE to at least need, the hard limit too if
// this process may (root). Go raises the soft limit to the hard one at
// start already, so this is only ever needed for a hard limit too low.
func raiseNoFile(need uint64) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("getrlimit: %w", err)
	}
	if lim.Cur >= need {
		return nil
	}
	// Raising the soft limit up to the hard one is always allowed; above
	// it needs CAP_SYS_RESOURCE.
	want := syscall.Rlimit{Cur: need, Max: max(lim.Max, need)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err == nil {
		return nil
	}
	return &fdShortage{need: need, have: lim.Max}
}

// sysTime is the CPU time this process has spent in the kernel.
func sysTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Stime.Nano())
}

// cpuTime is the CPU time this process has used, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func fanoutName(f Fanout) string {
	if f == FanoutTree {
		return "tree"
	}
	return string(f)
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func avg(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

func ff(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }

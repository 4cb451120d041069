package kerneltests

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
	"github.com/mpipause/mpipause/quiesce"
)

// BenchmarkPause measures the pause as users get it, on running jobs
// launched with `mpipause run` on the rig, beside what a scheduler's stop
// does today, alternately in the same run and on the same job: SIGSTOP to
// every rank (time until all are stopped) and a freeze of the job's cgroups
// (time until every one reports frozen), each with the bytes it leaves in
// the job's TCP queues as the BPF observer reads them; then `mpipause
// pause` (request to COMMIT, as mpid measures it; the kernel verified the
// queues empty) and `mpipause resume`. For every library, layout (3 nodes x
// 2 ranks, 4 x 4, and 2 x 1 for the ping-pong alone) and workload (a ring of 8 MiB messages, an irregular
// all-to-all of nonblocking sends, a latency-bound ping-pong of 8 bytes).
//
// Beside each pause, its lower bound: one control round trip per tree level
// (the rig link's TCP round trip, measured here) plus the bytes in flight
// when the pause was asked for over the link's bandwidth (measured here).
// Every job runs until told to stop and must then print what an unpaused
// run of as many iterations prints.
//
// `make bench` runs it with MPIPAUSE_RIG_NODES=4; MPIPAUSE_BENCH_CYCLES
// sets the cycles per job (default 10), MPIPAUSE_BENCH_ONLY a substring of
// the cases to run ("openmpi/3x2/ring").
func BenchmarkPause(b *testing.B) {
	if jobNodes < 4 {
		b.Fatalf("the 4 x 4 jobs need a 4-node rig: run with MPIPAUSE_RIG_NODES=4 (make bench does)")
	}
	dir, err := bench.Dir()
	if err != nil {
		b.Fatal(err)
	}
	sharedRig(b)
	link := probeLink(b)
	b.Logf("rig link node0-node1: TCP round trip p50 %.3f ms, bandwidth %.0f MiB/s", link.rttMs, link.bytesPerSec/(1<<20))
	bench.Record(dir,
		bench.Row{Section: "pause", Case: "rig link", Metric: "TCP round trip p50", Value: link.rttMs, Unit: "ms"},
		bench.Row{Section: "pause", Case: "rig link", Metric: "TCP bandwidth", Value: link.bytesPerSec / (1 << 20), Unit: "MiB/s"})
	var all []pauseCase
	only := os.Getenv("MPIPAUSE_BENCH_ONLY")
	for _, lib := range mpiLibs {
		for _, l := range benchLayouts {
			for _, w := range benchWorkloads {
				c := pauseCase{lib: lib.name, layout: l, work: w}
				if !strings.Contains(c.String(), only) || w.busy && l != (layout{3, 2}) || l == uncrowded && w.name != "pingpong-8B" {
					continue
				}
				b.Run(c.String(), func(b *testing.B) {
					benchPauseCase(b, &c, link)
					all = append(all, c)
				})
			}
		}
	}
	if err := writePauseResults(dir, all); err != nil {
		b.Fatal(err)
	}
}

type layout struct{ nodes, per int }

// uncrowded gives each rank a core of this 2-core machine: its ping-pong
// is the 3 x 2 one without receivers waiting for a core, so that the two
// ratios to the freeze tell how much of a light pause is that wait.
var uncrowded = layout{2, 1}

var benchLayouts = []layout{uncrowded, {3, 2}, {4, 4}}

func (l layout) String() string { return fmt.Sprintf("%dx%d", l.nodes, l.per) }
func (l layout) ranks() int     { return l.nodes * l.per }

// launch is the library's launcher for app on this layout.
func (l layout) launch(lib string) mpiLib {
	var hosts []string
	for k := 0; k < l.nodes; k++ {
		hosts = append(hosts, fmt.Sprintf("node%d:%d", k, l.per))
	}
	n := strconv.Itoa(l.ranks())
	return mpiLib{name: lib, launch: func(app string, args ...string) []string {
		if lib == "openmpi" {
			return append([]string{"mpirun.openmpi", "-np", n, "-H", strings.Join(hosts, ","), app}, args...)
		}
		return append([]string{"mpiexec.mpich", "-n", n, "-hosts", strings.Join(hosts, ","), app}, args...)
	}}
}

type workload struct {
	name  string
	args  []string
	heavy bool   // the targets hold for heavy traffic
	more  uint64 // bytes the job must send to count as running again
	// busy: a CPU hog per core runs beside the job (3 x 2 only), so that
	// mpid competes for the CPU as on a production node; its pause p99 is
	// compared with the same workload's idle one (idle names it).
	busy bool
	idle string
}

var benchWorkloads = []workload{
	{name: "ring-8MiB", args: []string{"-m", "ring", "-f", "-s", "8M"}, heavy: true, more: 32 << 20},
	{name: "a2a-irregular", args: []string{"-m", "a2a", "-s", "1M"}, heavy: true, more: 8 << 20},
	{name: "pingpong-8B", args: []string{"-m", "pair", "-f", "-s", "8"}, more: 64 << 10},
	{name: "ring-8MiB-busy", args: []string{"-m", "ring", "-f", "-s", "8M"}, heavy: true, more: 32 << 20, busy: true, idle: "ring-8MiB"},
	{name: "pingpong-8B-busy", args: []string{"-m", "pair", "-f", "-s", "8"}, more: 64 << 10, busy: true, idle: "pingpong-8B"},
}

// pauseCase is one job's samples: times in ms, bytes in flight.
type pauseCase struct {
	lib    string
	layout layout
	work   workload

	stopMs, freezeMs, thawMs, pauseMs, resumeMs, boundMs []float64
	stopBytes, freezeBytes, beforeBytes                  []float64
	phases                                               map[string][]float64
}

// minRounds is the fewest tree rounds a pause can take: PREPARE with the
// first drain check, FREEZE with its check, COMMIT (DECIDE is one hop,
// COMMITTED goes after the answer). The lower bound is these rounds at the rig's round
// trip per tree level, the bytes in flight at its bandwidth, and the
// cgroup freeze of the same job.
const minRounds = 3

func (c *pauseCase) String() string { return c.lib + "/" + c.layout.String() + "/" + c.work.name }

func benchPauseCase(b *testing.B, c *pauseCase, link linkProbe) {
	bin := binDir(b)
	cycles := envCount("MPIPAUSE_BENCH_CYCLES", 10)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	obs := jobObserver(ctx, b, rigCgroups)
	app := filepath.Join(bin, "apps", "xchg."+c.lib)
	id := fmt.Sprintf("bench-%s-%s-%s", c.lib, c.layout, c.work.name)
	stop := b.TempDir()
	job := runJob(ctx, b, c.layout.launch(c.lib), id, app, append(slices.Clone(c.work.args), "-n", "100000000", "-E", stop)...)
	defer cli(context.Background(), b, "node0", nil, "resume", id)
	if c.work.busy {
		defer cpuHogs(b, runtime.NumCPU())()
	}
	progress := func() { waitProgress(ctx, b, obs, job.done, sentBytes(ctx, obs), c.work.more) }
	progress()

	var cgs []string
	var pids []int
	for _, cg := range nodeJobCgroups(b, id) {
		p, err := cgroupv2.Procs(cg)
		if errors.Is(err, fs.ErrNotExist) {
			continue // a node the layout does not use
		}
		if err != nil {
			b.Fatal(err)
		}
		cgs = append(cgs, cg)
		pids = append(pids, p...)
	}
	if len(pids) != c.layout.ranks() {
		b.Fatalf("%d ranks in the job's cgroups, want %d", len(pids), c.layout.ranks())
	}
	inflight := func() float64 {
		cs, err := obs.Snapshot(ctx)
		if err != nil {
			b.Fatal(err)
		}
		var n uint64
		for _, c := range cs {
			n += uint64(c.SendQueue) + uint64(c.Unread)
		}
		return float64(n)
	}
	signalAll := func(sig syscall.Signal) {
		for _, p := range pids {
			syscall.Kill(p, sig)
		}
	}
	stopped := func() bool {
		for _, p := range pids {
			if procState(p) != "T" {
				return false
			}
		}
		return true
	}
	freezeAll := func(v string) {
		for _, cg := range cgs {
			if err := os.WriteFile(filepath.Join(cg, "cgroup.freeze"), []byte(v), 0); err != nil {
				b.Fatal(err)
			}
		}
	}
	frozen := func() bool {
		for _, cg := range cgs {
			if ok, err := cgroupv2.Frozen(cg); err != nil || !ok {
				return false
			}
		}
		return true
	}
	anyFrozen := func(cgs []string) bool {
		for _, cg := range cgs {
			if ok, err := cgroupv2.Frozen(cg); err != nil || ok {
				return true
			}
		}
		return false
	}
	// until polls cond every 100 us: the times measured here are
	// milliseconds, and waitFor's 20 ms step would dominate them.
	until := func(what string, cond func() bool) {
		deadline := time.Now().Add(time.Minute)
		for !cond() {
			if time.Now().After(deadline) {
				b.Fatalf("gave up waiting for %s", what)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	depth := quiesce.Depth(c.layout.nodes)
	c.phases = map[string][]float64{}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ResetTimer()
	for i := 0; i < cycles; i++ {
		fmt.Fprintf(os.Stderr, "bench: %s: cycle %d/%d\n", c, i+1, cycles)
		// Naive: SIGSTOP every rank at an arbitrary moment.
		t0 := time.Now()
		signalAll(syscall.SIGSTOP)
		until("every rank stopped", stopped)
		c.stopMs = append(c.stopMs, ms(time.Since(t0)))
		c.stopBytes = append(c.stopBytes, inflight())
		signalAll(syscall.SIGCONT)
		progress()

		// Naive too: freeze the job's cgroups, as a scheduler's suspend does.
		t0 = time.Now()
		freezeAll("1")
		until("every cgroup frozen", frozen)
		c.freezeMs = append(c.freezeMs, ms(time.Since(t0)))
		c.freezeBytes = append(c.freezeBytes, inflight())
		t0 = time.Now()
		freezeAll("0")
		until("every cgroup thawed", func() bool { return !anyFrozen(cgs) })
		c.thawMs = append(c.thawMs, ms(time.Since(t0)))
		progress()

		before := inflight()
		j, r := jobJSON(ctx, b, "pause", id)
		if r.code != 0 || j.State != ctl.StatePaused {
			b.Fatalf("pause %d: exit %d: %s%s", i+1, r.code, r.stderr, r.stdout)
		}
		if n := inflight(); n != 0 {
			b.Fatalf("pause %d committed with %.0f bytes in the job's queues", i+1, n)
		}
		c.pauseMs = append(c.pauseMs, j.TotalMs)
		c.beforeBytes = append(c.beforeBytes, before)
		c.boundMs = append(c.boundMs, minRounds*float64(depth)*link.rttMs+before/link.bytesPerSec*1000+c.freezeMs[i])
		for _, p := range j.Phases {
			c.phases[p.Name] = append(c.phases[p.Name], p.Ms)
		}
		j, r = jobJSON(ctx, b, "resume", id)
		if r.code != 0 || j.State != ctl.StateRunning {
			b.Fatalf("resume %d: exit %d: %s", i+1, r.code, r.stderr)
		}
		c.resumeMs = append(c.resumeMs, j.TotalMs)
		progress()
	}
	b.StopTimer()

	job.stopAndCheck(ctx, b, "job "+id, stop, app, c.layout.ranks(), c.work.args...)
	b.ReportMetric(bench.Percentile(c.pauseMs, 0.5), "pause-p50-ms")
	b.ReportMetric(bench.Percentile(c.resumeMs, 0.5), "resume-p50-ms")
	b.ReportMetric(bench.Percentile(c.stopMs, 0.5), "sigstop-p50-ms")
	b.ReportMetric(mean(c.stopBytes)/(1<<20), "sigstop-inflight-MiB")
}

// cpuHogs starts n processes that spin at nice 0, outside the job, and
// returns what stops them. A benchmark killed before it can stop them
// takes them along (Pdeathsig): left spinning, they would make every later
// run on the machine a busy one.
func cpuHogs(b *testing.B, n int) func() {
	var hogs []*exec.Cmd
	for range n {
		h := exec.Command("sh", "-c", "while :; do :; done")
		h.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := h.Start(); err != nil {
			b.Fatal(err)
		}
		hogs = append(hogs, h)
	}
	return func() {
		for _, h := range hogs {
			h.Process.Kill()
			h.Wait()
		}
	}
}

func mean(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// pausePhases are the phases of a pause, in order.
var pausePhases = []string{"PREPARE", "DRAIN", "FREEZE", "VERIFY", "COMMIT"}

// writePauseResults writes the raw samples, the summary rows and the CDF
// plots of every case.
func writePauseResults(dir string, cases []pauseCase) error {
	var raw, ph [][]string
	var rows []bench.Row
	idleP99 := map[string]float64{}
	for _, c := range cases {
		if !c.work.busy {
			idleP99[c.lib+"/"+c.layout.String()+"/"+c.work.name] = bench.Percentile(c.pauseMs, 0.99)
		}
	}
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }
	for _, c := range cases {
		key := []string{c.lib, c.layout.String(), c.work.name}
		for i := range c.pauseMs {
			cy := strconv.Itoa(i + 1)
			raw = append(raw,
				append(slices.Clone(key), cy, "sigstop", f(c.stopMs[i]), f(c.stopBytes[i]), ""),
				append(slices.Clone(key), cy, "cgroup-freeze", f(c.freezeMs[i]), f(c.freezeBytes[i]), ""),
				append(slices.Clone(key), cy, "cgroup-thaw", f(c.thawMs[i]), "", ""),
				append(slices.Clone(key), cy, "mpipause", f(c.pauseMs[i]), "0", f(c.boundMs[i])),
				append(slices.Clone(key), cy, "resume", f(c.resumeMs[i]), "", ""))
			for _, p := range pausePhases {
				if i < len(c.phases[p]) {
					ph = append(ph, append(slices.Clone(key), cy, p, f(c.phases[p][i])))
				}
			}
		}
		name := c.String()
		row := func(metric string, v float64, unit string) bench.Row {
			return bench.Row{Section: "pause", Case: name, Metric: metric, Value: v, Unit: unit}
		}
		p50, p99 := bench.Percentile(c.pauseMs, 0.5), bench.Percentile(c.pauseMs, 0.99)
		lb := bench.Percentile(c.boundMs, 0.5)
		ratios := make([]float64, len(c.pauseMs))
		for i := range c.pauseMs {
			ratios[i] = c.pauseMs[i] / c.boundMs[i]
		}
		pr := row("pause p50", p50, "ms")
		pr99 := row("pause p99", p99, "ms")
		if c.work.heavy {
			pr, pr99 = pr.Goal("<= 20 ms", p50 <= 20), pr99.Goal("<= 100 ms", p99 <= 100)
		}
		rp50 := bench.Percentile(c.resumeMs, 0.5)
		rr := bench.Percentile(ratios, 0.5)
		// The targets, each a ratio of figures of this run: against the
		// lower bound where bytes are in flight; against the cgroup freeze
		// of the same job where none are; the resume against the thaw.
		fp50, tp50 := bench.Percentile(c.freezeMs, 0.5), bench.Percentile(c.thawMs, 0.5)
		target := row("pause / lower bound p50", rr, "x")
		if c.work.heavy {
			target = target.Goal("<= 2", rr <= 2)
		} else {
			target = row("pause / cgroup freeze p50", p50/fp50, "x").Goal("<= 2", p50/fp50 <= 2)
		}
		thaw := row("resume / thaw p50", rp50/tp50, "x").Goal("<= 1.2", rp50/tp50 <= 1.2)
		total := 0.0
		for _, p := range pausePhases {
			total += mean(c.phases[p])
		}
		var shares []string
		slowest, slowestShare := "", 0.0
		for _, p := range pausePhases {
			s := mean(c.phases[p]) / total * 100
			shares = append(shares, fmt.Sprintf("%s %.0f%%", p, s))
			if s > slowestShare {
				slowest, slowestShare = p, s
			}
		}
		rows = append(rows,
			pr, pr99,
			row("pause max", bench.Max(c.pauseMs), "ms"),
			row("resume p50", rp50, "ms").Goal("<= 5 ms", rp50 <= 5),
			row("resume p99", bench.Percentile(c.resumeMs, 0.99), "ms"),
			row("lower bound p50", lb, "ms"),
			target, thaw,
			row("share of "+slowest+" (slowest phase)", slowestShare, "%"),
			row("in flight when asked, mean", mean(c.beforeBytes)/(1<<20), "MiB"),
			row("SIGSTOP stop p50", bench.Percentile(c.stopMs, 0.5), "ms"),
			row("SIGSTOP in flight, mean", mean(c.stopBytes)/(1<<20), "MiB"),
			row("cgroup freeze stop p50", bench.Percentile(c.freezeMs, 0.5), "ms"),
			row("cgroup freeze in flight, mean", mean(c.freezeBytes)/(1<<20), "MiB"),
			row("cgroup thaw p50", tp50, "ms"),
		)
		if idle, ok := idleP99[c.lib+"/"+c.layout.String()+"/"+c.work.idle]; c.work.busy && ok {
			rows = append(rows, row("pause p99 busy / idle ("+c.work.idle+")", p99/idle, "x").Goal("<= 3", p99/idle <= 3))
		}
		fmt.Fprintf(os.Stderr, "pause %s: phases (mean share): %s\n", name, strings.Join(shares, ", "))
	}
	if err := bench.WriteCSV(dir, "pause.csv", []string{"library", "layout", "workload", "cycle", "method", "ms", "inflight_bytes", "lower_bound_ms"}, raw); err != nil {
		return err
	}
	if err := bench.WriteCSV(dir, "pause-phases.csv", []string{"library", "layout", "workload", "cycle", "phase", "ms"}, ph); err != nil {
		return err
	}
	if err := bench.Record(dir, rows...); err != nil {
		return err
	}
	// One CDF per layout and workload: both libraries, every method.
	for _, l := range benchLayouts {
		for _, w := range benchWorkloads {
			var series []bench.Series
			for _, c := range cases {
				if c.layout != l || c.work.name != w.name {
					continue
				}
				series = append(series,
					bench.CDF(c.lib+" mpipause pause", c.pauseMs),
					bench.CDF(c.lib+" mpipause resume", c.resumeMs),
					bench.CDF(c.lib+" SIGSTOP", c.stopMs),
					bench.CDF(c.lib+" cgroup freeze", c.freezeMs))
			}
			if len(series) == 0 {
				continue
			}
			p := bench.Plot{
				Title:  fmt.Sprintf("Stop latency, %s job, %s", l, w.name),
				XLabel: "ms (log)", YLabel: "fraction of stops", LogX: true, Step: true, Series: series,
			}
			if err := bench.WritePlot(dir, fmt.Sprintf("pause-cdf-%s-%s.svg", l, w.name), p); err != nil {
				return err
			}
		}
	}
	return nil
}

// linkProbe is the rig link between node0 and node1 as TCP sees it.
type linkProbe struct {
	rttMs       float64 // p50 of 1-byte echoes
	bytesPerSec float64 // one stream of 256 MiB
}

// probeLink measures the round trip and bandwidth of the rig's link with a
// listener in node1 and a client in node0, the way the job's own bytes and
// mpid's control frames cross it.
func probeLink(b *testing.B) linkProbe {
	b.Helper()
	var ln net.Listener
	inNode(b, 1, func() (err error) { ln, err = net.Listen("tcp", "10.77.0.2:0"); return })
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 1<<20)
				var mode [1]byte
				if _, err := c.Read(mode[:]); err != nil {
					return
				}
				for {
					n, err := c.Read(buf)
					if err != nil {
						if mode[0] == 's' {
							c.Write(mode[:]) // all read: the sender's clock stops
						}
						return
					}
					if mode[0] == 'e' {
						c.Write(buf[:n])
					}
				}
			}()
		}
	}()
	dial := func() net.Conn {
		var c net.Conn
		inNode(b, 0, func() (err error) { c, err = net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second); return })
		return c
	}
	var p linkProbe
	echo := dial()
	defer echo.Close()
	echo.(*net.TCPConn).SetNoDelay(true)
	echo.Write([]byte{'e'})
	var rtts []float64
	one := []byte{1}
	for i := 0; i < 1000; i++ {
		t0 := time.Now()
		if _, err := echo.Write(one); err != nil {
			b.Fatal(err)
		}
		if _, err := echo.Read(one); err != nil {
			b.Fatal(err)
		}
		rtts = append(rtts, float64(time.Since(t0).Nanoseconds())/1e6)
	}
	p.rttMs = bench.Percentile(rtts, 0.5)
	sink := dial()
	sink.Write([]byte{'s'})
	buf := make([]byte, 1<<20)
	const total = 256 << 20
	t0 := time.Now()
	for n := 0; n < total; n += len(buf) {
		if _, err := sink.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	sink.(*net.TCPConn).CloseWrite()
	if _, err := sink.Read(one); err != nil {
		b.Fatalf("bandwidth probe: no answer after the stream: %v", err)
	}
	el := time.Since(t0)
	sink.Close()
	p.bytesPerSec = total / el.Seconds()
	if p.rttMs <= 0 || math.IsNaN(p.rttMs) || p.bytesPerSec <= 0 {
		b.Fatalf("link probe measured nothing: %+v", p)
	}
	return p
}

// inNode runs f on a thread in rig node k's network namespace: a socket
// keeps the namespace it was made in.
func inNode(b *testing.B, k int, f func() error) {
	b.Helper()
	if err := nodeNetns(b, k).Do(f); err != nil {
		b.Fatal(err)
	}
}

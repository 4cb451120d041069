package kerneltests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// BenchmarkOverhead measures what mpipause costs a job that is never
// paused, two ways.
//
// pingpong: MPI ping-pong latency (8 bytes) and streaming bandwidth
// between two ranks on two rig nodes, launched plainly and launched with
// `mpipause run` (the shim preloaded in both ranks, registered with the
// nodes' mpids, the job's cgroup watched by the BPF programs: sockops, the
// send/receive byte counters on every sendmsg and recvmsg). Runs come in
// pairs, one plain and one with mpipause, in alternating order; the
// figures are the medians of the per-pair ratios, with their 95%
// order-statistic intervals (bench.MedianInterval), and a target counts
// as met or MISSED only when the whole interval is on one side of it:
// the rig's run-to-run spread is +-15-20%, so a median alone would judge a
// 2% target by coin toss.
//
// calls: the deterministic side. callcost (kernel-tests/apps) measures
// the CPU time of one 8-byte send+recv pair over loopback TCP, of one
// EAGAIN recv poll, of one epoll_wait(.., 0) on an idle set and of one
// poll(.., 10) that returns at once, in four modes, in alternating order
// within each round, on node0: plain;
// the shim preloaded (unregistered: no mpid answers it, so its gate stays
// open, which is the registered rank's steady state too); the process in
// a job cgroup watched by the job's BPF programs, without the shim; and
// both, a rank of an `mpipause run` job registered with node0's mpid. The
// per-call ns each adds (paired differences with intervals), over the
// ping-pong's one-way latency, bounds the latency overhead from above
// independently of the end-to-end noise: a one-way MPICH message costs
// the sender one send and the receiver one recv, and its arrival is
// noticed at most one turn of UCX's epoll_wait(.., 0) loop later (UCX
// does not poll with EAGAIN recvs; the tracepoints do not see
// epoll_wait, the shim wraps it); only part of the pair's added time is
// on the message's path (the send tracepoint fires after the bytes are
// on their way), hence an upper bound. The bound is
// for one set of BPF programs, as on a cluster (one mpid per kernel); the
// rig's two nodes share one kernel, so there every call of a two-node
// job runs both nodes' sets.
//
// Every run starts with no job's BPF programs loaded on the machine
// (quietBPF; in calls, only when it runs a mode with a job), and callcost
// runs pinned to one CPU.
//
// MPIPAUSE_BENCH_RUNS sets the ping-pong pairs per library (default 12),
// MPIPAUSE_BENCH_CALL_RUNS the callcost rounds (default 24).
// MPIPAUSE_BENCH_BASE_SHIM names another build of libmpipause.so (an
// absolute path; `make bench-base BASE=<rev>` builds one from a git
// revision): calls then also runs callcost with that shim preloaded,
// unregistered, in each round beside the other modes, and prints plain,
// that shim and this build's per call, and this build's over it, paired by
// round. Two builds are compared within one run because on this machine
// the per-call figures move between runs by more than a wrapper costs (a
// neighbour's load). MPIPAUSE_BENCH_CALL_MODES names the modes calls runs
// (comma-separated: plain, shim, bpf, shim+bpf, base; default all, plain
// always among them): "plain,shim,base" compares two shims in a few
// seconds a round, where a mode with a job costs up to 10 s of mpid's
// cleanup after it.
func BenchmarkOverhead(b *testing.B) {
	dir, err := bench.Dir()
	if err != nil {
		b.Fatal(err)
	}
	bin := binDir(b)
	sharedRig(b)
	lat := map[string]float64{} // plain one-way latency (us) per library
	bw := map[string]float64{}  // plain bandwidth (MiB/s)
	b.Run("pingpong", func(b *testing.B) { overheadPingpong(b, dir, bin, lat, bw) })
	b.Run("calls", func(b *testing.B) { overheadCalls(b, dir, bin, lat["mpich"], bw["mpich"]) })
}

// overheadLevel is the coverage of every interval the benchmark judges by.
const overheadLevel = 0.95

func overheadPingpong(b *testing.B, dir, bin string, latOut, bwOut map[string]float64) {
	runs := envCount("MPIPAUSE_BENCH_RUNS", 12)
	app := func(lib string) string { return filepath.Join(bin, "apps", "pingpong."+lib) }
	// Open MPI's TCP BTL answers an 8-byte ping-pong in ~4 ms on the rig
	// (MPICH in ~7 us): fewer round trips, so
	// each run takes a few seconds for either library.
	args := map[string][]string{
		"openmpi": {"-l", "300", "-b", "256"},
		"mpich":   {"-l", "20000", "-b", "1024"},
	}
	var raw [][]string
	var rows []bench.Row
	for _, lib := range []string{"openmpi", "mpich"} {
		launch := layout{nodes: 2, per: 1}.launch(lib)
		var lat, bw [2][]float64 // [0] plain, [1] with mpipause; index = pair
		for i := 0; i < runs; i++ {
			// Alternate which mode goes first, so that a drift within a
			// pair (a neighbour's load starting) falls on both sides.
			for k := 0; k < 2; k++ {
				mode := k
				if i%2 == 1 {
					mode = 1 - k
				}
				fmt.Fprintf(os.Stderr, "bench: overhead %s pair %d/%d %s\n", lib, i+1, runs, modeName(mode))
				quietBPF(b)
				l, w := pingpong(b, bin, lib, mode == 1, launch.launch(app(lib), args[lib]...))
				lat[mode], bw[mode] = append(lat[mode], l), append(bw[mode], w)
				raw = append(raw, []string{lib, modeName(mode), strconv.Itoa(i + 1), fmt.Sprint(l), fmt.Sprint(w)})
			}
		}
		lr := bench.MedianInterval(bench.Ratios(lat[1], lat[0]), overheadLevel)
		br := bench.MedianInterval(bench.Ratios(bw[1], bw[0]), overheadLevel)
		latOut[lib], bwOut[lib] = median(lat[0]), median(bw[0])
		c := lib + ", 2 nodes x 1 rank"
		row := func(metric string, v float64, unit string) bench.Row {
			return bench.Row{Section: "overhead", Case: c, Metric: metric, Value: v, Unit: unit}
		}
		rows = append(rows,
			row("latency p50, plain", median(lat[0]), "us"),
			row("latency p50, with mpipause", median(lat[1]), "us"),
			row("latency with / plain, "+ivText(lr), lr.Median, "x").Judged("< 1.02", lr.Below(1.02)),
			row("bandwidth p50, plain", median(bw[0]), "MiB/s"),
			row("bandwidth p50, with mpipause", median(bw[1]), "MiB/s"),
			row("bandwidth with / plain, "+ivText(br), br.Median, "x").Judged("> 0.99", br.Above(0.99)))
		b.ReportMetric(lr.Median, lib+"-latency-ratio")
		b.ReportMetric(br.Median, lib+"-bandwidth-ratio")
		fmt.Fprintf(os.Stderr, "overhead %s: latency %.3g -> %.3g us, paired ratio %v: %s; bandwidth %.4g -> %.4g MiB/s, paired ratio %v: %s\n",
			lib, median(lat[0]), median(lat[1]), lr, verdict(lr.Below(1.02)), median(bw[0]), median(bw[1]), br, verdict(br.Above(0.99)))
	}
	if err := bench.WriteCSV(dir, "overhead.csv", []string{"library", "mode", "pair", "latency_us", "bandwidth_mibs"}, raw); err != nil {
		b.Fatal(err)
	}
	if err := bench.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
}

// quietBPF waits until no job's BPF programs are loaded on the machine,
// so that each run measures only its own job's. Every job's observer
// attaches a set (sockops on the job's cgroup, a tracepoint on TCP state
// changes of the whole machine), and an mpid ends a finished job
// (detaching them) only at its next sweep, up to 10 s later: without the
// wait, a plain run that follows a run with mpipause could pay for one to
// several sets, in a number that varies run to run.
func quietBPF(b *testing.B) {
	b.Helper()
	deadline := time.Now().Add(time.Minute)
	for waited := false; ; waited = true {
		n, err := programSets()
		if err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			if waited {
				time.Sleep(300 * time.Millisecond) // the rest of mpid's cleanup
			}
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d sets of mpipause's BPF programs still loaded after a minute: another job runs on this machine, and would weigh on every run", n)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// programSets counts the mpipause_state programs loaded (one per job
// observer's set).
func programSets() (int, error) {
	n := 0
	for id := ebpf.ProgramID(0); ; {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			return n, nil
		}
		if err != nil {
			return 0, fmt.Errorf("list BPF programs: %w", err)
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if errors.Is(err, os.ErrNotExist) {
			continue // unloaded meanwhile
		}
		if err != nil {
			return 0, fmt.Errorf("BPF program %d: %w", id, err)
		}
		info, err := p.Info()
		p.Close()
		if err == nil && info.Name == "mpipause_state" {
			n++
		}
	}
}

// ivText is an interval as the table's metric column shows it.
func ivText(iv bench.Interval) string {
	return fmt.Sprintf("paired, %g%% CI [%.4g, %.4g], n=%d", iv.Level*100, iv.Lo, iv.Hi, iv.N)
}

func verdict(met *bool) string {
	switch {
	case met == nil:
		return "not resolved"
	case *met:
		return "met"
	}
	return "MISSED"
}

func modeName(mode int) string {
	if mode == 1 {
		return "mpipause"
	}
	return "plain"
}

func median(v []float64) float64 { return bench.Percentile(v, 0.5) }

var pingpongRE = regexp.MustCompile(`(?m)^pingpong latency_us=([0-9.]+) bandwidth_mibs=([0-9.]+)$`)

// pingpong runs one ping-pong job from node0, plainly or under `mpipause
// run`, and returns its one-way latency (us) and bandwidth (MiB/s). Under
// mpipause it also checks that both ranks did register: a run that quietly
// lost the shim would measure nothing.
func pingpong(b *testing.B, bin, lib string, shim bool, launch []string) (float64, float64) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	argv := launch
	id := ""
	if shim {
		id = fmt.Sprintf("overhead-%s-%d", lib, time.Now().UnixNano())
		argv = append([]string{"mpipause", "run", "--jobid", id, "--"}, launch...)
	}
	r := runInNode(ctx, b, "node0", nil, argv...)
	if r.code != 0 {
		b.Fatalf("%s: exit %d\n%s%s", strings.Join(argv, " "), r.code, r.stdout, r.stderr)
	}
	m := pingpongRE.FindStringSubmatch(r.stdout)
	if m == nil {
		b.Fatalf("%s printed no result:\n%s%s", strings.Join(argv, " "), r.stdout, r.stderr)
	}
	if shim && (!strings.HasPrefix(r.stdout, "job "+id+"\n") || strings.Contains(r.stderr, "mpipause:")) {
		b.Fatalf("the shim did not run quietly under mpipause run:\n%s%s", r.stdout, r.stderr)
	}
	lat, _ := strconv.ParseFloat(m[1], 64)
	bw, _ := strconv.ParseFloat(m[2], 64)
	return lat, bw
}

// callMode is one way of running callcost.
type callMode struct {
	name string
	shim bool   // libmpipause.so loaded in the measuring process
	job  bool   // the process in a job cgroup its mpid watches
	so   string // the shim to preload, if not this build's
}

var callModes = []callMode{
	{name: "plain"},
	{name: "shim", shim: true},
	{name: "bpf", job: true},
	{name: "shim+bpf", shim: true, job: true},
}

// nominalMPICHLatency is MPICH's one-way 8-byte latency on the rig (us,
// measured by the ping-pong part on a quiet machine), used when the calls
// part runs without the ping-pong part before it.
const nominalMPICHLatency = 6.7

// callBytes is what one send+recv pair is assumed to move in a bandwidth
// run, for the bandwidth bound: a floor, with room. strace of MPICH
// streaming 256 MiB between two ranks over TCP counted ~1400 send calls
// (sendto, sendmsg) on the sender and ~1800 recvfrom on the receiver:
// over 140 KiB a call.
const callBytes = 64 << 10

// baseMode is the index of the base shim's mode in overheadCalls' modes,
// when MPIPAUSE_BENCH_BASE_SHIM names one.
const baseMode = 4

// callOrder is the order of the selected modes (indices) in round i
// (0-based): the modes without a job, then the ones with one, each group
// taking each of its orders in turn, so that every mode is as often first
// (after the previous round's job modes and their cleanup) as last. With
// every mode of callModes that is the alternation plain, shim, bpf,
// shim+bpf / shim, plain, shim+bpf, bpf.
func callOrder(i int, modes []callMode, sel []int) []int {
	var nojob, job []int
	for _, m := range sel {
		if modes[m].job {
			job = append(job, m)
		} else {
			nojob = append(nojob, m)
		}
	}
	pn, pj := permutations(nojob), permutations(job)
	return append(slices.Clone(pn[i%len(pn)]), pj[i%len(pj)]...)
}

// permutations lists every order of v, the identity first (lexicographic
// by position): 1 for 0 or 1 element, 2 for 2, 6 for 3.
func permutations(v []int) [][]int {
	if len(v) <= 1 {
		return [][]int{slices.Clone(v)}
	}
	var out [][]int
	for k := range v {
		rest := append(slices.Clone(v[:k]), v[k+1:]...)
		for _, p := range permutations(rest) {
			out = append(out, append([]int{v[k]}, p...))
		}
	}
	return out
}

// baseShim is MPIPAUSE_BENCH_BASE_SHIM, checked: "" when unset.
func baseShim(b *testing.B) string {
	so := os.Getenv("MPIPAUSE_BENCH_BASE_SHIM")
	if so == "" {
		return ""
	}
	// The path goes into LD_PRELOAD of a process in a rig node, whose
	// working directory is not the test's.
	if !filepath.IsAbs(so) {
		b.Fatalf("MPIPAUSE_BENCH_BASE_SHIM=%q: want an absolute path", so)
	}
	if _, err := os.Stat(so); err != nil {
		b.Fatalf("MPIPAUSE_BENCH_BASE_SHIM: %v", err)
	}
	return so
}

// selectModes is the indices into modes of the modes to run: every one, or
// those MPIPAUSE_BENCH_CALL_MODES names (comma-separated). plain is
// always one of them (every figure is against it), and a base shim needs
// this build's shim beside it.
func selectModes(b *testing.B, modes []callMode) []int {
	v := os.Getenv("MPIPAUSE_BENCH_CALL_MODES")
	if v == "" {
		sel := make([]int, len(modes))
		for m := range sel {
			sel[m] = m
		}
		return sel
	}
	var sel []int
	for _, name := range strings.Split(v, ",") {
		m := slices.IndexFunc(modes, func(c callMode) bool { return c.name == strings.TrimSpace(name) })
		if m < 0 {
			var names []string
			for _, c := range modes {
				names = append(names, c.name)
			}
			b.Fatalf("MPIPAUSE_BENCH_CALL_MODES=%q: no mode %q here (modes: %s; base needs MPIPAUSE_BENCH_BASE_SHIM)", v, name, strings.Join(names, ", "))
		}
		if !slices.Contains(sel, m) {
			sel = append(sel, m)
		}
	}
	slices.Sort(sel)
	if sel[0] != 0 {
		b.Fatalf("MPIPAUSE_BENCH_CALL_MODES=%q: plain must be one of them", v)
	}
	if len(modes) > baseMode && (!slices.Contains(sel, baseMode) || !slices.Contains(sel, 1)) {
		b.Fatalf("MPIPAUSE_BENCH_CALL_MODES=%q: with MPIPAUSE_BENCH_BASE_SHIM, shim and base must be among them", v)
	}
	return sel
}

func overheadCalls(b *testing.B, dir, bin string, lat, bw float64) {
	rounds := envCount("MPIPAUSE_BENCH_CALL_RUNS", 24)
	latCase := "measured"
	if lat == 0 {
		lat, latCase = nominalMPICHLatency, "nominal"
	}
	modes := slices.Clone(callModes)
	base := baseShim(b)
	if base != "" {
		// Unregistered only: the base build's rank channel need not
		// speak this mpid's, and with the gate open an unregistered
		// shim's send path is a registered one's.
		modes = append(modes, callMode{name: "base", shim: true, so: base})
	}
	sel := selectModes(b, modes)
	// Every run waits for the machine to have no job's BPF programs when
	// any mode of the run has a job: then each job measures its own set,
	// and the other modes none. Without a job mode there is nothing of
	// ours to wait for, and other checkouts' jobs on a shared machine
	// would only hold the run back: their programs run on TCP state
	// changes, which callcost makes before its timed loops, not in them.
	quiet := slices.ContainsFunc(sel, func(m int) bool { return modes[m].job })
	ns := make([][nCallFigs][]float64, len(modes)) // per mode, figure, round
	var raw [][]string
	// A job mode gets a job of its own: mpid refuses an id while the job
	// that had it is still known (an ended job's programs go up to 10 s
	// later).
	for i := 0; i < rounds; i++ {
		for _, m := range callOrder(i, modes, sel) {
			id := fmt.Sprintf("overhead-calls-%d-%d-%s", os.Getpid(), i+1, strings.ReplaceAll(modes[m].name, "+", "-"))
			fmt.Fprintf(os.Stderr, "bench: overhead calls round %d/%d %s\n", i+1, rounds, modes[m].name)
			if quiet {
				quietBPF(b)
			}
			f := callcost(b, bin, modes[m], id)
			rec := []string{modes[m].name, strconv.Itoa(i + 1)}
			for j := range f {
				ns[m][j] = append(ns[m][j], f[j])
				rec = append(rec, fmt.Sprint(f[j]))
			}
			raw = append(raw, rec)
		}
	}
	if err := bench.WriteCSV(dir, "overhead-calls.csv", []string{"mode", "round", "pair_ns", "poll_ns", "epoll_ns", "wait_ns"}, raw); err != nil {
		b.Fatal(err)
	}
	const c = "calls, node0, CPU ns per call"
	row := func(metric string, v float64, unit string) bench.Row {
		return bench.Row{Section: "overhead", Case: c, Metric: metric, Value: v, Unit: unit}
	}
	var rows []bench.Row
	for j, fig := range callFigs {
		rows = append(rows, row(fig+", plain", median(ns[0][j]), "ns"))
	}
	var add [4][nCallFigs]bench.Interval
	for m := 1; m < len(callModes); m++ {
		if !slices.Contains(sel, m) {
			continue
		}
		name := callModes[m].name
		var say []string
		for j, fig := range callFigs {
			add[m][j] = bench.MedianInterval(bench.Diffs(ns[m][j], ns[0][j]), overheadLevel)
			rows = append(rows, row(fig+", added by "+name+", "+ivText(add[m][j]), add[m][j].Median, "ns"))
			ratio := bench.MedianInterval(bench.Ratios(ns[m][j], ns[0][j]), overheadLevel)
			say = append(say, fmt.Sprintf("%v ns per %s (plain %.4g; %s / plain %v)", add[m][j], fig, median(ns[0][j]), name, ratio))
		}
		fmt.Fprintf(os.Stderr, "overhead calls: %s adds %s\n", name, strings.Join(say, ", "))
	}
	if all := len(callModes) - 1; slices.Contains(sel, all) {
		rows = append(rows, callBounds(b, add[all], rounds, lat, latCase, bw)...)
	}
	if base != "" {
		rows = append(rows, compareShims(b, base, rounds, ns[0], ns[1], ns[baseMode])...)
	}
	if err := bench.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
}

// callBounds is the bound, for the real state (shim+bpf, whose added
// costs add holds): what a one-way message pays on its critical path,
// over the plain one-way latency. MPICH (UCX's TCP transport) makes one
// send and one recv per message and rank and waits in epoll_wait(.., 0),
// which the tracepoints do not see and the shim wraps (strace of a
// ping-pong: per round trip and rank, 1 sendto, 1 recvfrom, ~4
// epoll_wait, no EAGAIN recv): one pair, and one turn of the wait loop,
// by which the message's arrival may be noticed later.
func callBounds(b *testing.B, add [nCallFigs]bench.Interval, rounds int, lat float64, latCase string, bw float64) []bench.Row {
	var rows []bench.Row
	pairAdd := add[figPair]
	msg := bench.Interval{ // one pair and one turn of the epoll_wait loop
		Median: pairAdd.Median + add[figEpoll].Median,
		Lo:     pairAdd.Lo + add[figEpoll].Lo,
		Hi:     pairAdd.Hi + add[figEpoll].Hi,
		N:      rounds, Level: overheadLevel,
	}
	frac := scaleInterval(msg, 1/(lat*1000))
	met := upperBound(frac.Below(0.02))
	rows = append(rows, bench.Row{Section: "overhead", Case: fmt.Sprintf("mpich, calls bound (%s latency %.3g us)", latCase, lat),
		Metric: "upper bound: latency added per one-way message (a send+recv pair, an epoll_wait) / latency, " + ivText(frac), Value: frac.Median, Unit: "x"}.
		Judged("< 0.02", met))
	fmt.Fprintf(os.Stderr, "overhead calls: a one-way message pays at most %v ns more (a send+recv pair, an epoll_wait), %v of the %s %.3g us latency: %s\n",
		msg, frac, latCase, lat, verdict(met))
	if bw > 0 {
		// One pair per callBytes moved: pairs per second at the plain
		// bandwidth times the ns each adds.
		perSec := bw * (1 << 20) / callBytes
		bwFrac := scaleInterval(pairAdd, perSec/1e9)
		bwMet := upperBound(bwFrac.Below(0.01))
		rows = append(rows, bench.Row{Section: "overhead", Case: fmt.Sprintf("mpich, calls bound (%.4g MiB/s, 64 KiB per send+recv)", bw),
			Metric: "upper bound: bandwidth lost / bandwidth, " + ivText(bwFrac), Value: bwFrac.Median, Unit: "x"}.
			Judged("< 0.01", bwMet))
		fmt.Fprintf(os.Stderr, "overhead calls: at %.4g MiB/s in 64 KiB calls that is at most %v of the bandwidth: %s\n",
			bw, bwFrac, verdict(bwMet))
	}
	b.ReportMetric(pairAdd.Median, "pair-added-ns")
	b.ReportMetric(add[figEpoll].Median, "epoll-added-ns")
	return rows
}

// compareShims prints and returns the base shim's figures beside this
// build's: plain, base and shim per call (min / median over the rounds),
// and shim over base, paired by round, with its interval. The pairs are
// the two shims' runs of one round, not each against the round's plain
// run as the "added by" figures are, so plain's own spread stays out of
// the comparison of the two builds.
func compareShims(b *testing.B, base string, rounds int, plain, shim, old [nCallFigs][]float64) []bench.Row {
	// The table names the base by its file's last two elements
	// (bench-base's base-<rev>/libmpipause.so); the log has the whole path.
	c := fmt.Sprintf("calls, base shim %s, node0, CPU ns per call", filepath.Join(filepath.Base(filepath.Dir(base)), filepath.Base(base)))
	row := func(metric string, v float64, unit string) bench.Row {
		return bench.Row{Section: "overhead", Case: c, Metric: metric, Value: v, Unit: unit}
	}
	mm := func(v []float64) string { return fmt.Sprintf("%.4g / %.4g", slices.Min(v), median(v)) }
	fmt.Fprintf(os.Stderr, "overhead shims: base shim %s against this build's, %d rounds, CPU ns per call (min / median)\n", base, rounds)
	var rows []bench.Row
	for j, fig := range callFigs {
		r := bench.MedianInterval(bench.Ratios(shim[j], old[j]), overheadLevel)
		d := bench.MedianInterval(bench.Diffs(shim[j], old[j]), overheadLevel)
		rows = append(rows,
			row(fig+", base shim", median(old[j]), "ns"),
			row(fig+", shim", median(shim[j]), "ns"),
			row(fig+", shim / base shim, "+ivText(r), r.Median, "x"),
			row(fig+", shim - base shim, "+ivText(d), d.Median, "ns"))
		fmt.Fprintf(os.Stderr, "overhead shims: %s: plain %s, base shim %s, shim %s; shim / base %v, shim - base %v ns\n",
			fig, mm(plain[j]), mm(old[j]), mm(shim[j]), r, d)
	}
	b.ReportMetric(bench.MedianInterval(bench.Ratios(shim[figPair], old[figPair]), overheadLevel).Median, "pair-shim/base")
	return rows
}

// upperBound is the verdict of a bound from above: below the target it
// shows the target met, but above it shows nothing (the true cost may
// still be under it), so a MISSED becomes not resolved.
func upperBound(met *bool) *bool {
	if met != nil && !*met {
		return nil
	}
	return met
}

// scaleInterval multiplies an interval by a positive factor.
func scaleInterval(iv bench.Interval, f float64) bench.Interval {
	iv.Median, iv.Lo, iv.Hi = iv.Median*f, iv.Lo*f, iv.Hi*f
	return iv
}

// callcost's figures, in the order it prints them.
var callFigs = [...]string{"send+recv pair", "EAGAIN recv poll", "epoll_wait(0), idle set", "poll(10), readable socket"}

const (
	figPair = iota
	figPoll
	figEpoll
	figWait
	nCallFigs
)

var callcostRE = regexp.MustCompile(`(?m)^callcost pair_ns=([0-9.]+) poll_ns=([0-9.]+) epoll_ns=([0-9.]+) wait_ns=([0-9.]+) shim=([01]) shimlib=(\S*) cgroup=(\S*)$`)

// callcost runs callcost.mpich once on node0 in mode m (a one-rank MPICH
// job, of job id id in the modes with a job: MPI_Init lets a preloaded
// shim register as a rank's does) and
// returns its figures (ns per call, in callFigs order). It checks that
// the process measured in the state m says: shim loaded or not (and which
// build of it), in the job's cgroup or not.
func callcost(b *testing.B, bin string, m callMode, id string) [nCallFigs]float64 {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	argv := []string{"mpiexec.mpich", "-n", "1", filepath.Join(bin, "apps", "callcost.mpich"), "-M", "-c", "1", "-n", "50000", "-p", "200000"}
	so := m.so // mpipause run preloads the one beside it, this build's
	if so == "" {
		so = filepath.Join(bin, "libmpipause.so")
	}
	var env []string
	switch {
	case m.job:
		// The shim's constructor joins the job's cgroup (JOIN to node0's
		// mpid, which attaches the job's BPF programs first); without the
		// shim, callcost then drops it (-U) and execs itself again, in
		// the same cgroup.
		if !m.shim {
			argv = append(argv, "-U")
		}
		argv = append([]string{"mpipause", "run", "--jobid", id, "--"}, argv...)
	case m.shim:
		// No mpid at this address: the shim stays unregistered, gate
		// open, quietly.
		env = []string{"LD_PRELOAD=" + so, "MPIPAUSE_MPID_SOCKET=@mpipause-bench-nobody", "MPIPAUSE_QUIET=1"}
	}
	r := runInNode(ctx, b, "node0", env, argv...)
	what := strings.Join(argv, " ")
	if r.code != 0 {
		b.Fatalf("%s (%s): exit %d\n%s%s", what, m.name, r.code, r.stdout, r.stderr)
	}
	o := callcostRE.FindStringSubmatch(r.stdout)
	if o == nil {
		b.Fatalf("%s (%s) printed no result:\n%s%s", what, m.name, r.stdout, r.stderr)
	}
	if got := o[5] == "1"; got != m.shim {
		b.Fatalf("%s (%s): shim loaded %v, want %v:\n%s%s", what, m.name, got, m.shim, r.stdout, r.stderr)
	}
	if m.shim && filepath.Clean(o[6]) != filepath.Clean(so) {
		b.Fatalf("%s (%s): shim loaded from %s, want %s:\n%s%s", what, m.name, o[6], so, r.stdout, r.stderr)
	}
	// mpid names a job's cgroup by its key, the owner's uid and the id.
	if _, name, _ := jobid.SplitKey(filepath.Base(o[7])); (name == id) != m.job {
		b.Fatalf("%s (%s): cgroup %s, want the job's (%v):\n%s%s", what, m.name, o[7], m.job, r.stdout, r.stderr)
	}
	if m.job && (!strings.HasPrefix(r.stdout, "job "+id+"\n") || strings.Contains(r.stderr, "mpipause:")) {
		b.Fatalf("%s (%s) did not run quietly under mpipause run:\n%s%s", what, m.name, r.stdout, r.stderr)
	}
	var f [nCallFigs]float64
	for j := range f {
		f[j], _ = strconv.ParseFloat(o[1+j], 64)
	}
	return f
}

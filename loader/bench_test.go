package loader

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/internal/testutil/benchrec"
)

// snapshotSizes are the job sizes BenchmarkSnapshot measures, in sockets.
var snapshotSizes = []int{100, 1000, 3000, 10000}

// snapshotPairs is how many snapshots of each observer one iteration of
// BenchmarkSnapshot takes, so that `-benchtime 20x` (make bench) gives 200
// samples per size and observer: enough for a stable p50 and a p99 that is
// not simply the maximum.
const snapshotPairs = 10

// snapshotSamples are the per-snapshot times, in ms, at one job size.
type snapshotSamples struct {
	sockets   int
	bpf, diag []float64
}

// BenchmarkSnapshot times one Snapshot of a job against its number of
// established sockets (100 to 10,000: half as many loopback connections,
// both ends in the job cgroup, in a fresh network namespace), for the BPF
// observer and the sock_diag observer alternately in one loop, so that the
// machine's noise falls on both alike; and, at 10,000 sockets, one iter/tcp
// pass over the same namespace (what a Snapshot through iter/tcp alone
// would cost). The namespace grows from one size to the next.
//
// It writes snapshot.csv (every snapshot's time), the summary rows of
// section "snapshot" (p50 and p99 per size and observer, their ratio, the
// issue's target of < 5 ms for BPF at 10,000 sockets) to the results
// directory; benchplot (kernel-tests/tools/bench) draws
// snapshot-vs-sockets.svg from the CSV.
func BenchmarkSnapshot(b *testing.B) {
	testutil.RequirePrivileged(b)
	dir, err := benchrec.Dir()
	if err != nil {
		b.Fatal(err)
	}
	ns := "mpt-" + randomID(b) + "-bench"
	cg := testutil.NewCgroup(b)
	testutil.NewNamedNetns(b, ns)
	h := startHelper(b, ns, cg)

	// Open before the connections exist, so that sockops registers them
	// all, as it does for a job started under mpipause.
	ctx := context.Background()
	bpf, err := OpenBPF(ctx, Config{Cgroup: cg, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer bpf.Close()
	d, err := OpenSockDiag(ctx, Config{Cgroup: cg, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()

	sockets := 0 // open in the namespace
	grow := func(b *testing.B, n int) {
		b.Helper()
		if n < sockets {
			b.Fatalf("the namespace has %d sockets already, cannot shrink to %d", sockets, n)
		}
		if n == sockets {
			return
		}
		f := h.do("mass 127.0.0.1:0 %d", (n-sockets)/2)
		if len(f) != 1 || f[0] != strconv.Itoa(n) {
			b.Fatalf("helper holds %v sockets, want %d", f, n)
		}
		sockets = n
	}
	// snap takes one snapshot, checks that it has every socket of the job
	// and returns its time in ms.
	snap := func(b *testing.B, o Observer) float64 {
		t0 := time.Now()
		cs, err := o.Snapshot(ctx)
		ms := float64(time.Since(t0).Nanoseconds()) / 1e6
		if err != nil {
			b.Fatal(err)
		}
		if len(cs) != sockets {
			b.Fatalf("%s snapshot has %d connections, want %d", o.Kind(), len(cs), sockets)
		}
		return ms
	}

	var results []snapshotSamples
	for _, n := range snapshotSizes {
		b.Run("sockets="+strconv.Itoa(n), func(b *testing.B) {
			grow(b, n)
			snap(b, bpf) // warm: buffers grown, caches filled
			snap(b, d)
			s := snapshotSamples{sockets: n}
			for i := 0; b.Loop(); i++ {
				for k := range snapshotPairs {
					// Take turns at going first, so that neither
					// always finds the other's cache footprint.
					if (i+k)%2 == 0 {
						s.bpf = append(s.bpf, snap(b, bpf))
						s.diag = append(s.diag, snap(b, d))
					} else {
						s.diag = append(s.diag, snap(b, d))
						s.bpf = append(s.bpf, snap(b, bpf))
					}
				}
			}
			bp50, dp50 := benchrec.Percentile(s.bpf, 0.5), benchrec.Percentile(s.diag, 0.5)
			b.ReportMetric(bp50, "bpf-p50-ms")
			b.ReportMetric(benchrec.Percentile(s.bpf, 0.99), "bpf-p99-ms")
			b.ReportMetric(dp50, "sock_diag-p50-ms")
			b.ReportMetric(bp50/dp50, "bpf/sock_diag")
			results = append(results, s)
		})
	}
	var iterMs []float64
	b.Run("iter_tcp_pass", func(b *testing.B) {
		grow(b, 10000)
		if len(bpf.ns.explicit) != 1 {
			b.Fatal("no namespace")
		}
		job := bpf.ns.explicit[0]
		for b.Loop() {
			for range snapshotPairs {
				t0 := time.Now()
				recs, err := bpf.readTCPIter(job)
				iterMs = append(iterMs, float64(time.Since(t0).Nanoseconds())/1e6)
				if err != nil {
					b.Fatal(err)
				}
				if len(recs) != sockets {
					b.Fatalf("iter/tcp pass has %d records, want %d", len(recs), sockets)
				}
			}
		}
		b.ReportMetric(benchrec.Percentile(iterMs, 0.5), "p50-ms")
	})
	if err := writeSnapshotResults(dir, results, iterMs); err != nil {
		b.Fatal(err)
	}
}

// writeSnapshotResults writes BenchmarkSnapshot's samples and summary rows to
// dir (benchplot draws its figure from snapshot.csv), and its table to stderr.
func writeSnapshotResults(dir string, results []snapshotSamples, iterMs []float64) error {
	if len(results) == 0 && len(iterMs) == 0 {
		return nil // filtered out by -bench
	}
	var raw [][]string
	add := func(observer string, sockets int, ms []float64) {
		for i, v := range ms {
			raw = append(raw, []string{observer, strconv.Itoa(sockets), strconv.Itoa(i + 1), strconv.FormatFloat(v, 'f', 4, 64)})
		}
	}
	var rows []benchrec.Row
	fmt.Fprintf(os.Stderr, "bench: snapshot %8s %12s %14s %14s\n", "sockets", "bpf p50", "sock_diag p50", "bpf/sock_diag")
	for _, s := range results {
		add("bpf", s.sockets, s.bpf)
		add("sock_diag", s.sockets, s.diag)
		row := func(observer, metric string, v float64, unit string) benchrec.Row {
			c := fmt.Sprintf("%d sockets", s.sockets)
			if observer != "" {
				c = observer + ", " + c
			}
			return benchrec.Row{Section: "snapshot", Case: c, Metric: metric, Value: v, Unit: unit}
		}
		bp50, dp50 := benchrec.Percentile(s.bpf, 0.5), benchrec.Percentile(s.diag, 0.5)
		bp := row("bpf", "snapshot p50", bp50, "ms")
		if s.sockets == 10000 {
			bp = bp.Goal("< 5 ms", bp50 < 5)
		}
		rows = append(rows,
			bp,
			row("bpf", "snapshot p99", benchrec.Percentile(s.bpf, 0.99), "ms"),
			row("sock_diag", "snapshot p50", dp50, "ms"),
			row("sock_diag", "snapshot p99", benchrec.Percentile(s.diag, 0.99), "ms"),
			row("", "bpf / sock_diag p50", bp50/dp50, "x"))
		fmt.Fprintf(os.Stderr, "bench: snapshot %8d %9.3f ms %11.3f ms %13.3fx\n", s.sockets, bp50, dp50, bp50/dp50)
	}
	if len(iterMs) > 0 {
		add("iter_tcp_pass", 10000, iterMs)
		p50 := benchrec.Percentile(iterMs, 0.5)
		rows = append(rows, benchrec.Row{Section: "snapshot", Case: "iter/tcp pass, 10000 sockets", Metric: "pass p50", Value: p50, Unit: "ms"})
		fmt.Fprintf(os.Stderr, "bench: snapshot iter/tcp pass alone at 10000 sockets: p50 %.3f ms\n", p50)
	}
	if err := benchrec.WriteCSV(dir, "snapshot.csv", []string{"observer", "sockets", "sample", "ms"}, raw); err != nil {
		return err
	}
	return benchrec.Record(dir, rows...)
}

// BenchmarkWatchSet measures what spreading a job over several cgroups
// costs the BPF observer, each time against a baseline taken in the same
// run, alternately: a Snapshot of 2,000 sockets held by 8 cgroups, watched
// as their one parent (1 cgroup) and as the 8 (8 cgroups); and the time of
// a connection made, accepted and closed (what sockops runs for) by a
// process of the job, with the observer watching 1 cgroup and with the job
// spread over 4 watched cgroups.
func BenchmarkWatchSet(b *testing.B) {
	testutil.RequirePrivileged(b)
	ctx := context.Background()
	ns := "mpt-" + randomID(b) + "-bws"
	parent := testutil.NewCgroup(b)
	testutil.NewNamedNetns(b, ns)
	var kids []string
	var hs []*helper
	for i := range 8 {
		dir := filepath.Join(parent, "rank"+strconv.Itoa(i))
		if err := cgroupv2.Create(dir); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { cgroupv2.Remove(dir) })
		kids = append(kids, dir)
		hs = append(hs, startHelper(b, ns, dir))
	}
	one, err := OpenBPF(ctx, Config{Cgroup: parent, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer one.Close()
	eight, err := OpenBPF(ctx, Config{Cgroups: kids, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer eight.Close()
	const sockets = 2000
	for _, h := range hs {
		h.do("mass 127.0.0.1:0 %d", sockets/8/2)
	}
	snap := func(b *testing.B, o Observer) float64 {
		t0 := time.Now()
		cs, err := o.Snapshot(ctx)
		ms := float64(time.Since(t0).Nanoseconds()) / 1e6
		if err != nil {
			b.Fatal(err)
		}
		if len(cs) != sockets {
			b.Fatalf("snapshot has %d connections, want %d", len(cs), sockets)
		}
		return ms
	}
	b.Run("snapshot", func(b *testing.B) {
		snap(b, one)
		snap(b, eight)
		var s1, s8 []float64
		for i := 0; b.Loop(); i++ {
			for k := range snapshotPairs {
				if (i+k)%2 == 0 {
					s1 = append(s1, snap(b, one))
					s8 = append(s8, snap(b, eight))
				} else {
					s8 = append(s8, snap(b, eight))
					s1 = append(s1, snap(b, one))
				}
			}
		}
		p1, p8 := benchrec.Percentile(s1, 0.5), benchrec.Percentile(s8, 0.5)
		b.ReportMetric(p1, "1-cgroup-p50-ms")
		b.ReportMetric(p8, "8-cgroups-p50-ms")
		b.ReportMetric(p8/p1, "8/1")
		mode := "conniter"
		if one.ScansTCP() {
			mode = "scanTCP: an iter/tcp pass per namespace"
		}
		fmt.Fprintf(os.Stderr, "bench: watchset snapshot of %d sockets (%s): 1 cgroup p50 %.3f ms, 8 cgroups p50 %.3f ms, ratio %.3f\n", sockets, mode, p1, p8, p8/p1)
	})
	one.Close()
	eight.Close()

	// The churning process is in kids[0] throughout; the observer watches
	// kids[0] alone, or kids[0..3].
	const conns = 200
	churnOnce := func(b *testing.B, cgroups []string) float64 {
		o, err := OpenBPF(ctx, Config{Cgroups: cgroups, Netns: []string{ns}})
		if err != nil {
			b.Fatal(err)
		}
		defer o.Close()
		f := hs[0].do("churn 127.0.0.1:0 %d", conns)
		n, _ := strconv.ParseFloat(f[0], 64)
		return n / conns / 1e3 // µs per connection
	}
	b.Run("sockops", func(b *testing.B) {
		var c1, c4 []float64
		for i := 0; b.Loop(); i++ {
			for k := range snapshotPairs {
				if (i+k)%2 == 0 {
					c1 = append(c1, churnOnce(b, kids[:1]))
					c4 = append(c4, churnOnce(b, kids[:4]))
				} else {
					c4 = append(c4, churnOnce(b, kids[:4]))
					c1 = append(c1, churnOnce(b, kids[:1]))
				}
			}
		}
		p1, p4 := benchrec.Percentile(c1, 0.5), benchrec.Percentile(c4, 0.5)
		b.ReportMetric(p1, "1-cgroup-us/conn")
		b.ReportMetric(p4, "4-cgroups-us/conn")
		b.ReportMetric(p4/p1, "4/1")
		fmt.Fprintf(os.Stderr, "bench: watchset connect+accept+close: 1 cgroup p50 %.2f µs, 4 cgroups p50 %.2f µs, ratio %.3f\n", p1, p4, p4/p1)
	})
}

// BenchmarkSnapshotModes is what each kernel mode's observer (kernelModes,
// the refusals forced on this kernel) costs a kernel check: a Snapshot of
// the same 10,000 job sockets, as Open gives it to mpid (on 5.10 the
// programs and sock_diag: Complemented), each mode against the full one in
// the same run, in turns. Every observer must see every socket.
func BenchmarkSnapshotModes(b *testing.B) {
	testutil.RequirePrivileged(b)
	dir, err := benchrec.Dir()
	if err != nil {
		b.Fatal(err)
	}
	ns := "mpt-" + randomID(b) + "-modes"
	cg := testutil.NewCgroup(b)
	testutil.NewNamedNetns(b, ns)
	h := startHelper(b, ns, cg)
	ctx := context.Background()
	type mode struct {
		name string
		obs  Observer
		ms   []float64
	}
	var modes []*mode
	for _, k := range kernelModes {
		refuse := map[string]error{}
		for _, p := range k.refused {
			refuse[p] = errors.New("refused by the benchmark")
		}
		refuseForTest = refuse
		o, err := Open(ctx, Config{Cgroup: cg, Netns: []string{ns}, Require: KindBPF})
		refuseForTest = nil
		if err != nil {
			b.Fatalf("mode %s: %v", k.name, err)
		}
		defer o.Close()
		modes = append(modes, &mode{name: k.name, obs: o})
	}
	const sockets = 10000
	if f := h.do("mass 127.0.0.1:0 %d", sockets/2); len(f) != 1 || f[0] != strconv.Itoa(sockets) {
		b.Fatalf("helper holds %v sockets, want %d", f, sockets)
	}
	snap := func(m *mode) float64 {
		t0 := time.Now()
		cs, err := m.obs.Snapshot(ctx)
		ms := float64(time.Since(t0).Nanoseconds()) / 1e6
		if err != nil {
			b.Fatal(err)
		}
		if len(cs) != sockets {
			b.Fatalf("mode %s: %d connections, want %d", m.name, len(cs), sockets)
		}
		return ms
	}
	for _, m := range modes {
		snap(m) // warm, and adopt where the mode adopts
	}
	for i := 0; b.Loop(); i++ {
		for k := range snapshotPairs {
			for j := range modes {
				m := modes[(i+k+j)%len(modes)]
				m.ms = append(m.ms, snap(m))
			}
		}
	}
	full := benchrec.Percentile(modes[0].ms, 0.5)
	var rows []benchrec.Row
	for _, m := range modes {
		p50 := benchrec.Percentile(m.ms, 0.5)
		c := fmt.Sprintf("kernel mode %s, %d sockets", m.name, sockets)
		rows = append(rows,
			benchrec.Row{Section: "snapshot", Case: c, Metric: "snapshot p50", Value: p50, Unit: "ms"},
			benchrec.Row{Section: "snapshot", Case: c, Metric: "p50 / this kernel's", Value: p50 / full, Unit: "x"})
		fmt.Fprintf(os.Stderr, "bench: snapshot mode %-24s %9.3f ms p50, %6.2fx this kernel's (%s)\n", m.name, p50, p50/full, features(m.obs))
	}
	if err := benchrec.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
}

// features is the observer's Features as a string ("" for sock_diag).
func features(o Observer) string {
	if f, ok := o.(interface{ Features() Features }); ok {
		return f.Features().String()
	}
	return ""
}

// BenchmarkRecheck: a kernel read where map iterators are refused, as a
// walk (a Snapshot made to walk: an iter/tcp pass in each of the job's two
// namespaces), as a listed read (a Snapshot from connlist, two sock_diag
// lookups a connection at least) and as a Recheck of the connections the
// walk listed (one lookup each), alternated in one run, for a job of 3
// connections (6 sockets) and of 48. The walk's cost is the machine's
// hash table; the others' the job's sockets (the listed read's also the
// job's namespaces, found from its cgroups as a walk finds them).
func BenchmarkRecheck(b *testing.B) {
	testutil.RequirePrivileged(b)
	if !withRefused(b, []string{ProgConnIter, ProgConnIterSkc}) {
		b.Skip("this kernel cannot run the observer with map iterators refused")
	}
	dir, err := benchrec.Dir()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	var rows []benchrec.Row
	for _, conns := range []int{3, 48} {
		b.Run("connections="+strconv.Itoa(conns), func(b *testing.B) {
			r, client, server := newPair(b)
			o := openBPF(b, Config{Cgroup: r.cgroup, FollowJob: true})
			for range conns {
				connect(b, r, client, server)
			}
			cs, err := o.Snapshot(ctx)
			if err != nil || len(cs) < 2*conns {
				b.Fatalf("Snapshot: %d connections (%v), want %d", len(cs), err, 2*conns)
			}
			var walk, list, recheck []float64
			for b.Loop() {
				for range snapshotPairs {
					// A walk, made to walk; then a listed read, which
					// must not.
					o.mu.Lock()
					o.listFrom.ok = false
					walks := o.walks
					o.mu.Unlock()
					t0 := time.Now()
					if _, err := o.Snapshot(ctx); err != nil {
						b.Fatal(err)
					}
					walk = append(walk, float64(time.Since(t0).Nanoseconds())/1e6)
					t0 = time.Now()
					if _, err := o.Snapshot(ctx); err != nil {
						b.Fatal(err)
					}
					list = append(list, float64(time.Since(t0).Nanoseconds())/1e6)
					if o.walks != walks+1 {
						b.Fatalf("%d walks for a walk and a listed read", o.walks-walks)
					}
					t0 = time.Now()
					got, err := o.Recheck(ctx, cs)
					if err != nil || len(got) != len(cs) {
						b.Fatalf("Recheck: %d of %d (%v)", len(got), len(cs), err)
					}
					recheck = append(recheck, float64(time.Since(t0).Nanoseconds())/1e6)
				}
			}
			w, l, c := benchrec.Percentile(walk, 0.5), benchrec.Percentile(list, 0.5), benchrec.Percentile(recheck, 0.5)
			b.ReportMetric(w, "walk-p50-ms")
			b.ReportMetric(l, "listed-p50-ms")
			b.ReportMetric(c, "recheck-p50-ms")
			b.ReportMetric(w/l, "walk/listed")
			b.ReportMetric(w/c, "walk/recheck")
			name := fmt.Sprintf("%d job connections in 2 namespaces", conns)
			rows = append(rows,
				benchrec.Row{Section: "snapshot", Case: name, Metric: "walk p50", Value: w, Unit: "ms"},
				benchrec.Row{Section: "snapshot", Case: name, Metric: "listed read p50", Value: l, Unit: "ms"},
				benchrec.Row{Section: "snapshot", Case: name, Metric: "recheck p50", Value: c, Unit: "ms"},
				benchrec.Row{Section: "snapshot", Case: name, Metric: "walk / listed read", Value: w / l, Unit: "x"},
				benchrec.Row{Section: "snapshot", Case: name, Metric: "walk / recheck", Value: w / c, Unit: "x"})
			fmt.Fprintf(os.Stderr, "bench: recheck %d connections: walk %.3f ms p50, listed read %.3f ms p50 (%.1fx), recheck %.3f ms p50 (%.1fx)\n", conns, w, l, w/l, c, w/c)
		})
	}
	if err := benchrec.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
}

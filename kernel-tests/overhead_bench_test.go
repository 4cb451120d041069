package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/bench"
)

// BenchmarkOverhead measures what mpipause costs a job that is never
// paused: MPI ping-pong latency (8 bytes) and streaming bandwidth between
// two ranks on two rig nodes, launched plainly and launched with `mpipause
// run` (the shim preloaded in both ranks, registered with the nodes' mpids,
// the job's cgroup watched by the BPF programs: sockops, the send/receive
// byte counters on every sendmsg and recvmsg), alternately in one run so
// that the machine's noise falls on both alike. The figures are the ratios
// of the medians, with to without.
//
// MPIPAUSE_BENCH_RUNS sets the runs per mode and library (default 7).
func BenchmarkOverhead(b *testing.B) {
	dir, err := bench.Dir()
	if err != nil {
		b.Fatal(err)
	}
	bin := binDir(b)
	sharedRig(b)
	runs := envCount("MPIPAUSE_BENCH_RUNS", 7)
	app := func(lib string) string { return filepath.Join(bin, "apps", "pingpong."+lib) }
	// Open MPI's TCP BTL answers an 8-byte ping-pong in ~4 ms on the rig
	// (MPICH in ~15 us; see docs/ARCHITECTURE.md): fewer round trips, so
	// each run takes a few seconds for either library.
	args := map[string][]string{
		"openmpi": {"-l", "300", "-b", "256"},
		"mpich":   {"-l", "20000", "-b", "1024"},
	}
	var raw [][]string
	var rows []bench.Row
	for _, lib := range []string{"openmpi", "mpich"} {
		launch := layout{nodes: 2, per: 1}.launch(lib)
		var lat, bw [2][]float64 // [0] plain, [1] with mpipause
		for i := 0; i < runs; i++ {
			for mode := 0; mode < 2; mode++ {
				fmt.Fprintf(os.Stderr, "bench: overhead %s run %d/%d %s\n", lib, i+1, runs, modeName(mode))
				l, w := pingpong(b, bin, lib, mode == 1, launch.launch(app(lib), args[lib]...))
				lat[mode], bw[mode] = append(lat[mode], l), append(bw[mode], w)
				raw = append(raw, []string{lib, modeName(mode), strconv.Itoa(i + 1), fmt.Sprint(l), fmt.Sprint(w)})
			}
		}
		lr := median(lat[1]) / median(lat[0])
		br := median(bw[1]) / median(bw[0])
		c := lib + ", 2 nodes x 1 rank"
		row := func(metric string, v float64, unit string) bench.Row {
			return bench.Row{Section: "overhead", Case: c, Metric: metric, Value: v, Unit: unit}
		}
		rows = append(rows,
			row("latency p50, plain", median(lat[0]), "us"),
			row("latency p50, with mpipause", median(lat[1]), "us"),
			row("latency with / plain", lr, "x").Goal("< 1.02", lr < 1.02),
			row("bandwidth p50, plain", median(bw[0]), "MiB/s"),
			row("bandwidth p50, with mpipause", median(bw[1]), "MiB/s"),
			row("bandwidth with / plain", br, "x").Goal("> 0.99", br > 0.99))
		b.ReportMetric(lr, lib+"-latency-ratio")
		b.ReportMetric(br, lib+"-bandwidth-ratio")
		fmt.Fprintf(os.Stderr, "overhead %s: latency %.3g -> %.3g us (x%.3f), bandwidth %.4g -> %.4g MiB/s (x%.3f), medians of %d\n",
			lib, median(lat[0]), median(lat[1]), lr, median(bw[0]), median(bw[1]), br, runs)
	}
	if err := bench.WriteCSV(dir, "overhead.csv", []string{"library", "mode", "run", "latency_us", "bandwidth_mibs"}, raw); err != nil {
		b.Fatal(err)
	}
	if err := bench.Record(dir, rows...); err != nil {
		b.Fatal(err)
	}
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

package bench

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func writeFile(t *testing.T, dir, name, text string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The figures are the ones BenchmarkScale and BenchmarkSnapshot drew
// themselves before they recorded only CSV: series in the order measured,
// the pause's p50 (nearest rank), the root's mean count, one root series per
// fanout, and the iter/tcp pass left off the snapshot curve.
func TestFigures(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "scale.csv", `transport,fanout,nodes,cycle,pause_ms,round_ms,cpu_ms,msgs_per_node_mean,msgs_per_node_max,root_msgs
mem,tree,16,1,3.000,1,1,1,1,5.000
mem,tree,16,2,1.000,1,1,1,1,5.000
mem,tree,16,3,2.000,1,1,1,1,6.000
mem,star,16,1,4.000,1,1,1,1,16.000
mem,tree,64,1,7.000,1,1,1,1,7.000
mem,star,64,1,9.000,1,1,1,1,64.000
tcp,tree,16,1,30.000,1,1,1,1,5.000
tcp,star,16,1,40.000,1,1,1,1,16.000
`)
	writeFile(t, dir, "snapshot.csv", `observer,sockets,sample,ms
bpf,100,1,0.5000
bpf,100,2,0.3000
sock_diag,100,1,2.0000
bpf,1000,1,1.0000
sock_diag,1000,1,9.0000
iter_tcp_pass,10000,1,4.0000
`)
	got, err := Figures(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []Figure{
		{"scale-pause.svg", Plot{Title: "Pause time (PREPARE to COMMIT, p50) vs nodes", XLabel: "simulated nodes",
			YLabel: "pause p50 (ms)", LogX2: true, LogY: true, Series: []Series{
				{Name: "mem/tree", X: []float64{16, 64}, Y: []float64{2, 7}},
				{Name: "mem/star", X: []float64{16, 64}, Y: []float64{4, 9}},
				{Name: "tcp/tree", X: []float64{16}, Y: []float64{30}},
				{Name: "tcp/star", X: []float64{16}, Y: []float64{40}},
			}}},
		{"scale-root-messages.svg", Plot{Title: "Messages at the root per round vs nodes", XLabel: "simulated nodes",
			YLabel: "requests in + out at node 0, per round", LogX2: true, LogY: true, Series: []Series{
				{Name: "tree", X: []float64{16, 64}, Y: []float64{16.0 / 3, 7}},
				{Name: "star", X: []float64{16, 64}, Y: []float64{16, 64}},
			}}},
		{"snapshot-vs-sockets.svg", Plot{Title: "Snapshot time against job size",
			XLabel: "job sockets (log)", YLabel: "snapshot p50, ms (log)", LogX: true, LogY: true, Series: []Series{
				{Name: "bpf", X: []float64{100, 1000}, Y: []float64{0.3, 1}},
				{Name: "sock_diag", X: []float64{100, 1000}, Y: []float64{2, 9}},
			}}},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("Figures (-want +got):\n%s", d)
	}

	names, err := WriteFigures(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if _, err := os.Stat(filepath.Join(dir, n)); err != nil {
			t.Error(err)
		}
	}
	if len(names) != 3 {
		t.Errorf("WriteFigures wrote %q, want 3 files", names)
	}
}

// A run that measured neither benchmark draws nothing and is no error; a
// snapshot run of the iter/tcp pass alone has no curve to draw; a CSV file
// without the columns is an error, not an empty figure.
func TestFiguresMissingAndMalformed(t *testing.T) {
	dir := t.TempDir()
	if got, err := Figures(dir); err != nil || len(got) != 0 {
		t.Errorf("no CSV: Figures = %v, %v; want none, nil", got, err)
	}
	writeFile(t, dir, "snapshot.csv", "observer,sockets,sample,ms\niter_tcp_pass,10000,1,4.0000\n")
	if got, err := Figures(dir); err != nil || len(got) != 0 {
		t.Errorf("iter/tcp pass alone: Figures = %v, %v; want none, nil", got, err)
	}
	writeFile(t, dir, "scale.csv", "transport,nodes\nmem,16\n")
	if _, err := Figures(dir); err == nil {
		t.Error("scale.csv without fanout, pause_ms, root_msgs: Figures succeeded")
	}
}

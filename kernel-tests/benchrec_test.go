package kerneltests

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/mpipause/mpipause/internal/testutil/benchrec"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// The product module's benchmarks record with benchrec, which may not
// import the tools module; benchtable reads what they wrote with bench.
// This module requires both, so the two copies of the format meet here.
func TestBenchrecWritesWhatBenchReads(t *testing.T) {
	if benchrec.EnvDir != bench.EnvDir || benchrec.SummaryFile != bench.SummaryFile {
		t.Errorf("benchrec writes %s to $%s; bench reads %s from $%s",
			benchrec.SummaryFile, benchrec.EnvDir, bench.SummaryFile, bench.EnvDir)
	}
	if d := cmp.Diff(bench.Header, benchrec.Header); d != "" {
		t.Errorf("summary header (-bench +benchrec):\n%s", d)
	}
	dir := t.TempDir()
	in := []benchrec.Row{
		{Section: "scale", Case: "mem/tree/4096 nodes", Metric: "pause p50", Value: 123.456789, Unit: "ms"},
		benchrec.Row{Section: "snapshot", Case: "bpf, 10000 sockets", Metric: "snapshot p50", Value: 1.5, Unit: "ms"}.Goal("< 5 ms", true),
		benchrec.Row{Section: "scale", Case: "tcp/tree, \"quoted\"", Metric: "pause p50", Value: 300, Unit: "ms"}.Goal("< 250 ms", false),
	}
	// Two appends, as two benchmarks' binaries make: one header.
	if err := benchrec.Record(dir, in[:1]...); err != nil {
		t.Fatal(err)
	}
	if err := benchrec.Record(dir, in[1:]...); err != nil {
		t.Fatal(err)
	}
	got, err := bench.ReadSummary(dir)
	if err != nil {
		t.Fatal(err)
	}
	yes, no := true, false
	want := []bench.Row{
		{Section: "scale", Case: "mem/tree/4096 nodes", Metric: "pause p50", Value: 123.457, Unit: "ms"},
		{Section: "snapshot", Case: "bpf, 10000 sockets", Metric: "snapshot p50", Value: 1.5, Unit: "ms", Target: "< 5 ms", Met: &yes},
		{Section: "scale", Case: "tcp/tree, \"quoted\"", Metric: "pause p50", Value: 300, Unit: "ms", Target: "< 250 ms", Met: &no},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("rows read back (-want +got):\n%s", d)
	}

	// The raw samples' CSV is what the figures are drawn from.
	if err := benchrec.WriteCSV(dir, "snapshot.csv", []string{"observer", "sockets", "sample", "ms"},
		[][]string{{"bpf", "100", "1", "0.5000"}, {"sock_diag", "100", "1", "2.0000"}}); err != nil {
		t.Fatal(err)
	}
	figs, err := bench.Figures(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(figs) != 1 || len(figs[0].Plot.Series) != 2 || figs[0].Plot.Series[1].Y[0] != 2 {
		t.Errorf("figures from benchrec's snapshot.csv: %+v", figs)
	}
}

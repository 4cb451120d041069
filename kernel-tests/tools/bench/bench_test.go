package bench

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestPercentile(t *testing.T) {
	tests := []struct {
		name string
		v    []float64
		q    float64
		want float64
	}{
		{name: "none", v: nil, q: 0.5, want: math.NaN()},
		{name: "one", v: []float64{3}, q: 0.99, want: 3},
		{name: "median of odd", v: []float64{5, 1, 3}, q: 0.5, want: 3},
		{name: "median of even is the lower", v: []float64{4, 1, 3, 2}, q: 0.5, want: 2},
		{name: "p99 of 10 is the max", v: []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, q: 0.99, want: 10},
		{name: "p90 of 10", v: []float64{10, 9, 8, 7, 6, 5, 4, 3, 2, 1}, q: 0.9, want: 9},
		{name: "q 0 is the min", v: []float64{2, 1, 3}, q: 0, want: 1},
		{name: "q 1 is the max", v: []float64{2, 1, 3}, q: 1, want: 3},
		{name: "q above 1 clamps", v: []float64{2, 1, 3}, q: 1.5, want: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := append([]float64(nil), tt.v...)
			got := Percentile(tt.v, tt.q)
			if got != tt.want && !(math.IsNaN(got) && math.IsNaN(tt.want)) {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tt.v, tt.q, got, tt.want)
			}
			if diff := cmp.Diff(in, tt.v); diff != "" {
				t.Errorf("input modified (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRecordReadSummary(t *testing.T) {
	dir := t.TempDir()
	first := []Row{
		{Section: "pause", Case: "rig link", Metric: "TCP round trip p50", Value: 0.0412, Unit: "ms"},
		Row{Section: "pause", Case: "openmpi/3x2/ring", Metric: "pause p50", Value: 12.5, Unit: "ms"}.Goal("<= 20 ms", true),
	}
	second := []Row{
		Row{Section: "scale", Case: "4096 nodes, \"tree\", fan-out 8", Metric: "rounds", Value: 4096, Unit: ""}.Goal("<= 3", false),
	}
	// Two calls: the header is written once, the rows of both are kept.
	if err := Record(dir, first...); err != nil {
		t.Fatal(err)
	}
	if err := Record(dir, second...); err != nil {
		t.Fatal(err)
	}
	got, err := ReadSummary(dir)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(append(first, second...), got); diff != "" {
		t.Errorf("rows (-want +got):\n%s", diff)
	}
	if got[0].Met != nil {
		t.Error("row without a target read back with Met set")
	}

	if _, err := ReadSummary(t.TempDir()); !os.IsNotExist(err) {
		t.Errorf("ReadSummary of an empty directory: err = %v, want not-exist", err)
	}
	bad := t.TempDir()
	os.WriteFile(filepath.Join(bad, SummaryFile), []byte("section,case,metric,value,unit,target,met\npause,a,b,fast,ms,,\n"), 0o644)
	if _, err := ReadSummary(bad); err == nil {
		t.Error("ReadSummary of a non-numeric value: no error")
	}
}

package bench

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestOrderRank(t *testing.T) {
	// Published sign-test ranks for a 95% interval of the median
	// (e.g. Conover, Practical Nonparametric Statistics, table A3).
	tests := []struct{ n, want int }{
		{n: 1, want: 0}, {n: 5, want: 0}, {n: 6, want: 1}, {n: 8, want: 1},
		{n: 9, want: 2}, {n: 10, want: 2}, {n: 20, want: 6}, {n: 30, want: 10},
		{n: 40, want: 14}, {n: 100, want: 40},
	}
	for _, tt := range tests {
		if got := orderRank(tt.n, 0.025); got != tt.want {
			t.Errorf("orderRank(%d, 0.025) = %d, want %d", tt.n, got, tt.want)
		}
	}
}

func TestMedianInterval(t *testing.T) {
	tests := []struct {
		name string
		v    []float64
		want Interval
	}{
		{name: "odd", v: []float64{9, 1, 8, 2, 7, 3, 6, 4, 5, 10, 0}, want: Interval{Median: 5, Lo: 1, Hi: 9, N: 11, Level: 0.95}},
		{name: "even averages the middle two", v: []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}, want: Interval{Median: 5.5, Lo: 2, Hi: 9, N: 10, Level: 0.95}},
		{name: "too few to resolve", v: []float64{1, 2, 3, 4, 5}, want: Interval{Median: 3, Lo: math.Inf(-1), Hi: math.Inf(1), N: 5, Level: 0.95}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := append([]float64(nil), tt.v...)
			if diff := cmp.Diff(tt.want, MedianInterval(tt.v, 0.95)); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(in, tt.v); diff != "" {
				t.Errorf("input modified (-want +got):\n%s", diff)
			}
		})
	}
	if iv := MedianInterval(nil, 0.95); !math.IsNaN(iv.Median) || !math.IsNaN(iv.Lo) || !math.IsNaN(iv.Hi) {
		t.Errorf("no samples: %v, want NaN", iv)
	}
}

// TestMedianIntervalCoverage draws skewed, long-tailed samples (what run
// ratios on a loaded machine look like) with a known median and checks
// that the 95% interval holds it about 95% of the time: not much less
// (the interval would claim what it cannot), not much more (it would be
// wider than it need be).
func TestMedianIntervalCoverage(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const trials = 4000
	median := 1 + math.Ln2*0.1 // of 1 + Exp(mean 0.1)
	for _, n := range []int{10, 30, 101} {
		hit := 0
		for range trials {
			v := make([]float64, n)
			for i := range v {
				v[i] = 1 + r.ExpFloat64()*0.1
			}
			if iv := MedianInterval(v, 0.95); iv.Lo <= median && median <= iv.Hi {
				hit++
			}
		}
		// Exact coverage of the order-statistic interval: 97.9% at n=10,
		// 95.7% at 30, 95.4% at 101. 4000 trials: sd 0.3 points.
		if c := float64(hit) / trials; c < 0.945 || c > 0.985 {
			t.Errorf("n=%d: 95%% interval held the median in %.1f%% of %d trials", n, c*100, trials)
		}
	}
}

func TestVerdicts(t *testing.T) {
	iv := func(lo, hi float64) Interval { return Interval{Median: (lo + hi) / 2, Lo: lo, Hi: hi} }
	yes, no := ptr(true), ptr(false)
	tests := []struct {
		name         string
		iv           Interval
		bound        float64
		below, above *bool
	}{
		{name: "all below", iv: iv(0.97, 1.01), bound: 1.02, below: yes, above: no},
		{name: "all above", iv: iv(1.05, 1.2), bound: 1.02, below: no, above: yes},
		{name: "straddles", iv: iv(0.99, 1.05), bound: 1.02, below: nil, above: nil},
		{name: "unresolvable", iv: iv(math.Inf(-1), math.Inf(1)), bound: 1.02, below: nil, above: nil},
		{name: "upper end on the bound is not below", iv: iv(0.9, 1.02), bound: 1.02, below: nil, above: no},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.below, tt.iv.Below(tt.bound)); diff != "" {
				t.Errorf("Below (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.above, tt.iv.Above(tt.bound)); diff != "" {
				t.Errorf("Above (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRatiosDiffs(t *testing.T) {
	if diff := cmp.Diff([]float64{2, 0.5}, Ratios([]float64{4, 1}, []float64{2, 2})); diff != "" {
		t.Errorf("Ratios (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]float64{2, -1}, Diffs([]float64{4, 1}, []float64{2, 2})); diff != "" {
		t.Errorf("Diffs (-want +got):\n%s", diff)
	}
}

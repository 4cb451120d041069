package bench

import (
	"fmt"
	"math"
	"slices"
)

// Interval is a sample median with a distribution-free confidence interval
// for the median of the population it was drawn from.
//
// The interval is the order-statistic (sign-test) one: with n samples and
// k the largest integer such that P(Binomial(n, 1/2) < k) <= (1-Level)/2,
// it runs from the k-th smallest sample to the k-th largest. It assumes
// only that the samples are independent draws from one distribution (no
// normality, no symmetry), which is what alternating runs on a noisy
// machine give: their ratios have long tails a mean and a t-interval
// would follow. Its coverage is at least Level, exactly so only for
// continuous samples.
//
// golang.org/x/perf's benchmath (AssumeNothing) has a median interval too,
// but another one: where no symmetric pair of ranks gives exactly Level it
// moves one end in by a rank (at n=24, the 8th to the 18th sample, 95.7%,
// not the 7th to the 18th, 97.7%), above 30 samples it takes the ranks
// from a normal approximation (n=200: 86th to 114th, not 115th), and at
// n=5 its upper end is finite. Over the recorded overhead-calls samples 79
// of 144 intervals printed differently, so the table's figures would move.
type Interval struct {
	Median, Lo, Hi float64
	N              int
	Level          float64 // the coverage asked for (0.95)
}

// MedianInterval returns the median of v and its interval at level (0 to
// 1). With too few samples for any interval at that level (fewer than 6
// for 0.95) Lo and Hi are -Inf and +Inf: nothing is resolved. No samples:
// all NaN. v is not modified.
func MedianInterval(v []float64, level float64) Interval {
	iv := Interval{N: len(v), Level: level}
	if len(v) == 0 {
		iv.Median, iv.Lo, iv.Hi = math.NaN(), math.NaN(), math.NaN()
		return iv
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	iv.Median = s[n/2]
	if n%2 == 0 {
		iv.Median = (s[n/2-1] + s[n/2]) / 2
	}
	k := orderRank(n, (1-level)/2)
	if k == 0 {
		iv.Lo, iv.Hi = math.Inf(-1), math.Inf(1)
		return iv
	}
	iv.Lo, iv.Hi = s[k-1], s[n-k]
	return iv
}

// orderRank is the largest k (1-based) with P(Binomial(n, 1/2) < k) <=
// tail, or 0 when even k = 1 exceeds it (P(X < 1) = 2^-n). The binomial
// terms are summed in logs: n runs to thousands.
func orderRank(n int, tail float64) int {
	cdf, k := 0.0, 0 // cdf = P(X < k+1) after adding term k
	for x := 0; x < n; x++ {
		lg, _ := math.Lgamma(float64(n + 1))
		a, _ := math.Lgamma(float64(x + 1))
		b, _ := math.Lgamma(float64(n - x + 1))
		cdf += math.Exp(lg - a - b - float64(n)*math.Ln2)
		if cdf > tail*(1+1e-12) {
			break
		}
		k = x + 1
	}
	return k
}

// Ratios returns num[i]/den[i] for each pair; the slices must be as long
// as each other.
func Ratios(num, den []float64) []float64 {
	if len(num) != len(den) {
		panic(fmt.Sprintf("bench: Ratios of %d and %d samples", len(num), len(den)))
	}
	out := make([]float64, len(num))
	for i := range num {
		out[i] = num[i] / den[i]
	}
	return out
}

// Diffs returns a[i]-b[i] for each pair; the slices must be as long as
// each other.
func Diffs(a, b []float64) []float64 {
	if len(a) != len(b) {
		panic(fmt.Sprintf("bench: Diffs of %d and %d samples", len(a), len(b)))
	}
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}

// String prints the interval as "1.03 [0.99, 1.08] (95%, n=40)".
func (iv Interval) String() string {
	return fmt.Sprintf("%.3g [%.3g, %.3g] (%g%%, n=%d)", iv.Median, iv.Lo, iv.Hi, iv.Level*100, iv.N)
}

// Below judges the goal "the true median is below bound": met (true) when
// the whole interval is below it, MISSED (false) when the whole interval
// is at or above it, and not resolved (nil) when the interval straddles
// it. A sample median on the right side of the bound is not enough: on
// this machine that is a coin toss for an effect of a few percent.
func (iv Interval) Below(bound float64) *bool {
	switch {
	case iv.Hi < bound:
		return ptr(true)
	case iv.Lo >= bound:
		return ptr(false)
	}
	return nil
}

// Above judges "the true median is above bound", as Below does.
func (iv Interval) Above(bound float64) *bool {
	switch {
	case iv.Lo > bound:
		return ptr(true)
	case iv.Hi <= bound:
		return ptr(false)
	}
	return nil
}

func ptr(b bool) *bool { return &b }

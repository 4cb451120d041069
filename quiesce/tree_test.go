package quiesce

import (
	"math"
	"testing"
)

func treeSizes() []int {
	var ns []int
	for n := 1; n <= 1100; n++ {
		ns = append(ns, n)
	}
	return append(ns, 2047, 2048, 2049, 3000, 4095, 4096, 4097, 4999, 5000)
}

func ceilLog2(n int) int {
	if n <= 1 {
		return 0
	}
	return int(math.Ceil(math.Log2(float64(n))))
}

func TestTreeReachesEveryNodeOnce(t *testing.T) {
	for _, n := range treeSizes() {
		seen := make([]int, n)
		hops := make([]int, n)
		step := make([]int, n) // sequential schedule: one send per node per step
		queue := []int{0}
		seen[0] = 1
		maxHops, maxStep := 0, 0
		for len(queue) > 0 {
			i := queue[0]
			queue = queue[1:]
			for k, c := range Children(i, n) {
				if c <= i || c >= n {
					t.Fatalf("n=%d: child %d of %d out of range", n, c, i)
				}
				if p := Parent(c, n); p != i {
					t.Fatalf("n=%d: Parent(%d)=%d, want %d", n, c, p, i)
				}
				seen[c]++
				hops[c] = hops[i] + 1
				step[c] = step[i] + k + 1
				maxHops = max(maxHops, hops[c])
				maxStep = max(maxStep, step[c])
				queue = append(queue, c)
			}
		}
		for i, s := range seen {
			if s != 1 {
				t.Fatalf("n=%d: node %d reached %d times", n, i, s)
			}
		}
		if Parent(0, n) != -1 {
			t.Fatalf("n=%d: root has a parent", n)
		}
		want := ceilLog2(n)
		if Depth(n) != want {
			t.Fatalf("Depth(%d)=%d, want %d", n, Depth(n), want)
		}
		// Concurrent sends reach every node in at most ceil(log2 n) hops,
		// exactly that many when n is a power of two; one send at a time,
		// largest subtree first, takes exactly ceil(log2 n) steps.
		if maxHops > want || (n&(n-1) == 0 && maxHops != want) {
			t.Fatalf("n=%d: depth %d hops, want <= %d", n, maxHops, want)
		}
		if maxStep != want {
			t.Fatalf("n=%d: sequential schedule takes %d steps, want %d", n, maxStep, want)
		}
	}
}

// The agent relies on every subtree being a contiguous range that is itself a
// binomial tree rooted at its first index.
func TestSubtreeIsContiguousBinomialTree(t *testing.T) {
	for _, n := range treeSizes() {
		for i := range n {
			lo, hi := Subtree(i, n)
			if lo != i || hi > n || hi <= lo {
				t.Fatalf("n=%d: Subtree(%d)=[%d,%d)", n, i, lo, hi)
			}
			got := Children(i, n)
			want := Children(0, hi-lo)
			if len(got) != len(want) {
				t.Fatalf("n=%d i=%d: children %v, relative %v", n, i, got, want)
			}
			for k := range got {
				if got[k]-lo != want[k] {
					t.Fatalf("n=%d i=%d: children %v, relative %v", n, i, got, want)
				}
			}
			if n > 64 && i > 64 {
				break // the first indices cover every shape; keep it fast
			}
		}
	}
}

// TestFanoutSplit: the tree's split is node 0's Children with their
// Subtree ranges, and the star's every other node alone.
func TestFanoutSplit(t *testing.T) {
	for _, n := range treeSizes() {
		var want [][2]int
		for _, c := range Children(0, n) {
			lo, hi := Subtree(c, n)
			want = append(want, [2]int{lo, hi})
		}
		count, depth := FanoutTree.split(n)
		if count != len(want) || depth != Depth(n) {
			t.Fatalf("n=%d: tree split %d depth %d, want %d depth %d", n, count, depth, len(want), Depth(n))
		}
		for i := range count {
			if lo, hi := FanoutTree.sub(n, i); [2]int{lo, hi} != want[i] {
				t.Fatalf("n=%d: tree sub-list %d is [%d, %d), want %v", n, i, lo, hi, want[i])
			}
		}
		count, depth = FanoutStar.split(n)
		if count != n-1 || depth != min(n-1, 1) {
			t.Fatalf("n=%d: star split %d depth %d", n, count, depth)
		}
		for i := range count {
			if lo, hi := FanoutStar.sub(n, i); lo != i+1 || hi != i+2 {
				t.Fatalf("n=%d: star sub-list %d is [%d, %d)", n, i, lo, hi)
			}
		}
	}
}

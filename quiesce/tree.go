package quiesce

import "math/bits"

// The binomial tree of OpenXM's broadcast and reduction (docs/guarantees.md,
// "Where the protocol comes from"), rooted at index 0 (the coordinator). Node
// i's parent is i with its lowest set bit cleared; its children are i+m for the
// powers of two m below that bit. Child c's subtree is the contiguous range
// [c, c+lowbit(c)), which is again a binomial tree rooted at its first
// element: that is why a message can carry just the recipient's slice.

func lowbit(i int) int { return i & -i }

// Parent returns the parent of node i in a tree of n nodes, or -1 for the root
// (and for indices outside the tree).
func Parent(i, n int) int {
	if i <= 0 || i >= n {
		return -1
	}
	return i - lowbit(i)
}

// Children returns the children of node i in a tree of n nodes, largest
// subtree first: sending to the largest subtree first is what makes the
// sequential schedule finish in ceil(log2 n) steps.
func Children(i, n int) []int {
	if i < 0 || i >= n {
		return nil
	}
	limit := lowbit(i)
	if i == 0 {
		limit = 1 << bits.Len(uint(n-1))
	}
	var out []int
	for m := limit >> 1; m >= 1; m >>= 1 {
		if i+m < n {
			out = append(out, i+m)
		}
	}
	return out
}

// Subtree returns the half-open index range [lo, hi) of node i's subtree in a
// tree of n nodes.
func Subtree(i, n int) (lo, hi int) {
	if i == 0 {
		return 0, n
	}
	return i, min(i+lowbit(i), n)
}

// Depth returns ceil(log2 n): the number of hops a round needs to reach every
// node when each node sends one message at a time, and an upper bound on the
// hops from the root to any node.
func Depth(n int) int {
	if n <= 1 {
		return 0
	}
	return bits.Len(uint(n - 1))
}

// Fanout says how the first node of a message's list sends the request on
// to the rest of the list.
type Fanout string

const (
	// FanoutTree, the default, forwards over the binomial tree above: a
	// round takes Depth(n) hops, and no node sends more than Depth(n)
	// requests or merges more than Depth(n) replies.
	FanoutTree Fanout = ""
	// FanoutStar has the first node call every other node directly: one
	// hop, but n-1 requests sent and replies merged by one node, so its
	// cost grows linearly with the job. It exists as the baseline the
	// tree's log2 scaling is measured against (BenchmarkScale); use the
	// tree for real jobs.
	FanoutStar Fanout = "star"
)

// split returns, for the first node of a list of n nodes, how many
// sub-lists it sends a request on to and the most hops a request then takes
// to reach the end of the list; sub gives each sub-list's range. A value
// other than FanoutStar is the tree: the fan-out changes the cost of a
// round, never its result, so guessing the tree is safe where refusing
// would only fail the pause.
func (f Fanout) split(n int) (count, depth int) {
	if f == FanoutStar {
		return max(n-1, 0), min(max(n-1, 0), 1)
	}
	return Depth(n), Depth(n)
}

// sub returns the index range [lo, hi) of the i-th sub-list of split(n),
// which starts with the node it is sent to. For the tree these are the
// Subtree ranges of Children(0, n), largest first, computed without the
// allocation: a round does this on every node.
func (f Fanout) sub(n, i int) (lo, hi int) {
	if f == FanoutStar {
		return i + 1, i + 2
	}
	m := (1 << Depth(n)) >> (i + 1)
	return m, min(2*m, n)
}

package quiesce

import "math/bits"

// The binomial tree of SEEDS.md §4, rooted at index 0 (the coordinator). Node
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

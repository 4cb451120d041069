package quiesce

import (
	"context"
	"sync"
	"testing"
	"time"
)

// timedNode records when each Drain check began and, as the CPU time the
// agent reads, charges each check cost.
type timedNode struct {
	*fakeNode
	mu   sync.Mutex
	cost time.Duration
	cpu  time.Duration
	at   []time.Time
}

func (n *timedNode) Drain(ctx context.Context, job string) (NodeReport, error) {
	n.mu.Lock()
	n.at = append(n.at, time.Now())
	n.cpu += n.cost
	n.mu.Unlock()
	return n.fakeNode.Drain(ctx, job)
}

func (n *timedNode) cpuTime() time.Duration {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cpu
}

// TestDrainWaitPacedByCPU: a node waiting for its queues to drain waits
// between two checks at least the CPU time the last check cost, so that
// mpid's checks, at real-time priority, leave at least half a CPU to the
// ranks whose reads they wait for. A sleep never ends early, so the
// checks' start times are at least that far apart however loaded the
// machine is. Without CPUTime the wait is DrainPoll.
func TestDrainWaitPacedByCPU(t *testing.T) {
	const cost = 20 * time.Millisecond
	f := newFake("n0")
	f.gatesOpen = false
	f.left = 6
	n := &timedNode{fakeNode: f, cost: cost}
	a := NewAgent(n, nil, RetryPolicy{})
	a.CPUTime = n.cpuTime
	ctx := context.Background()
	rep, err := n.Drain(ctx, "j")
	rep, err = a.drainUntil(ctx, "j", rep, err, time.Now().Add(time.Minute), func() bool { return false })
	if err != nil || !rep.Clean() {
		t.Fatalf("drainUntil: %+v, %v; want a clean report once the fake drained", rep, err)
	}
	if len(n.at) != 7 {
		t.Fatalf("%d checks, want 7 (6 rounds with bytes, then empty)", len(n.at))
	}
	// The first check's cost is not the wait's to know (it came with the
	// step); every later gap follows a check that cost 20 ms of CPU.
	for i := 2; i < len(n.at); i++ {
		if gap := n.at[i].Sub(n.at[i-1]); gap < cost {
			t.Errorf("checks %d and %d %v apart, after a check that cost %v of CPU: want at least that", i-1, i, gap, cost)
		}
	}
}

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

// wakingNode is a timedNode that says, through DrainWake, when its drain
// has done what it started: wakes are closed channels, one a check
// (none for a check past their end).
type wakingNode struct {
	*timedNode
	wakes []chan struct{}
}

func (n *wakingNode) DrainWake(job string) <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	if k := len(n.at) - 1; k >= 0 && k < len(n.wakes) {
		return n.wakes[k]
	}
	return nil
}

// TestDrainWaitWoken: a node whose drain says it is done is checked again
// then, not a poll later; each wake brings one check, and the wait
// between two checks stays at least what the last one cost in CPU. The
// poll is an hour, so every check before the deadline is a wake's.
func TestDrainWaitWoken(t *testing.T) {
	const cost = 20 * time.Millisecond
	for _, tc := range []struct {
		name   string
		left   int // checks with bytes before an empty one
		wakes  int // the first checks each followed by a closed wake
		checks int
		clean  bool
	}{
		{"one wake, then empty", 1, 1, 2, true},
		{"two wakes, then empty", 2, 2, 3, true},
		{"one wake, bytes still there: no second check", 3, 1, 2, false},
		{"the same wake again: no second early check", 3, 0, 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake("n0")
			f.gatesOpen = false
			f.left = tc.left
			n := &wakingNode{timedNode: &timedNode{fakeNode: f, cost: cost}}
			for range tc.wakes {
				c := make(chan struct{})
				close(c)
				n.wakes = append(n.wakes, c)
			}
			if tc.wakes == 0 {
				// One closed channel, said again after every check.
				c := make(chan struct{})
				close(c)
				n.wakes = []chan struct{}{c, c, c}
			}
			a := NewAgent(n, nil, RetryPolicy{})
			a.CPUTime = n.cpuTime
			a.poll = time.Hour
			ctx := context.Background()
			rep, err := n.Drain(ctx, "j")
			rep, err = a.drainUntil(ctx, "j", rep, err, time.Now().Add(time.Minute), func() bool { return false })
			if err != nil || rep.Clean() != tc.clean {
				t.Fatalf("drainUntil: %+v, %v; want clean %v", rep, err, tc.clean)
			}
			if len(n.at) != tc.checks {
				t.Fatalf("%d checks, want %d", len(n.at), tc.checks)
			}
			for i := 1; i < len(n.at); i++ {
				if gap := n.at[i].Sub(n.at[i-1]); i > 1 && gap < cost {
					t.Errorf("checks %d and %d %v apart, after a check that cost %v of CPU: want at least that", i-1, i, gap, cost)
				}
			}
		})
	}
}

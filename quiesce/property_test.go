package quiesce

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// problems returns the invariant breaches of a cluster, given the protocol's
// outcome. Checked only after the network delivered every late duplicate.
func problems(c *cluster, committed bool) []string {
	var out []string
	for _, f := range c.fakes {
		s := f.state()
		for _, b := range s.breaches {
			out = append(out, f.name+": "+b)
		}
		if committed {
			// Never COMMIT while any node's final report is non-empty.
			if s.lastVerify == nil || !s.lastVerify.Clean() {
				out = append(out, fmt.Sprintf("%s: committed with final report %+v", f.name, s.lastVerify))
			}
			if !s.frozen || s.gatesOpen {
				out = append(out, fmt.Sprintf("%s: committed but frozen=%v gatesOpen=%v", f.name, s.frozen, s.gatesOpen))
			}
		} else if s.frozen || !s.gatesOpen {
			// After ABORT (or RESUME) no node is frozen and every gate is open.
			out = append(out, fmt.Sprintf("%s: rolled back but frozen=%v gatesOpen=%v", f.name, s.frozen, s.gatesOpen))
		}
	}
	return out
}

type propOutcome struct{ committed, aborted bool }

func runSeed(seed uint64) (propOutcome, []string) { return runSeedFanout(seed, FanoutTree) }

func runSeedFanout(seed uint64, fanout Fanout) (propOutcome, []string) {
	rng := rand.New(rand.NewPCG(seed, 42))
	n := 1 + rng.IntN(40)
	if rng.IntN(8) == 0 {
		n = 100 + rng.IntN(100)
	}
	faults := Faults{
		MaxDelay: time.Duration(rng.IntN(2000)) * time.Microsecond,
		Drop:     rng.Float64() * 0.15,
		Dup:      rng.Float64() * 0.3,
	}
	retry := RetryPolicy{Initial: 3 * time.Millisecond, Max: 30 * time.Millisecond}
	c := newCluster(n, seed, faults, retry)
	faulty := false
	badNodes := rng.IntN(3) // most runs have at most one misbehaving node
	// Half the runs have every node count the bytes sent through closed
	// gates (FREEZE checks in its own round); in the rest, some do.
	allCount := rng.IntN(2) == 0
	for _, f := range c.fakes {
		f.counts = allCount || rng.IntN(2) == 0
		f.left = rng.IntN(4)
		if rng.IntN(4) == 0 {
			f.thawFails = 1 + rng.IntN(2)
		}
	}
	for range badNodes {
		f := c.fakes[rng.IntN(n)]
		switch rng.IntN(6) {
		case 0:
			f.stuck = true
		case 1:
			f.dirty = true
		case 2:
			f.fail = KindPrepare
		case 3:
			f.fail = KindDrain
		case 4:
			f.fail = KindFreeze
		case 5:
			f.fail = KindVerify
		}
	}
	for _, f := range c.fakes {
		faulty = faulty || f.faulty()
	}
	opt := Options{
		Prepare: 3 * time.Second, Drain: time.Second, DrainInterval: time.Millisecond,
		Freeze: 3 * time.Second, Verify: 3 * time.Second, Commit: 3 * time.Second,
		Abort: 20 * time.Second, Resume: 20 * time.Second, Retry: retry, Fanout: fanout,
	}
	co := NewCoordinator(c.net, opt)
	tag := fmt.Sprintf("seed %d (n=%d faults=%+v fanout=%q every node counts=%v)", seed, n, faults, fanout, allCount)
	var out []string
	res, err := co.Pause(context.Background(), "job", c.names)
	c.settle() // let every late duplicate land before looking
	var o propOutcome
	switch {
	case err == nil:
		o.committed = true
		if faulty {
			out = append(out, "committed although a node was configured to fail or stay non-empty")
		}
		if res.State != StatePaused || !res.Report.Empty() {
			out = append(out, fmt.Sprintf("committed with result %+v", res))
		}
		out = append(out, problems(c, true)...)
		if _, err := co.Resume(context.Background(), "job", c.names); err != nil {
			out = append(out, fmt.Sprintf("resume: %v", err))
		}
		c.settle()
		out = append(out, problems(c, false)...)
	default:
		o.aborted = true
		var ae *AbortError
		if !errors.As(err, &ae) {
			out = append(out, fmt.Sprintf("error is not an AbortError: %v", err))
			break
		}
		if len(ae.Unconfirmed) > 0 {
			out = append(out, fmt.Sprintf("rollback unconfirmed: %v", err))
		}
		if res.State != StateRunning {
			out = append(out, fmt.Sprintf("aborted with state %q", res.State))
		}
		out = append(out, problems(c, false)...)
	}
	c.net.Close()
	for i := range out {
		out[i] = tag + ": " + out[i]
	}
	return o, out
}

// TestPropertyRandomFaults runs the protocol over many seeds with random
// delays, duplicates and drops and random misbehaving nodes. Outcomes may
// differ with scheduling; the invariants may not.
func TestPropertyRandomFaults(t *testing.T) {
	seeds := 120
	if testing.Short() {
		seeds = 60
	}
	var commits, aborts atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16) // runs mostly wait on timers; overlap them
	for s := range seeds {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			o, probs := runSeed(uint64(s))
			if o.committed {
				commits.Add(1)
			}
			if o.aborted {
				aborts.Add(1)
			}
			for _, p := range probs {
				t.Error(p)
			}
		})
	}
	wg.Wait()
	// Both outcomes must have been exercised, or the invariants were checked
	// on nothing.
	if commits.Load() == 0 || aborts.Load() == 0 {
		t.Fatalf("commits=%d aborts=%d: property test did not exercise both outcomes", commits.Load(), aborts.Load())
	}
	t.Logf("%d seeds: %d committed, %d aborted", seeds, commits.Load(), aborts.Load())
}

// TestThousandsOfNodes simulates a job on 5000 nodes with a lossy network.
func TestThousandsOfNodes(t *testing.T) {
	const n = 3000
	retry := RetryPolicy{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	c := newCluster(n, 7, Faults{MaxDelay: 200 * time.Microsecond, Drop: 0.01, Dup: 0.01}, retry)
	defer c.net.Close()
	rng := rand.New(rand.NewPCG(7, 7))
	for _, f := range c.fakes {
		f.left = rng.IntN(3)
	}
	opt := Options{
		Prepare: 30 * time.Second, Drain: 30 * time.Second, Freeze: 30 * time.Second,
		Verify: 30 * time.Second, Commit: 30 * time.Second, Abort: 30 * time.Second,
		Resume: 30 * time.Second, Retry: retry,
	}
	co := NewCoordinator(c.net, opt)
	res, err := co.Pause(context.Background(), "big", c.names)
	if err != nil {
		t.Fatalf("pause of %d nodes: %v", n, err)
	}
	c.settle()
	if p := problems(c, true); len(p) > 0 {
		t.Fatalf("%d problems, first: %s", len(p), p[0])
	}
	if res.Report.Nodes != n {
		t.Fatalf("report accounts for %d nodes", res.Report.Nodes)
	}
	if _, err := co.Resume(context.Background(), "big", c.names); err != nil {
		t.Fatalf("resume: %v", err)
	}
	c.settle()
	if p := problems(c, false); len(p) > 0 {
		t.Fatalf("%d problems, first: %s", len(p), p[0])
	}
	calls, drops, dups := c.net.Stats()
	if drops == 0 || dups == 0 {
		t.Fatalf("faults not exercised: calls=%d drops=%d dups=%d", calls, drops, dups)
	}
	t.Logf("phases %+v; calls=%d drops=%d dups=%d", res.Phases, calls, drops, dups)
}

package quiesce

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// filterTransport is a node's (or the coordinator's) transport that loses
// what drop says: a request it never sends.
type filterTransport struct {
	tr   Transport
	drop func(to string, req Message) bool
}

func (f filterTransport) Call(ctx context.Context, to string, req Message) (Message, error) {
	if f.drop(to, req) {
		return Message{}, fmt.Errorf("to %s: %s lost", to, req.Kind)
	}
	return f.tr.Call(ctx, to, req)
}

// TestCoordinatorDiesInCommit: a coordinator that dies with its COMMIT on
// the way leaves the job in one state on every node once their leases have
// run out: rolled back everywhere if it died before the decider heard that
// every node committed (COMMIT reached some nodes and not others, the
// decider among them or not; or every node, and no DECIDE followed),
// paused everywhere if it died after (no COMMITTED, or a COMMITTED that
// missed a node). Before the decider, a COMMIT that reached node1 and not
// node2 left node1 paused for good and node2 rolled back by its lease.
func TestCoordinatorDiesInCommit(t *testing.T) {
	for _, tc := range []struct {
		name string
		// lost: what node0 (the tree's root) never sends on; dies: the
		// first request the coordinator can no longer send (nothing
		// after it goes either).
		lost   func(to string, req Message) bool
		dies   Kind
		paused bool
	}{
		{"COMMIT reaches node1 (the decider), not node2", lostTo(KindCommit, "node2"), KindAbort, false},
		{"COMMIT reaches node2, not the decider", lostTo(KindCommit, "node1"), KindAbort, false},
		{"COMMIT everywhere, no DECIDE", nothing, KindDecide, false},
		{"DECIDE, no COMMITTED", nothing, KindCommitted, true},
		{"COMMITTED reaches node1, not node2", lostTo(KindCommitted, "node2"), "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := NewMemNetwork(1, Faults{})
			defer mem.Close()
			c := &cluster{net: mem, byName: map[string]*fakeNode{}}
			opt := fastOpts()
			opt.Verify, opt.Commit, opt.Abort = 300*time.Millisecond, 300*time.Millisecond, 300*time.Millisecond
			var mu sync.Mutex
			var lost []string
			for i := range 3 {
				name := fmt.Sprintf("node%d", i)
				f := newFake(name)
				var tr Transport = mem
				if i == 0 {
					tr = filterTransport{mem, func(to string, req Message) bool {
						if !tc.lost(to, req) {
							return false
						}
						mu.Lock()
						lost = append(lost, fmt.Sprintf("%s to %s", req.Kind, to))
						mu.Unlock()
						return true
					}}
				}
				a := NewAgent(f, tr, opt.Retry)
				a.LeaseGrace = 20 * time.Millisecond
				c.names, c.fakes, c.agents = append(c.names, name), append(c.fakes, f), append(c.agents, a)
				c.byName[name] = f
				mem.Register(name, a.Handle)
			}
			var dead atomic.Bool
			co := NewCoordinator(filterTransport{mem, func(to string, req Message) bool {
				if req.Kind == tc.dies {
					dead.Store(true)
				}
				return dead.Load()
			}}, opt)
			_, err := co.Pause(context.Background(), "j", c.names)
			if tc.dies == "" && err != nil {
				t.Fatalf("pause: %v", err)
			}
			co.Wait() // COMMITTED goes after Pause returns
			mu.Lock()
			if len(lost) == 0 && tc.dies != KindDecide && tc.dies != KindCommitted {
				t.Fatalf("nothing was lost: the case did not happen")
			}
			mu.Unlock()
			// Every lease has run out, and whatever it asked is answered.
			deadline := time.Now().Add(10 * time.Second)
			for {
				c.settle()
				pausing := 0
				for _, a := range c.agents {
					if a.Pausing("j") {
						pausing++
					}
				}
				if pausing == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d nodes still under way 10 s after the pause", pausing)
				}
				time.Sleep(time.Millisecond)
			}
			c.settle()
			if tc.paused {
				checkPaused(t, c)
			} else {
				checkRolledBack(t, c)
			}
			for i, a := range c.agents {
				st, _ := a.State("j")
				t.Logf("node%d: %+v", i, st)
			}
		})
	}
}

func lostTo(kind Kind, node string) func(string, Message) bool {
	return func(to string, req Message) bool { return req.Kind == kind && to == node }
}

func nothing(string, Message) bool { return false }

// TestOutcomeFences: the decider asked about a pause whose DECIDE it never
// ran says it did not hold, rolls it back there and refuses its DECIDE from
// then on, so a coordinator still alive rolls back everywhere; asked after
// DECIDE, it says held, and an ABORT undoes that.
func TestOutcomeFences(t *testing.T) {
	f := newFake("n1")
	a := NewAgent(f, nil, fastOpts().Retry)
	step := func(kind Kind, seq uint64) Message {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		rep, err := a.Handle(ctx, Message{Version: ProtocolVersion, Job: "j", Epoch: 7, Seq: seq, Kind: kind, Nodes: []string{"n1"}, Decider: "n1"})
		if err != nil {
			t.Fatalf("%s: %v", kind, err)
		}
		return rep
	}
	ask := func(epoch uint64) (bool, error) {
		rep, err := a.Handle(context.Background(), Message{Version: ProtocolVersion, Job: "j", Epoch: epoch, Kind: KindOutcome, Nodes: []string{"n1"}})
		if err != nil {
			return false, err
		}
		return outcome(rep)
	}
	for i, k := range []Kind{KindPrepare, KindDrain, KindFreeze, KindVerify, KindCommit} {
		step(k, uint64(i+1))
	}
	if !a.Pausing("j") {
		t.Fatal("no lease after COMMIT on a job with a decider")
	}
	if held, err := ask(7); held || err != nil {
		t.Fatalf("asked before DECIDE: held %v, %v; want not held", held, err)
	}
	checkRolledBack(t, &cluster{fakes: []*fakeNode{f}})
	if rep := step(KindDecide, 6); !strings.Contains(rep.Err, ErrStale.Error()) {
		t.Errorf("DECIDE after it was asked: %+v; want it refused", rep)
	}
	if held, _ := ask(7); held {
		t.Error("asked again: held")
	}

	g := newFake("n1")
	a = NewAgent(g, nil, fastOpts().Retry)
	f = g
	for i, k := range []Kind{KindPrepare, KindDrain, KindFreeze, KindVerify, KindCommit, KindDecide} {
		if rep := step(k, uint64(i+1)); rep.Err != "" {
			t.Fatalf("%s: %s", k, rep.Err)
		}
	}
	if held, err := ask(7); !held || err != nil {
		t.Fatalf("asked after DECIDE: held %v, %v; want held", held, err)
	}
	if held, _ := ask(0); held {
		t.Error("epoch 0 held")
	}
	step(KindAbort, 7)
	if held, _ := ask(7); held {
		t.Error("asked after the ABORT: held")
	}
}

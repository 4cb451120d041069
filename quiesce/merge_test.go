package quiesce

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// phaseRounds is each phase's rounds in order, e.g. "FREEZE:1 VERIFY:0".
func phaseRounds(res Result) string {
	var s []string
	for _, p := range res.Phases {
		s = append(s, fmt.Sprintf("%s:%d", p.Phase, p.Rounds))
	}
	return strings.Join(s, " ")
}

// TestFreezeVerifyOneRound: where every node counts the bytes sent through
// closed gates, FREEZE carries Check, each node checks right after its own
// freeze, and no VERIFY round follows; where one node does not count (or
// does not know the field), the two rounds stay.
func TestFreezeVerifyOneRound(t *testing.T) {
	for _, tc := range []struct {
		name      string
		uncounted int // the node that does not count, -1: none
		want      string
	}{
		{"every node counts", -1, "PREPARE:1 DRAIN:0 FREEZE:1 VERIFY:0 COMMIT:1"},
		{"node3 does not", 3, "PREPARE:1 DRAIN:0 FREEZE:1 VERIFY:1 COMMIT:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(6, 1, Faults{}, fastOpts().Retry)
			defer c.net.Close()
			for i, f := range c.fakes {
				f.counts = i != tc.uncounted
			}
			res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
			if err != nil {
				t.Fatal(err)
			}
			if got := phaseRounds(res); got != tc.want {
				t.Errorf("phases %s, want %s", got, tc.want)
			}
			checkPaused(t, c)
			for _, f := range c.fakes {
				if s := f.state(); s.calls["freeze"] != 1 || s.calls["verify"] != 1 {
					t.Errorf("%s: %d freezes, %d checks; want one each", f.name, s.calls["freeze"], s.calls["verify"])
				}
			}
		})
	}
}

// countingCluster is newCluster of n fakes that all count the bytes sent
// through closed gates, closed at the end of the test.
func countingCluster(t *testing.T, n int) *cluster {
	c := newCluster(n, 1, Faults{}, fastOpts().Retry)
	t.Cleanup(c.net.Close)
	for _, f := range c.fakes {
		f.counts = true
	}
	return c
}

// TestFreezeVerifyOneRoundFindsBytes: the one round's check is VERIFY's.
// Bytes that crossed after a node's last drain answer are found after its
// freeze, the job thaws with its gates closed and drains again, and the
// next round holds; bytes sent through a closed gate roll the pause back
// at once, in VERIFY, as with two rounds.
func TestFreezeVerifyOneRoundFindsBytes(t *testing.T) {
	t.Run("late bytes", func(t *testing.T) {
		c := countingCluster(t, 5)
		c.fakes[2].late = 1
		res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatal(err)
		}
		// The second drain takes as many rounds as the fake's late bytes
		// need to be read.
		want := "PREPARE:1 DRAIN:0 FREEZE:1 VERIFY:0 THAW:1 DRAIN:n FREEZE:1 VERIFY:0 COMMIT:1"
		if got := regexp.MustCompile(`THAW:1 DRAIN:\d+`).ReplaceAllString(phaseRounds(res), "THAW:1 DRAIN:n"); got != want {
			t.Errorf("phases %s, want %s", got, want)
		}
		if e := res.Phases[3].Err; !strings.Contains(e, "node2") {
			t.Errorf("the first check's VERIFY record: %q, want the bytes node2 found", e)
		}
		checkPaused(t, c)
	})
	t.Run("violation", func(t *testing.T) {
		c := countingCluster(t, 5)
		c.fakes[4].dirty, c.fakes[4].violate = true, true
		_, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindVerify || !errors.Is(err, ErrNotEmpty) {
			t.Fatalf("want abort in VERIFY, got %v", err)
		}
		if s := c.fakes[4].state(); s.calls["verify"] != 1 {
			t.Errorf("%d checks, want 1: a violation is not drained again", s.calls["verify"])
		}
		checkRolledBack(t, c)
	})
	t.Run("late send", func(t *testing.T) {
		// A send call that read its gate open before it closed reached
		// the kernel after node3's last drain answer, on a socket with
		// nothing held: its bytes may already be on another node that
		// froze and checked, so the round is not clean, and the job
		// drains again and pauses.
		c := countingCluster(t, 5)
		c.fakes[3].lateChecks = 1
		res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatal(err)
		}
		want := "PREPARE:1 DRAIN:0 FREEZE:1 VERIFY:0 THAW:1 DRAIN:1 FREEZE:1 VERIFY:0 COMMIT:1"
		if got := phaseRounds(res); got != want {
			t.Errorf("phases %s, want %s", got, want)
		}
		if e := res.Phases[3].Err; !strings.Contains(e, "node3") || !strings.Contains(e, "late 40") {
			t.Errorf("the first check's VERIFY record: %q, want node3's late bytes", e)
		}
		checkPaused(t, c)
	})
	t.Run("freeze fails", func(t *testing.T) {
		c := countingCluster(t, 5)
		c.fakes[1].fail = KindFreeze
		_, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindFreeze || !errors.Is(err, ErrNodeFailed) {
			t.Fatalf("want abort in FREEZE, got %v", err)
		}
		if s := c.fakes[1].state(); s.calls["verify"] != 0 {
			t.Errorf("node1 checked after its freeze failed")
		}
		checkRolledBack(t, c)
	})
}

// drainPorts is a peeredNode whose job sockets get the ports add at its
// first DRAIN (a socket made after PREPARE): no node hears of them before
// that round's answers.
type drainPorts struct {
	*peeredNode
	add Ports
}

func (d *drainPorts) Drain(ctx context.Context, job string) (NodeReport, error) {
	d.pm.Lock()
	d.mine = d.mine.Union(d.add)
	d.pm.Unlock()
	return d.peeredNode.Drain(ctx, job)
}

// TestDrainNamesLateJobPorts: a node that left out, as a program's own, a
// connection holding bytes whose far port another node's answer in the
// same round says is the job's does not end the drain: the next round
// names the port, the node drains that connection like the others, and
// the check after the freeze finds nothing left (without that round, the
// drain would end with the connection unseen, and only the check after the
// freeze would find it).
func TestDrainNamesLateJobPorts(t *testing.T) {
	a := &peeredNode{fakeNode: newFake("a"), mine: Ports{5000}, far: 7000}
	b := &drainPorts{peeredNode: &peeredNode{fakeNode: newFake("b"), mine: Ports{6000}}, add: Ports{7000}}
	net := NewMemNetwork(1, Faults{})
	defer net.Close()
	for _, n := range []Node{a, b} {
		ag := NewAgent(n, net, fastOpts().Retry)
		net.Register(map[Node]string{a: "a", b: "b"}[n], ag.Handle)
	}
	a.counts, b.counts = true, true
	res, err := NewCoordinator(net, fastOpts()).Pause(context.Background(), "j", []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	got := phaseRounds(res)
	if !strings.HasPrefix(got, "PREPARE:1 DRAIN:") || strings.HasPrefix(got, "PREPARE:1 DRAIN:1 ") || strings.Contains(got, "THAW") {
		t.Errorf("phases %s: want more than one drain round, and no THAW", got)
	}
	if s := a.state(); s.lastVerify == nil || !s.lastVerify.Clean() || s.calls["verify"] != 1 {
		t.Errorf("a's check after the freeze: %+v (%d checks)", s.lastVerify, s.calls["verify"])
	}
}

// holdKind is a transport that holds the coordinator's requests of one
// kind until release is closed, and records the kinds it was asked to
// send, in order.
type holdKind struct {
	tr      Transport
	kind    Kind
	release chan struct{}
	mu      sync.Mutex
	sent    []Kind
}

func (h *holdKind) Call(ctx context.Context, to string, req Message) (Message, error) {
	h.mu.Lock()
	h.sent = append(h.sent, req.Kind)
	h.mu.Unlock()
	if req.Kind == h.kind {
		select {
		case <-h.release:
		case <-ctx.Done():
			return Message{}, ctx.Err()
		}
	}
	return h.tr.Call(ctx, to, req)
}

func (h *holdKind) kinds() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var s []string
	for _, k := range h.sent {
		s = append(s, string(k))
	}
	return strings.Join(s, " ")
}

// TestCommittedAfterReturn: once DECIDE is acknowledged the pause holds,
// so Pause returns without waiting for COMMITTED, which ends the nodes'
// leases afterwards; the job's next operation (here a RESUME) waits for
// it rather than racing it over the same nodes and connections.
func TestCommittedAfterReturn(t *testing.T) {
	c := newCluster(5, 1, Faults{}, fastOpts().Retry)
	defer c.net.Close()
	h := &holdKind{tr: c.net, kind: KindCommitted, release: make(chan struct{})}
	co := NewCoordinator(h, fastOpts())
	if _, err := co.Pause(context.Background(), "j", c.names); err != nil {
		t.Fatalf("pause, COMMITTED held: %v", err)
	}
	checkPaused(t, c)
	resumed := make(chan error, 1)
	go func() {
		_, err := co.Resume(context.Background(), "j", c.names)
		resumed <- err
	}()
	select {
	case err := <-resumed:
		t.Fatalf("the resume ended (%v) while the pause's COMMITTED was still held", err)
	case <-time.After(50 * time.Millisecond):
	}
	if k := h.kinds(); strings.Contains(k, string(KindResume)) {
		t.Fatalf("RESUME sent while COMMITTED was held: %s", k)
	}
	close(h.release)
	if err := <-resumed; err != nil {
		t.Fatalf("resume: %v", err)
	}
	co.Wait()
	if k := h.kinds(); !regexp.MustCompile(`DECIDE (COMMITTED )+RESUME$`).MatchString(k) {
		t.Errorf("the coordinator sent %s; want DECIDE, COMMITTED, then RESUME", k)
	}
	checkRolledBack(t, c) // resumed: thawed, gates open
}

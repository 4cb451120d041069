package quiesce

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// edge is one request sent: by whom (an agent's node, or "coordinator"),
// to whom, carrying how many nodes.
type edge struct {
	from, to string
	nodes    int
	kind     Kind
}

// recorder keeps every request sent through its transports.
type recorder struct {
	mu    sync.Mutex
	edges []edge
}

// recTransport is one sender's transport, recording what it sends.
type recTransport struct {
	from string
	tr   Transport
	rec  *recorder
}

func (t recTransport) Call(ctx context.Context, to string, req Message) (Message, error) {
	t.rec.mu.Lock()
	t.rec.edges = append(t.rec.edges, edge{t.from, to, len(req.Nodes), req.Kind})
	t.rec.mu.Unlock()
	return t.tr.Call(ctx, to, req)
}

// recordedCluster is newCluster with every agent sending through a
// recTransport. Retransmissions come late (a second), so that each request
// is sent once and the edges are exactly the fan-out's.
func recordedCluster(n int) (*cluster, *recorder, RetryPolicy) {
	retry := RetryPolicy{Initial: time.Second, Max: time.Second}
	c := newCluster(n, 1, Faults{}, retry)
	rec := &recorder{}
	for i, name := range c.names {
		a := NewAgent(c.fakes[i], recTransport{name, c.net, rec}, retry)
		c.agents[i] = a
		c.net.Register(name, a.Handle)
	}
	return c, rec, retry
}

// TestStarFansOutFlat: with FanoutStar the first node calls every other
// node itself, each with a list of one, and no other node sends anything;
// with the tree, nodes below the root forward, and the root sends only to
// its Depth(n) children. Either way each node gets each request once,
// COMMITTED's too: the round Pause leaves behind it, which Phases does not
// count.
func TestStarFansOutFlat(t *testing.T) {
	const n = 13 // not a power of two: the tree's last subtrees are cut short
	for _, f := range []Fanout{FanoutStar, FanoutTree} {
		c, rec, retry := recordedCluster(n)
		o := fastOpts()
		o.Retry, o.Fanout = retry, f
		co := NewCoordinator(recTransport{"coordinator", c.net, rec}, o)
		res, err := co.Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatalf("%q: pause: %v", f, err)
		}
		co.Wait() // COMMITTED's round runs after Pause returned
		checkPaused(t, c)
		rounds := 1 // COMMITTED
		for _, p := range res.Phases {
			rounds += p.Rounds
		}
		received := map[string]int{}
		sent := map[string]int{}
		for _, e := range rec.edges {
			received[e.to]++
			sent[e.from]++
			if f == FanoutStar && e.from != "coordinator" && (e.from != c.names[0] || e.nodes != 1) {
				t.Errorf("star: %s sent %s a list of %d nodes; only %s may send, lists of one", e.from, e.to, e.nodes, c.names[0])
			}
		}
		for i, name := range c.names {
			want := rounds
			if i == 1 {
				want++ // the decider's DECIDE, the coordinator's call
			}
			if received[name] != want {
				t.Errorf("%q: %s received %d requests in %d rounds, want %d", f, name, received[name], rounds, want)
			}
		}
		forwarders := 0
		for from := range sent {
			if from != "coordinator" && from != c.names[0] {
				forwarders++
			}
		}
		switch f {
		case FanoutStar:
			if sent[c.names[0]] != (n-1)*rounds || forwarders != 0 {
				t.Errorf("star: root sent %d requests (want %d), %d other nodes sent any (want 0)", sent[c.names[0]], (n-1)*rounds, forwarders)
			}
		case FanoutTree:
			if sent[c.names[0]] != Depth(n)*rounds || forwarders == 0 {
				t.Errorf("tree: root sent %d requests (want %d), %d other nodes forwarded (want some)", sent[c.names[0]], Depth(n)*rounds, forwarders)
			}
		}
		c.net.Close()
	}
}

// TestStarCommitsAndAborts: a pause with the star commits, resumes and
// rolls back exactly as one with the tree does: the same outcomes and the
// same reports for a dirty node, a failing node in every phase and an
// unreachable one.
func TestStarCommitsAndAborts(t *testing.T) {
	for _, f := range []Fanout{FanoutTree, FanoutStar} {
		o := fastOpts()
		o.Fanout = f

		c := newCluster(9, 1, Faults{}, o.Retry)
		for i, fk := range c.fakes {
			fk.left = i % 3
		}
		co := NewCoordinator(c.net, o)
		res, err := co.Pause(context.Background(), "j", c.names)
		if err != nil || res.State != StatePaused || !res.Report.Complete(9) || !res.Report.Empty() {
			t.Fatalf("%q: pause: %+v %v", f, res, err)
		}
		checkPaused(t, c)
		if _, err := co.Resume(context.Background(), "j", c.names); err != nil {
			t.Fatalf("%q: resume: %v", f, err)
		}
		checkRolledBack(t, c)
		c.net.Close()

		c = newCluster(9, 1, Faults{}, o.Retry)
		c.fakes[7].dirty = true
		_, err = NewCoordinator(c.net, o).Pause(context.Background(), "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindVerify || !errors.Is(err, ErrNotEmpty) || ae.Report.Pending[0].Node != "node7" {
			t.Fatalf("%q: want abort in VERIFY naming node7, got %v", f, err)
		}
		checkRolledBack(t, c)
		c.net.Close()

		for _, k := range []Kind{KindPrepare, KindDrain, KindFreeze, KindVerify, KindCommit} {
			c := newCluster(6, 1, Faults{}, o.Retry)
			c.fakes[3].fail = k
			c.fakes[5].thawFails = 1
			_, err := NewCoordinator(c.net, o).Pause(context.Background(), "j", c.names)
			var ae *AbortError
			if !errors.As(err, &ae) || ae.Phase != k || !errors.Is(err, ErrNodeFailed) || len(ae.Unconfirmed) != 0 {
				t.Fatalf("%q, %s fails: want a confirmed abort in that phase, got %v", f, k, err)
			}
			if fl := ae.Report.Failed(); len(fl) != 1 || fl[0].Node != "node3" || !strings.Contains(fl[0].Err, "injected") {
				t.Errorf("%q, %s fails: report %+v", f, k, ae.Report)
			}
			checkRolledBack(t, c)
			c.net.Close()
		}

		c = newCluster(4, 1, Faults{}, o.Retry)
		ou := o
		ou.Prepare, ou.Abort = 200*time.Millisecond, 2*time.Second
		_, err = NewCoordinator(c.net, ou).Pause(context.Background(), "j", append(append([]string(nil), c.names...), "ghost"))
		if !errors.As(err, &ae) || ae.Phase != KindPrepare {
			t.Fatalf("%q: want abort in PREPARE, got %v", f, err)
		}
		if fl := ae.Report.Failed(); len(fl) != 1 || fl[0].Node != "ghost" || !fl[0].Unreached {
			t.Errorf("%q: failed nodes %+v, want the ghost, unreached", f, fl)
		}
		checkRolledBack(t, c)
		c.net.Close()
	}
}

// TestPropertyRandomFaultsStar: the invariants of TestPropertyRandomFaults
// hold with the star too, under lost, duplicated and delayed messages.
func TestPropertyRandomFaultsStar(t *testing.T) {
	seeds := 40
	if testing.Short() {
		seeds = 20
	}
	var mu sync.Mutex
	var commits, aborts int
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for s := range seeds {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			o, probs := runSeedFanout(uint64(s), FanoutStar)
			mu.Lock()
			defer mu.Unlock()
			if o.committed {
				commits++
			}
			if o.aborted {
				aborts++
			}
			for _, p := range probs {
				t.Error(p)
			}
		})
	}
	wg.Wait()
	if commits == 0 || aborts == 0 {
		t.Fatalf("commits=%d aborts=%d: both outcomes must be exercised", commits, aborts)
	}
}

// TestFanoutWire: the tree, the default, leaves the field out, so the
// envelope is what agents that predate it send and read; such an agent
// ignores "fanout" and uses the tree, which is still a correct round.
func TestFanoutWire(t *testing.T) {
	m := Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindFreeze, Nodes: []string{"a", "b"}}
	b, err := json.Marshal(m)
	if err != nil || strings.Contains(string(b), "fanout") {
		t.Fatalf("tree message on the wire: %s %v", b, err)
	}
	m.Fanout = FanoutStar
	if b, err = json.Marshal(m); err != nil || !strings.Contains(string(b), `"fanout":"star"`) {
		t.Fatalf("star message on the wire: %s %v", b, err)
	}
	// A fan-out this agent does not know is served as the tree, as an
	// agent that predates the field serves the star: the pause holds.
	c := newCluster(7, 1, Faults{}, fastOpts().Retry)
	defer c.net.Close()
	o := fastOpts()
	o.Fanout = "from-a-newer-coordinator"
	if _, err := NewCoordinator(c.net, o).Pause(context.Background(), "j", c.names); err != nil {
		t.Fatalf("pause with an unknown fan-out: %v", err)
	}
	checkPaused(t, c)
}

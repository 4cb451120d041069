package quiesce

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// fakeNode is an in-memory Node. Its bytes drain only while its gates are
// closed, and it records every breach of the order the protocol promises
// (freeze with open gates, verify while running, ...), so tests can assert
// there were none.
type fakeNode struct {
	name string

	mu        sync.Mutex
	gatesOpen bool
	frozen    bool
	left      int  // drain rounds with closed gates until empty
	stuck     bool // never drains (a rank computing, not reading)
	dirty     bool // drains, but the kernel check after freeze finds bytes
	violate   bool // ... and bytes sent through closed gates
	// lateChecks: that many kernel checks after a freeze find bytes sent
	// through closed gates on sockets with nothing held (a late send
	// call), already read; the later ones are clean.
	lateChecks int
	fail       Kind          // this step always fails
	blame      *Fault        // ... blaming a rank (RankFault)
	thawFails  int           // the first thawFails Thaws fail
	slow       time.Duration // each Drain takes this long (a busy node)
	counts     bool          // Drain says it counts bytes sent through closed gates
	// violateDrain: every drain check after the first counts bytes sent
	// through closed gates that no page vouches for (a send past the
	// shim), and says them from then on.
	violateDrain bool
	// late bytes arrive right after the node's first empty DRAIN answer
	// (another node's last bytes, crossing): its next late checks find
	// them, and a freeze before they are read leaves them for VERIFY.
	late       int
	saidEmpty  bool
	frozeDirty bool
	calls      map[string]int
	lastVerify *NodeReport
	breaches   []string
}

func newFake(name string) *fakeNode {
	return &fakeNode{name: name, gatesOpen: true, calls: map[string]int{}}
}

var errInjected = errors.New("injected failure")

func (f *fakeNode) enter(step string, kind Kind) error {
	f.calls[step]++
	if f.fail == kind {
		if f.blame != nil {
			return fmt.Errorf("%s on %s: %w", step, f.name, errors.Join(errInjected, blamed{*f.blame}))
		}
		return fmt.Errorf("%s on %s: %w", step, f.name, errInjected)
	}
	return nil
}

// blamed is a node's RankFault.
type blamed struct{ f Fault }

func (b blamed) Error() string { return fmt.Sprintf("rank %d: %s", b.f.Rank, b.f.Code) }
func (b blamed) Fault() Fault  { return b.f }

func (f *fakeNode) breach(s string) { f.breaches = append(f.breaches, s) }

func (f *fakeNode) report() NodeReport {
	if f.stuck || f.left > 0 {
		return NodeReport{Conns: []Conn{{Local: f.name + ":1000", Remote: "peer:2000", SendQueue: 100, Unread: 7, Rank: 3}}}
	}
	return NodeReport{Empty: true}
}

func (f *fakeNode) Prepare(ctx context.Context, job string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("prepare", KindPrepare); err != nil {
		return err
	}
	if f.frozen {
		f.breach("prepare while frozen")
	}
	f.gatesOpen = false
	return nil
}

func (f *fakeNode) Drain(ctx context.Context, job string) (NodeReport, error) {
	f.mu.Lock()
	slow := f.slow
	f.mu.Unlock()
	if slow > 0 {
		select {
		case <-time.After(slow):
		case <-ctx.Done():
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("drain", KindDrain); err != nil {
		return NodeReport{}, err
	}
	if f.gatesOpen {
		f.breach("drain with open gates")
	}
	r := f.report()
	r.Counted = f.counts
	if f.violateDrain && f.calls["drain"] > 1 {
		r.Violations = 7
	}
	if f.left > 0 {
		f.left--
	}
	if r.Empty && f.late > 0 {
		if f.saidEmpty {
			f.late--
			return NodeReport{Conns: []Conn{{Local: f.name + ":1002", Remote: "peer:2002", Unread: 9, Rank: 4}}}, nil
		}
		f.saidEmpty = true
	}
	return r, nil
}

// Commit is where mpid records the pause; a failed one must roll it back.
func (f *fakeNode) Commit(ctx context.Context, job string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enter("commit", KindCommit)
}

func (f *fakeNode) Freeze(ctx context.Context, job string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("freeze", KindFreeze); err != nil {
		return err
	}
	if f.gatesOpen {
		f.breach("freeze with open gates")
	}
	f.frozen = true
	f.frozeDirty = f.saidEmpty && f.late > 0
	return nil
}

func (f *fakeNode) Verify(ctx context.Context, job string) (NodeReport, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("verify", KindVerify); err != nil {
		f.lastVerify = &NodeReport{Err: err.Error()}
		return NodeReport{}, err
	}
	if !f.frozen {
		f.breach("verify while running")
	}
	r := f.report()
	if f.dirty || f.frozeDirty {
		r = NodeReport{Conns: []Conn{{Local: f.name + ":1001", Remote: "peer:2001", Unread: 1, Rank: -1}}}
		if f.violate {
			r.Violations = 5
		}
	}
	if f.lateChecks > 0 {
		f.lateChecks--
		r.Late = 40
	}
	f.lastVerify = &r
	return r, nil
}

func (f *fakeNode) Thaw(ctx context.Context, job string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["thaw"]++
	if f.thawFails > 0 {
		f.thawFails--
		return fmt.Errorf("thaw on %s: %w", f.name, errInjected)
	}
	f.frozen = false
	return nil
}

func (f *fakeNode) Open(ctx context.Context, job string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["open"]++
	f.gatesOpen = true
	return nil
}

type fakeState struct {
	gatesOpen, frozen bool
	lastVerify        *NodeReport
	breaches          []string
	calls             map[string]int
}

func (f *fakeNode) state() fakeState {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := make(map[string]int, len(f.calls))
	for k, v := range f.calls {
		c[k] = v
	}
	return fakeState{f.gatesOpen, f.frozen, f.lastVerify, append([]string(nil), f.breaches...), c}
}

// faulty reports whether the fake is configured so that no pause may commit.
func (f *fakeNode) faulty() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stuck || f.dirty || (f.fail != "" && f.fail != KindCommit)
}

// cluster is a job of fake nodes on a MemNetwork, each with its Agent.
type cluster struct {
	net    *MemNetwork
	names  []string
	fakes  []*fakeNode
	byName map[string]*fakeNode
	agents []*Agent
}

// settle waits until no message, duplicate or local step is in progress
// anywhere, so the nodes' state is final and can be checked.
func (c *cluster) settle() {
	for {
		c.net.Drain()
		for _, a := range c.agents {
			a.Wait()
		}
		if !c.net.Idle() {
			continue
		}
		quiet := true
		for _, a := range c.agents {
			quiet = quiet && a.work.idle()
		}
		if quiet && c.net.Idle() {
			return
		}
	}
}

func newCluster(n int, seed uint64, faults Faults, retry RetryPolicy) *cluster {
	c := &cluster{net: NewMemNetwork(seed, faults), byName: map[string]*fakeNode{}}
	for i := range n {
		name := fmt.Sprintf("node%d", i)
		f := newFake(name)
		c.names = append(c.names, name)
		c.fakes = append(c.fakes, f)
		c.byName[name] = f
		a := NewAgent(f, c.net, retry)
		c.agents = append(c.agents, a)
		c.net.Register(name, a.Handle)
	}
	return c
}

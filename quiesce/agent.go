package quiesce

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// NodeState is what a node last did for a job, for status reports (G3,
// docs/guarantees.md: say exactly what state each node is in).
type NodeState struct {
	// Kind is the last step executed, successfully or not.
	Kind  Kind   `json:"kind"`
	Epoch uint64 `json:"epoch"`
	Seq   uint64 `json:"seq"`
	// Err is the error of that step, empty on success.
	Err string `json:"err,omitempty"`
}

// DefaultRoundDeadline bounds a request that arrives without a deadline, so a
// misbehaving peer cannot make a node wait on an unreachable child forever.
const DefaultRoundDeadline = time.Minute

// Agent is the node role of the protocol. One Agent serves every job of a
// node daemon; register its Handle with the transport under the node's name.
type Agent struct {
	node  Node
	tr    Transport
	retry RetryPolicy

	mu   sync.Mutex
	jobs map[string]*jobState
	work busy // flights still running

	// LeaseGrace overrides DefaultLeaseGrace (set before serving); OnExpire,
	// if set, hears every rollback a lease made, with its outcome, and
	// OnHeld every pause a lease after COMMIT found held (resolve).
	LeaseGrace time.Duration
	OnExpire   func(job string, err error)
	OnHeld     func(job string)
	// Self, if set, is this node's name: a request addressed to another
	// node (its Nodes[0]) is refused, whatever its transport delivered it
	// (a name that resolves to the wrong member).
	Self string
	// CPUTime, if set, is the process's CPU time so far. A node waiting
	// for its queues to drain (drainUntil) then waits between two checks
	// at least the CPU time the last one cost, so that its checks take at
	// most half a CPU: mpid runs them at real-time priority, and where CPU
	// is scarce (one emulated core, every core busy) checks back to back
	// would take it from the very ranks whose reads the drain waits for.
	CPUTime func() time.Duration

	// poll, if set, replaces DrainPoll (tests).
	poll time.Duration
}

type jobState struct {
	// step serializes local steps so that a check for supersession and the
	// step it guards are atomic with respect to later steps.
	step sync.Mutex
	// Guarded by Agent.mu:
	newest  key
	flights map[key]*flight
	state   NodeState
	// lease, while a pause is under way here, rolls the job back on this
	// node if no next step comes (see LeaseGrace); expired is the epoch of
	// the last pause it rolled back, whose steps are refused from then on.
	lease   *time.Timer
	expired uint64
	// prepared is the epoch of the last pause this agent ran PREPARE for:
	// its later steps need it. An agent that did not (its mpid restarted
	// mid-pause) would otherwise drain, freeze and commit ranks whose
	// gates it never closed, and a message could be cut in half (G1,
	// docs/guarantees.md).
	prepared uint64
	// self, coordinator and decider come with the last COMMIT: the node
	// a lease after COMMIT asks what became of the pause (resolve), and
	// what it says it is. decided, on the decider, is the epoch of the
	// last pause whose DECIDE it ran, until an ABORT or RESUME.
	self, coordinator, decider string
	decided                    uint64
}

// flight is a request being served, or served, on this node: reply is
// final once done is closed.
type flight struct {
	done  chan struct{}
	reply Message
	rep   Report // what reply.Report points to, in the same allocation
}

// NewAgent returns an Agent that runs local steps on node and forwards
// requests to its children over tr, retransmitting by retry.
func NewAgent(node Node, tr Transport, retry RetryPolicy) *Agent {
	return &Agent{node: node, tr: tr, retry: retry, jobs: make(map[string]*jobState)}
}

// State returns what the agent last did for job, and false if it never saw it.
func (a *Agent) State(job string) (NodeState, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	js, ok := a.jobs[job]
	if !ok {
		return NodeState{}, false
	}
	return js.state, true
}

// Forget drops what the agent remembers of job, once the job has ended. A
// request for it after that starts from scratch, so call Forget only when
// no coordinator will send for the job again.
func (a *Agent) Forget(job string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.jobs, job)
}

// Pausing says whether a pause of job is under way here: a step from
// PREPARE to VERIFY ran and neither COMMIT, ABORT, RESUME nor the lease's
// own rollback has ended it. A daemon keeps such a job known (no Forget)
// even when its last process here exits, so that the pause's next step
// finds the ranks gone and says so, and its rollback finds the job.
func (a *Agent) Pausing(job string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	js, ok := a.jobs[job]
	return ok && js.lease != nil
}

// Wait blocks until no request is being served. A request's work can outlive
// its caller (it is bounded by the request's deadline), so this is how a
// daemon shutting down, or a test, knows no local step is still to come.
func (a *Agent) Wait() { a.work.wait() }

// Handle serves one request: it forwards it down the recipient's subtree,
// runs the local step, merges and replies. It is a Handler. A request it
// refuses (bad version, malformed, stale) gets a reply with Err set and a nil
// error, because that answer is final and must not be retransmitted.
//
// Duplicates of a request being served wait for the same result, and
// retransmissions of a finished one get the cached reply: a round runs each
// node's local step at most once.
func (a *Agent) Handle(ctx context.Context, req Message) (Message, error) {
	if err := req.Validate(); err != nil {
		return refusal(&req, err.Error()), nil
	}
	if a.Self != "" && req.Nodes[0] != a.Self {
		return refusal(&req, fmt.Sprintf("%v: a %s addressed to %s reached %s", ErrWrongNode, req.Kind, req.Nodes[0], a.Self)), nil
	}
	if req.Kind == KindOutcome {
		// Not a step of the coordinator's: a peer's question, outside the
		// order of the pause's steps.
		return a.answerOutcome(req), nil
	}
	if req.Kind == KindWarm {
		return a.warm(ctx, &req), nil
	}
	js, f, dup, why := a.admit(&req)
	if why != "" {
		return refusal(&req, why), nil
	}
	if !dup {
		// The work is bounded by the request's deadline, not by the caller's
		// patience: a retransmission may come on another attempt and must
		// find the result, not a half-cancelled one.
		dl, ok := ctx.Deadline()
		if !ok {
			dl = time.Now().Add(DefaultRoundDeadline)
		}
		fctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), dl)
		a.work.add()
		go a.fly(fctx, cancel, js, f, req)
	}
	select {
	case <-f.done:
		return f.reply, nil
	case <-ctx.Done():
		return Message{}, fmt.Errorf("%s %s of job %s: %w", req.Nodes[0], req.Kind, req.Job, ctx.Err())
	}
}

// warm serves a WARM: it sends the request on over the same tree a
// pause's rounds over req.Nodes take, which leaves each of those
// connections authenticated in this node's pool, and answers for its
// subtree. It runs no step and keeps nothing of the job, so it cannot
// disturb a pause under way; a retransmission is served again, which costs
// a round of small messages and no handshake.
func (a *Agent) warm(ctx context.Context, req *Message) Message {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultRoundDeadline)
		defer cancel()
	}
	var wg sync.WaitGroup
	parts, cancel := a.launch(ctx, req, &wg)
	defer cancel()
	rep := new(Report)
	rep.Add(NodeReport{Node: req.Nodes[0], Empty: true})
	wg.Wait()
	for _, p := range parts {
		rep.Merge(p)
	}
	m := replyTo(req)
	m.Report = rep
	return m
}

// admit finds the flight of req: the one serving it already (dup), or a
// new one; or says why req is refused. It is out of line from Handle, as
// are refusals, to keep Handle's frame small: with MemNetwork a round's
// every forward runs Handle on its own goroutine's stack.
func (a *Agent) admit(req *Message) (js *jobState, f *flight, dup bool, why string) {
	k := key{req.Epoch, req.Seq}
	a.mu.Lock()
	defer a.mu.Unlock()
	js = a.jobs[req.Job]
	if js == nil {
		js = &jobState{flights: make(map[key]*flight)}
		a.jobs[req.Job] = js
	}
	if f, dup = js.flights[k]; dup {
		return js, f, true, ""
	}
	if req.Epoch <= js.expired && req.Kind != KindAbort && req.Kind != KindResume {
		return nil, nil, false, fmt.Sprintf("%v: %s of epoch %d: this node rolled that pause back on its own (its lease expired: no step came in time, or its decider said it did not hold)",
			ErrStale, req.Kind, req.Epoch)
	}
	if newest := js.newest; k.less(newest) {
		return nil, nil, false, fmt.Sprintf("%v: %s epoch %d seq %d, node is at epoch %d seq %d",
			ErrStale, req.Kind, req.Epoch, req.Seq, newest.epoch, newest.seq)
	}
	// Older flights can go: their senders have moved on, and a late copy of
	// one is now refused as stale rather than served.
	for old := range js.flights {
		if old.less(k) {
			delete(js.flights, old)
		}
	}
	js.newest = k
	f = &flight{done: make(chan struct{}), reply: replyTo(req)}
	js.flights[k] = f
	return js, f, false, ""
}

// replyTo is the envelope of the reply to req.
func replyTo(req *Message) Message {
	return Message{Version: ProtocolVersion, Job: req.Job, Epoch: req.Epoch, Seq: req.Seq, Kind: req.Kind, Reply: true}
}

// refusal is the final answer to a request refused: it carries why, and is
// not retransmitted.
//
//go:noinline
func refusal(req *Message, why string) Message {
	m := replyTo(req)
	m.Err = why
	return m
}

// fly serves the request of flight f, on a goroutine of its own, and
// publishes its reply. The request comes as an argument, copied once onto
// the new goroutine, rather than captured by a closure, which would move
// it to the heap.
func (a *Agent) fly(ctx context.Context, cancel context.CancelFunc, js *jobState, f *flight, req Message) {
	defer a.work.done()
	defer cancel()
	f.rep = a.serve(ctx, js, &req)
	f.reply.Report = &f.rep
	close(f.done)
}

// serve runs one round on this node's subtree and returns the reduction.
func (a *Agent) serve(ctx context.Context, js *jobState, req *Message) Report {
	var wg sync.WaitGroup
	parts, cancel := a.launch(ctx, req, &wg)
	defer cancel()
	var rep Report
	rep.Add(a.local(ctx, js, *req))
	wg.Wait()
	for _, p := range parts {
		rep.Merge(p)
	}
	return rep
}

// launch sends req on to the sub-lists of its fan-out, each forward on its
// own goroutine, and returns where their reports will be once wg is done,
// and what to call then.
func (a *Agent) launch(ctx context.Context, req *Message, wg *sync.WaitGroup) ([]Report, context.CancelFunc) {
	n := len(req.Nodes)
	count, depth := req.Fanout.split(n)
	if count == 0 {
		return nil, func() {}
	}
	parts := make([]Report, count)
	// Keep back a share of the time to reduce and reply, so that a dead
	// child is reported by name instead of the whole subtree timing out at
	// the parent. Deeper levels get less, in proportion to depth.
	cctx, cancel := ctx, context.CancelFunc(func() {})
	if dl, ok := ctx.Deadline(); ok {
		reserve := time.Until(dl) / time.Duration(depth+2)
		cctx, cancel = context.WithDeadline(ctx, dl.Add(-reserve))
	}
	wg.Add(count)
	for i := range count {
		lo, hi := req.Fanout.sub(n, i)
		sub := *req
		sub.Nodes = req.Nodes[lo:hi]
		go a.forwardTo(cctx, sub, &parts[i], wg)
	}
	return parts, cancel
}

// forward sends req to the first node of req.Nodes and returns its subtree's
// report, or a report naming every node of the subtree as failed.
func (a *Agent) forward(ctx context.Context, req *Message) Report {
	rep, err := call(ctx, a.tr, a.retry, req.Nodes[0], req)
	if err == nil && rep.Report != nil && rep.Report.Complete(len(req.Nodes)) {
		return *rep.Report
	}
	var got *Report
	if rep != nil {
		got = rep.Report
	}
	return unreached(req, got, err)
}

// unreached is forward's report when the subtree's reply is missing or
// incomplete. It is out of line because it is rare and its formatting
// would make every forward's stack frame larger.
//
//go:noinline
func unreached(req *Message, got *Report, err error) Report {
	if err == nil {
		err = fmt.Errorf("%w: reply accounts for %d of %d nodes", ErrIncomplete, reportNodes(got), len(req.Nodes))
	}
	var out Report
	out.Add(NodeReport{Node: req.Nodes[0], Unreached: true, Refused: permanent(err), Err: fmt.Sprintf("%s: %v", req.Kind, err)})
	for _, name := range req.Nodes[1:] {
		out.Add(NodeReport{Node: name, Unreached: true, Err: fmt.Sprintf("%s: not reached: %s did not answer", req.Kind, req.Nodes[0])})
	}
	return out
}

// forwardTo is forward on its own goroutine, its arguments copied there
// instead of captured (see fly).
func (a *Agent) forwardTo(ctx context.Context, req Message, out *Report, wg *sync.WaitGroup) {
	defer wg.Done()
	*out = a.forward(ctx, &req)
}

func reportNodes(r *Report) int {
	if r == nil {
		return 0
	}
	return r.Nodes
}

// local runs this node's step of req.
func (a *Agent) local(ctx context.Context, js *jobState, req Message) NodeReport {
	self := req.Nodes[0]
	k := key{req.Epoch, req.Seq}
	js.step.Lock()
	defer js.step.Unlock()
	a.mu.Lock()
	superseded := k.less(js.newest)
	a.mu.Unlock()
	if superseded {
		// A newer step (an ABORT, typically) is on its way; running this one
		// now could undo it, e.g. freeze a node the ABORT has just thawed.
		return NodeReport{Node: self, Err: fmt.Sprintf("%s: %v: superseded", req.Kind, ErrStale)}
	}
	p, peered := a.node.(Peered)
	if peered && req.Ports != nil {
		p.Peers(req.Job, req.Ports)
	}
	var rep NodeReport
	var err error
	// checked: a PREPARE with Check went on to the first DRAIN round's
	// check, which this answer is (or whose failure it reports).
	checked := false
	switch req.Kind {
	case KindPrepare:
		a.mu.Lock()
		js.prepared = req.Epoch
		a.mu.Unlock()
		rep, err = a.run(ctx, req)
		if err == nil && req.Check {
			checked = true
			rep, err = a.node.Drain(ctx, req.Job)
		}
	case KindDrain, KindFreeze, KindVerify, KindThaw, KindCommit, KindDecide, KindCommitted:
		a.mu.Lock()
		prepared := js.prepared == req.Epoch
		if req.Kind == KindCommit {
			js.self, js.coordinator, js.decider = self, req.Coordinator, req.Decider
		}
		a.mu.Unlock()
		if !prepared {
			err = fmt.Errorf("%w: this node never ran the PREPARE of this pause (its mpid restarted since?)", ErrNotPrepared)
			break
		}
		rep, err = a.run(ctx, req)
	default:
		rep, err = a.run(ctx, req)
	}
	switch {
	case req.Kind == KindDecide && err == nil:
		a.mu.Lock()
		js.decided = req.Epoch
		a.mu.Unlock()
	case req.Kind == KindAbort || req.Kind == KindResume:
		// Whatever was decided is undone: a node that asks from now on
		// rolls back too.
		a.mu.Lock()
		js.decided = 0
		a.mu.Unlock()
	}
	a.renew(js, req, ctx)
	var drained uint64
	for _, c := range rep.Conns {
		drained += c.SendQueue + c.Unread
	}
	drainCheck := req.Kind == KindDrain || checked
	if drainCheck && req.Wait > 0 {
		// Hold the answer while bytes drain, but leave time to send it
		// within the request's deadline, and give way at once to a newer
		// step (an ABORT waits for this lock).
		until := time.Now().Add(req.Wait)
		if dl, ok := ctx.Deadline(); ok {
			if half := time.Now().Add(time.Until(dl) / 2); half.Before(until) {
				until = half
			}
		}
		rep, err = a.drainUntil(ctx, req.Job, rep, err, until, func() bool {
			a.mu.Lock()
			defer a.mu.Unlock()
			return k.less(js.newest)
		})
	}
	if drainCheck {
		rep.Drained = drained
		rep.DrainChecked = checked
	}
	if peered && (req.Kind == KindPrepare || req.Kind == KindDrain || req.Kind == KindVerify || req.Kind == KindFreeze && req.Check) {
		rep.Ports = p.Ports(req.Job)
	}
	rep.Node = self
	for i := range rep.Conns {
		if rep.Conns[i].Node == "" {
			rep.Conns[i].Node = self
		}
	}
	st := NodeState{Kind: req.Kind, Epoch: req.Epoch, Seq: req.Seq}
	if err != nil {
		step := req.Kind
		if checked {
			step = KindDrain // the gates closed; the check failed
		}
		rep.Err = fmt.Sprintf("%s: %v", step, err)
		st.Err = rep.Err
		var rf RankFault
		if errors.As(err, &rf) {
			f := rf.Fault()
			rep.Fault = &f
		}
	}
	a.mu.Lock()
	js.state = st
	a.mu.Unlock()
	return rep
}

// settle waits, at most req.Wait, until this node's queues are empty again
// before it freezes. With waiting DRAIN answers the nodes' reports are not
// simultaneous: a node can answer empty while another's last bytes to it
// are still in the other's send queue, and they arrive after the answer
// (seen on the rig: 6 KiB unread at VERIFY, about one pause in 150). Every
// node answered empty before FREEZE was sent, with its gates closed, so
// nothing new is sent to anyone: bytes like these can only be unread, and
// the node's running ranks read them. Without this wait the freeze would
// catch them and the pause roll back. VERIFY still checks every node. The
// answer goes nowhere: the settle check takes no count (Settling), so the
// check after the freeze counts every byte sent through a closed gate
// since the node's last drain answer.
func (a *Agent) settle(ctx context.Context, req Message) {
	ctx = WithSettling(ctx)
	rep, err := a.node.Drain(ctx, req.Job)
	a.drainUntil(ctx, req.Job, rep, err, time.Now().Add(req.Wait), func() bool { return false })
}

type settlingKey struct{}

// WithSettling is ctx marked as a settle check's (Settling), for a node's
// own tests.
func WithSettling(ctx context.Context) context.Context {
	return context.WithValue(ctx, settlingKey{}, true)
}

// Settling reports whether ctx is a FREEZE's settle check's (the node's
// Drain called by the agent right before it freezes), which only waits for
// the node's queues: its count of bytes sent through closed gates must
// move nothing, since the check after the freeze counts from the node's
// last drain answer (late bytes sent between the two may be on a node
// that froze and checked already).
func Settling(ctx context.Context) bool {
	v, _ := ctx.Value(settlingKey{}).(bool)
	return v
}

// drainUntil checks the job's queues on this node every DrainPoll (or,
// with CPUTime, after as long as the last check cost in CPU), and once
// more as soon as the node says its drain has done what it started
// (DrainWaker), from the check rep (or its error), until they are empty,
// until has passed, ctx ends or stop says to give way; it returns the
// last check. A check that saw bytes sent through closed gates ends the
// wait at once: a node counts late ones per check, and the next, clean,
// check would hide them.
func (a *Agent) drainUntil(ctx context.Context, job string, rep NodeReport, err error, until time.Time, stop func() bool) (NodeReport, error) {
	var cost time.Duration
	var woke <-chan struct{} // the wake already checked after
	waker, _ := a.node.(DrainWaker)
	poll := cmp.Or(a.poll, DrainPoll)
	for err == nil && !rep.Clean() && rep.Violations == 0 && rep.Late == 0 {
		var wake <-chan struct{}
		if waker != nil {
			if wake = waker.DrainWake(job); wake == woke {
				wake = nil
			}
		}
		wait := max(poll, cost)
		if wake == nil {
			if !time.Now().Add(wait).Before(until) || stop() || sleep(ctx, wait) != nil {
				break
			}
		} else {
			if !time.Now().Add(cost).Before(until) || stop() {
				break
			}
			// The poll's own check would come after until: only the
			// wake can still bring one.
			late := !time.Now().Add(wait).Before(until)
			if late {
				wait = time.Until(until)
			}
			woken, werr := waitCheck(ctx, cost, wait, wake)
			if werr != nil || !woken && late {
				break
			}
			if woken {
				woke = wake
			}
		}
		var c0 time.Duration
		if a.CPUTime != nil {
			c0 = a.CPUTime()
		}
		rep, err = a.node.Drain(ctx, job)
		if a.CPUTime != nil {
			cost = a.CPUTime() - c0
		}
	}
	return rep, err
}

// waitCheck waits until a drain check is due: at least least, then until
// wake closes or most has passed. woken says whether wake ended it.
func waitCheck(ctx context.Context, least, most time.Duration, wake <-chan struct{}) (woken bool, err error) {
	if least > 0 {
		if err := sleep(ctx, least); err != nil {
			return false, err
		}
	}
	t := time.NewTimer(most - least)
	defer t.Stop()
	select {
	case <-wake:
		return true, nil
	case <-t.C:
		return false, nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

func (a *Agent) run(ctx context.Context, req Message) (NodeReport, error) {
	ack := NodeReport{Empty: true}
	job := req.Job
	switch req.Kind {
	case KindPrepare:
		return ack, a.node.Prepare(ctx, job)
	case KindDrain:
		return a.node.Drain(ctx, job)
	case KindFreeze:
		if req.Wait > 0 {
			a.settle(ctx, req)
		}
		if err := a.node.Freeze(ctx, job); err != nil || !req.Check {
			return ack, err
		}
		return a.node.Verify(ctx, job)
	case KindVerify:
		return a.node.Verify(ctx, job)
	case KindThaw:
		if t, ok := a.node.(Rethawer); ok {
			return ack, t.Rethaw(ctx, job)
		}
		return ack, a.node.Thaw(ctx, job)
	case KindCommit:
		if c, ok := a.node.(Committer); ok {
			return ack, c.Commit(ctx, job)
		}
		return ack, nil
	case KindDecide, KindCommitted:
		return ack, nil // the agent's own: what it records is in local
	case KindAbort, KindResume:
		// Both are attempted even if the thaw fails: open gates on a frozen
		// rank do no harm, and the user is told about the thaw either way.
		errT := a.node.Thaw(ctx, job)
		if errT != nil {
			errT = fmt.Errorf("thaw: %w", errT)
		}
		errO := a.node.Open(ctx, job)
		if errO != nil {
			errO = fmt.Errorf("open gates: %w", errO)
		}
		return ack, errors.Join(errT, errO)
	}
	return NodeReport{}, fmt.Errorf("quiesce: no local step for %q", req.Kind)
}

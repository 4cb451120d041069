package quiesce

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// Coordinator is the coordinator role: it drives Pause and Resume of a job
// over the binomial tree of the job's nodes. Its own node must be nodes[0]
// and reachable through the transport like any other.
type Coordinator struct {
	tr  Transport
	opt Options
	*ledger
}

// ledger is what every Coordinator made With another shares with it.
type ledger struct {
	mu    sync.Mutex
	epoch uint64
	// after counts the rounds still on their way after the operation that
	// sent them returned (COMMITTED), and tail has each one's job: the
	// job's next operation waits for it (under mu).
	after sync.WaitGroup
	tail  map[string]chan struct{}
}

// With is a Coordinator with other options that shares c's epochs and
// the rounds c's operations left behind: a daemon makes one and takes a
// With for each operation's deadlines.
func (c *Coordinator) With(opt Options) *Coordinator {
	return &Coordinator{tr: c.tr, opt: opt.withDefaults(), ledger: c.ledger}
}

// Wait returns once every round sent after its operation returned has
// ended (a pause's COMMITTED).
func (c *Coordinator) Wait() { c.after.Wait() }

// behind runs f after the operation that returned, on job's nodes and
// connections: the job's next operation waits for it (settled), so that
// the two never share the nodes' attention or dial a connection for each.
func (c *Coordinator) behind(job string, f func()) {
	done := make(chan struct{})
	c.mu.Lock()
	if c.tail == nil {
		c.tail = map[string]chan struct{}{}
	}
	c.tail[job] = done
	c.mu.Unlock()
	c.after.Add(1)
	go func() {
		defer c.after.Done()
		f()
		close(done)
		c.mu.Lock()
		if c.tail[job] == done {
			delete(c.tail, job)
		}
		c.mu.Unlock()
	}()
}

// settled waits until the rounds job's last operation left behind have
// ended.
func (c *Coordinator) settled(ctx context.Context, job string) error {
	c.mu.Lock()
	done := c.tail[job]
	c.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NewCoordinator returns a Coordinator that sends over tr.
func NewCoordinator(tr Transport, opt Options) *Coordinator {
	return &Coordinator{tr: tr, opt: opt.withDefaults(), ledger: &ledger{}}
}

// nextEpoch is time-based so that a restarted coordinator still outranks the
// epochs its predecessor used (nodes refuse older epochs), and monotonic so
// that two calls in the same nanosecond, or a clock step back, do not collide.
func (c *Coordinator) nextEpoch() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := uint64(time.Now().UnixNano())
	if e <= c.epoch {
		e = c.epoch + 1
	}
	c.epoch = e
	return e
}

type run struct {
	c     *Coordinator
	job   string
	nodes []string
	epoch uint64
	seq   uint64
	res   Result
	start time.Time
	// ports are the job's ports on every node as the pause's rounds have
	// reported them, kept from round to round: a socket that closed may
	// have had a connection a node still holds.
	ports Ports
	// counted: every node said, in the last drain round, that it counts
	// the bytes sent through closed gates; then FREEZE carries Check.
	counted bool
}

func (c *Coordinator) newRun(ctx context.Context, job string, nodes []string) (*run, error) {
	if err := checkRun(job, nodes); err != nil {
		return nil, err
	}
	if err := c.settled(ctx, job); err != nil {
		return nil, err
	}
	r := &run{c: c, job: job, nodes: nodes, epoch: c.nextEpoch(), start: time.Now()}
	r.res = Result{Job: job, Epoch: r.epoch, Nodes: len(nodes)}
	return r, nil
}

// checkRun refuses a job id or node list no round can be sent over.
func checkRun(job string, nodes []string) error {
	if job == "" {
		return errors.New("quiesce: empty job id")
	}
	if len(nodes) == 0 {
		return fmt.Errorf("quiesce: job %s has no nodes", job)
	}
	// A name twice would make a node serve its own subtree twice and
	// coalesce the two requests into one reply.
	seen := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		if n == "" || seen[n] {
			return fmt.Errorf("quiesce: job %s: node list has an empty or repeated name %q", job, n)
		}
		seen[n] = true
	}
	return nil
}

// round runs one request over the whole tree. It returns an error only when
// the reply is missing or does not account for every node; failures of
// individual nodes are in the report.
func (r *run) round(ctx context.Context, kind Kind) (Report, error) {
	r.seq++
	req := Message{Version: ProtocolVersion, Job: r.job, Epoch: r.epoch, Seq: r.seq, Kind: kind, Nodes: r.nodes, Fanout: r.c.opt.Fanout, Coordinator: r.nodes[0]}
	if kind == KindDrain || kind == KindFreeze || kind == KindVerify {
		req.Ports = r.ports
	}
	if kind == KindCommit {
		req.Decider = r.decider()
	}
	req.Check = kind == KindFreeze && r.counted || kind == KindPrepare
	if (kind == KindPrepare || kind == KindDrain || kind == KindFreeze) && r.c.opt.DrainWait > 0 {
		req.Wait = r.c.opt.DrainWait
		if dl, ok := ctx.Deadline(); ok {
			req.Wait = min(req.Wait, time.Until(dl)/4)
		}
	}
	rep, err := call(ctx, r.c.tr, r.c.opt.Retry, r.nodes[0], &req)
	if err != nil {
		return Report{}, fmt.Errorf("%s round: %w", kind, err)
	}
	if rep.Report == nil || !rep.Report.Complete(len(r.nodes)) {
		return Report{}, fmt.Errorf("%s round: %w: reply accounts for %d of %d nodes",
			kind, ErrIncomplete, reportNodes(rep.Report), len(r.nodes))
	}
	r.ports = r.ports.Union(rep.Report.Ports)
	return *rep.Report, nil
}

// verify is VERIFY's phase (or FREEZE's, when it carries Check): once's,
// and then the check that no node left out, as a program's own, a
// connection holding bytes whose far port the job's sockets have after
// all: the node had not heard of that port yet (a socket made during the
// pause). Only ports read after the freeze are complete; the drain that
// follows takes the connection in.
func (r *run) verify(kind Kind, last *Report) func(ctx context.Context, st *PhaseStat) error {
	once := r.once(kind, last)
	return func(ctx context.Context, st *PhaseStat) error {
		if err := once(ctx, st); err != nil {
			return err
		}
		if p, ok := r.ports.Meets(last.Own); ok {
			return fmt.Errorf("%w: a connection to port %d, holding bytes, was left out as a program's own, but port %d is a port of the job's", ErrNotEmpty, p, p)
		}
		return nil
	}
}

// decider is the node that holds the pause's outcome once every node has
// committed (DECIDE): the job's second node, or none for a job of one,
// whose coordinator cannot die without its only node's mpid.
func (r *run) decider() string {
	if len(r.nodes) < 2 {
		return ""
	}
	return r.nodes[1]
}

// commit is COMMIT's phase. A COMMIT that reaches some nodes and not
// others (the coordinator dies with it on the way) must not leave the
// first paused and the others rolled back by their leases: so COMMIT
// leaves each node's lease armed, and only once every node has
// acknowledged it does DECIDE tell the decider, alone, that the pause
// holds. COMMITTED then ends the nodes' leases. A node whose lease runs
// out after COMMIT asks the decider (Agent.resolve), which answers held
// after DECIDE and, before it, refuses the DECIDE from then on and says
// rolled back: every node that asks hears the same. A COMMITTED that
// misses a node changes nothing: it asks, and holds.
func (r *run) commit(last *Report) func(ctx context.Context, st *PhaseStat) error {
	once := r.once(KindCommit, last)
	return func(ctx context.Context, st *PhaseStat) error {
		if err := once(ctx, st); err != nil {
			return err
		}
		d := r.decider()
		if d == "" {
			return nil
		}
		// One call, not a round: Rounds counts the tree's.
		r.seq++
		req := Message{Version: ProtocolVersion, Job: r.job, Epoch: r.epoch, Seq: r.seq, Kind: KindDecide, Nodes: []string{d}, Coordinator: r.nodes[0]}
		rep, err := call(ctx, r.c.tr, r.c.opt.Retry, d, &req)
		if err != nil {
			return fmt.Errorf("%s: %w", KindDecide, err)
		}
		if rep.Report == nil || !rep.Report.Complete(1) {
			return fmt.Errorf("%s: %w: reply accounts for %d of 1 nodes", KindDecide, ErrIncomplete, reportNodes(rep.Report))
		}
		if f := rep.Report.Failed(); len(f) > 0 {
			return &NodeError{Failed: 1, First: f[0]}
		}
		// The pause holds from here, whatever COMMITTED finds: a node it
		// misses asks the decider when its lease runs out. So the caller
		// does not wait for it; it ends the nodes' leases after Pause has
		// returned, and a newer operation's steps supersede it on any node
		// it reaches late.
		r.c.behind(r.job, func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.c.opt.Commit)
			defer cancel()
			_, _ = r.round(ctx, KindCommitted)
		})
		return nil
	}
}

func (r *run) progress(ctx context.Context, p Progress) {
	if f, ok := ctx.Value(progressKey{}).(func(Progress)); ok {
		p.Job = r.job
		f(p)
	}
}

// phase runs f under the phase's deadline and records its cost.
func (r *run) phase(ctx context.Context, kind Kind, d time.Duration, f func(ctx context.Context, st *PhaseStat) error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	st := PhaseStat{Phase: kind}
	t := time.Now()
	err := f(ctx, &st)
	st.Elapsed = time.Since(t)
	if err != nil {
		st.Err = err.Error()
	}
	r.res.Phases = append(r.res.Phases, st)
	r.progress(ctx, Progress{Phase: kind, Round: st.Rounds, Done: true, Stat: st})
	return err
}

// once is the body of a phase that is a single round whose nodes must all
// succeed with a clean report.
func (r *run) once(kind Kind, last *Report) func(ctx context.Context, st *PhaseStat) error {
	return func(ctx context.Context, st *PhaseStat) error {
		st.Rounds++
		rep, err := r.round(ctx, kind)
		if err != nil {
			return err
		}
		r.progress(ctx, Progress{Phase: kind, Round: st.Rounds, Report: rep})
		*last = rep
		if f := rep.Failed(); len(f) > 0 {
			return &NodeError{Failed: len(f), First: f[0]}
		}
		if !rep.Empty() {
			return fmt.Errorf("%w: %s", ErrNotEmpty, rep.String())
		}
		return nil
	}
}

// Pause pauses job on nodes (nodes[0] is the coordinator's own node):
// PREPARE, whose answers are the first drain checks; DRAIN until every
// node is empty or the drain deadline passes (no round if PREPARE's were);
// FREEZE; VERIFY; COMMIT when the kernel check after the freeze is empty on
// every node. A VERIFY that finds bytes (the last of them reached a queue
// after its node's final DRAIN check) is followed by THAW, DRAIN, FREEZE
// and VERIFY again, at most Rethaws times and within the drain deadline;
// so are bytes sent through closed gates on sockets with nothing held
// (NodeReport.Late), but not other bytes sent through closed gates
// (Violations), which fail the pause at the first DRAIN or VERIFY round
// that counts them and which the user must hear of. Any other failure, timeout, or a non-empty report after the last
// attempt rolls the job back on every node (ABORT: thaw, then reopen gates)
// and returns an *AbortError carrying the report. The Result is filled in
// either way.
func (c *Coordinator) Pause(ctx context.Context, job string, nodes []string) (Result, error) {
	r, err := c.newRun(ctx, job, nodes)
	if err != nil {
		return Result{}, err
	}
	var last Report
	fail := func(kind Kind, err error) (Result, error) {
		return r.abort(ctx, kind, err, last)
	}
	// PREPARE's answers are the first drain round's checks where every
	// node made one (docs/guarantees.md, "PREPARE and the first DRAIN in
	// one round"): clean, the drain is over.
	merged := false
	var checkFailed error // a node failed in its check, its gates closed: DRAIN's failure
	prepare := func(ctx context.Context, st *PhaseStat) error {
		st.Rounds++
		rep, err := r.round(ctx, KindPrepare)
		if err != nil {
			return err
		}
		r.progress(ctx, Progress{Phase: KindPrepare, Round: st.Rounds, Report: rep})
		last = rep
		if f := rep.Failed(); len(f) > 0 {
			err := &NodeError{Failed: len(f), First: f[0]}
			if rep.DrainChecked == len(r.nodes) {
				checkFailed = err
				return nil
			}
			return err
		}
		if rep.DrainChecked == len(r.nodes) {
			_, own := r.ports.Meets(rep.Own)
			merged = rep.Empty() && !own
			r.counted = rep.Counted == len(r.nodes)
		}
		return nil
	}
	if err := r.phase(ctx, KindPrepare, c.opt.Prepare, prepare); err != nil {
		return fail(KindPrepare, err)
	}
	if checkFailed != nil {
		st := PhaseStat{Phase: KindDrain, Err: checkFailed.Error()}
		r.res.Phases = append(r.res.Phases, st)
		r.progress(ctx, Progress{Phase: KindDrain, Done: true, Stat: st})
		return fail(KindDrain, checkFailed)
	}
	if !merged {
		last = Report{}
	}
	drainBody := func(ctx context.Context, st *PhaseStat) error {
		// A node that failed to read its queues fails the pause at once; a
		// node that did not answer is asked again next round, since a lost
		// message is not a reason to give up before the drain deadline.
		for {
			st.Rounds++
			rep, err := r.round(ctx, KindDrain)
			if err != nil {
				if ctx.Err() != nil && last.Nodes > 0 {
					return drainTimeout(st.Rounds-1, last)
				}
				return err
			}
			last = carryOver(last, rep)
			r.progress(ctx, Progress{Phase: KindDrain, Round: st.Rounds, Report: last})
			if failed, _, _ := rep.split(); failed > 0 {
				return &NodeError{Failed: failed, First: rep.Failed()[0]}
			}
			// Bytes sent through closed gates that may have overtaken held
			// bytes fail the pause whenever a check counts them, as after
			// the freeze: the node keeps saying them, so no later round
			// could be clean.
			if rep.violations() > 0 {
				return fmt.Errorf("%w: %s", ErrThroughGates, rep.String())
			}
			// A connection a node left out as a program's own while it
			// held bytes, whose far port this round says is the job's,
			// is drained in the next round, which names that port: the
			// last drain round has seen every job connection.
			if _, own := r.ports.Meets(rep.Own); rep.Empty() && !own {
				r.counted = rep.Counted == len(r.nodes)
				return nil
			}
			if sleep(ctx, c.opt.DrainInterval) != nil {
				return drainTimeout(st.Rounds, last)
			}
		}
	}
	// The drain deadline (the user's --timeout) bounds every attempt's
	// DRAIN together.
	drainLeft := c.opt.Drain
	drain := func() error {
		t := time.Now()
		err := r.phase(ctx, KindDrain, drainLeft, drainBody)
		drainLeft -= time.Since(t)
		return err
	}
	if merged {
		// What the first drain check's listener decided (mpid cancels a
		// pause whose check counts fewer ranks than the job has) ends
		// the drain, as it would in a DRAIN round.
		if err := ctx.Err(); err != nil {
			return fail(KindDrain, err)
		}
		// DRAIN's record says it had no round of its own.
		st := PhaseStat{Phase: KindDrain}
		r.res.Phases = append(r.res.Phases, st)
		r.progress(ctx, Progress{Phase: KindDrain, Done: true, Stat: st})
	} else if err := drain(); err != nil {
		return fail(KindDrain, err)
	}
	for attempt := 0; ; attempt++ {
		var err error
		if r.counted {
			// One round freezes and checks (docs/guarantees.md, "FREEZE
			// and VERIFY in one round"). VERIFY's record says it had no
			// round of its own; a check that found bytes is VERIFY's
			// failure, as with two rounds.
			err = r.phase(ctx, KindFreeze, c.opt.Freeze+c.opt.Verify, r.verify(KindFreeze, &last))
			if err != nil && !errors.Is(err, ErrNotEmpty) {
				return fail(KindFreeze, err)
			}
			st := PhaseStat{Phase: KindVerify}
			if err != nil {
				st.Err = err.Error()
			}
			r.res.Phases = append(r.res.Phases, st)
			r.progress(ctx, Progress{Phase: KindVerify, Done: true, Stat: st})
		} else {
			if err := r.phase(ctx, KindFreeze, c.opt.Freeze, r.once(KindFreeze, &last)); err != nil {
				return fail(KindFreeze, err)
			}
			err = r.phase(ctx, KindVerify, c.opt.Verify, r.verify(KindVerify, &last))
		}
		if err == nil {
			break
		}
		if !errors.Is(err, ErrNotEmpty) || attempt >= c.opt.Rethaws || drainLeft <= 0 || last.violations() > 0 {
			return fail(KindVerify, err)
		}
		if err := r.phase(ctx, KindThaw, c.opt.Freeze, r.once(KindThaw, &last)); err != nil {
			return fail(KindThaw, err)
		}
		last = Report{}
		if err := drain(); err != nil {
			return fail(KindDrain, err)
		}
	}
	verified := last
	// A node that never hears COMMIT would not know the pause holds, so a
	// COMMIT that does not reach everyone is rolled back like any failure.
	if err := r.phase(ctx, KindCommit, c.opt.Commit, r.commit(&last)); err != nil {
		return fail(KindCommit, err)
	}
	r.res.State = StatePaused
	r.res.Report = verified
	r.res.Total = time.Since(r.start)
	return r.res, nil
}

// drainTimeout says why the drain deadline passed: bytes still held
// (ErrNotEmpty, the case G2 asks to report: docs/guarantees.md), or only
// unreachable nodes.
func drainTimeout(rounds int, last Report) error {
	if _, unreached, holding := last.split(); holding == 0 && unreached > 0 {
		// Nobody is known to hold bytes: the network, not the job, failed.
		return fmt.Errorf("%w: %d nodes unreachable after %d drain rounds: %s", ErrNodeFailed, unreached, rounds, last.String())
	}
	return fmt.Errorf("%w after %d drain rounds: %s", ErrNotEmpty, rounds, last.String())
}

// abort rolls the job back and builds the AbortError.
func (r *run) abort(ctx context.Context, phase Kind, cause error, last Report) (Result, error) {
	if ctx.Err() != nil && !errors.Is(cause, ctx.Err()) {
		cause = fmt.Errorf("%w (caller: %v)", cause, ctx.Err())
	}
	// The rollback must run even if the caller gave up.
	unconfirmed := r.thawOpen(context.WithoutCancel(ctx), KindAbort, r.c.opt.Abort)
	e := &AbortError{Job: r.job, Phase: phase, Cause: cause, Report: last, Unconfirmed: unconfirmed}
	r.res.State = StateRunning
	if len(unconfirmed) > 0 {
		r.res.State = StateFailed
	}
	r.res.Report = last
	r.res.Unconfirmed = unconfirmed
	r.res.Error = e.Error()
	r.res.Total = time.Since(r.start)
	return r.res, e
}

// thawOpen repeats a thaw-and-open round until every node acknowledges or the
// deadline passes, and returns the nodes that never did. Every repetition is a
// new round: a node that failed is asked again, one that succeeded does a
// harmless no-op. It stops early when every node still pending refused the
// cluster for good (NodeReport.Refused): such a node never took a step of
// this operation, and its answer would be the same until the deadline.
func (r *run) thawOpen(ctx context.Context, kind Kind, d time.Duration) []NodeReport {
	var pending []NodeReport
	_ = r.phase(ctx, kind, d, func(ctx context.Context, st *PhaseStat) error {
		for {
			st.Rounds++
			rep, err := r.round(ctx, kind)
			switch {
			case err == nil && rep.Empty():
				pending = nil
				return nil
			case err == nil:
				pending = rep.Pending
			case pending == nil:
				// No reply at all yet: nobody is confirmed.
				pending = make([]NodeReport, len(r.nodes))
				for i, n := range r.nodes {
					pending[i] = NodeReport{Node: n, Err: err.Error()}
				}
			}
			if err == nil && allRefused(pending) {
				return fmt.Errorf("%s refused by %s", kind, firstOf(len(pending), pending[0]))
			}
			if sleep(ctx, r.c.opt.Retry.Initial) != nil {
				return fmt.Errorf("%s not confirmed on %s: %w", kind, names(pending), ctx.Err())
			}
		}
	})
	return pending
}

// firstOf names the first of n nodes that failed and why: "node2: why" when
// it is the only one, "3 nodes, first node2: why" when not.
func firstOf(n int, first NodeReport) string {
	if n == 1 {
		return first.Node + ": " + first.Err
	}
	return fmt.Sprintf("%d nodes, first %s: %s", n, first.Node, first.Err)
}

// names lists the nodes of l, the first few by name: "node1", "2 nodes
// (node1, node2)", "9 nodes (node1, …, node5, …)".
func names(l []NodeReport) string {
	if len(l) == 1 {
		return l[0].Node
	}
	const max = 5
	var b strings.Builder
	fmt.Fprintf(&b, "%d nodes (", len(l))
	for i, n := range l {
		if i == max {
			b.WriteString(", …")
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(n.Node)
	}
	b.WriteString(")")
	return b.String()
}

func allRefused(pending []NodeReport) bool {
	for _, n := range pending {
		if !n.Refused {
			return false
		}
	}
	return len(pending) > 0
}

// Warm sends WARM over the tree a pause or resume of job over nodes takes,
// so that every connection those rounds use is open and authenticated
// before they need it, and returns an error naming the nodes it did not
// reach. It takes no epoch and changes nothing on any node: a daemon calls
// it whenever it likes (mpid: when a node registers ranks of a job it
// coordinates, and then more often than its pool lets a connection idle).
func (c *Coordinator) Warm(ctx context.Context, job string, nodes []string) error {
	if err := checkRun(job, nodes); err != nil {
		return err
	}
	if err := c.settled(ctx, job); err != nil {
		return err
	}
	req := Message{Version: ProtocolVersion, Job: job, Kind: KindWarm, Nodes: nodes, Fanout: c.opt.Fanout, Coordinator: nodes[0]}
	rep, err := call(ctx, c.tr, c.opt.Retry, nodes[0], &req)
	if err != nil {
		return fmt.Errorf("WARM round: %w", err)
	}
	if rep.Report == nil || !rep.Report.Complete(len(nodes)) {
		return fmt.Errorf("WARM round: %w: reply accounts for %d of %d nodes", ErrIncomplete, reportNodes(rep.Report), len(nodes))
	}
	if failed := rep.Report.Failed(); len(failed) > 0 {
		return fmt.Errorf("WARM round: %d of %d nodes not reached, first %s: %s", len(failed), len(nodes), failed[0].Node, failed[0].Err)
	}
	return nil
}

// Resume thaws the job on every node and then reopens its gates. It is
// idempotent: resuming a running job changes nothing. It returns an error
// naming the nodes that did not acknowledge before the resume deadline.
func (c *Coordinator) Resume(ctx context.Context, job string, nodes []string) (Result, error) {
	r, err := c.newRun(ctx, job, nodes)
	if err != nil {
		return Result{}, err
	}
	unconfirmed := r.thawOpen(ctx, KindResume, c.opt.Resume)
	r.res.Total = time.Since(r.start)
	r.res.Unconfirmed = unconfirmed
	if len(unconfirmed) > 0 {
		r.res.State = StateFailed
		err := fmt.Errorf("resume of job %s: %w", job,
			&NodeError{Failed: len(unconfirmed), First: unconfirmed[0], Unconfirmed: true})
		r.res.Error = err.Error()
		return r.res, err
	}
	r.res.State = StateRunning
	return r.res, nil
}

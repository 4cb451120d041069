package quiesce

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// A node's lease on a pause under way: a step that does not come in time
// rolls the job back here (the coordinator died or lost the node), unless
// the pause committed, which the pause's decider is asked about.

// DefaultLeaseGrace is how long after a pause step's deadline a node waits
// for the next step before it rolls the job back on its own: a coordinator
// that died or lost the node mid-pause must not leave its ranks gated or
// frozen for ever (G3, docs/guarantees.md). A committed pause holds
// without a lease.
const DefaultLeaseGrace = 2 * time.Second

// renew arms the job's lease after a pause step (PREPARE to VERIFY, THAW,
// and COMMIT on a job of several nodes): it expires LeaseGrace after the
// step's deadline unless another step comes. Any other step (DECIDE,
// COMMITTED, ABORT, RESUME) ends the lease.
func (a *Agent) renew(js *jobState, req Message, ctx context.Context) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if js.lease != nil {
		js.lease.Stop()
		js.lease = nil
	}
	after := a.expire
	switch req.Kind {
	case KindPrepare, KindDrain, KindFreeze, KindVerify, KindThaw:
	case KindCommit:
		if js.decider == "" {
			return // one node, or a coordinator that names no decider: COMMIT is the end
		}
		after = a.resolve
	default:
		return
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(DefaultRoundDeadline)
	}
	k := key{req.Epoch, req.Seq}
	js.lease = time.AfterFunc(time.Until(dl)+a.grace(), func() { after(req.Job, js, k) })
}

func (a *Agent) grace() time.Duration {
	if a.LeaseGrace > 0 {
		return a.LeaseGrace
	}
	return DefaultLeaseGrace
}

// expire rolls the job back on this node (thaw, then reopen the gates) when
// the pause step k was the last one it heard of, and refuses that pause's
// later steps: a coordinator that comes back must start again.
func (a *Agent) expire(job string, js *jobState, k key) {
	js.step.Lock()
	defer js.step.Unlock()
	a.mu.Lock()
	if js.newest != k || js.lease == nil {
		a.mu.Unlock()
		return // a newer step came, or ended the lease
	}
	js.lease = nil
	js.expired = max(js.expired, k.epoch)
	a.mu.Unlock()
	a.rollback(job, js, k, "lease expired: no step came from the coordinator")
}

// rollback thaws and reopens the job here on the node's own, its lease
// ended and the pause of k refused from now on (js.expired); the caller
// holds js.step.
func (a *Agent) rollback(job string, js *jobState, k key, why string) {
	ctx, cancel := context.WithTimeout(context.Background(), DefaultRoundDeadline)
	defer cancel()
	err := errors.Join(a.node.Thaw(ctx, job), a.node.Open(ctx, job))
	st := NodeState{Kind: KindAbort, Epoch: k.epoch, Seq: k.seq, Err: why}
	if err != nil {
		st.Err += "; rollback: " + err.Error()
	}
	a.mu.Lock()
	js.state = st
	a.mu.Unlock()
	if a.OnExpire != nil {
		a.OnExpire(job, err)
	}
}

// resolve is the lease of a node that ran COMMIT k and heard neither
// COMMITTED nor ABORT since: its coordinator may have died with the COMMIT
// on the way to other nodes, some of which may have rolled back on their
// own leases by now, so the node asks the pause's decider. DECIDE ran
// there: every node committed, and the pause holds here. It did not: the
// decider has refused it from now on, so the pause cannot hold anywhere,
// and it rolls back here too. No answer: the node asks again a grace
// later, frozen meanwhile, since either outcome may be the others'.
func (a *Agent) resolve(job string, js *jobState, k key) {
	a.mu.Lock()
	if js.newest != k || js.lease == nil {
		a.mu.Unlock()
		return
	}
	req := Message{Version: ProtocolVersion, Job: job, Epoch: k.epoch, Kind: KindOutcome, Nodes: []string{js.decider}, Coordinator: js.coordinator}
	here := js.decider == js.self
	a.mu.Unlock()
	var held bool
	var err error
	if here {
		held, err = outcome(a.answerOutcome(req))
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), a.grace())
		var rep *Message
		if rep, err = call(ctx, a.tr, a.retry, req.Nodes[0], &req); err == nil {
			held, err = outcome(*rep)
		}
		cancel()
	}
	js.step.Lock()
	defer js.step.Unlock()
	a.mu.Lock()
	if js.newest != k || js.lease == nil {
		a.mu.Unlock()
		return // a step came meanwhile, or the decider was this node and rolled back
	}
	if err != nil {
		js.lease = time.AfterFunc(a.grace(), func() { a.resolve(job, js, k) })
		a.mu.Unlock()
		return
	}
	js.lease = nil
	if held {
		js.state = NodeState{Kind: KindCommitted, Epoch: k.epoch, Seq: k.seq}
		a.mu.Unlock()
		if a.OnHeld != nil {
			a.OnHeld(job)
		}
		return
	}
	js.expired = max(js.expired, k.epoch)
	decider := js.decider
	a.mu.Unlock()
	a.rollback(job, js, k, "no step came from the coordinator after COMMIT, and the pause's decider "+decider+" never heard that every node committed")
}

// outcome reads the decider's answer to OUTCOME: held when its report is
// clean.
func outcome(m Message) (bool, error) {
	if m.Report == nil || !m.Report.Complete(1) {
		return false, fmt.Errorf("%s: %w: reply accounts for %d of 1 nodes", KindOutcome, ErrIncomplete, reportNodes(m.Report))
	}
	return m.Report.Empty(), nil
}

// answerOutcome is the decider's answer to a node that asks what became of
// the pause of req.Epoch (OUTCOME): held if it ran that pause's DECIDE.
// If not, that pause can no longer hold: from now on the decider refuses
// its DECIDE (and every step of it but ABORT and RESUME), and rolls it back
// here if it is under way, so that every node that asks hears the same and
// a coordinator still alive fails its DECIDE and rolls back everywhere.
func (a *Agent) answerOutcome(req Message) Message {
	self := req.Nodes[0]
	a.mu.Lock()
	js := a.jobs[req.Job]
	if js == nil {
		js = &jobState{flights: make(map[key]*flight)}
		a.jobs[req.Job] = js
	}
	a.mu.Unlock()
	js.step.Lock()
	defer js.step.Unlock()
	a.mu.Lock()
	held := req.Epoch != 0 && js.decided == req.Epoch
	var undo *key
	if !held {
		js.expired = max(js.expired, req.Epoch)
		if js.lease != nil && js.newest.epoch == req.Epoch {
			js.lease.Stop()
			js.lease = nil
			k := js.newest
			undo = &k
		}
	}
	a.mu.Unlock()
	if undo != nil {
		a.rollback(req.Job, js, *undo, "rolled back: a node asked what became of this pause, whose DECIDE never came here")
	}
	reply := replyTo(&req)
	var rep Report
	if held {
		rep.Add(NodeReport{Node: self, Empty: true})
	} else {
		rep.Add(NodeReport{Node: self, Err: fmt.Sprintf("%s: the pause of epoch %d did not hold: %s never ran its DECIDE", KindOutcome, req.Epoch, self)})
	}
	reply.Report = &rep
	return reply
}

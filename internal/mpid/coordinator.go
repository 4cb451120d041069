package mpid

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/quiesce"
)

// coordinator is mpid's answer to what users ask of a job (the CLI, a
// rank's SIGTSTP, a request another node's mpid passed on): its status on
// this node and, for the jobs this node coordinates, their pauses and
// resumes over the peer port (quiesce.Coordinator), each an operation the
// registry hands out (operation.go: it keeps the job's record), and the
// confirmation of a rollback some node did not confirm. A pause or resume of a job coordinated
// elsewhere goes to that node's mpid.
type coordinator struct {
	node     string
	observer string // this node's observer mode (loader.Features), for status
	reg      *registry
	ranks    *ranks.Server
	agent    *quiesce.Agent // this node's steps: a job's state here when another node coordinates it
	tr       quiesce.Transport
	metrics  *metrics.Metrics
	drain    time.Duration // a pause's drain timeout unless the request names one
	retry    quiesce.RetryPolicy
	once     sync.Once
	proto    *quiesce.Coordinator // protocol's, made at its first call
	log      *slog.Logger
	// done closes when mpid stops: background work ends.
	done <-chan struct{}

	// events holds the jobs that have a rank's pause or resume under way:
	// a job's ranks all get the signal, and one request is enough. wanted
	// is, for such a job, the latest request that came meanwhile: acted on
	// when the one under way ends, so that a resume signalled during a
	// pause is not lost (one a job, whatever its ranks send).
	evMu   sync.Mutex
	events map[string]bool
	wanted map[string]ranks.Request
}

// slowPause is how long a pause may go before the journal says, once a
// round at most this often, what it waits on.
const slowPause = time.Second

// do runs a status, pause or resume request of a caller with uid, for the
// job the caller names (lookup). A pause or resume of a job coordinated
// elsewhere goes to the coordinator's mpid.
func (c *coordinator) do(ctx context.Context, req ctl.Request, uid uint32, progress func(ctl.Progress)) (ctl.Job, error) {
	key, err := c.reg.lookup(req.Job, uid)
	if err != nil {
		return ctl.Job{}, err
	}
	req.Job = key
	return c.doAt(ctx, req, uid, progress, true)
}

// doAt runs req for the job whose key is req.Job.
func (c *coordinator) doAt(ctx context.Context, req ctl.Request, uid uint32, progress func(ctl.Progress), mayForward bool) (ctl.Job, error) {
	owner, _, ok := jobid.SplitKey(req.Job)
	if !ok || (uid != 0 && uid != owner) {
		// Nothing about the job, not even that it exists, goes to a
		// stranger: their name for it is in their own namespace.
		return ctl.Job{}, c.noJob(req.Job)
	}
	v, err := c.view(req.Job)
	if err != nil {
		return ctl.Job{}, err
	}
	if req.Op == ctl.OpStatus {
		return v, nil
	}
	if v.Coordinator != c.node {
		if v.Coordinator == "" || !mayForward {
			return v, ctl.Errorf(ctl.CodeElsewhere, "job %s is not coordinated by %s (ranks here: %s) and its coordinator is not known here; run mpipause on its coordinator: the node where `mpipause run` launched it, or the Slurm step's first node",
				jobName(req.Job), c.node, ctl.RankList(v.LocalRanks))
		}
		return c.forward(ctx, v.Coordinator, req, uid)
	}
	switch req.Op {
	case ctl.OpPause:
		return c.pause(ctx, req, v, progress)
	case ctl.OpResume:
		return c.resume(ctx, req, v, progress)
	}
	return v, ctl.Errorf(ctl.CodeBadRequest, "unknown operation %q", req.Op)
}

// noJob is the answer about a job this node does not know, and about
// another user's job: the same, so a stranger learns nothing from it.
func (c *coordinator) noJob(key string) error {
	return ctl.Errorf(ctl.CodeUnknownJob, "no job %s on %s: see `mpipause list`", jobName(key), c.node)
}

func (c *coordinator) protocol(drain time.Duration) *quiesce.Coordinator {
	if drain <= 0 {
		drain = c.drain
	}
	// Nodes hold their DRAIN answers while they drain (checking every
	// quiesce.DrainPoll): the end of a drain is seen a millisecond after it
	// happens instead of at the next protocol round (2 ms apart, 2-3 ms
	// each on the rig). 20 ms keeps progress reports coming.
	// One ledger for every operation (With): a job's next operation waits
	// for the rounds its last one left behind (a pause's COMMITTED).
	c.once.Do(func() { c.proto = quiesce.NewCoordinator(c.tr, quiesce.Options{Retry: c.retry}) })
	return c.proto.With(quiesce.Options{Drain: drain, DrainWait: 20 * time.Millisecond, Retry: c.retry})
}

func (c *coordinator) pause(ctx context.Context, req ctl.Request, v ctl.Job, progress func(ctl.Progress)) (ctl.Job, error) {
	// The busy check first: a pause refused for the one under way costs
	// nothing else.
	op, err := c.reg.begin(req.Job, ctl.OpPause, v)
	if err != nil {
		c.metrics.PauseRefused()
		return v, err
	}
	if missing := c.unregistered(req.Job, v.Nodes); len(missing) > 0 {
		op.undo()
		c.metrics.PauseRefused()
		return v, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused: rank 0 says it has ranks on %s, whose mpid has registered none of them with %s, the job's coordinator: is mpid running there, with this cluster's key file (every node needs the same one)?",
			jobName(req.Job), someOf(missing, 8), c.node)
	}
	start := time.Now()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var drained uint64
	var once sync.Once
	var logged time.Time
	ctx = quiesce.WithProgress(ctx, func(p quiesce.Progress) {
		// The first drain check: DRAIN's first round, or PREPARE's answers
		// where every node made one there.
		first := p.Phase == quiesce.KindDrain || p.Phase == quiesce.KindPrepare && p.Report.DrainChecked == p.Report.Nodes
		if first && !p.Done {
			once.Do(func() {
				drained = max(p.Report.Drained, p.Report.InflightBytes())
				// Only the ranks the nodes know can be gated: a rank that has
				// not registered yet (still in MPI_Init, or without the shim)
				// would send through the cut.
				if p.Report.Ranks < v.Ranks && len(p.Report.Failed()) == 0 {
					cancel(fmt.Errorf("only %d of the job's %d ranks are registered with mpid (the others exited, are still starting, or run without the shim)", p.Report.Ranks, v.Ranks))
				}
			})
		}
		if !p.Done && len(p.Report.Pending) > 0 {
			if now := time.Now(); now.Sub(start) > slowPause && now.Sub(logged) > slowPause {
				logged = now
				c.log.Info("slow pause: waiting", "job", req.Job, "phase", p.Phase, "round", p.Round,
					"ms", now.Sub(start).Milliseconds(), "on", waitingOn(p.Report, 8))
			}
		}
		if progress != nil {
			progress(toProgress(p, len(v.Nodes), start))
		}
	})
	// Recorded before any node is touched: if this mpid dies mid-pause,
	// some nodes may have committed and others rolled back on their leases;
	// its successor finds this record and rolls the pause back everywhere
	// (adopt), since nobody was told it held. Without it a successor
	// would not, and this node's own COMMIT would record the pause as a
	// plain node's, as held: no pause then.
	if err := op.record(); err != nil {
		c.metrics.PauseRefused()
		fig := v
		fig.Failure = &ctl.Failure{Phase: string(quiesce.KindPrepare), Node: c.node, Rank: -1,
			Reason: fmt.Sprintf("the coordinator cannot record the pause (%v); no node was touched", err)}
		fig = op.end(ctl.StateRunning, fig)
		c.log.Error("pause refused: cannot record it", "job", req.Job, "error", err)
		return fig, ctl.Errorf(ctl.CodeFailed, "pause of job %s failed before PREPARE: %s; the job runs on", req.Job, fig.Failure.Reason)
	}
	res, err := c.protocol(req.Timeout).Pause(ctx, req.Job, v.Nodes)
	fig := figures(v, res)
	fig.DrainedBytes = drained
	if err == nil {
		// The pause holds only as far as its record says so: a restarted
		// mpid trusts the record (G5), and this one still says pausing,
		// which it would roll back. Told paused, the user must find it
		// paused after a restart too; told nothing yet, the user can be
		// told it failed, after a rollback.
		paused, rerr := op.endRecorded(ctl.StatePaused, fig)
		if rerr != nil {
			return c.rollBackUnrecorded(op, req, v, fig, rerr, func(outcome string) {
				c.metrics.PauseDone(outcome, total(res, start), metricPhases(res), drained)
			})
		}
		c.metrics.PauseDone(metrics.Committed, total(res, start), metricPhases(res), drained)
		c.log.Info("paused", "job", req.Job, "nodes", len(v.Nodes), "connections", paused.Connections, "drained_bytes", drained, "total_ms", paused.TotalMs)
		return paused, nil
	}
	fig.State = stateAfter(res.State)
	c.metrics.PauseDone(pauseOutcome(fig.State), total(res, start), metricPhases(res), drained)
	fig.Failure = failure(err, res, context.Cause(ctx))
	fig = op.end(fig.State, fig)
	c.log.Warn("pause failed", "job", req.Job, "state", fig.State, "error", fig.Failure.Reason)
	if fig.State == ctl.StateFailed {
		// The record stays until the rollback is confirmed everywhere.
		go c.confirmRollback(req.Job, v.Nodes)
	}
	msg := fmt.Sprintf("pause of job %s failed in %s: %s", req.Job, fig.Failure.Phase, fig.Failure.Reason)
	code := ctl.CodeFailed
	if fa := fault(err, context.Cause(ctx)); fa != nil && fa.Code == node.FaultRankGone {
		code = ctl.CodeRankGone
		msg += "; rolled back for the other ranks"
	} else if fig.State == ctl.StateRunning {
		msg += "; rolled back, the job runs on"
	}
	return fig, ctl.Errorf(code, "%s", msg)
}

func (c *coordinator) resume(ctx context.Context, req ctl.Request, v ctl.Job, progress func(ctl.Progress)) (ctl.Job, error) {
	op, err := c.reg.begin(req.Job, ctl.OpResume, v)
	if err != nil {
		c.metrics.ResumeRefused()
		return v, err
	}
	start := time.Now()
	ctx = quiesce.WithProgress(ctx, func(p quiesce.Progress) {
		if progress != nil {
			progress(toProgress(p, len(v.Nodes), start))
		}
	})
	res, err := c.protocol(0).Resume(ctx, req.Job, v.Nodes)
	fig := figures(v, res)
	if err == nil {
		c.metrics.ResumeDone(metrics.Resumed, total(res, start))
		fig = op.end(ctl.StateRunning, fig)
		c.log.Info("resumed", "job", req.Job, "total_ms", fig.TotalMs)
		return fig, nil
	}
	c.metrics.ResumeDone(metrics.Failed, total(res, start))
	fig.Failure = failure(err, res, nil)
	fig = op.end(ctl.StateFailed, fig)
	return fig, ctl.Errorf(ctl.CodeFailed, "resume of job %s failed: %s", req.Job, fig.Failure.Reason)
}

// confirmRollback goes on rolling back a failed pause whose rollback some
// node did not confirm (its mpid was down, or its link): those nodes thaw
// on their own (lease, or at their mpid's restart), and this finds out, so
// that the job's state becomes the truth (running) without a user's
// resume. It gives way to any operation a user starts and stops when the
// job is running or gone, or after rollbackRetries attempts.
func (c *coordinator) confirmRollback(id string, nodes []string) {
	delay := time.Second
	for range rollbackRetries {
		select {
		case <-c.done:
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 30*time.Second)
		op, last, ok := c.reg.claimFailed(id, ctl.Job{Nodes: nodes})
		if !ok {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		res, err := c.protocol(0).Resume(ctx, id, nodes)
		cancel()
		if err == nil {
			if last.Failure != nil {
				f := *last.Failure
				f.Unconfirmed = nil // confirmed now
				last.Failure = &f
			}
			op.end(ctl.StateRunning, last)
			c.log.Info("rollback of the failed pause now confirmed on every node; the job runs", "job", id)
			return
		}
		op.end(ctl.StateFailed, last)
		c.log.Warn("rollback of the failed pause still not confirmed", "job", id, "unconfirmed", len(res.Unconfirmed), "error", err)
	}
}

// rollbackRetries bounds confirmRollback: about half an hour.
const rollbackRetries = 64

// forward passes a pause or resume to the job's coordinator (the mpid the
// job key names) over the peer port, and returns its answer. The user's uid
// travels with it: the coordinator applies the same ownership rule, and
// believes the uid because only a holder of the cluster key can speak on
// the peer port (TLS, docs/security.md, "The peer port").
func (c *coordinator) forward(ctx context.Context, to string, req ctl.Request, uid uint32) (ctl.Job, error) {
	drain := req.Timeout
	if drain <= 0 {
		drain = c.drain
	}
	// The coordinator's own deadlines bound the work; this only bounds a
	// coordinator that never answers.
	ctx, cancel := context.WithTimeout(ctx, drain+2*time.Minute)
	defer cancel()
	m := (&peerControl{Op: req.Op, UID: uid, Timeout: req.Timeout}).message(req.Job, to)
	rep, err := c.tr.Call(ctx, to, m)
	if err == nil && rep.Err != "" {
		err = errors.New(rep.Err)
	}
	var ans *peerControl
	if err == nil {
		if ans, err = decodeControl(rep); errors.Is(err, errNoControl) {
			err = errors.New("an answer without a result")
		}
	}
	if err != nil {
		return ctl.Job{}, ctl.Errorf(ctl.CodeUnavailable, "job %s is coordinated by mpid on %s (the node its job key names: where `mpipause run` ran, or the Slurm step's first node), which did not answer: %v", req.Job, to, err)
	}
	var j ctl.Job
	if len(ans.Result) > 0 {
		if err := json.Unmarshal(ans.Result, &j); err != nil {
			return ctl.Job{}, ctl.Errorf(ctl.CodeUnavailable, "mpid on %s sent a malformed result: %v", to, err)
		}
	}
	if ans.Code != "" {
		return j, &ctl.Error{Code: ans.Code, Message: ans.Message}
	}
	return j, nil
}

// someOf names the first n of names, and says how many more there are:
// a rank 0 may list thousands.
func someOf(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:n], ", "), len(names)-n)
}

// unregistered cross-checks the job's node list (the nodes that registered
// ranks of it here) against the hosts rank 0 gathered at MPI_Init, if rank
// 0 is here: a node rank 0 names and the list lacks has ranks nobody would
// gate (its mpid is down, refused the job key, or holds another cluster
// key). Rank 0's word never adds a node; it only explains a refusal.
//
// Linear in the hosts named: a job's rank 0 registrations share one list
// (ranks.Server), read once, and every name is looked up in a set.
func (c *coordinator) unregistered(key string, nodes []string) []string {
	var out []string
	known := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		known[n] = true
	}
	read := map[*string]bool{}
	for _, r := range c.ranks.Ranks(key) {
		if r.Rank != 0 || len(r.Hosts) == 0 || read[&r.Hosts[0]] {
			continue
		}
		read[&r.Hosts[0]] = true
		for _, h := range r.Hosts {
			if h != r.Host && h != "" && !known[h] {
				known[h] = true
				out = append(out, h)
			}
		}
	}
	return out
}

// rollBackUnrecorded rolls back a pause that committed everywhere but
// whose paused record could not be written (rerr), and reports it failed.
// The record still says pausing until the rollback is confirmed, so a
// successor would finish it. done counts the pause in the metrics.
func (c *coordinator) rollBackUnrecorded(op *operation, req ctl.Request, v ctl.Job, fig ctl.Job, rerr error, done func(outcome string)) (ctl.Job, error) {
	c.log.Error("the pause held but cannot be recorded; rolling it back", "job", req.Job, "error", rerr)
	// Its own deadline: the caller may be gone, and the nodes must not
	// stay paused for a pause nobody will be told of.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	res, err := c.protocol(0).Resume(ctx, req.Job, v.Nodes)
	cancel()
	fig.Failure = &ctl.Failure{Phase: string(quiesce.KindCommit), Node: c.node, Rank: -1,
		Reason: fmt.Sprintf("the pause held, but the coordinator cannot record it (%v), and a restart of its mpid would roll it back", rerr)}
	if err != nil {
		for _, n := range res.Unconfirmed {
			fig.Failure.Unconfirmed = append(fig.Failure.Unconfirmed, n.Node)
		}
		fig = op.end(ctl.StateFailed, fig)
		done(metrics.Failed)
		go c.confirmRollback(req.Job, v.Nodes)
		return fig, ctl.Errorf(ctl.CodeFailed, "pause of job %s failed in COMMIT: %s; its rollback is not confirmed yet: %v", req.Job, fig.Failure.Reason, err)
	}
	fig = op.end(ctl.StateRunning, fig)
	done(metrics.RolledBack)
	return fig, ctl.Errorf(ctl.CodeFailed, "pause of job %s failed in COMMIT: %s; rolled back, the job runs on", req.Job, fig.Failure.Reason)
}

// rankEvent acts on a rank's SIGTSTP or SIGCONT: the whole job pauses or
// resumes, as `mpipause` would do it, unless a resume (a pause) on this
// node since the signal has answered it (registry.answered). Only the
// coordinator acts; every rank of a job usually gets the signal (Slurm, a
// terminal), rank 0 included. One request per job is under way at a time
// (a rank repeating its EVENT line would cost mpid a goroutine and a log
// line each otherwise); of those that come meanwhile the latest is kept
// and acted on after it (startEvent, nextEvent).
func (c *coordinator) rankEvent(r *ranks.Rank, ev string) {
	if strings.HasPrefix(ev, "flushed ") {
		o, err := ranks.ParseFlushed(ev)
		switch {
		case err != nil:
			c.log.Warn("rank sent a malformed flush report", "job", r.Job, "rank", r.Rank, "error", err)
		case o.Errors > 0:
			// A connection the peer closed during the pause: the kernel
			// would have dropped those bytes too.
			c.log.Warn("held bytes refused at reopen", "job", r.Job, "rank", r.Rank, "flushed", o.Flushed, "errors", o.Errors, "errno", o.Errno)
		default:
			c.log.Debug("held bytes flushed", "job", r.Job, "rank", r.Rank, "flushed", o.Flushed)
		}
		return
	}
	q, err := ranks.ParseRequest(ev)
	if err != nil {
		return
	}
	key := r.JobKey()
	if c.reg.answered(key, r.Pid, q) {
		if q.Op == "pause" {
			c.log.Info("pause request left alone: signalled before the last resume", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
		} else {
			c.log.Info("resume request left alone: signalled before the last pause", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
		}
		return
	}
	if !c.startEvent(key, q) {
		return
	}
	// ev is the rank's to write: an attribute (quoted), never the message.
	c.log.Info("rank event", "event", ev, "job", r.Job, "rank", r.Rank, "pid", r.Pid)
	go func() {
		for {
			c.actOnRequest(r, key, q)
			next, ok := c.nextEvent(key, q)
			if !ok {
				return
			}
			q = next
			c.log.Info("rank event that came during the last", "event", q.Op, "job", r.Job, "at", q.At)
		}
	}()
}

// actOnRequest pauses or resumes job key on rank r's request q, as the
// rank's own uid (a rank's signal pauses its job, and nothing else). An
// operation under way (a user's) is waited for, and the request made
// after it unless answered since.
func (c *coordinator) actOnRequest(r *ranks.Rank, key string, q ranks.Request) {
	op := map[string]string{"pause": ctl.OpPause, "resume": ctl.OpResume}[q.Op]
	for {
		rep, err := c.doAt(context.Background(), ctl.Request{Version: ctl.Version, Op: op, Job: key}, r.UID, nil, true)
		var ce *ctl.Error
		switch {
		case errors.As(err, &ce) && ce.Code == ctl.CodeState:
			if idle := c.reg.whenIdle(key); idle != nil {
				select {
				case <-idle:
				case <-c.done:
					return
				}
				// The operation waited for may have ended in the other
				// one since (a resume's SIGCONT while a pause failed).
				if c.reg.answered(key, r.Pid, q) {
					c.log.Info(q.Op+" request left alone: answered while it waited", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
					return
				}
				continue
			}
			c.log.Info(q.Op+" request left alone", "job", r.Job, "reason", ce.Message)
		case errors.As(err, &ce) && ce.Code == ctl.CodeElsewhere:
			c.log.Info(q.Op+" request left alone", "job", r.Job, "reason", ce.Message)
		case err != nil:
			c.log.Warn(q.Op+" on the rank's request failed", "job", r.Job, "error", err)
		default:
			c.log.Info(q.Op+" on the rank's request", "job", r.Job, "state", rep.State, "total_ms", rep.TotalMs)
		}
		return
	}
}

// rankContinued acts on a SIGCONT pending on rank r, frozen by a pause of
// its job (registry.watchContinue): the request its handler would make.
func (c *coordinator) rankContinued(r *ranks.Rank) {
	c.log.Info("a SIGCONT waits on a frozen rank: resuming its job", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
	c.rankEvent(r, "resume")
}

// startEvent says whether a rank's request q for job key may start: none
// is under way. If one is, q is kept if it is the latest that came
// meanwhile (unstamped: as it comes), for nextEvent.
func (c *coordinator) startEvent(key string, q ranks.Request) bool {
	c.evMu.Lock()
	defer c.evMu.Unlock()
	if c.events[key] {
		if w, ok := c.wanted[key]; !ok || q.At == 0 || q.At >= w.At {
			if c.wanted == nil {
				c.wanted = map[string]ranks.Request{}
			}
			c.wanted[key] = q
		}
		return false
	}
	if c.events == nil {
		c.events = map[string]bool{}
	}
	c.events[key] = true
	return true
}

// nextEvent ends the request done (job key's under way) and returns the
// one to act on next, if a later one of the other operation came
// meanwhile: the latest signal is what the user wants. A request of the
// same operation asks what was just done; an older one was answered by it.
func (c *coordinator) nextEvent(key string, done ranks.Request) (ranks.Request, bool) {
	c.evMu.Lock()
	defer c.evMu.Unlock()
	w, ok := c.wanted[key]
	delete(c.wanted, key)
	if ok && w.Op != done.Op && (w.At == 0 || done.At == 0 || w.At > done.At) {
		return w, true
	}
	delete(c.events, key)
	return ranks.Request{}, false
}

// list shows the jobs the caller may see: all for root, their own otherwise.
func (c *coordinator) list(uid uint32) []ctl.Job {
	out := []ctl.Job{}
	for _, id := range c.reg.visible(uid) {
		if v, err := c.view(id); err == nil {
			out = append(out, v)
		}
	}
	return out
}

// view is the job (by key) as this node sees it.
func (c *coordinator) view(id string) (ctl.Job, error) {
	jv, ok := c.reg.view(id)
	if !ok {
		return ctl.Job{}, c.noJob(id)
	}
	v := jv.v
	v.Observer = c.observer
	rs := c.ranks.Ranks(id)
	if jv.adopted && len(rs) == 0 {
		// What the ranks told the previous mpid, from its record.
		v.Node, v.Ranks, v.LocalRanks, v.Coordinator = c.node, jv.size, jv.localRanks, jv.coordinator
		v.State = jv.state
		if jv.coordinated && len(jv.nodes) > len(v.Nodes) {
			v.Nodes = jv.nodes
		}
		if !jv.coordinated {
			v.Nodes = []string{c.node}
			if _, ok := c.agent.State(id); ok {
				v.State = agentState(c.agent, id)
			}
		}
		return v, nil
	}
	v.LocalRanks = nil
	v.Ranks = jv.size
	for _, r := range rs {
		v.LocalRanks = append(v.LocalRanks, r.Rank)
		v.Ranks = max(v.Ranks, r.Size)
	}
	slices.Sort(v.LocalRanks)
	v.Node, v.Coordinator = c.node, jv.coordinator
	if jv.coordinated {
		v.State = jv.state
	} else {
		v.State = agentState(c.agent, id)
	}
	return v, nil
}

// jobName is the id part of a job key, for messages.
func jobName(key string) string {
	if _, name, ok := jobid.SplitKey(key); ok {
		return name
	}
	return key
}

// agentState is a non-coordinator node's idea of the job's state: the last
// protocol step it ran.
func agentState(a *quiesce.Agent, id string) string {
	st, ok := a.State(id)
	if !ok {
		return ctl.StateRunning
	}
	if st.Err != "" && (st.Kind == quiesce.KindAbort || st.Kind == quiesce.KindResume) {
		return ctl.StateFailed
	}
	switch st.Kind {
	case quiesce.KindCommit, quiesce.KindDecide, quiesce.KindCommitted:
		return ctl.StatePaused
	case quiesce.KindAbort, quiesce.KindResume:
		return ctl.StateRunning
	}
	return ctl.StatePausing
}

package mpid

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/quiesce"
)

// do runs a status, pause or resume request of a caller with uid, for the
// job the caller names (lookup). A pause or resume of a job coordinated
// elsewhere goes to the coordinator's mpid.
func (d *Daemon) do(ctx context.Context, req ctl.Request, uid uint32, progress func(ctl.Progress)) (ctl.Job, error) {
	key, err := d.lookup(req.Job, uid)
	if err != nil {
		return ctl.Job{}, err
	}
	req.Job = key
	return d.doAt(ctx, req, uid, progress, true)
}

// doAt runs req for the job whose key is req.Job.
func (d *Daemon) doAt(ctx context.Context, req ctl.Request, uid uint32, progress func(ctl.Progress), mayForward bool) (ctl.Job, error) {
	owner, _, ok := ranks.SplitJobKey(req.Job)
	if !ok || (uid != 0 && uid != owner) {
		// Nothing about the job, not even that it exists, goes to a
		// stranger: their name for it is in their own namespace.
		return ctl.Job{}, d.noJob(req.Job)
	}
	v, err := d.view(req.Job)
	if err != nil {
		return ctl.Job{}, err
	}
	if req.Op == ctl.OpStatus {
		return v, nil
	}
	if v.Coordinator != d.cfg.Node {
		if v.Coordinator == "" || !mayForward {
			return v, ctl.Errorf(ctl.CodeElsewhere, "job %s is not coordinated by %s (ranks here: %s) and its coordinator is not known here; run mpipause on the node that launched it",
				jobName(req.Job), d.cfg.Node, ctl.RankList(v.LocalRanks))
		}
		return d.forward(ctx, v.Coordinator, req, uid)
	}
	switch req.Op {
	case ctl.OpPause:
		return d.pause(ctx, req, v, progress)
	case ctl.OpResume:
		return d.resume(ctx, req, v, progress)
	}
	return v, ctl.Errorf(ctl.CodeBadRequest, "unknown operation %q", req.Op)
}

// noJob is the answer about a job this node does not know, and about
// another user's job: the same, so a stranger learns nothing from it.
func (d *Daemon) noJob(key string) error {
	return ctl.Errorf(ctl.CodeUnknownJob, "no job %s on %s: see `mpipause list`", jobName(key), d.cfg.Node)
}

// begin marks the job busy for op if its state allows op.
func (d *Daemon) begin(id, op string) (*job, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	j := d.jobs[id]
	if j == nil {
		return nil, ctl.Errorf(ctl.CodeUnknownJob, "job %s ended", id)
	}
	if j.busy {
		return nil, ctl.Errorf(ctl.CodeState, "job %s is %s: wait for it to finish", id, j.state)
	}
	switch op {
	case ctl.OpPause:
		if j.state == ctl.StatePaused {
			return nil, ctl.Errorf(ctl.CodeState, "job %s is already paused (since %s); resume it with `mpipause resume %s`",
				id, j.since.Format(time.TimeOnly), id)
		}
		if j.unwatched != "" {
			return nil, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused cleanly: %s", id, j.unwatched)
		}
		if why := d.missingLocked(j); why != "" {
			return nil, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused yet: %s", id, why)
		}
		j.state = ctl.StatePausing
	case ctl.OpResume:
		if j.state == ctl.StateRunning {
			return nil, ctl.Errorf(ctl.CodeState, "job %s is running, not paused: nothing to resume", id)
		}
		j.state = ctl.StateResuming
	}
	j.busy = true
	return j, nil
}

// end records the outcome of an operation and returns fig as of now.
func (d *Daemon) end(j *job, state string, fig ctl.Job) ctl.Job {
	d.mu.Lock()
	defer d.mu.Unlock()
	j.busy = false
	j.state = state
	j.since = time.Now()
	fig.State, fig.Since = state, j.since
	j.last = fig
	d.maybeEndLocked(j)
	return fig
}

func (d *Daemon) coordinator(drain time.Duration) *quiesce.Coordinator {
	if drain <= 0 {
		drain = d.cfg.Drain
	}
	// Nodes hold their DRAIN answers while they drain (checking every
	// quiesce.DrainPoll): the end of a drain is seen a millisecond after it
	// happens instead of at the next protocol round (2 ms apart, 2-3 ms
	// each on the rig). 20 ms keeps progress reports coming.
	return quiesce.NewCoordinator(d.tr, quiesce.Options{Drain: drain, DrainWait: 20 * time.Millisecond})
}

func (d *Daemon) pause(ctx context.Context, req ctl.Request, v ctl.Job, progress func(ctl.Progress)) (ctl.Job, error) {
	if missing := d.unregistered(req.Job, v.Nodes); len(missing) > 0 {
		d.metrics.PauseRefused()
		return v, ctl.Errorf(ctl.CodeUnpausable, "job %s cannot be paused: rank 0 says it has ranks on %s, whose mpid has registered none of them with %s, the job's coordinator: is mpid running there, with this cluster's key file (every node needs the same one)?",
			jobName(req.Job), strings.Join(missing, ", "), d.cfg.Node)
	}
	j, err := d.begin(req.Job, ctl.OpPause)
	if err != nil {
		d.metrics.PauseRefused()
		return v, err
	}
	start := time.Now()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var drained uint64
	var once sync.Once
	ctx = quiesce.WithProgress(ctx, func(p quiesce.Progress) {
		if p.Phase == quiesce.KindDrain && !p.Done {
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
		if progress != nil {
			progress(toProgress(p, len(v.Nodes), start))
		}
	})
	// Recorded before any node is touched: if this mpid dies mid-pause,
	// some nodes may have committed and others rolled back on their leases;
	// its successor finds this record and rolls the pause back everywhere
	// (adopt), since nobody was told it held.
	d.mu.Lock()
	d.saveLocked(j, v)
	d.mu.Unlock()
	res, err := d.coordinator(req.Timeout).Pause(ctx, req.Job, v.Nodes)
	fig := figures(v, res)
	fig.DrainedBytes = drained
	if err == nil {
		d.metrics.PauseDone(metrics.Committed, total(res, start), metricPhases(res), drained)
		fig = d.end(j, ctl.StatePaused, fig)
		d.mu.Lock()
		d.saveLocked(j, v)
		d.mu.Unlock()
		d.log.Info("paused", "job", req.Job, "nodes", len(v.Nodes), "connections", fig.Connections, "drained_bytes", drained, "total_ms", fig.TotalMs)
		return fig, nil
	}
	fig.State = res.State
	if fig.State == "" {
		fig.State = ctl.StateRunning
	}
	d.metrics.PauseDone(pauseOutcome(fig.State), total(res, start), metricPhases(res), drained)
	fig.Failure = failure(err, res, context.Cause(ctx))
	fig = d.end(j, fig.State, fig)
	d.log.Warn("pause failed", "job", req.Job, "state", fig.State, "error", fig.Failure.Reason)
	if fig.State == ctl.StateFailed {
		// The record stays until the rollback is confirmed everywhere.
		go d.confirmRollback(req.Job, v.Nodes)
	} else {
		d.dropRecord(req.Job)
	}
	msg := fmt.Sprintf("pause of job %s failed in %s: %s", req.Job, fig.Failure.Phase, fig.Failure.Reason)
	code := ctl.CodeFailed
	if strings.Contains(fig.Failure.Reason, node.ErrRankGone.Error()) {
		// Errors cross the network as text: the node's words are the key.
		code = ctl.CodeRankGone
		msg += "; rolled back for the other ranks"
	} else if fig.State == ctl.StateRunning {
		msg += "; rolled back, the job runs on"
	}
	return fig, ctl.Errorf(code, "%s", msg)
}

func (d *Daemon) resume(ctx context.Context, req ctl.Request, v ctl.Job, progress func(ctl.Progress)) (ctl.Job, error) {
	j, err := d.begin(req.Job, ctl.OpResume)
	if err != nil {
		d.metrics.ResumeRefused()
		return v, err
	}
	start := time.Now()
	ctx = quiesce.WithProgress(ctx, func(p quiesce.Progress) {
		if progress != nil {
			progress(toProgress(p, len(v.Nodes), start))
		}
	})
	res, err := d.coordinator(0).Resume(ctx, req.Job, v.Nodes)
	fig := figures(v, res)
	if err == nil {
		d.metrics.ResumeDone(metrics.Resumed, total(res, start))
		fig = d.end(j, ctl.StateRunning, fig)
		d.dropRecord(req.Job)
		d.log.Info("resumed", "job", req.Job, "total_ms", fig.TotalMs)
		return fig, nil
	}
	d.metrics.ResumeDone(metrics.Failed, total(res, start))
	fig.Failure = failure(err, res, nil)
	fig = d.end(j, ctl.StateFailed, fig)
	return fig, ctl.Errorf(ctl.CodeFailed, "resume of job %s failed: %s", req.Job, fig.Failure.Reason)
}

// confirmRollback goes on rolling back a failed pause whose rollback some
// node did not confirm (its mpid was down, or its link): those nodes thaw
// on their own (lease, or at their mpid's restart), and this finds out, so
// that the job's state becomes the truth (running) without a user's
// resume. It gives way to any operation a user starts and stops when the
// job is running or gone, or after rollbackRetries attempts.
func (d *Daemon) confirmRollback(id string, nodes []string) {
	delay := time.Second
	for range rollbackRetries {
		select {
		case <-d.done:
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 30*time.Second)
		d.mu.Lock()
		j := d.jobs[id]
		ok := j != nil && !j.busy && j.state == ctl.StateFailed
		var last ctl.Job
		if ok {
			j.busy, last = true, j.last
		}
		d.mu.Unlock()
		if !ok {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		res, err := d.coordinator(0).Resume(ctx, id, nodes)
		cancel()
		if err == nil {
			if last.Failure != nil {
				f := *last.Failure
				f.Unconfirmed = nil // confirmed now
				last.Failure = &f
			}
			d.end(j, ctl.StateRunning, last)
			d.dropRecord(id)
			d.log.Info("rollback of the failed pause now confirmed on every node; the job runs", "job", id)
			return
		}
		d.end(j, ctl.StateFailed, last)
		d.log.Warn("rollback of the failed pause still not confirmed", "job", id, "unconfirmed", len(res.Unconfirmed), "error", err)
	}
}

// rollbackRetries bounds confirmRollback: about half an hour.
const rollbackRetries = 64

func (d *Daemon) resolve(name string) (string, error) {
	return fmt.Sprintf("%s:%d", name, d.cfg.PeerPort), nil
}

func toProgress(p quiesce.Progress, nodes int, start time.Time) ctl.Progress {
	out := ctl.Progress{Phase: string(p.Phase), Round: p.Round, Done: p.Done, Nodes: nodes, Ms: ms(time.Since(start)), Err: p.Stat.Err}
	if !p.Done {
		out.NodesClean = p.Report.Nodes - len(p.Report.Pending)
		for _, n := range p.Report.Pending {
			out.Conns += len(n.Conns)
		}
		out.InflightBytes = p.Report.InflightBytes()
	}
	return out
}

// figures fills a job view with a result's measurements.
func figures(v ctl.Job, res quiesce.Result) ctl.Job {
	v.Connections = res.Report.Checked
	v.InflightBytes = res.Report.InflightBytes()
	v.TotalMs = ms(res.Total)
	v.Phases = nil
	for _, p := range res.Phases {
		v.Phases = append(v.Phases, ctl.Phase{Name: string(p.Phase), Rounds: p.Rounds, Ms: ms(p.Elapsed), Err: p.Err})
		if p.Phase == quiesce.KindDrain {
			v.DrainMs += ms(p.Elapsed) // a VERIFY that found bytes drains again
		}
	}
	v.Failure = nil
	return v
}

// failure explains a failed pause or resume: where, why, and which
// connections still held bytes.
func failure(err error, res quiesce.Result, cause error) *ctl.Failure {
	f := &ctl.Failure{Rank: -1, Reason: err.Error()}
	var ae *quiesce.AbortError
	if errors.As(err, &ae) {
		f.Phase = string(ae.Phase)
		f.Reason = ae.Cause.Error()
	}
	if cause != nil && !errors.Is(cause, context.Canceled) {
		// Our own reason for cutting the pause short beats "context canceled".
		f.Reason = cause.Error()
	}
	if m := goneRank.FindStringSubmatch(f.Reason); m != nil {
		f.Rank, _ = strconv.Atoi(m[1])
	}
	// The peer of a connection is whoever owns its other end: another
	// node's pending connection with the addresses swapped, if listed.
	byEnds := map[[2]string]int{}
	for _, n := range res.Report.Pending {
		for _, c := range n.Conns {
			byEnds[[2]string{c.Local, c.Remote}] = c.Rank
		}
	}
	notReading := map[int]bool{}
	nodes := 0
	violNode := ""
	for _, n := range res.Report.Pending {
		if f.Node == "" {
			f.Node = n.Node
		}
		if len(n.Conns) > 0 {
			nodes++
		}
		f.Violations += n.Violations
		if n.Violations > 0 && violNode == "" {
			violNode = n.Node
		}
		for _, c := range n.Conns {
			peer, ok := byEnds[[2]string{c.Remote, c.Local}]
			if !ok {
				peer = -1
			}
			f.Conns = append(f.Conns, ctl.Conn{Node: c.Node, Local: c.Local, Remote: c.Remote,
				SendQueue: c.SendQueue, Unread: c.Unread, Rank: c.Rank, Peer: peer})
			if c.Unread > 0 && c.Rank >= 0 {
				notReading[c.Rank] = true
			}
		}
	}
	for r := range notReading {
		f.NotReading = append(f.NotReading, r)
	}
	slices.Sort(f.NotReading)
	if len(f.NotReading) == 1 {
		f.Rank = f.NotReading[0]
	}
	if errors.Is(err, quiesce.ErrNotEmpty) && f.Phase == string(quiesce.KindDrain) {
		// The user's question is who does not read, not the protocol's
		// round count.
		f.Reason = "the drain timed out"
		if len(f.Conns) > 0 || f.Violations == 0 {
			f.Reason += fmt.Sprintf(": %s on %s still hold bytes", plural(len(f.Conns), "connection"), plural(nodes, "node"))
		}
		if len(f.NotReading) > 0 {
			f.Reason += fmt.Sprintf("; ranks not reading what was sent to them: %s (busy outside MPI?)", ctl.RankList(f.NotReading))
		}
	}
	if f.Violations > 0 {
		// Bytes that keep moving while every gate is closed are not the
		// library's: something sends past the shim (raw system calls,
		// io_uring, a helper process), and no pause can be consistent.
		sep := "; "
		if f.Reason == "the drain timed out" {
			sep = ": "
		}
		if len(f.Conns) == 0 {
			f.Node = violNode
		}
		f.Reason += fmt.Sprintf("%s%s sent through closed gates on %s in the last round (a send path the shim does not wrap: raw system calls, io_uring?)",
			sep, plural(int(f.Violations), "byte"), violNode)
	}
	for _, n := range res.Unconfirmed {
		f.Unconfirmed = append(f.Unconfirmed, n.Node)
	}
	if f.Phase == "" {
		f.Phase = string(quiesce.KindResume)
	}
	return f
}

// goneRank finds the rank in node.ErrRankGone's text.
var goneRank = regexp.MustCompile(`rank (\d+) \(pid \d+\) ` + regexp.QuoteMeta(node.ErrRankGone.Error()))

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// forward passes a pause or resume to the job's coordinator (the mpid of
// rank 0's node) over the peer port, and returns its answer. The user's uid
// travels with it: the coordinator applies the same ownership rule.
// (Nothing authenticates the peers yet: the cluster key is the next issue's.)
func (d *Daemon) forward(ctx context.Context, to string, req ctl.Request, uid uint32) (ctl.Job, error) {
	drain := req.Timeout
	if drain <= 0 {
		drain = d.cfg.Drain
	}
	// The coordinator's own deadlines bound the work; this only bounds a
	// coordinator that never answers.
	ctx, cancel := context.WithTimeout(ctx, drain+2*time.Minute)
	defer cancel()
	m := quiesce.Message{Version: quiesce.ProtocolVersion, Job: req.Job, Kind: quiesce.KindControl, Nodes: []string{to},
		Control: &quiesce.Control{Op: req.Op, UID: uid, Timeout: req.Timeout}}
	rep, err := d.tr.Call(ctx, to, m)
	if err == nil && rep.Err != "" {
		err = errors.New(rep.Err)
	}
	if err == nil && rep.Control == nil {
		err = errors.New("an answer without a result")
	}
	if err != nil {
		return ctl.Job{}, ctl.Errorf(ctl.CodeUnavailable, "job %s is coordinated by mpid on %s (the node of rank 0), which did not answer: %v", req.Job, to, err)
	}
	var j ctl.Job
	if len(rep.Control.Result) > 0 {
		if err := json.Unmarshal(rep.Control.Result, &j); err != nil {
			return ctl.Job{}, ctl.Errorf(ctl.CodeUnavailable, "mpid on %s sent a malformed result: %v", to, err)
		}
	}
	if rep.Control.Code != "" {
		return j, &ctl.Error{Code: rep.Control.Code, Message: rep.Control.Message}
	}
	return j, nil
}

// peer serves the peer port: protocol steps go to the agent, a request
// passed on by another node's mpid is run here as the coordinator.
func (d *Daemon) peer(ctx context.Context, m quiesce.Message) (quiesce.Message, error) {
	if m.Kind != quiesce.KindControl {
		if why := d.foreignStep(m); why != "" {
			d.log.Warn("protocol step refused", "job", m.Job, "kind", m.Kind, "coordinator", m.Coordinator, "reason", why)
			return quiesce.Message{Version: quiesce.ProtocolVersion, Job: m.Job, Epoch: m.Epoch, Seq: m.Seq, Kind: m.Kind, Reply: true, Err: why}, nil
		}
		return d.agent.Handle(ctx, m)
	}
	reply := quiesce.Message{Version: quiesce.ProtocolVersion, Job: m.Job, Kind: m.Kind, Reply: true}
	c := m.Control
	if m.Version == quiesce.ProtocolVersion && c != nil && (c.Op == opRegister || c.Op == opUnregister) {
		reply.Control = d.registered(m)
		return reply, nil
	}
	if m.Version != quiesce.ProtocolVersion || c == nil || (c.Op != ctl.OpPause && c.Op != ctl.OpResume) {
		reply.Err = "malformed control request"
		return reply, nil
	}
	req := ctl.Request{Version: ctl.Version, Op: c.Op, Job: m.Job, Timeout: c.Timeout}
	var j ctl.Job
	err := req.Validate()
	if err == nil {
		// As for the CLI: the caller going away does not cut the pause short.
		j, err = d.doAt(context.WithoutCancel(ctx), req, c.UID, nil, false)
	}
	out := &quiesce.Control{Op: c.Op}
	var ce *ctl.Error
	switch {
	case errors.As(err, &ce):
		out.Code, out.Message = ce.Code, ce.Message
	case err != nil:
		out.Code, out.Message = ctl.CodeFailed, err.Error()
	}
	if j.ID != "" {
		out.Result, _ = json.Marshal(j)
	}
	reply.Control = out
	d.log.Info("request from a peer", "job", m.Job, "op", c.Op, "uid", c.UID, "code", out.Code)
	return reply, nil
}

// foreignStep says why this node refuses a protocol step: its job is not a
// job key, or it is a job this node knows as coordinated by another node
// than the one the step comes from. A step of a job unknown here finds
// nothing to act on.
func (d *Daemon) foreignStep(m quiesce.Message) string {
	if _, _, ok := ranks.SplitJobKey(m.Job); !ok {
		return fmt.Sprintf("job %q is not a job key", m.Job)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if j := d.jobs[m.Job]; j != nil && j.coordinator != "" && j.coordinator != m.Coordinator {
		return fmt.Sprintf("job %s is coordinated by %s, not %s", m.Job, j.coordinator, m.Coordinator)
	}
	return ""
}

// unregistered cross-checks the job's node list (the nodes that registered
// ranks of it here) against the hosts rank 0 gathered at MPI_Init, if rank
// 0 is here: a node rank 0 names and the list lacks has ranks nobody would
// gate (its mpid is down, refused the job key, or holds another cluster
// key). Rank 0's word never adds a node; it only explains a refusal.
func (d *Daemon) unregistered(key string, nodes []string) []string {
	var out []string
	for _, r := range d.ranks.Ranks(key) {
		if r.Rank != 0 {
			continue
		}
		for _, h := range r.Hosts {
			if h != r.Host && h != "" && !slices.Contains(nodes, h) && !slices.Contains(out, h) {
				out = append(out, h)
			}
		}
	}
	return out
}

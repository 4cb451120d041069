package mpid

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/quiesce"
)

// peer serves the peer port, to the holders of the cluster key: protocol
// steps of the jobs this node has ranks of (the agent, playing the node
// role), the registrations of nodes with the jobs this node coordinates,
// and the pauses and resumes other nodes' mpids pass on to this one.
type peer struct {
	node  string
	key   *quiesce.Keyring
	reg   *registry
	coord *coordinator
	agent *quiesce.Agent
	log   *slog.Logger
}

// handle serves one message: a protocol step goes to the agent, a request
// passed on by another node's mpid is run here as the coordinator.
func (p *peer) handle(ctx context.Context, m quiesce.Message) (quiesce.Message, error) {
	if m.Kind != kindControl {
		if why := p.foreignStep(m); why != "" {
			p.log.Warn("protocol step refused", "job", m.Job, "kind", m.Kind, "coordinator", m.Coordinator, "reason", why)
			return quiesce.Message{Version: quiesce.ProtocolVersion, Job: m.Job, Epoch: m.Epoch, Seq: m.Seq, Kind: m.Kind, Reply: true, Err: why}, nil
		}
		return p.agent.Handle(ctx, m)
	}
	reply := quiesce.Message{Version: quiesce.ProtocolVersion, Job: m.Job, Kind: m.Kind, Reply: true}
	c, err := decodeControl(m)
	if m.Version == quiesce.ProtocolVersion && err == nil && (c.Op == opRegister || c.Op == opUnregister) {
		reply.Payload = p.registered(m.Job, c).encode()
		return reply, nil
	}
	if m.Version != quiesce.ProtocolVersion || err != nil || (c.Op != ctl.OpPause && c.Op != ctl.OpResume) {
		reply.Err = "malformed control request"
		return reply, nil
	}
	req := ctl.Request{Version: ctl.Version, Op: c.Op, Job: m.Job, Timeout: c.Timeout}
	var j ctl.Job
	err = req.Validate()
	if err == nil {
		// As for the CLI: the caller going away does not cut the pause short.
		j, err = p.coord.doAt(context.WithoutCancel(ctx), req, c.UID, nil, false)
	}
	out := &peerControl{Op: c.Op}
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
	reply.Payload = out.encode()
	p.log.Info("request from a peer", "job", m.Job, "op", c.Op, "uid", c.UID, "code", out.Code)
	return reply, nil
}

// foreignStep says why this node refuses a protocol step: its job is not a
// job key, or it is a job this node knows as coordinated by another node
// than the one the step comes from. A step of a job unknown here finds
// nothing to act on.
func (p *peer) foreignStep(m quiesce.Message) string {
	if _, _, ok := jobid.SplitKey(m.Job); !ok {
		return fmt.Sprintf("job %q is not a job key", m.Job)
	}
	if coord := p.reg.coordinatorOf(m.Job); coord != "" && coord != m.Coordinator {
		return fmt.Sprintf("job %s is coordinated by %s, not %s", m.Job, coord, m.Coordinator)
	}
	return ""
}

// registered serves a node's registration (or its job's end there): the
// job key must be this job's and name this node as its coordinator.
func (p *peer) registered(job string, c *peerControl) *peerControl {
	out := &peerControl{Op: c.Op}
	refuse := func(format string, args ...any) *peerControl {
		out.Code, out.Message = ctl.CodePermission, fmt.Sprintf(format, args...)
		return out
	}
	uid, name, ok := jobid.SplitKey(job)
	if !ok || uid != c.UID || !jobid.ValidHostName(c.Node) {
		return refuse("malformed registration")
	}
	coord, err := checkToken(p.key, uid, name, c.Token)
	if err != nil {
		return refuse("%v", err)
	}
	if coord != p.node {
		return refuse("job %s is coordinated by %s, not %s", job, coord, p.node)
	}
	if err := p.reg.remote(job, uid, name, c.Node, c.Size, c.Cgroups, c.Op == opRegister); err != nil {
		return refuse("%v", err)
	}
	return out
}

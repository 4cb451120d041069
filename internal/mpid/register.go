package mpid

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/quiesce"
)

// Registration: the coordinator of a job learns its nodes from the nodes
// themselves, over the authenticated peer port, each presenting the job key
// one of its ranks presented; never from what rank 0 says (docs/security.md).
const (
	opRegister   = "register"
	opUnregister = "unregister"
)

// registerTimeout bounds one registration call; sweep repeats it.
const registerTimeout = 5 * time.Second

// register tells job key's coordinator that this node has ranks of it.
func (d *Daemon) register(key, coord, token string, uid uint32) {
	size := 0
	for _, r := range d.ranks.Ranks(key) {
		size = max(size, r.Size)
	}
	err := d.registration(key, coord, &quiesce.Control{Op: opRegister, UID: uid, Token: token, Node: d.cfg.Node, Size: size})
	d.mu.Lock()
	defer d.mu.Unlock()
	j := d.jobs[key]
	if j == nil {
		return
	}
	if err != nil {
		if ok, held := d.refusals.allow("register " + key); ok {
			d.log.Warn("the job's coordinator did not confirm this node yet; retried", "job", key, "coordinator", coord, "error", err, "repeats_not_logged", held)
		}
		return
	}
	if !j.registered {
		d.log.Info("registered with the job's coordinator", "job", key, "coordinator", coord)
	}
	j.registered = true
	j.token = token
}

// unregister tells the coordinator that the job ended on this node.
func (d *Daemon) unregister(key, coord, token string, uid uint32) {
	if err := d.registration(key, coord, &quiesce.Control{Op: opUnregister, UID: uid, Token: token, Node: d.cfg.Node}); err != nil {
		d.log.Info("the job's coordinator was not told that the job ended here", "job", key, "coordinator", coord, "error", err)
	}
}

func (d *Daemon) registration(key, coord string, c *quiesce.Control) error {
	ctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
	defer cancel()
	m := quiesce.Message{Version: quiesce.ProtocolVersion, Job: key, Kind: quiesce.KindControl, Nodes: []string{coord}, Coordinator: coord, Control: c}
	rep, err := d.tr.Call(ctx, coord, m)
	if err == nil && rep.Err != "" {
		err = errors.New(rep.Err)
	}
	if err == nil && rep.Control != nil && rep.Control.Code != "" {
		err = errors.New(rep.Control.Message)
	}
	return err
}

// registered serves a node's registration (or its job's end there): the
// job key must be this job's and name this node as its coordinator.
func (d *Daemon) registered(m quiesce.Message) *quiesce.Control {
	c := m.Control
	out := &quiesce.Control{Op: c.Op}
	refuse := func(format string, args ...any) *quiesce.Control {
		out.Code, out.Message = ctl.CodePermission, fmt.Sprintf(format, args...)
		return out
	}
	uid, name, ok := ranks.SplitJobKey(m.Job)
	if !ok || uid != c.UID || !ranks.ValidHostName(c.Node) {
		return refuse("malformed registration")
	}
	coord, err := checkToken(d.cfg.ClusterKey, uid, name, c.Token)
	if err != nil {
		return refuse("%v", err)
	}
	if coord != d.cfg.Node {
		return refuse("job %s is coordinated by %s, not %s", m.Job, coord, d.cfg.Node)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	j := d.jobs[m.Job]
	if c.Op == opUnregister {
		if j != nil && j.remotes[c.Node] {
			delete(j.remotes, c.Node)
			d.log.Info("job ended on a node", "job", m.Job, "node", c.Node)
			d.maybeEndLocked(j)
		}
		return out
	}
	if j == nil {
		if j, err = d.newJobLocked(uid, name, coord); err != nil {
			return refuse("%v", err)
		}
	}
	if j.remotes == nil {
		j.remotes = map[string]bool{}
	}
	if !j.remotes[c.Node] {
		d.log.Info("node registered ranks of the job", "job", m.Job, "node", c.Node)
	}
	j.remotes[c.Node] = true
	if c.Size > j.size {
		j.size = c.Size
	}
	return out
}

// create makes job name of uid, coordinated by this node, for the
// `mpipause run` of pid, and answers with its job key. An id in use by
// one of the caller's jobs here is refused: two launches under one id
// would be one job to mpid.
func (d *Daemon) create(name string, uid uint32, pid int) ctl.Reply {
	d.mu.Lock()
	defer d.mu.Unlock()
	key := ranks.JobKey(uid, name)
	if d.jobs[key] != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeState, "job id %s is in use by a job of yours on %s: choose another (--jobid), or let it end", name, d.cfg.Node), Final: true}
	}
	j, err := d.newJobLocked(uid, name, d.cfg.Node)
	if err != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeUnavailable, "%v", err), Final: true}
	}
	// os.FindProcess holds a pidfd: a later pid of the same number is
	// never taken for the creator.
	if p, err := os.FindProcess(pid); err == nil {
		j.creator = p
	}
	d.log.Info("job created", "job", key, "pid", pid)
	v := ctl.Job{ID: name, Owner: uid, State: j.state, Node: d.cfg.Node, Coordinator: d.cfg.Node, Nodes: []string{d.cfg.Node}, Since: j.since}
	return ctl.Reply{Job: &v, Token: JobToken(d.cfg.ClusterKey, uid, name, d.cfg.Node), Final: true}
}

// token answers root (the SPANK plugin in slurmstepd) with the job key of
// a step: its user and id as Slurm says, coordinated by the step's first
// node.
func (d *Daemon) token(req ctl.Request, uid uint32) ctl.Reply {
	if uid != 0 {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodePermission, "only root may ask for another job's key (the SPANK plugin does, in slurmstepd)"), Final: true}
	}
	coord, err := firstHost(req.Nodelist)
	if err != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeBadRequest, "%v", err), Final: true}
	}
	return ctl.Reply{Token: JobToken(d.cfg.ClusterKey, *req.Owner, req.Job, coord), Final: true}
}

// lookup finds the job a caller of uid means by name: their own job of
// that id; for root, "UID:ID" or the one job of that id, whoever owns it.
// A job of someone else's is unknown to a stranger, owner and all.
func (d *Daemon) lookup(name string, uid uint32) (string, error) {
	if uid != 0 {
		return ranks.JobKey(uid, name), nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.jobs[name] != nil {
		return name, nil
	}
	var keys []string
	for k, j := range d.jobs {
		if j.name == name {
			keys = append(keys, k)
		}
	}
	switch len(keys) {
	case 0:
		return ranks.JobKey(0, name), nil
	case 1:
		return keys[0], nil
	}
	slices.Sort(keys)
	return "", ctl.Errorf(ctl.CodeBadRequest, "%d users have a job %s on %s: name one as UID:ID (%s)", len(keys), name, d.cfg.Node, strings.Join(keys, ", "))
}

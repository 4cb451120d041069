package mpid

import (
	"bufio"
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/peercred"
	"github.com/mpipause/mpipause/quiesce"
)

// control serves the control socket: the mpipause CLI, `mpipause run`
// creating its job, and the SPANK plugin asking for a step's job key. Each
// request is its caller's, by the uid the kernel reports for the
// connection (SO_PEERCRED), never by anything the request says.
type control struct {
	key   *quiesce.Keyring
	reg   *registry
	coord *coordinator
}

// serve answers one request per connection until ctx ends. ln's bounds
// and back-off keep it serving through a flood of connections; it fails
// only if ln is closed under it.
func (s *control) serve(ctx context.Context, ln *accept.Listener) error {
	context.AfterFunc(ctx, func() { ln.Close() })
	err := ln.ServeUnix(func(c *net.UnixConn) { s.conn(ctx, c) })
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func (s *control) conn(ctx context.Context, c *net.UnixConn) {
	defer c.Close()
	cred, err := peercred.Of(c)
	if err != nil {
		return
	}
	uid := cred.Uid
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	req, err := ctl.ReadRequest(bufio.NewReader(c))
	c.SetReadDeadline(time.Time{})
	if err != nil {
		var ce *ctl.Error
		if !errors.As(err, &ce) {
			ce = ctl.Errorf(ctl.CodeBadRequest, "control request: %v", err)
		}
		ctl.Write(c, ctl.Reply{Err: ce, Final: true})
		return
	}
	// The CLI going away (Ctrl-C) must not cut a pause short: the protocol
	// finishes or rolls back on its own deadlines either way.
	var wmu sync.Mutex
	progress := func(p ctl.Progress) {
		wmu.Lock()
		defer wmu.Unlock()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		ctl.Write(c, ctl.Reply{Progress: &p})
	}
	switch req.Op {
	case ctl.OpList:
		ctl.Write(c, ctl.Reply{Jobs: s.coord.list(uid), Final: true})
		return
	case ctl.OpStatus:
		if req.Job == "" {
			ctl.Write(c, ctl.Reply{Jobs: s.coord.list(uid), Final: true})
			return
		}
	case ctl.OpCreate:
		ctl.Write(c, s.reg.create(req.Job, uid, int(cred.Pid)))
		return
	case ctl.OpToken:
		ctl.Write(c, s.token(req, uid))
		return
	}
	j, err := s.coord.do(context.WithoutCancel(ctx), req, uid, progress)
	wmu.Lock()
	defer wmu.Unlock()
	c.SetWriteDeadline(time.Now().Add(time.Second))
	var ce *ctl.Error
	switch {
	case errors.As(err, &ce):
		r := ctl.Reply{Err: ce, Final: true}
		if j.ID != "" {
			r.Job = &j
		}
		ctl.Write(c, r)
	case err != nil:
		ctl.Write(c, ctl.Reply{Err: ctl.Errorf(ctl.CodeFailed, "%v", err), Final: true})
	default:
		ctl.Write(c, ctl.Reply{Job: &j, Final: true})
	}
}

// token answers root (the SPANK plugin in slurmstepd) with the job key of
// a step: its user and id as Slurm says, coordinated by the step's first
// node.
func (s *control) token(req ctl.Request, uid uint32) ctl.Reply {
	if uid != 0 {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodePermission, "only root may ask for another job's key (the SPANK plugin does, in slurmstepd)"), Final: true}
	}
	coord, err := firstHost(req.Nodelist)
	if err != nil {
		return ctl.Reply{Err: ctl.Errorf(ctl.CodeBadRequest, "%v", err), Final: true}
	}
	return ctl.Reply{Token: JobToken(s.key.Current(), *req.Owner, req.Job, coord), Final: true}
}

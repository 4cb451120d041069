package quiesce

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
)

// local is the handler a TCPTransport runs in process for calls to its own
// node (ServeLocal).
type local struct {
	ctx  context.Context
	node string
	h    Handler
}

// ServeLocal makes calls to node (this process's own name) run h in
// process, as the peer port serving h would, instead of over a connection
// to itself. A node that coordinates a job starts every round, DECIDE and
// its ranks' registration with a call to itself; over TCP each is a TLS
// round trip through the loopback with two goroutine wake-ups, on a
// pause's critical path. h sees what the server would hand it: a copy
// decoded from the request's wire form, under ctx (the server's life) with
// the caller's deadline; its context errors give the caller an error, as a
// server's silence would, and its other errors a reply that carries them.
// The caller stops waiting when its own context ends.
func (t *TCPTransport) ServeLocal(ctx context.Context, node string, h Handler) {
	t.local.Store(&local{ctx: ctx, node: node, h: h})
}

// localTo is the in-process handler for calls to node, if there is one.
func (t *TCPTransport) localTo(node string) *local {
	if l := t.local.Load(); l != nil && l.node == node {
		return l
	}
	return nil
}

type localResult struct {
	m   Message
	err error
}

func (l *local) call(ctx context.Context, req *Message) (Message, error) {
	if err := ctx.Err(); err != nil {
		return Message{}, callError(l.node, "", err)
	}
	in, err := wireCopy(req)
	if err != nil {
		return Message{}, callError(l.node, "", err)
	}
	hctx, cancel := l.ctx, context.CancelFunc(func() {})
	if dl, ok := ctx.Deadline(); ok {
		hctx, cancel = context.WithDeadline(l.ctx, dl)
	}
	done := make(chan localResult, 1)
	go func() {
		defer cancel()
		rep, err := l.h(hctx, in)
		if err == nil {
			rep, err = wireCopy(&rep)
		}
		done <- localResult{rep, err}
	}()
	var r localResult
	select {
	case r = <-done:
	case <-ctx.Done():
		return Message{}, callError(l.node, "", ctx.Err())
	}
	switch {
	case r.err == nil:
		return r.m, nil
	case errors.Is(r.err, context.Canceled) || errors.Is(r.err, context.DeadlineExceeded):
		return Message{}, callError(l.node, "", r.err)
	default:
		return Message{Version: ProtocolVersion, Job: in.Job, Epoch: in.Epoch, Seq: in.Seq,
			Kind: in.Kind, Reply: true, Err: r.err.Error()}, nil
	}
}

// wireCopy is m as the far end of a connection decodes it: nothing in it is
// shared with m, and what the wire does not carry is not there.
func wireCopy(m *Message) (Message, error) {
	var out Message
	var timeout int64
	if err := decodeFrameMsg(string(appendFrame(nil, 0, m)), &timeout, &out); err != nil {
		return Message{}, fmt.Errorf("local call: %w", err)
	}
	return out, nil
}

// localSlot is embedded in TCPTransport: set once the handler exists,
// read by every call.
type localSlot = atomic.Pointer[local]

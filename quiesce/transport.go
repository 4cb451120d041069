package quiesce

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Transport delivers one request to a peer daemon and returns its reply. It is
// request/response because every step of the protocol is a question whose
// answer (an acknowledgement or a report) the sender needs before it can
// reduce. Call makes one attempt: it may lose the request or the reply, in
// which case it returns when ctx is done. Retransmission is the sender's
// business (see RetryPolicy), so that every transport gets the same behaviour.
//
// Implementations must be safe for concurrent use, and must pass ctx's
// deadline to the handler on the far side, because the receiving node sizes
// its own forwarding budget from it.
type Transport interface {
	Call(ctx context.Context, to string, req Message) (Message, error)
}

// Handler serves one inbound request. [Agent.Handle] is the protocol's handler.
type Handler func(ctx context.Context, req Message) (Message, error)

// RetryPolicy says when a sender retransmits a request that has not been
// answered. Earlier attempts are not cancelled by a retransmission: the first
// reply to any attempt wins. Receivers coalesce duplicates, so a slow subtree
// costs nothing but a few small messages, and a lost message costs one
// retransmission interval.
type RetryPolicy struct {
	// Initial is the wait before the first retransmission.
	Initial time.Duration
	// Max caps the exponentially growing wait.
	Max time.Duration
}

// DefaultRetry suits a LAN of daemons: a lost message is noticed in 50 ms.
var DefaultRetry = RetryPolicy{Initial: 50 * time.Millisecond, Max: time.Second}

// TCPRetry suits TCPTransport. Over TCP a request is lost only with its
// connection, and Call redials at once a pooled connection that fails
// before a reply's first byte; a timed retransmission helps only when a
// connection hangs without failing (a peer host gone silent). Each one
// takes a connection of its own, a TCP and TLS handshake on the round's
// path if the pool has none spare, and DefaultRetry's would start whenever
// a round took 50 ms (a node holding its DRAIN answer, a busy node).
var TCPRetry = RetryPolicy{Initial: time.Second, Max: 4 * time.Second}

func (p RetryPolicy) normalized() RetryPolicy {
	if p.Initial <= 0 {
		p.Initial = DefaultRetry.Initial
	}
	if p.Max < p.Initial {
		p.Max = p.Initial
	}
	return p
}

// call sends req to a peer with retransmissions until a reply arrives or ctx
// is done, and returns the reply, nil if none came. A reply that carries Err
// is a definite answer and is not retried: the receiver refused the request,
// and asking again would be refused again.
//
// The first attempt runs on the caller's goroutine and retransmissions on
// their own, started by a timer: a round makes a call on every tree edge,
// and in the usual case, a first attempt that answers, that is a goroutine,
// a channel and a select fewer per edge (about a tenth of the CPU of a
// round of 4096 in-memory nodes).
func call(ctx context.Context, tr Transport, p RetryPolicy, to string, req *Message) (*Message, error) {
	p = p.normalized()
	c := &caller{tr: tr, to: to, req: *req, wait: p.Initial, max: p.Max}
	c.ctx, c.cancel = context.WithCancel(ctx)
	defer c.cancel() // stops the attempts still waiting for a lost reply
	c.mu.Lock()
	c.timer = time.AfterFunc(p.Initial, c.retransmit)
	c.mu.Unlock()
	defer c.timer.Stop()
	c.attempt()
	for {
		c.mu.Lock()
		won, lastErr := c.reply, c.lastErr
		if won == nil && c.wake == nil {
			c.wake = make(chan struct{}, 1)
		}
		wake := c.wake
		c.mu.Unlock()
		if won != nil {
			if won.Err != "" {
				return won, refused(to, req.Kind, won.Err)
			}
			return won, nil
		}
		if permanent(lastErr) {
			return nil, lastErr // it names the peer (see TCPTransport)
		}
		// A transport error (peer down, connection reset) is retried on
		// the next tick rather than at once, so a dead peer is not hammered.
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, gaveUp(to, req.Kind, ctx.Err(), lastErr)
		}
	}
}

// caller is one call's state, shared by its attempts.
type caller struct {
	tr     Transport
	to     string
	req    Message
	ctx    context.Context // cancelled once a reply came, or the call ended
	cancel context.CancelFunc

	mu        sync.Mutex
	timer     *time.Timer
	wait, max time.Duration
	reply     *Message // the first reply, nil until one came
	lastErr   error
	// wake hears that an attempt finished (buffered: one pending is
	// enough). The caller makes it once it has to wait, which it never does
	// when the first attempt answers.
	wake chan struct{}
}

// attempt makes one attempt and records its outcome. The first reply
// cancels the other attempts: they wait for a lost request or reply, one
// of them perhaps on the caller's goroutine.
func (c *caller) attempt() {
	m, err := c.tr.Call(c.ctx, c.to, c.req)
	c.mu.Lock()
	won := err == nil && c.reply == nil
	switch {
	case won:
		c.reply = &m
	case err != nil && c.ctx.Err() == nil:
		c.lastErr = err
	}
	wake := c.wake
	c.mu.Unlock()
	if won {
		c.cancel()
	}
	if wake != nil {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}

// retransmit runs on the timer: it starts another attempt on a goroutine
// of its own, and backs off exponentially until the call ends.
func (c *caller) retransmit() {
	if c.ctx.Err() != nil {
		return
	}
	go c.attempt()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.wait = min(2*c.wait, c.max)
	c.timer.Reset(c.wait)
}

// refused and gaveUp are call's errors, out of line so that formatting
// them does not enlarge the frame of every call, on whose goroutine the
// first attempt, and with MemNetwork the recipient's handler, runs.
//
//go:noinline
func refused(to string, kind Kind, why string) error {
	return fmt.Errorf("%s refused %s: %s", to, kind, why)
}

// permanent reports whether a transport error will be the same on every
// retry until the call's deadline: the peer turned the handshake down (no
// or another cluster key, another protocol version) or its name does not
// resolve (TCPTransport marks these with permanentError). Such a call fails
// at once, so that a misconfigured cluster is told so in milliseconds
// rather than after the phase's deadline (PREPARE's 5 s, then ABORT's 30 s)
// with the reason as a "last error". A frame that fails its MAC on an
// established connection is not one: a new connection may do.
func permanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// permanentError marks an error that retrying will not change.
type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

//go:noinline
func gaveUp(to string, kind Kind, err, lastErr error) error {
	if lastErr != nil {
		return fmt.Errorf("call %s %s: %w (last error: %v)", to, kind, err, lastErr)
	}
	return fmt.Errorf("call %s %s: %w", to, kind, err)
}

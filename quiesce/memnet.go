package quiesce

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// Faults is what a MemNetwork does to messages. Each request and each reply is
// dropped, duplicated and delayed independently.
type Faults struct {
	// MaxDelay bounds the random delay of each request and reply.
	MaxDelay time.Duration
	// Drop is the probability that a request, or a reply, is lost.
	Drop float64
	// Dup is the probability that a request is delivered a second time, after
	// its own random delay, possibly after the sender has moved on.
	Dup float64
}

// ErrUnknownPeer is returned by MemNetwork for a name nobody registered, as a
// real transport returns "connection refused".
var ErrUnknownPeer = errors.New("quiesce: unknown peer")

// MemNetwork is an in-memory Transport between registered handlers, with
// seeded random faults so that a failing property test can be replayed.
// Handlers run on the caller's goroutine (plus one goroutine per duplicate);
// the caller's context, deadline included, is passed to the handler, as a
// real transport passes the deadline in the request.
type MemNetwork struct {
	faults Faults

	mu  sync.Mutex // guards rng
	rng *rand.Rand
	// handlers has its own lock, read-mostly: every call looks its
	// recipient up, and thousands of simulated nodes call at once.
	hmu      sync.RWMutex
	handlers map[string]Handler

	base   context.Context
	cancel context.CancelFunc
	work   busy // handler invocations and pending duplicates

	calls, drops, dups atomic.Int64
}

// NewMemNetwork returns a network whose faults are drawn from seed.
func NewMemNetwork(seed uint64, f Faults) *MemNetwork {
	ctx, cancel := context.WithCancel(context.Background())
	return &MemNetwork{
		faults:   f,
		rng:      rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		handlers: make(map[string]Handler),
		base:     ctx,
		cancel:   cancel,
	}
}

// Register makes h reachable under name, replacing any earlier handler.
func (n *MemNetwork) Register(name string, h Handler) {
	n.hmu.Lock()
	defer n.hmu.Unlock()
	n.handlers[name] = h
}

// Close cancels duplicates still in flight and waits until no handler runs.
func (n *MemNetwork) Close() {
	n.cancel()
	n.work.wait()
}

// Drain waits until no call is in progress and no duplicate is pending,
// without cancelling anything: late messages land, which is the harsher test.
func (n *MemNetwork) Drain() { n.work.wait() }

// Idle reports whether no handler runs and no duplicate is pending.
func (n *MemNetwork) Idle() bool { return n.work.idle() }

// Stats returns how many calls were made and how many messages were dropped
// or duplicated, so tests can check the faults were actually exercised.
func (n *MemNetwork) Stats() (calls, drops, dups int64) {
	return n.calls.Load(), n.drops.Load(), n.dups.Load()
}

type draw struct {
	reqDelay, repDelay, dupDelay time.Duration
	dropReq, dropRep, dup        bool
}

func (n *MemNetwork) draw() draw {
	if n.faults == (Faults{}) {
		return draw{} // a perfect network draws nothing, and takes no lock
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	d := func() time.Duration {
		if n.faults.MaxDelay <= 0 {
			return 0
		}
		return time.Duration(n.rng.Int64N(int64(n.faults.MaxDelay) + 1))
	}
	return draw{
		reqDelay: d(), repDelay: d(), dupDelay: d(),
		dropReq: n.rng.Float64() < n.faults.Drop,
		dropRep: n.rng.Float64() < n.faults.Drop,
		dup:     n.rng.Float64() < n.faults.Dup,
	}
}

// Call implements Transport.
func (n *MemNetwork) Call(ctx context.Context, to string, req Message) (Message, error) {
	// Counted from entry, so Drain cannot miss an attempt that is about to
	// spawn a duplicate; and a sender that already gave up sends nothing.
	n.work.add()
	defer n.work.done()
	if err := ctx.Err(); err != nil {
		return Message{}, callError(to, "", err)
	}
	n.calls.Add(1)
	n.hmu.RLock()
	h, ok := n.handlers[to]
	n.hmu.RUnlock()
	if !ok {
		return Message{}, callError(to, "", ErrUnknownPeer)
	}
	if n.faults != (Faults{}) {
		return n.faulty(ctx, to, h, &req)
	}
	// A perfect network only runs the handler. The handler runs on this
	// goroutine, below the sender's frames, so this frame is kept small.
	rep, err := h(ctx, req)
	if err != nil {
		return Message{}, callError(to, "", err)
	}
	return rep, nil
}

// faulty is Call on a network with faults: the request and the reply are
// delayed, dropped and duplicated as drawn.
func (n *MemNetwork) faulty(ctx context.Context, to string, h Handler, req *Message) (Message, error) {
	d := n.draw()
	if d.dup {
		n.dups.Add(1)
		n.work.add()
		go n.duplicate(ctx, h, *req, d.dupDelay)
	}
	if err := sleep(ctx, d.reqDelay); err != nil {
		return Message{}, err
	}
	if d.dropReq {
		n.drops.Add(1)
		<-ctx.Done()
		return Message{}, callError(to, "request lost: ", ctx.Err())
	}
	rep, err := h(ctx, *req)
	if err != nil {
		return Message{}, callError(to, "", err)
	}
	if d.dropRep {
		n.drops.Add(1)
		<-ctx.Done()
		return Message{}, callError(to, "reply lost: ", ctx.Err())
	}
	if err := sleep(ctx, d.repDelay); err != nil {
		return Message{}, err
	}
	return rep, nil
}

// callError is out of line so that its formatting does not enlarge the
// frames of the calls that may return it.
//
//go:noinline
func callError(to, what string, err error) error {
	return fmt.Errorf("call %s: %s%w", to, what, err)
}

// duplicate delivers req a second time. It keeps the sender's deadline but not
// its cancellation: a real duplicate sits in a queue after the sender has
// given up, and that is exactly the case the protocol must survive.
func (n *MemNetwork) duplicate(ctx context.Context, h Handler, req Message, delay time.Duration) {
	defer n.work.done()
	dctx := n.base
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		dctx, cancel = context.WithDeadline(n.base, dl)
		defer cancel()
	}
	if sleep(dctx, delay) != nil {
		return
	}
	_, _ = h(dctx, req) // the reply of a duplicate goes nowhere
}

// sleep waits d or until ctx is done; it is how simulated latency respects
// cancellation.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

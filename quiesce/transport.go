package quiesce

import (
	"context"
	"fmt"
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
// is done. A reply that carries Err is a definite answer and is not retried:
// the receiver refused the request, and asking again would be refused again.
func call(ctx context.Context, tr Transport, p RetryPolicy, to string, req Message) (Message, error) {
	p = p.normalized()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops the attempts still waiting for a lost reply

	type result struct {
		m   Message
		err error
	}
	results := make(chan result, 1)
	attempt := func() {
		m, err := tr.Call(ctx, to, req)
		select {
		case results <- result{m, err}:
		case <-ctx.Done():
		}
	}
	wait := p.Initial
	timer := time.NewTimer(wait)
	defer timer.Stop()
	go attempt()
	var lastErr error
	for {
		select {
		case r := <-results:
			if r.err == nil {
				if r.m.Err != "" {
					return r.m, fmt.Errorf("%s refused %s: %s", to, req.Kind, r.m.Err)
				}
				return r.m, nil
			}
			// A transport error (peer down, connection reset) is retried on
			// the next tick rather than at once, so a dead peer is not hammered.
			lastErr = r.err
		case <-timer.C:
			go attempt()
			wait = min(2*wait, p.Max)
			timer.Reset(wait)
		case <-ctx.Done():
			if lastErr != nil {
				return Message{}, fmt.Errorf("call %s %s: %w (last error: %v)", to, req.Kind, ctx.Err(), lastErr)
			}
			return Message{}, fmt.Errorf("call %s %s: %w", to, req.Kind, ctx.Err())
		}
	}
}

package quiesce

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// scriptedTransport answers attempt i (from 0) as script[i] says: "lose"
// waits for the caller to give up, "fail" errs at once, "refuse" answers
// with Err, anything else answers.
type scriptedTransport struct {
	script   []string
	rest     string // what attempts past the script do: "" answers
	attempts atomic.Int32
	returned atomic.Int32 // attempts that have returned
}

func (s *scriptedTransport) Call(ctx context.Context, to string, req Message) (Message, error) {
	i := int(s.attempts.Add(1)) - 1
	defer s.returned.Add(1)
	what := "answer"
	if i < len(s.script) {
		what = s.script[i]
	} else if s.rest != "" {
		what = s.rest
	}
	rep := Message{Version: ProtocolVersion, Job: req.Job, Kind: req.Kind, Reply: true, Report: &Report{Nodes: i}}
	switch what {
	case "lose":
		<-ctx.Done()
		return Message{}, ctx.Err()
	case "fail":
		return Message{}, errors.New("connection refused")
	case "nohost":
		return Message{}, dialError("n", &net.DNSError{Err: "no such host", Name: "n", IsNotFound: true})
	case "badmac":
		return Message{}, fmt.Errorf("%w: frame 2: bad MAC", ErrAuth)
	case "auth":
		return Message{}, permanentError{fmt.Errorf("n: %w: it does not hold this node's cluster key", ErrAuth)}
	case "refuse":
		rep.Err = "no"
	}
	return rep, nil
}

// TestCallRetransmits: the first attempt runs on the caller's goroutine;
// when it is lost, a retransmission's reply still ends the call at once
// (the lost attempt is cancelled, not waited for until the deadline), and
// errors are retried on the next tick.
func TestCallRetransmits(t *testing.T) {
	p := RetryPolicy{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond}
	req := &Message{Version: ProtocolVersion, Job: "j", Kind: KindDrain, Nodes: []string{"n"}}
	for _, tc := range []struct {
		name   string
		script []string
		want   int // the attempt whose reply is returned
		err    string
	}{
		{name: "first answers", script: nil, want: 0},
		{name: "first lost", script: []string{"lose"}, want: 1},
		{name: "two lost", script: []string{"lose", "lose"}, want: 2},
		{name: "first fails", script: []string{"fail", "fail"}, want: 2},
		{name: "refused", script: []string{"lose", "refuse"}, want: 1, err: "refused DRAIN: no"},
	} {
		tr := &scriptedTransport{script: tc.script}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		start := time.Now()
		rep, err := call(ctx, tr, p, "n", req)
		took := time.Since(start)
		cancel()
		if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) || tc.err == "" && err != nil {
			t.Errorf("%s: error %v, want %q", tc.name, err, tc.err)
		}
		if rep == nil || rep.Report.Nodes != tc.want {
			t.Errorf("%s: reply %+v, want attempt %d's", tc.name, rep, tc.want)
		}
		if took > 5*time.Second {
			t.Errorf("%s: took %v: a lost attempt was waited for", tc.name, took)
		}
		// Every attempt ends once the call has: none is left waiting.
		deadline := time.Now().Add(5 * time.Second)
		for tr.returned.Load() != tr.attempts.Load() && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if r, a := tr.returned.Load(), tr.attempts.Load(); r != a {
			t.Errorf("%s: %d of %d attempts still running after the call", tc.name, a-r, a)
		}
	}

	// Nothing answers: the call ends with the caller's deadline and says
	// what the attempts last saw. The deadline leaves room for dozens of
	// attempts, so that a loaded machine that schedules the retries late
	// still gets the three asked for.
	tr := &scriptedTransport{rest: "fail"}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	rep, err := call(ctx, tr, p, "n", req)
	if rep != nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("no answer: %+v %v", rep, err)
	}
	if n := tr.attempts.Load(); n < 3 {
		t.Errorf("%d attempts in 1 s with a 5 ms retransmission", n)
	}
}

// TestCallPermanentErrors: an error that every retry would repeat (a peer
// without this cluster's key, a name that does not resolve) ends the call
// at its first attempt, with the error itself in the chain rather than as a
// "last error" after the deadline; a passing error is still retried.
func TestCallPermanentErrors(t *testing.T) {
	p := RetryPolicy{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond}
	req := &Message{Version: ProtocolVersion, Job: "j", Kind: KindPrepare, Nodes: []string{"n"}}
	var dns *net.DNSError
	for _, tc := range []struct {
		name   string
		script []string
		is     func(error) bool
	}{
		{"another key", []string{"auth", "answer"}, func(err error) bool { return errors.Is(err, ErrAuth) }},
		{"no such host", []string{"nohost", "answer"}, func(err error) bool { return errors.As(err, &dns) && dns.IsNotFound }},
	} {
		tr := &scriptedTransport{script: tc.script}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		rep, err := call(ctx, tr, p, "n", req)
		cancel()
		if rep != nil || !tc.is(err) || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: reply %+v, error %v; want the error itself, not a deadline", tc.name, rep, err)
		}
	}
	tr := &scriptedTransport{script: []string{"fail", "badmac", "answer"}}
	if _, err := call(context.Background(), tr, p, "n", req); err != nil || tr.attempts.Load() < 3 {
		t.Errorf("a refused connection and a frame failing its MAC are retried: %v after %d attempts", err, tr.attempts.Load())
	}
}

// TestDialErrorSaysResolve: a name that does not resolve is reported with
// what to do, and stays a permanent error; a refused connection is not.
func TestDialErrorSaysResolve(t *testing.T) {
	nx := dialError("node9", &net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "node9", IsNotFound: true}})
	if !permanent(nx) || !strings.Contains(nx.Error(), "must resolve") || !strings.Contains(nx.Error(), "node9") {
		t.Errorf("no such host: %v (permanent %v)", nx, permanent(nx))
	}
	refused := dialError("node9", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")})
	if permanent(refused) || strings.Contains(refused.Error(), "resolve") {
		t.Errorf("connection refused: %v (permanent %v)", refused, permanent(refused))
	}
}

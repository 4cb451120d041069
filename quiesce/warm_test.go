package quiesce

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// warmCluster is n agents over TCP with TLS, each behind a loopback
// listener that keeps the connections it accepted (cut closes them, as a
// restarted daemon's would be), all calling through one transport that
// counts what it dials.
type warmCluster struct {
	names []string
	fakes []*fakeNode
	tr    *TCPTransport
	dials atomic.Int64

	mu    sync.Mutex
	conns map[int][]net.Conn
}

type keptListener struct {
	net.Listener
	c *warmCluster
	i int
}

func (l keptListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err == nil {
		l.c.mu.Lock()
		l.c.conns[l.i] = append(l.c.conns[l.i], conn)
		l.c.mu.Unlock()
	}
	return conn, err
}

func newWarmCluster(t *testing.T, n int, retry RetryPolicy) *warmCluster {
	t.Helper()
	keys := NewKeyring(mustKey(t))
	c := &warmCluster{conns: map[int][]net.Conn{}}
	c.tr = &TCPTransport{Identity: mustIdentity(t, "client", keys), OnDial: func(string) { c.dials.Add(1) }}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { c.tr.CloseIdle(); cancel(); wg.Wait() })
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		name := ln.Addr().String()
		f := newFake(name)
		a := NewAgent(f, c.tr, retry)
		c.names = append(c.names, name)
		c.fakes = append(c.fakes, f)
		id := mustIdentity(t, name, keys)
		wg.Go(func() {
			if err := ServeTCPWith(ctx, keptListener{ln, c, i}, a.Handle, ServerOptions{Identity: id}); err != nil {
				t.Errorf("serve: %v", err)
			}
		})
	}
	return c
}

// cut closes node i's side of every connection it accepted.
func (c *warmCluster) cut(i int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns[i] {
		conn.Close()
	}
	c.conns[i] = nil
}

// pauseResume pauses and resumes the job and returns how many connections
// that dialled.
func (c *warmCluster) pauseResume(t *testing.T, co *Coordinator) int64 {
	t.Helper()
	before := c.dials.Load()
	if res, err := co.Pause(context.Background(), "1000:warm", c.names); err != nil || res.State != StatePaused {
		t.Fatalf("pause: %v (%+v)", err, res)
	}
	if _, err := co.Resume(context.Background(), "1000:warm", c.names); err != nil {
		t.Fatalf("resume: %v", err)
	}
	return c.dials.Load() - before
}

// The connections of every edge of a job's tree are made by WARM, and a
// pause and a resume after it dial none, even where a node holds its DRAIN
// answer longer than DefaultRetry's first wait. A node whose daemon
// restarted (its connections cut) is dialled again by the next WARM, not
// by the next pause.
func TestWarmLeavesNoDialToThePause(t *testing.T) {
	const n = 9
	opts := fastOpts()
	opts.Retry = TCPRetry
	c := newWarmCluster(t, n, TCPRetry)
	c.fakes[5].slow = 3 * DefaultRetry.Initial
	co := NewCoordinator(c.tr, opts)

	// Positive control: cold, the pause dials every edge (n-1 and the
	// coordinator's own).
	if d := c.pauseResume(t, co); d < n {
		t.Fatalf("a cold pause and resume dialled %d connections, want at least %d (one per edge)", d, n)
	}
	c.tr.CloseIdle()
	for i := range n {
		c.cut(i)
	}

	before := c.dials.Load()
	if err := co.Warm(context.Background(), "1000:warm", c.names); err != nil {
		t.Fatalf("warm: %v", err)
	}
	if d := c.dials.Load() - before; d != n {
		t.Fatalf("WARM dialled %d connections, want %d: one per edge of the tree", d, n)
	}
	for i := range 3 {
		if d := c.pauseResume(t, co); d != 0 {
			t.Fatalf("pause and resume %d after WARM dialled %d connections, want 0", i, d)
		}
	}
	for _, f := range c.fakes {
		if f.calls["prepare"] != 4 {
			t.Fatalf("node %s ran PREPARE %d times in 4 pauses: WARM ran a step", f.name, f.calls["prepare"])
		}
	}

	// Node 3's daemon restarts: WARM finds its connection dead and
	// replaces it; the pause after it dials nothing.
	c.cut(3)
	before = c.dials.Load()
	if err := co.Warm(context.Background(), "1000:warm", c.names); err != nil {
		t.Fatalf("warm after a restart: %v", err)
	}
	if d := c.dials.Load() - before; d != 1 {
		t.Fatalf("WARM after node 3's restart dialled %d connections, want 1", d)
	}
	if d := c.pauseResume(t, co); d != 0 {
		t.Fatalf("pause and resume after the restart and a WARM dialled %d connections, want 0", d)
	}
}

// DefaultRetry's retransmissions each take a connection of their own:
// over TCP, where a request is lost only with its connection, TCPRetry
// does not retransmit a round that is merely slow.
func TestTCPRetryDialsNoSecondConnection(t *testing.T) {
	for _, tc := range []struct {
		name  string
		retry RetryPolicy
		extra bool
	}{
		{"DefaultRetry", DefaultRetry, true},
		{"TCPRetry", TCPRetry, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newWarmCluster(t, 3, tc.retry)
			c.fakes[2].slow = 4 * DefaultRetry.Initial
			opts := fastOpts()
			opts.Retry = tc.retry
			co := NewCoordinator(c.tr, opts)
			if err := co.Warm(context.Background(), "1000:warm", c.names); err != nil {
				t.Fatalf("warm: %v", err)
			}
			d := c.pauseResume(t, co)
			if tc.extra && d == 0 {
				t.Fatalf("with DefaultRetry a round slower than its first wait dialled nothing: the control does not show the cost")
			}
			if !tc.extra && d != 0 {
				t.Fatalf("with TCPRetry a slow round dialled %d connections, want 0", d)
			}
		})
	}
}

// WARM reaches no node's steps and answers for every node; a node that is
// down is named.
func TestWarmNamesAnUnreachedNode(t *testing.T) {
	c := newWarmCluster(t, 4, TCPRetry)
	co := NewCoordinator(c.tr, fastOpts())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = co.Warm(ctx, "1000:warm", append(c.names, dead))
	if err == nil {
		t.Fatal("WARM over a tree with a node down: no error")
	}
	t.Logf("%v", err)
	for _, f := range c.fakes {
		if len(f.calls) != 0 {
			t.Fatalf("WARM ran steps on %s: %v", f.name, f.calls)
		}
	}
}

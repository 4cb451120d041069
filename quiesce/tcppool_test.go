package quiesce

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// echoServer serves requests by echoing them as replies, with the cluster
// key, and keeps every connection it accepted so that a test can count or
// cut them. hold, if set, is called with each request before the reply.
type echoServer struct {
	addr  string
	keys  *Keyring
	mu    sync.Mutex
	conns []net.Conn
	n     atomic.Int64
}

type recordingListener struct {
	net.Listener
	s *echoServer
}

func (l recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.s.n.Add(1)
		l.s.mu.Lock()
		l.s.conns = append(l.s.conns, c)
		l.s.mu.Unlock()
	}
	return c, err
}

func startEcho(t *testing.T, hold func(Message)) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{addr: ln.Addr().String(), keys: NewKeyring(mustKey(t))}
	id := mustIdentity(t, s.addr, s.keys)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() {
		h := func(ctx context.Context, m Message) (Message, error) {
			if hold != nil {
				hold(m)
			}
			m.Reply = true
			return m, nil
		}
		if err := ServeTCPWith(ctx, recordingListener{ln, s}, h, ServerOptions{Identity: id}); err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return s
}

// cut closes the server's side of every connection it accepted, as a
// restarted daemon would have.
func (s *echoServer) cut() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.conns {
		c.Close()
	}
	s.conns = nil
}

func echoCall(t *testing.T, tr *TCPTransport, to string, seq uint64, timeout time.Duration) (Message, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return tr.Call(ctx, to, Message{Version: ProtocolVersion, Job: "j", Kind: KindPrepare, Seq: seq})
}

func TestTCPReusesConnections(t *testing.T) {
	s := startEcho(t, nil)
	tr := &TCPTransport{Identity: mustIdentity(t, "client", s.keys)}
	defer tr.CloseIdle()
	for i := range uint64(20) {
		rep, err := echoCall(t, tr, s.addr, i, 5*time.Second)
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if !rep.Reply || rep.Seq != i {
			t.Fatalf("call %d got reply %+v", i, rep)
		}
	}
	if n := s.n.Load(); n != 1 {
		t.Fatalf("20 calls in a row opened %d connections, want 1", n)
	}

	// Without reuse, a connection per call.
	s2 := startEcho(t, nil)
	tr2 := &TCPTransport{Identity: mustIdentity(t, "client", s2.keys), MaxIdle: -1}
	for i := range uint64(3) {
		if _, err := echoCall(t, tr2, s2.addr, i, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if n := s2.n.Load(); n != 3 {
		t.Fatalf("MaxIdle -1: 3 calls opened %d connections, want 3", n)
	}
}

func TestTCPConcurrentCallsKeepAFewConnections(t *testing.T) {
	s := startEcho(t, nil)
	tr := &TCPTransport{Identity: mustIdentity(t, "client", s.keys)}
	defer tr.CloseIdle()
	for round := range 5 {
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for i := range 16 {
			seq := uint64(round*100 + i)
			wg.Go(func() {
				rep, err := echoCall(t, tr, s.addr, seq, 5*time.Second)
				if err == nil && rep.Seq != seq {
					err = errors.New("a reply to another request")
				}
				if err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	tr.mu.Lock()
	idle := len(tr.idle[peerAddr{s.addr, s.addr}])
	tr.mu.Unlock()
	if idle > DefaultMaxIdle {
		t.Fatalf("%d idle connections kept, want at most %d", idle, DefaultMaxIdle)
	}
}

// A pooled connection the server has closed is replaced without the
// caller seeing an error.
func TestTCPRedialsAClosedPooledConnection(t *testing.T) {
	s := startEcho(t, nil)
	tr := &TCPTransport{Identity: mustIdentity(t, "client", s.keys)}
	defer tr.CloseIdle()
	if _, err := echoCall(t, tr, s.addr, 1, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	s.cut()
	rep, err := echoCall(t, tr, s.addr, 2, 5*time.Second)
	if err != nil {
		t.Fatalf("call after the server closed the pooled connection: %v", err)
	}
	if rep.Seq != 2 {
		t.Fatalf("reply %+v", rep)
	}
	if n := s.n.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the pooled one, then a new one)", n)
	}
}

// A call that times out closes its connection: the late reply can never be
// read as the answer to the next request.
func TestTCPLateReplyIsNeverReused(t *testing.T) {
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	s := startEcho(t, func(m Message) {
		if m.Seq == 1 {
			held <- struct{}{}
			<-release
		}
	})
	// Registered after the server's cleanup, so it runs first: a failure
	// below must not leave the handler held and the server's wait hanging.
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	tr := &TCPTransport{Identity: mustIdentity(t, "client", s.keys)}
	defer tr.CloseIdle()
	if _, err := echoCall(t, tr, s.addr, 0, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := echoCall(t, tr, s.addr, 1, 200*time.Millisecond)
		errc <- err
	}()
	<-held
	if err := <-errc; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("held call: %v, want deadline exceeded", err)
	}
	free() // the server now writes seq 1's reply to a closed connection
	rep, err := echoCall(t, tr, s.addr, 2, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Seq != 2 {
		t.Fatalf("got the reply to seq %d, want 2", rep.Seq)
	}
}

// deadlineOnly is a context whose deadline has passed while its timer has
// not fired yet: Err is still nil.
type deadlineOnly struct {
	context.Context
	dl time.Time
}

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.dl, true }

// The connection's deadline is the call's, and the poller may pass it before
// the context's timer fires: the call still fails with its deadline, not
// as if the peer had gone quiet.
func TestTCPDeadlineBeforeContextTimer(t *testing.T) {
	tr := &TCPTransport{}
	ctx := deadlineOnly{context.Background(), time.Now().Add(-time.Millisecond)}
	err := tr.fail(ctx, "n1", fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("connection deadline passed with the call's: %v, want context.DeadlineExceeded", err)
	}
	// A connection deadline the call's has not reached is the peer's doing.
	ctx.dl = time.Now().Add(time.Hour)
	if err := tr.fail(ctx, "n1", fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded)); errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("deadline not reached: %v, want no context.DeadlineExceeded", err)
	}
}

package quiesce

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// A coordinator's calls to its own node never touch a socket: the node
// served locally has no listener at all, and the pause and resume of a
// job on it and four nodes over TCP still go through.
func TestTCPServeLocalPausesWithoutASocket(t *testing.T) {
	names, fakes, tr := tcpCluster(t, 4)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	self := ln.Addr().String()
	ln.Close() // a dial to self is refused
	f := newFake(self)
	a := NewAgent(f, tr, fastOpts().Retry)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tr.ServeLocal(ctx, self, a.Handle)
	dials := 0
	tr.OnDial = func(to string) {
		if to == self {
			dials++
		}
	}
	all := append([]string{self}, names...)
	co := NewCoordinator(tr, fastOpts())
	res, err := co.Pause(context.Background(), "localjob", all)
	if err != nil {
		t.Fatalf("pause with the first node local: %v", err)
	}
	if res.State != StatePaused || res.Report.Nodes != 5 {
		t.Fatalf("result %+v", res)
	}
	c := &cluster{fakes: append([]*fakeNode{f}, fakes...)}
	checkPaused(t, c)
	if _, err := co.Resume(context.Background(), "localjob", all); err != nil {
		t.Fatalf("resume: %v", err)
	}
	checkRolledBack(t, c)
	if dials != 0 {
		t.Fatalf("%d connections opened to the node served locally", dials)
	}
}

// The handler gets what a server would decode: nothing it changes reaches
// the caller's request, and the caller's later changes do not reach it.
func TestTCPServeLocalCopiesTheRequest(t *testing.T) {
	tr := &TCPTransport{}
	got := make(chan []string, 1)
	tr.ServeLocal(context.Background(), "self", func(_ context.Context, m Message) (Message, error) {
		m.Nodes[0] = "changed by the handler"
		got <- m.Nodes
		m.Reply = true
		return m, nil
	})
	req := Message{Version: ProtocolVersion, Job: "j", Kind: KindPrepare, Nodes: []string{"a", "b"}}
	rep, err := tr.Call(context.Background(), "self", req)
	if err != nil {
		t.Fatal(err)
	}
	if req.Nodes[0] != "a" {
		t.Fatalf("the handler's change reached the caller's request: %v", req.Nodes)
	}
	handed := <-got
	rep.Nodes[1] = "changed by the caller"
	if !rep.Reply || !slices.Equal(handed, []string{"changed by the handler", "b"}) {
		t.Fatalf("reply %+v, the handler kept %v", rep, handed)
	}
}

// Errors come back as a server's would: a handler's refusal as a reply
// carrying it, its context's end as the caller's error; the handler runs
// under the caller's deadline, and a caller whose context ends stops
// waiting for a handler that does not return.
func TestTCPServeLocalErrorsAndDeadlines(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tr := &TCPTransport{}
	deadlines := make(chan time.Time, 1)
	var held sync.WaitGroup
	tr.ServeLocal(ctx, "self", func(hctx context.Context, m Message) (Message, error) {
		switch m.Job {
		case "refuse":
			return Message{}, errors.New("not yours")
		case "expire":
			return Message{}, context.DeadlineExceeded
		case "hold":
			held.Done()
			dl, _ := hctx.Deadline()
			deadlines <- dl
			<-hctx.Done() // the server's life, or the caller's deadline
			return Message{}, hctx.Err()
		}
		return m, nil
	})
	rep, err := tr.Call(context.Background(), "self", Message{Version: ProtocolVersion, Job: "refuse", Kind: KindFreeze, Seq: 7})
	if err != nil || !rep.Reply || rep.Err != "not yours" || rep.Job != "refuse" || rep.Seq != 7 || rep.Kind != KindFreeze {
		t.Fatalf("a refusal: reply %+v, error %v", rep, err)
	}
	if _, err := tr.Call(context.Background(), "self", Message{Job: "expire"}); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "call self") {
		t.Fatalf("a handler's deadline: %v", err)
	}

	cctx, ccancel := context.WithTimeout(context.Background(), time.Hour)
	held.Add(1)
	errc := make(chan error, 1)
	go func() {
		_, err := tr.Call(cctx, "self", Message{Job: "hold"})
		errc <- err
	}()
	held.Wait()
	want, _ := cctx.Deadline()
	if dl := <-deadlines; !dl.Equal(want) {
		t.Fatalf("the handler's deadline %v, the caller's %v", dl, want)
	}
	ccancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled caller: %v", err)
	}

	// A call already cancelled runs nothing.
	if _, err := tr.Call(cctx, "self", Message{Job: "refuse"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("a call made cancelled: %v", err)
	}
}

// Calls to other nodes still dial: ServeLocal is for one name.
func TestTCPServeLocalOnlyItsNode(t *testing.T) {
	tr := &TCPTransport{}
	tr.ServeLocal(context.Background(), "self", func(_ context.Context, m Message) (Message, error) { return m, nil })
	if _, err := tr.Call(context.Background(), "127.0.0.1:1", Message{}); err == nil {
		t.Fatal("a call to another node was answered without a connection")
	}
}

package quiesce

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
)

// tcpCluster starts one Agent per fake node, each behind its own loopback
// listener; node names are the listeners' addresses.
func tcpCluster(t *testing.T, n int) ([]string, []*fakeNode, *TCPTransport) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	tr := &TCPTransport{}
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	var names []string
	var fakes []*fakeNode
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		f := newFake(ln.Addr().String())
		a := NewAgent(f, tr, fastOpts().Retry)
		names = append(names, ln.Addr().String())
		fakes = append(fakes, f)
		wg.Go(func() {
			if err := ServeTCP(ctx, ln, a.Handle); err != nil {
				t.Errorf("serve: %v", err)
			}
		})
	}
	return names, fakes, tr
}

func TestTCPPauseResume(t *testing.T) {
	names, fakes, tr := tcpCluster(t, 5)
	fakes[3].left = 2
	co := NewCoordinator(tr, fastOpts())
	res, err := co.Pause(context.Background(), "tcpjob", names)
	if err != nil {
		t.Fatalf("pause over TCP: %v", err)
	}
	if res.State != StatePaused || res.Report.Nodes != 5 {
		t.Fatalf("result %+v", res)
	}
	c := &cluster{fakes: fakes}
	checkPaused(t, c)
	if _, err := co.Resume(context.Background(), "tcpjob", names); err != nil {
		t.Fatalf("resume over TCP: %v", err)
	}
	checkRolledBack(t, c)

	// A verify failure travels back over TCP as a report naming the node.
	fakes[4].dirty = true
	_, err = co.Pause(context.Background(), "tcpjob", names)
	var ae *AbortError
	if !errors.As(err, &ae) || ae.Phase != KindVerify || ae.Report.Pending[0].Node != names[4] {
		t.Fatalf("want abort in VERIFY naming %s, got %v", names[4], err)
	}
	checkRolledBack(t, c)
}

func TestTCPHelloVersionMismatch(t *testing.T) {
	names, _, _ := tcpCluster(t, 1)
	conn, err := net.Dial("tcp", names[0])
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion + 1}); err != nil {
		t.Fatal(err)
	}
	var h Hello
	if err := readFrame(conn, &h); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(h.Err, "version") {
		t.Fatalf("server accepted a future version: %+v", h)
	}
	// The server closes the connection after refusing.
	if err := readFrame(conn, &h); err == nil {
		t.Fatal("connection still open after refused hello")
	}
}

func TestFrameLimits(t *testing.T) {
	r := strings.NewReader("\xff\xff\xff\xff")
	var m Message
	if err := readFrame(r, &m); err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("oversized frame: %v", err)
	}
}

package ranks

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseHello(t *testing.T) {
	r, err := ParseHello("HELLO 1 job=j-1 rank=0 size=6 pid=42 host=node0 hosts=node0,node1,node2")
	if err != nil {
		t.Fatal(err)
	}
	if r.Job != "j-1" || r.Rank != 0 || r.Size != 6 || r.Pid != 42 || r.Host != "node0" || strings.Join(r.Hosts, " ") != "node0 node1 node2" {
		t.Errorf("parsed %+v", r)
	}
	for _, bad := range []string{"", "HELLO 2 job=x pid=1", "HELLO 1 job=x", "HELLO 1 pid=3", "HELLO 1 job=x pid=1 rank=one", "HELLO 1 job=x job=y pid=1", "HELLO 1 job=x pid=1 junk"} {
		if _, err := ParseHello(bad); err == nil {
			t.Errorf("ParseHello(%q) accepted", bad)
		}
	}
}

func TestParseOpened(t *testing.T) {
	o, err := ParseOpened("OPENED flushed=5 errors=1 errno=32")
	if err != nil || o != (Opened{Flushed: 5, Errors: 1, Errno: 32}) {
		t.Errorf("got %+v, %v", o, err)
	}
	if _, err := ParseOpened("OPENED flushed=x errors=0"); err == nil {
		t.Error("accepted a malformed reply")
	}
}

func TestParseGate(t *testing.T) {
	g, err := ParseGate("CLOSED gate=closed gated=3 closing=1 held=100", "CLOSED")
	if err != nil || g != (Gate{State: "closed", Gated: 3, Closing: 1, Held: 100}) {
		t.Errorf("got %+v, %v", g, err)
	}
	for _, bad := range []string{"STATE gate=open gated=1 closing=0 held=0", "CLOSED gate=closed gated=x closing=0 held=0", "CLOSED"} {
		if _, err := ParseGate(bad, "CLOSED"); err == nil {
			t.Errorf("ParseGate(%q) accepted", bad)
		}
	}
}

// fakeShim speaks the shim's side of the protocol over a real unix socket.
func fakeShim(t *testing.T, addr, hello string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprint(c, hello)
	go func() {
		br := bufio.NewReader(c)
		gate := "open"
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return
			}
			switch strings.TrimSpace(l) {
			case "CLOSE":
				gate = "closed"
				fmt.Fprintf(c, "CLOSED gate=%s gated=2 closing=0 held=10\n", gate)
			case "STATE":
				fmt.Fprintf(c, "STATE gate=%s gated=2 closing=0 held=10\n", gate)
			case "OPEN":
				gate = "open"
				fmt.Fprintf(c, "OPENED flushed=10 errors=0\n")
			}
		}
	}()
	return c
}

func TestServer(t *testing.T) {
	addr := fmt.Sprintf("@mpipause-ranks-test-%d", os.Getpid())
	s, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error)
	go func() { done <- s.Serve(ctx) }()

	// A HELLO that lies about its pid is refused.
	liar := fakeShim(t, addr, fmt.Sprintf("HELLO 1 job=j rank=1 size=2 pid=%d host=h\n", os.Getpid()+1))
	defer liar.Close()
	c := fakeShim(t, addr, fmt.Sprintf("HELLO 1 job=j rank=0 size=2 pid=%d host=h\n", os.Getpid()))
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	// The liar's connection is closed by the server.
	liar.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := liar.Read(make([]byte, 1)); err == nil {
		t.Error("the lying rank's connection is still open")
	}
	rs := s.Ranks("j")
	if len(rs) != 1 || rs[0].Rank != 0 || rs[0].UID != uint32(os.Getuid()) {
		t.Fatalf("ranks %+v", rs)
	}
	g, err := rs[0].Close(ctx)
	if err != nil || g.State != "closed" || g.Gated != 2 || g.Held != 10 {
		t.Errorf("Close: %+v %v", g, err)
	}
	if o, err := rs[0].Open(ctx); err != nil || o.Flushed != 10 || o.Errors != 0 {
		t.Errorf("Open: %+v %v", o, err)
	}
	c.Close()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 0 }); err != nil {
		t.Fatalf("rank not removed after its connection closed: %v", err)
	}
	if _, err := rs[0].State(ctx); err == nil {
		t.Error("State on a gone rank succeeded")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

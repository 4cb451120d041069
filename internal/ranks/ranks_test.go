package ranks

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
)

func TestParseHello(t *testing.T) {
	r, err := ParseHello("HELLO 2 job=j-1 rank=0 size=6 pid=42 host=node0 key=node0:1f hosts=node0,node1,node2")
	if err != nil {
		t.Fatal(err)
	}
	if r.Job != "j-1" || r.Rank != 0 || r.Size != 6 || r.Pid != 42 || r.Host != "node0" || strings.Join(r.Hosts, " ") != "node0 node1 node2" {
		t.Errorf("parsed %+v", r)
	}
	if r.Tstp != 0 {
		t.Errorf("a HELLO without tstp= parsed with Tstp %x", r.Tstp)
	}
	r, err = ParseHello("HELLO 2 job=j-1 rank=3 size=6 pid=43 tstp=7f0012345678 host=node1 root=node0 key=node0:1f")
	if err != nil || r.Root != "node0" || r.Hosts != nil || r.Tstp != 0x7f0012345678 {
		t.Errorf("rank 3: %+v %v", r, err)
	}
	for _, bad := range []string{"", "HELLO 1 job=x rank=0 size=1 pid=1 key=k", "HELLO 2 job=x rank=0 size=1 pid=1", "HELLO 2 job=x rank=0 size=1 pid=1 key=a=b", "HELLO 2 job=x pid=1 root=a root=b key=k", "HELLO 2 job=x key=k", "HELLO 2 pid=3 key=k", "HELLO 2 job=x pid=1 rank=one key=k", "HELLO 2 job=x job=y pid=1 key=k", "HELLO 2 job=x pid=1 junk key=k", "HELLO 2 job=x pid=1 tstp=xyz key=k", "HELLO 2 job=x pid=1 tstp=1 tstp=2 key=k"} {
		if _, err := ParseHello(bad); err == nil {
			t.Errorf("ParseHello(%q) accepted", bad)
		}
	}
}

// TestParseHelloHostNames: a HELLO whose host=, root= or any hosts= entry
// is not a host name (terminal escapes for root's mpipause status, a path,
// an empty entry) is refused, saying which field and what a name may be.
func TestParseHelloHostNames(t *testing.T) {
	const ok = "HELLO 2 job=j rank=0 size=2 pid=42 key=k host=node0 root=node0 hosts=node0,node1.example.org"
	if _, err := ParseHello(ok); err != nil {
		t.Fatalf("ParseHello(%q): %v", ok, err)
	}
	for _, c := range []struct{ line, field string }{
		{"HELLO 2 job=j rank=0 size=2 pid=42 key=k host=node0 hosts=node0,\x1b]0;pwned\x07", "hosts"},
		{"HELLO 2 job=j rank=0 size=2 pid=42 key=k host=node0 hosts=node0,\x1b[2J", "hosts"},
		{"HELLO 2 job=j rank=0 size=2 pid=42 key=k host=node0 hosts=node0,,node1", "hosts"},
		{"HELLO 2 job=j rank=0 size=2 pid=42 key=k host=node0 hosts=../../etc", "hosts"},
		{"HELLO 2 job=j rank=1 size=2 pid=42 key=k host=\x1b[31mnode1 root=node0", "host"},
		{"HELLO 2 job=j rank=1 size=2 pid=42 key=k host=node1 root=node0\x9b", "root"},
		{"HELLO 2 job=j rank=1 size=2 pid=42 key=k host= root=node0", "host"},
		{"HELLO 2 job=j rank=1 size=2 pid=42 key=k host=node1 root=-node0", "root"},
	} {
		_, err := ParseHello(c.line)
		if err == nil || !strings.Contains(err.Error(), "HELLO "+c.field+" ") || !strings.Contains(err.Error(), "RFC 1123") {
			t.Errorf("ParseHello(%q): %v; want it refused naming %s and the rule", c.line, err, c.field)
		}
	}
}

func TestValidHostName(t *testing.T) {
	label63 := strings.Repeat("a", 63)
	long := strings.Repeat(label63+".", 4)[:253]
	for _, good := range []string{"node0", "n", "0", "Node-1", "a.b.c", "node1.example.org", "xn--bcher-kva.example", label63, long} {
		if !jobid.ValidHostName(good) {
			t.Errorf("jobid.ValidHostName(%q) = false", good)
		}
	}
	for _, bad := range []string{"", ".", "a..b", ".a", "a.", "-a", "a-", "a.-b", "a_b", "a b", "a/b", "a,b", "a=b",
		label63 + "a", long + "a", "node\x1b[2J", "\x1b]0;x\x07", "n\x00", "n\u00e9", "n\u202e", "n\x7f"} {
		if jobid.ValidHostName(bad) {
			t.Errorf("jobid.ValidHostName(%q) = true", bad)
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

func TestParseFlushed(t *testing.T) {
	o, err := ParseFlushed("flushed bytes=2621622 errors=1 errno=32")
	if err != nil || o != (Opened{Flushed: 2621622, Errors: 1, Errno: 32}) {
		t.Errorf("ParseFlushed: %+v %v", o, err)
	}
	for _, bad := range []string{"pause", "flushed", "flushed bytes=x errors=0", "flushed errors=0"} {
		if _, err := ParseFlushed(bad); err == nil {
			t.Errorf("ParseFlushed(%q) accepted", bad)
		}
	}
}

// TestParseRequest: a shim's SIGTSTP/SIGCONT request, stamped or (an
// older shim) not; anything else is not a request.
func TestParseRequest(t *testing.T) {
	for in, want := range map[string]Request{
		"pause":                         {Op: "pause"},
		"resume":                        {Op: "resume"},
		"pause at=1":                    {Op: "pause", At: 1},
		"resume at=9223372036854775807": {Op: "resume", At: 1<<63 - 1},
		"pause at=5 overtaken":          {Op: "pause", At: 5, Overtaken: true},
		"pause overtaken":               {Op: "pause", Overtaken: true},
	} {
		if got, err := ParseRequest(in); err != nil || got != want {
			t.Errorf("ParseRequest(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "pause ", "pause at=", "pause at=0", "pause at=-1", "pause at=+1", "pause at=1 ",
		"pause at=9223372036854775808", "pause at=1x", "pause  at=1", "pause when=1", "stop at=1", "Pause", "pause at=0x10",
		"resume at=5 overtaken", "pause at=5 overtaken ", "pause at=+5 overtaken", "pause at=0 overtaken", "overtaken", "pause at=5 overtaken overtaken"} {
		if q, err := ParseRequest(bad); err == nil {
			t.Errorf("ParseRequest(%q) accepted: %+v", bad, q)
		}
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
			case "REOPEN":
				gate = "open"
				fmt.Fprintf(c, "REOPENED\nEVENT flushed bytes=10 errors=0 errno=0\n")
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
	liar := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=1 size=2 pid=%d host=h key=k\n", os.Getpid()+1))
	defer liar.Close()
	c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=0 size=2 pid=%d host=h key=k\n", os.Getpid()))
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	// The liar's connection is closed by the server.
	liar.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := liar.Read(make([]byte, 1)); err == nil {
		t.Error("the lying rank's connection is still open")
	}
	rs := s.Ranks(jobid.Key(uint32(os.Getuid()), "j"))
	if len(rs) != 1 || rs[0].Rank != 0 || rs[0].UID != uint32(os.Getuid()) {
		t.Fatalf("ranks %+v", rs)
	}
	g, err := rs[0].Close(ctx)
	if err != nil || g.State != "closed" || g.Gated != 2 || g.Held != 10 {
		t.Errorf("Close: %+v %v", g, err)
	}
	if err := rs[0].Reopen(ctx); err != nil {
		t.Errorf("Reopen: %v", err)
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

// TestGateWithoutPage: a shim that shared no gate page has its gate
// closed and reopened by request; CloseGate and ReopenGate ask it.
func TestGateWithoutPage(t *testing.T) {
	s, addr, ctx := serving(t)
	c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=np rank=0 size=1 pid=%d host=h key=k\n", os.Getpid()))
	defer c.Close()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	r := s.Ranks(jobid.Key(uint32(os.Getuid()), "np"))[0]
	if r.HasGatePage() {
		t.Fatal("a gate page from a shim that sent none")
	}
	for _, step := range []struct {
		name string
		do   func(context.Context) error
		want string
	}{
		{"close", r.CloseGate, "closed"},
		{"reopen", r.ReopenGate, "open"},
	} {
		if err := step.do(ctx); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		if g, err := r.State(ctx); err != nil || g.State != step.want {
			t.Fatalf("after %s: %+v %v, want gate %s", step.name, g, err, step.want)
		}
	}
}

func TestParseJoin(t *testing.T) {
	id128 := strings.Repeat("a", 128)
	for _, c := range []struct {
		line, job string
		pid       int
	}{
		{"JOIN 2 job=j-1 pid=42 key=n0:1f", "j-1", 42},
		{"JOIN 2 job=j-1 pid=42 key=n0:1f\n", "j-1", 42},
		{"JOIN 2 pid=7 key=n0:1f job=slurm-12.0", "slurm-12.0", 7},
		{"JOIN 2 job=a.b:c-d@e_f pid=2147483647 key=n0:1f", "a.b:c-d@e_f", 2147483647},
		{"JOIN 2 job=" + id128 + " pid=1 key=n0:1f", id128, 1},
	} {
		job, pid, key, err := ParseJoin(c.line)
		if err != nil || job != c.job || pid != c.pid || key != "n0:1f" {
			t.Errorf("ParseJoin(%q) = %q, %d, %v; want %q, %d", c.line, job, pid, err, c.job, c.pid)
		}
	}
	for _, bad := range []string{
		"",
		"JOIN",
		"JOIN 1",
		"join 1 job=x pid=1",
		"HELLO 1 job=x pid=1",
		"JOIN 1 job=x pid=1",
		"JOIN 1 job=x pid=1 key=n0:1f",
		"JOIN 2 job=x pid=1",
		"JOIN 2 job=x pid=1 key=",
		"JOIN 2 job=x pid=1 key=a=b",
		"JOIN 2 job=x pid=1 key=k key=k",
		"JOIN 02 job=x pid=1 key=k",
		"JOIN 2 job=x key=k",
		"JOIN 2 pid=1 key=k",
		"JOIN 2 job=x pid=1 extra=2 key=k",
		"JOIN 2 job=x pid=1 junk key=k",
		"JOIN 2 job=x job=y key=k",
		"JOIN 2 pid=1 pid=2 key=k",
		"JOIN 2 job=x jobx pid=1 key=k",
		"JOIN 2 job= pid=1 key=k",
		"JOIN 2 job pid=1 key=k",
		"JOIN 2 job=a=b pid=1 key=k",
		"JOIN 2 job=a,b pid=1 key=k",
		"JOIN 2 job=a/b pid=1 key=k",
		"JOIN 2 job=. pid=1 key=k",
		"JOIN 2 job=.. pid=1 key=k",
		"JOIN 2 job=a\tb pid=1 key=k",
		"JOIN 2 job=a\x01 pid=1 key=k",
		"JOIN 2 job=a\x7f pid=1 key=k",
		"JOIN 2 job=caf\u00e9 pid=1 key=k",
		"JOIN 2 job=" + id128 + "a pid=1 key=k",
		"JOIN 2 job=x pid= key=k",
		"JOIN 2 job=x pid=0 key=k",
		"JOIN 2 job=x pid=-1 key=k",
		"JOIN 2 job=x pid=+1 key=k",
		"JOIN 2 job=x pid=01 key=k",
		"JOIN 2 job=x pid=1x key=k",
		"JOIN 2 job=x pid=0x10 key=k",
		"JOIN 2 job=x pid=99999999999 key=k",
		"JOIN  1 job=x pid=1",
		"JOIN 2 job=x  pid=1 key=k",
		"JOIN 2 job=x pid=1  key=k",
		"JOIN 2 job=x pid=1\r key=k",
		"JOIN 2 job=x pid=1\n\n key=k",
	} {
		if job, pid, _, err := ParseJoin(bad); err == nil {
			t.Errorf("ParseJoin(%q) accepted: %q, %d", bad, job, pid)
		}
	}
}

// joinServer serves ranks with the Join hook join on a fresh socket; the
// refusals OnChange is told of go to the channel.
func joinServer(t *testing.T, join func(JoinRequest) error) (*Server, string, <-chan error) {
	t.Helper()
	addr := fmt.Sprintf("@mpipause-ranks-join-test-%d-%s", os.Getpid(), t.Name())
	s, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	refused := make(chan error, 10)
	hooksOf(s).join = join
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if r == nil && err != nil {
			refused <- err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s, addr, refused
}

// joinOnce is the shim's JOIN: one line, one answer, then the server
// hangs up (the answer, without its newline, and whether it hung up).
func joinOnce(t *testing.T, addr, line string) (string, bool) {
	t.Helper()
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprint(c, line); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	reply, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("no answer to %q: %v", line, err)
	}
	_, err = br.ReadByte()
	return strings.TrimSuffix(reply, "\n"), errors.Is(err, io.EOF)
}

func TestServerJoin(t *testing.T) {
	me := os.Getpid()
	type call struct {
		job string
		pid int
		uid uint32
	}

	t.Run("ok", func(t *testing.T) {
		calls := make(chan call, 10)
		s, addr, refused := joinServer(t, func(r JoinRequest) error {
			if r.Key != "n0:1f" {
				t.Errorf("Join got key %q", r.Key)
			}
			calls <- call{r.Job, r.Proc.Pid, r.Proc.UID}
			return nil
		})
		reply, hungUp := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=j-7 pid=%d key=n0:1f\n", me))
		if reply != "OK" || !hungUp {
			t.Errorf("reply %q, hung up %v; want OK and the connection closed", reply, hungUp)
		}
		select {
		case c := <-calls:
			if c != (call{"j-7", me, uint32(os.Getuid())}) {
				t.Errorf("Join got %+v", c)
			}
		default:
			t.Error("OK without a Join call")
		}
		if len(calls) != 0 || len(refused) != 0 {
			t.Errorf("%d more Join calls, %d refusals", len(calls), len(refused))
		}
		if rs := s.Ranks(""); len(rs) != 0 {
			t.Errorf("a JOIN registered ranks: %+v", rs)
		}
	})

	t.Run("hook error", func(t *testing.T) {
		_, addr, refused := joinServer(t, func(JoinRequest) error {
			return errors.New("cannot move pid into /sys/fs/cgroup/job:\npermission denied")
		})
		reply, hungUp := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=j pid=%d key=n0:1f\n", me))
		if want := "ERR cannot move pid into /sys/fs/cgroup/job: permission denied"; reply != want || !hungUp {
			t.Errorf("reply %q, hung up %v; want %q and the connection closed", reply, hungUp, want)
		}
		wantRefusal(t, refused, "permission denied")
	})

	t.Run("pid mismatch", func(t *testing.T) {
		called := make(chan struct{}, 1)
		_, addr, refused := joinServer(t, func(JoinRequest) error { called <- struct{}{}; return nil })
		reply, hungUp := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=j pid=%d key=n0:1f\n", me+1))
		if want := "ERR pid does not match the connection's credentials"; reply != want || !hungUp {
			t.Errorf("reply %q, hung up %v; want %q and the connection closed", reply, hungUp, want)
		}
		wantRefusal(t, refused, "pid does not match")
		if len(called) != 0 {
			t.Error("Join called for a pid that is not the peer's")
		}
	})

	t.Run("malformed", func(t *testing.T) {
		called := make(chan struct{}, 1)
		_, addr, refused := joinServer(t, func(JoinRequest) error { called <- struct{}{}; return nil })
		reply, hungUp := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=a=b pid=%d key=n0:1f\n", me))
		if !strings.HasPrefix(reply, "ERR JOIN job id") || !hungUp {
			t.Errorf("reply %q, hung up %v; want an ERR about the job id and the connection closed", reply, hungUp)
		}
		wantRefusal(t, refused, "job id")
		if len(called) != 0 {
			t.Error("Join called for a malformed JOIN")
		}
	})

	t.Run("no hook", func(t *testing.T) {
		_, addr, refused := joinServer(t, nil)
		reply, hungUp := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=j pid=%d key=n0:1f\n", me))
		if want := "ERR joining is not supported here"; reply != want || !hungUp {
			t.Errorf("reply %q, hung up %v; want %q and the connection closed", reply, hungUp, want)
		}
		wantRefusal(t, refused, "not supported")
	})

	t.Run("hello after join", func(t *testing.T) {
		s, addr, _ := joinServer(t, func(JoinRequest) error { return nil })
		if reply, _ := joinOnce(t, addr, fmt.Sprintf("JOIN 2 job=j pid=%d key=n0:1f\n", me)); reply != "OK" {
			t.Fatalf("JOIN: %q", reply)
		}
		c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=0 size=1 pid=%d host=h key=k\n", me))
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
			t.Fatalf("the HELLO after a JOIN did not register: %v", err)
		}
		if g, err := s.Ranks(jobid.Key(uint32(os.Getuid()), "j"))[0].State(ctx); err != nil || g.State != "open" {
			t.Errorf("State: %+v %v", g, err)
		}
	})
}

func wantRefusal(t *testing.T, refused <-chan error, want string) {
	t.Helper()
	select {
	case err := <-refused:
		if !strings.Contains(err.Error(), want) {
			t.Errorf("OnChange told %q, want it to say %q", err, want)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("OnChange not told of the refusal (%s)", want)
	}
}

// TestLongHello: rank 0 of a job on thousands of nodes lists them all in
// its HELLO, and every one of them arrives.
func TestLongHello(t *testing.T) {
	s, addr, ctx := serving(t)
	hosts := make([]string, 5000)
	for i := range hosts {
		hosts[i] = fmt.Sprintf("node%05d.cluster.example", i)
	}
	c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=big rank=0 size=20000 pid=%d host=%s key=k hosts=%s\n", os.Getpid(), hosts[0], strings.Join(hosts, ",")))
	defer c.Close()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	if got := s.Ranks(jobid.Key(uint32(os.Getuid()), "big"))[0].Hosts; len(got) != len(hosts) || got[len(got)-1] != hosts[len(hosts)-1] {
		t.Errorf("%d hosts arrived, last %q; want %d", len(got), got[len(got)-1], len(hosts))
	}
}

// TestLateReply: a reply that comes after its caller gave up is not taken
// for the next request's, and does not cut the rank off.
func TestLateReply(t *testing.T) {
	s, addr, ctx := serving(t)
	c, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "HELLO 2 job=late rank=0 size=1 pid=%d host=h key=k\n", os.Getpid())
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	r := s.Ranks(jobid.Key(uint32(os.Getuid()), "late"))[0]
	br := bufio.NewReader(c)
	short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	if _, err := r.State(short); err == nil {
		t.Fatal("State answered without a reply")
	}
	// The shim answers the first request late, then the second at once.
	go func() {
		for _, reply := range []string{"STATE gate=open gated=1 closing=0 held=1\n", "CLOSED gate=closed gated=2 closing=0 held=2\n"} {
			if _, err := br.ReadString('\n'); err != nil {
				return
			}
			fmt.Fprint(c, reply)
		}
	}()
	g, err := r.Close(ctx)
	if err != nil || g.State != "closed" || g.Gated != 2 {
		t.Errorf("Close after a late reply: %+v %v; want its own reply", g, err)
	}
	if len(s.Ranks(jobid.Key(uint32(os.Getuid()), "late"))) != 1 {
		t.Error("the rank was cut off by its late reply")
	}
}

// serving is a Server on a fresh abstract socket, served until the test ends.
func serving(t *testing.T) (*Server, string, context.Context) {
	t.Helper()
	addr := fmt.Sprintf("@mpipause-ranks-%s-%d", t.Name(), os.Getpid())
	s, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	go s.Serve(ctx)
	return s, addr, ctx
}

// TestRankCap: a uid holds at most MaxPerUID registered ranks; one more
// HELLO is refused before it is admitted, and a rank that goes makes room.
func TestRankCap(t *testing.T) {
	addr := fmt.Sprintf("@mpipause-ranks-%s-%d", t.Name(), os.Getpid())
	s, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	refused := make(chan error, 4)
	var admitted atomic.Int32
	s.MaxPerUID = 2
	hooksOf(s).admit = func(*Rank) error { admitted.Add(1); return nil }
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if r == nil {
			refused <- err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go s.Serve(ctx)
	hello := func(rank int) net.Conn {
		return fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=%d size=9 pid=%d host=h key=k\n", rank, os.Getpid()))
	}
	count := func(n int) {
		t.Helper()
		if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == n }); err != nil {
			t.Fatalf("waiting for %d ranks: %v", n, err)
		}
	}
	first := hello(0)
	defer first.Close()
	second := hello(1)
	defer second.Close()
	count(2)
	over := hello(2)
	defer over.Close()
	wantRefusal(t, refused, "the most one user may have")
	if n := admitted.Load(); n != 2 {
		t.Errorf("%d HELLOs reached Admit, want 2 (none past the cap)", n)
	}
	first.Close()
	count(1)
	again := hello(3)
	defer again.Close()
	count(2)
}

// TestLeft: a rank whose channel closes is Left until it registers again
// (a shim whose mpid cut it off comes back with the same HELLO) or its
// job is forgotten; another job's ranks are not its job's.
func TestLeft(t *testing.T) {
	s, addr, ctx := serving(t)
	hello := func(job string, rank int) string {
		return fmt.Sprintf("HELLO 2 job=%s rank=%d size=2 pid=%d host=h key=k\n", job, rank, os.Getpid())
	}
	key := jobid.Key(uint32(os.Getuid()), "j")
	r0 := fakeShim(t, addr, hello("j", 0))
	r1 := fakeShim(t, addr, hello("j", 1))
	other := fakeShim(t, addr, hello("k", 1))
	defer other.Close()
	count := func(n int) {
		t.Helper()
		if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == n }); err != nil {
			t.Fatal(err)
		}
	}
	count(3)
	if l := s.Left(key); len(l) != 0 {
		t.Fatalf("Left %v with every rank registered", l)
	}
	r1.Close()
	r0.Close()
	count(1)
	if l := s.Left(key); !slices.Equal(l, []Departed{{0, os.Getpid()}, {1, os.Getpid()}}) {
		t.Fatalf("Left %v; want ranks 0 and 1", l)
	}
	again := fakeShim(t, addr, hello("j", 1))
	defer again.Close()
	count(2)
	if l := s.Left(key); !slices.Equal(l, []Departed{{0, os.Getpid()}}) {
		t.Errorf("Left %v after rank 1 came back; want rank 0", l)
	}
	s.Forget(key)
	if l := s.Left(key); len(l) != 0 {
		t.Errorf("Left %v after Forget", l)
	}
}

// TestLeftBounded: a job's process that registers under rank after rank
// and hangs up each time makes mpid keep no more departures than a uid may
// have ranks registered.
func TestLeftBounded(t *testing.T) {
	s, addr, ctx := serving(t)
	s.MaxPerUID = 3
	key := jobid.Key(uint32(os.Getuid()), "j")
	for rank := range 6 {
		c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=%d size=1000000 pid=%d host=h key=k\n", rank, os.Getpid()))
		if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 1 }); err != nil {
			t.Fatal(err)
		}
		c.Close()
		if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == 0 }); err != nil {
			t.Fatal(err)
		}
	}
	if l := s.Left(key); len(l) != 3 {
		t.Errorf("Left keeps %d departures (%v); want the bound, 3", len(l), l)
	}
}

// hooks is Jobs from the functions a test sets; one it leaves nil refuses
// every JOIN as a server without Jobs does, admits every rank, or hears
// nothing.
type hooks struct {
	join    func(JoinRequest) error
	admit   func(*Rank) error
	changed func(r *Rank, gone bool, err error)
	event   func(r *Rank, ev string)
}

// hooksOf is s's hooks, set as its Jobs at the first call.
func hooksOf(s *Server) *hooks {
	if h, ok := s.Jobs.(*hooks); ok {
		return h
	}
	h := &hooks{}
	s.Jobs = h
	return h
}

func (h *hooks) Join(q JoinRequest) error {
	if h.join == nil {
		return errors.New("joining is not supported here")
	}
	return h.join(q)
}

func (h *hooks) Admit(r *Rank) error {
	if h.admit == nil {
		return nil
	}
	return h.admit(r)
}

func (h *hooks) Changed(r *Rank, gone bool, err error) {
	if h.changed != nil {
		h.changed(r, gone, err)
	}
}

func (h *hooks) Event(r *Rank, ev string) {
	if h.event != nil {
		h.event(r, ev)
	}
}

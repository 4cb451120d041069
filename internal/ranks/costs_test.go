package ranks

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
)

// hostNames is n distinct host names, joined as rank 0's hosts= sends them.
func hostNames(prefix string, n int) string {
	hs := make([]string, n)
	for i := range hs {
		hs[i] = fmt.Sprintf("%s%06d.cluster.example.org", prefix, i)
	}
	return strings.Join(hs, ",")
}

// refusing is a Server that reports its refusals.
func refusing(t *testing.T) (*Server, string, context.Context, chan error) {
	t.Helper()
	s, addr, ctx := serving(t)
	refused := make(chan error, 64)
	hooksOf(s).changed = func(r *Rank, gone bool, err error) {
		if r == nil {
			refused <- err
		}
	}
	return s, addr, ctx, refused
}

func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestHostsKeptOnce: a job's rank 0 registering again and again with the
// same long host list costs mpid that list once, not once a registration,
// and no registration pins the line its list came in; another rank's
// hosts= is not kept at all.
func TestHostsKeptOnce(t *testing.T) {
	s, addr, ctx, refused := refusing(t)
	hosts := hostNames("n", 16000) // 480 KB of text
	before := heap()
	const n = 40
	var conns []net.Conn
	for i := range n {
		rank := 0
		if i%2 == 1 {
			rank = i
		}
		conns = append(conns, fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=big rank=%d size=64 pid=%d host=h key=k hosts=%s\n", rank, os.Getpid(), hosts)))
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == n }); err != nil {
		t.Fatalf("%v (refused: %d)", err, len(refused))
	}
	grown := int64(heap()) - int64(before)
	// One list: its text and a string header a name, about 740 KB; kept
	// for each registration, or pinning its 480 KB line, it is 20 MB.
	if grown > 3<<20 {
		t.Errorf("%d registrations with a %d-byte host list grew the heap by %d bytes: the list is kept more than once", n, len(hosts), grown)
	}
	var first *string
	for _, r := range s.Ranks(jobid.Key(uint32(os.Getuid()), "big")) {
		switch {
		case r.Rank != 0 && r.Hosts != nil:
			t.Errorf("rank %d's hosts= was kept", r.Rank)
		case r.Rank == 0 && len(r.Hosts) != 16000:
			t.Errorf("rank 0 has %d hosts, want 16000", len(r.Hosts))
		case r.Rank == 0 && first == nil:
			first = &r.Hosts[0]
		case r.Rank == 0 && first != &r.Hosts[0]:
			t.Errorf("the job's rank 0 registrations hold copies of one host list")
		}
	}
}

// TestHostsBounded: a job's host list past MaxHosts names or
// MaxHostsBytes, or one that would take a uid's lists past MaxHostsPerUID,
// is refused, the reason saying which bound; a list that fits is kept, and
// a job's end gives its room back.
func TestHostsBounded(t *testing.T) {
	s, addr, ctx, refused := refusing(t)
	hello := func(job, hosts string) net.Conn {
		return fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=%s rank=0 size=2 pid=%d host=h key=k hosts=%s\n", job, os.Getpid(), hosts))
	}
	expect := func(what, want string) {
		t.Helper()
		select {
		case err := <-refused:
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: refused with %q, want it to say %q", what, err, want)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s: not refused", what)
		}
	}
	c := hello("many", strings.Repeat("a,", MaxHosts)+"a")
	defer c.Close()
	expect("a list of MaxHosts+1 names", fmt.Sprintf("at most %d hosts", MaxHosts))
	c = hello("long", strings.Repeat(strings.Repeat("b", 63)+".", MaxHostsBytes/64)+"c")
	defer c.Close()
	expect("a list longer than MaxHostsBytes", fmt.Sprintf("at most %d bytes", MaxHostsBytes))

	// Lists of 16,000 names of 27 bytes hold 704 KB each (a string header
	// a name): five fit in MaxHostsPerUID, a sixth job's does not.
	list := hostNames("u", 16000)
	fit := MaxHostsPerUID / hostsCost(strings.Split(list, ","))
	var kept []net.Conn
	for i := range fit {
		kept = append(kept, hello(fmt.Sprintf("j%d", i), list))
	}
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == fit }); err != nil {
		t.Fatalf("%v (refused: %v)", err, <-refused)
	}
	c = hello("past", list)
	defer c.Close()
	expect("one more job's list", fmt.Sprintf("past the %d one user may", MaxHostsPerUID))
	kept[0].Close()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == fit-1 }); err != nil {
		t.Fatal(err)
	}
	c = hello("again", list)
	defer c.Close()
	if err := s.Wait(ctx, func(all []*Rank) bool { return len(all) == fit }); err != nil {
		t.Fatalf("a job's list once another job ended: %v", err)
	}
	for _, c := range kept[1:] {
		c.Close()
	}
}

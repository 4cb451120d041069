package ranks

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/jobid"
)

// Every decoder of bytes another process sends mpid has a fuzz target
// (`make test-fuzz` runs each for a bounded time; testdata/fuzz holds the
// corpus). Each checks, beyond not panicking, what the callers rely on in
// what the decoder accepts.

func FuzzParseHello(f *testing.F) {
	f.Add("HELLO 2 job=j rank=0 size=2 pid=42 host=h key=n:1f\n")
	f.Add("HELLO 2 job=j rank=1 size=2 pid=42 host=h root=r hosts=a,b,c key=n:1f")
	f.Add("HELLO 2 job=../x rank=0 size=1 pid=1 host=h key=n:1f")
	f.Add("HELLO 2 job=j rank=-1 size=0 pid=1 host=h rank=2 key=n:1f")
	f.Add("HELLO 2 job=j rank=0 size=2 pid=42 host=h key=n:1f hosts=h,\x1b[2J")
	f.Add("HELLO 2 job=j rank=1 size=2 pid=42 host=h root=r.example-1.org key=n:1f")
	f.Fuzz(func(t *testing.T, line string) {
		r, err := ParseHello(line)
		if err != nil {
			return
		}
		if !jobid.Valid(r.Job) || r.Pid <= 0 || r.Size <= 0 || r.Rank < 0 || r.Rank >= r.Size {
			t.Fatalf("accepted %q as %+v", line, r)
		}
		// Only rank 0's list is kept, and within its bounds.
		if r.Hosts != nil && (r.Rank != 0 || len(r.Hosts) > MaxHosts || len(strings.Join(r.Hosts, ",")) > MaxHostsBytes) {
			t.Fatalf("accepted %q with %d hosts for rank %d", line, len(r.Hosts), r.Rank)
		}
		// Names reach node lists, peers' addresses and terminals.
		for _, h := range append([]string{r.Host, r.Root}, r.Hosts...) {
			if h != "" && !jobid.ValidHostName(h) {
				t.Fatalf("accepted %q with host name %q", line, h)
			}
		}
	})
}

func FuzzParseJoin(f *testing.F) {
	f.Add("JOIN 2 job=j pid=42 key=n:1f\n")
	f.Add("JOIN 2 pid=42 job=a.b-c key=n:1f")
	f.Add("JOIN 2 job=.. pid=1 key=n:1f")
	f.Add("JOIN 2 job=j pid=042 key=n:1f")
	f.Fuzz(func(t *testing.T, line string) {
		job, pid, key, err := ParseJoin(line)
		if err != nil {
			return
		}
		if !jobid.Valid(job) || pid <= 0 || strings.ContainsAny(job, "/= \n") || !validKey(key) || strings.ContainsAny(key, "= \n") {
			t.Fatalf("accepted %q as job %q pid %d", line, job, pid)
		}
	})
}

// FuzzParseReply: the shim's answers to mpid's requests and its events.
func FuzzParseReply(f *testing.F) {
	f.Add("CLOSED gate=closed gated=2 closing=0 held=10")
	f.Add("STATE gate=open gated=0 closing=1 held=0")
	f.Add("OPENED flushed=10 errors=0 errno=0")
	f.Add("flushed bytes=3 errors=1 errno=32")
	f.Add("pause at=123456789")
	f.Add("resume at=+1")
	f.Add("STATE gate=closed gated=-1 closing=99999999999999999999 held=x")
	f.Fuzz(func(t *testing.T, line string) {
		for _, verb := range []string{"CLOSED", "STATE"} {
			if g, err := ParseGate(line, verb); err == nil {
				if g.Gated < 0 || g.Closing < 0 {
					t.Fatalf("accepted %q as %+v", line, g)
				}
				if g.State != "open" && g.State != "closed" && g.State != "flushing" {
					t.Fatalf("accepted %q with gate %q", line, g.State)
				}
			}
		}
		if o, err := ParseOpened(line); err == nil && o.Errors < 0 {
			t.Fatalf("accepted %q as %+v", line, o)
		}
		ParseFlushed(line)
		if q, err := ParseRequest(line); err == nil {
			if (q.Op != "pause" && q.Op != "resume") || q.At < 0 {
				t.Fatalf("accepted %q as %+v", line, q)
			}
		}
	})
}

// FuzzStatePage: a state page's header is the rank's to write; whatever it
// says, mpid's reads of the page stay inside it.
func FuzzStatePage(f *testing.F) {
	page := func(version uint32, fds, size, held, from uint64) []byte {
		b := make([]byte, size)
		copy(b, pageMagic)
		le := binary.LittleEndian
		le.PutUint32(b[8:], version)
		le.PutUint32(b[12:], uint32(fds))
		le.PutUint64(b[16:], size)
		le.PutUint64(b[24:], held)
		if size >= pageHeader2 {
			le.PutUint64(b[40:], from)
		}
		return b
	}
	f.Add(page(1, 4, 80, 48, 0))
	f.Add(page(1, 64, 688, 176, 0))
	f.Add(page(2, 4, 120, 56, 88))
	f.Add(page(2, 64, 1200, 176, 688))
	f.Add(page(2, 1<<31, 64, 48, 56))
	f.Add(page(2, 3, 64, 1<<63, 1<<62))
	f.Fuzz(func(t *testing.T, mem []byte) {
		p, err := checkPage(mem)
		if err != nil {
			return
		}
		r := &Rank{page: p}
		for _, s := range r.Sockets() {
			if s.FD < 0 || s.FD >= p.fds {
				t.Fatalf("socket %+v outside %d fds", s, p.fds)
			}
		}
		r.Quiet()
		hs, _ := r.Holding()
		for _, h := range hs {
			if h.Fd < 0 || h.Fd >= p.fds || h.Held == 0 {
				t.Fatalf("holding %+v outside %d fds or empty", h, p.fds)
			}
		}
	})
}

package kerneltests

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// testRankSocket is where the tests that drive the gates themselves (no
// mpid) serve the rank channel, beside the rig's own mpid on ranks.DefaultAddr.
const testRankSocket = "@mpipause-kt-ranks"

// shimEnv preloads the shim and points it at testRankSocket.
func shimEnv(bin string) []string {
	return []string{"LD_PRELOAD=" + filepath.Join(bin, "libmpipause.so"), "MPIPAUSE_MPID_SOCKET=" + testRankSocket, fakeJobKey}
}

// listenInNode opens testRankSocket (an abstract unix socket, which belongs
// to the network namespace it is made in) inside a rig node.
func listenInNode(t testing.TB, node int) *net.UnixListener {
	t.Helper()
	var ln *net.UnixListener
	if err := nodeNetns(t, node).Do(func() (err error) {
		ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: testRankSocket, Net: "unix"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ln
}

// serveNodes serves the rank socket in every node of the shared rig until
// the test ends; the sockets are closed before it returns, so the next test
// can listen on the same names.
func serveNodes(t testing.TB) []*ranks.Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var serving sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		serving.Wait()
	})
	srv := make([]*ranks.Server, jobNodes)
	for k := range srv {
		srv[k] = ranks.NewServer(listenInNode(t, k))
		serving.Go(func() { srv[k].Serve(ctx) })
	}
	return srv
}

// registered waits until n ranks have registered across srv and returns
// them.
func registered(t testing.TB, srv []*ranks.Server, n int, done <-chan struct{}) []*ranks.Rank {
	t.Helper()
	var all []*ranks.Rank
	waitFor(t, fmt.Sprintf("%d ranks registered", n), 2*time.Minute, done, func() bool {
		all = nil
		for _, s := range srv {
			all = append(all, s.Ranks("")...)
		}
		return len(all) == n
	})
	return all
}

// jobObserver is a BPF observer of the job cgroup cg, closed when the test
// ends. Unbounded: cg may be the rig's parent of every node's jobs, the
// cgroups of many tests' jobs below it, and the bounds are mpid's.
func jobObserver(ctx context.Context, t testing.TB, cg string) loader.Observer {
	t.Helper()
	obs, err := loader.Open(ctx, loader.Config{Cgroup: cg, FollowJob: true, Require: loader.KindBPF, Unbounded: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { obs.Close() })
	return obs
}

// TestGateDrainsJob is the shim's gate on real jobs: with libmpipause.so
// preloaded into every rank of a 3 x 2 job running a heavy all-to-all, close
// every rank's gate, wait until the kernel reports every connection of the
// job empty, check for a second that it stays empty and that no byte moves
// on any of them, reopen, and repeat; the job must end with the checksum of
// an unpaused run.
func TestGateDrainsJob(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testGate(t, lib) })
	}
}

func testGate(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()

	srv := serveNodes(t)
	cg := testutil.NewCgroup(t)
	obs := jobObserver(ctx, t, cg)

	want := envCount("MPIPAUSE_GATE_CYCLES", 50)
	cycles, jobs := 0, 0
	var drain []time.Duration
	var pausedCPU []float64
	for cycles < want {
		jobs++
		n := runGatedJob(ctx, t, bin, lib, cg, obs, srv, want-cycles, &drain, &pausedCPU)
		if t.Failed() {
			return
		}
		cycles += n
	}
	var worst, sum time.Duration
	for _, d := range drain {
		sum += d
		worst = max(worst, d)
	}
	var cpu float64
	for _, c := range pausedCPU {
		cpu += c
	}
	t.Logf("%d pause cycles over %d jobs: every connection empty after %v on average, %v at worst; ranks used %.0f%% of a CPU each while gated (not frozen); results unchanged",
		cycles, jobs, sum/time.Duration(len(drain)), worst, 100*cpu/float64(len(pausedCPU)))
}

// runGatedJob runs one job and pauses it up to n times while it runs; it
// returns how many pauses it made.
func runGatedJob(ctx context.Context, t *testing.T, bin string, lib mpiLib, cg string, obs loader.Observer, srv []*ranks.Server, n int, drain *[]time.Duration, pausedCPU *[]float64) int {
	t.Helper()
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "600", "-s", "256K"}
	job := startJob(ctx, t, lib, cg, app, shimEnv(bin), args...)
	done := job.done

	// Every rank registers with its own node's server, under one job id.
	all := registered(t, srv, 6, done)
	for k, s := range srv {
		if rs := s.Ranks(""); len(rs) != 2 {
			t.Fatalf("node%d has %d ranks registered, want 2", k, len(rs))
		}
	}
	for _, r := range all {
		if r.Job != all[0].Job || r.Size != 6 {
			t.Fatalf("rank %d: job %q size %d; rank %d: job %q", r.Rank, r.Job, r.Size, all[0].Rank, all[0].Job)
		}
	}

	made := 0
	for made < n {
		select {
		case <-done:
			goto finished
		default:
		}
		start := time.Now()
		for _, r := range all {
			if _, err := r.Close(ctx); err != nil {
				goto finished // the job ended between the check and the request
			}
		}
		// Wait for the kernel to report every connection of the job empty
		// and every gate at a call boundary.
		var conns []loader.Conn
		waitFor(t, "every job connection empty under closed gates", time.Minute, nil, func() bool {
			for _, r := range all {
				if g, err := r.State(ctx); err != nil || g.Closing > 0 {
					return false
				}
			}
			var err error
			conns, err = obs.Snapshot(ctx)
			return err == nil && allEmpty(conns)
		})
		*drain = append(*drain, time.Since(start))
		// mpid's view without asking the ranks: their state pages. A
		// socket shows gated once a send to it is held: right after the
		// drain the ranks may still be reading what it delivered, their
		// next sends not made yet, so the pages are watched until one
		// does (or the job ends).
		gated := func() (n int) {
			for _, r := range all {
				for _, so := range r.Sockets() {
					if so.Gated {
						n++
					}
				}
			}
			return n
		}
		for deadline := time.Now().Add(10 * time.Second); gated() == 0; {
			select {
			case <-done:
				goto finished
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("pause %d: no rank's state page showed a gated socket within 10 s of the drain", made+1)
			}
			time.Sleep(time.Millisecond)
		}
		// A second of nothing: still empty, and no byte moved on any job
		// connection (the BPF counters of the gated sockets stand still).
		before := counters(conns)
		cpu0, t0 := ranksCPU(all), time.Now()
		for end := time.Now().Add(time.Second); time.Now().Before(end); {
			now, err := obs.Snapshot(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !allEmpty(now) {
				t.Fatalf("pause %d: a connection filled again under closed gates: %v", made+1, nonEmpty(now))
			}
			if k, moved := counterMoved(before, counters(now)); moved {
				ended := "running"
				select {
				case <-done:
					ended = "ended"
				default:
				}
				t.Fatalf("pause %d: connection %v counted bytes under closed gates (job %s):\n  at the drain: %s\n  now:          %s",
					made+1, k, ended, connLine(conns, k), connLine(now, k))
			}
		}
		*pausedCPU = append(*pausedCPU, (ranksCPU(all)-cpu0).Seconds()/time.Since(t0).Seconds()/float64(len(all)))
		var total uint64
		for _, c := range conns {
			total += c.BytesSent // the conns of the drained snapshot
		}
		for _, r := range all {
			o, err := r.Open(ctx)
			if err != nil {
				t.Fatalf("open rank %d: %v", r.Rank, err)
			}
			if o.Errors > 0 {
				// Bytes held for a connection the library closed during the
				// pause (Open MPI settles simultaneous connects by closing
				// one): the kernel would have dropped them too. The checksum
				// at the end says whether the job noticed.
				t.Logf("pause %d: rank %d: %d held chunks refused at reopen (errno %d)", made+1, r.Rank, o.Errors, o.Errno)
			}
		}
		for _, r := range all {
			for _, so := range r.Sockets() {
				if so.Gated || so.Held > 0 {
					t.Fatalf("pause %d: after reopening, rank %d's page shows fd %d gated=%v held=%d", made+1, r.Rank, so.FD, so.Gated, so.Held)
				}
			}
		}
		made++
		// The job goes on: wait for 4 MiB more to be sent before the next pause.
		waitProgress(ctx, t, obs, done, total, 4<<20)
	}
finished:
	job.finish(ctx, t, fmt.Sprintf("the job paused %d times", made), serial(t, app, 6, args...))
	return made
}

func allEmpty(cs []loader.Conn) bool {
	for _, c := range cs {
		if c.State == loader.StateEstablished && !c.Empty() {
			return false
		}
	}
	return true
}

func nonEmpty(cs []loader.Conn) []string {
	var out []string
	for _, c := range cs {
		if !c.Empty() {
			out = append(out, fmt.Sprintf("%v->%v send-q %d unread %d", c.Local, c.Remote, c.SendQueue, c.Unread))
		}
	}
	return out
}

// connLine is what a failure says of cookie's connection in cs.
func connLine(cs []loader.Conn, cookie uint64) string {
	for _, c := range cs {
		if c.Cookie == cookie {
			return fmt.Sprintf("%v->%v %v sent %d recv %d send-q %d unread %d counted %v",
				c.Local, c.Remote, c.State, c.BytesSent, c.BytesRecv, c.SendQueue, c.Unread, c.Counted)
		}
	}
	return "absent"
}

func counters(cs []loader.Conn) map[uint64][2]uint64 {
	m := map[uint64][2]uint64{}
	for _, c := range cs {
		m[c.Cookie] = [2]uint64{c.BytesSent, c.BytesRecv}
	}
	return m
}

func counterMoved(before, now map[uint64][2]uint64) (uint64, bool) {
	for k, v := range now {
		if b, ok := before[k]; ok && b != v {
			return k, true
		}
	}
	return 0, false
}

// ranksCPU is the CPU time the ranks have used so far (utime + stime).
func ranksCPU(all []*ranks.Rank) time.Duration {
	var ticks int64
	for _, r := range all {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", r.Pid))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 12 {
			u, _ := strconv.ParseInt(f[11], 10, 64)
			s, _ := strconv.ParseInt(f[12], 10, 64)
			ticks += u + s
		}
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

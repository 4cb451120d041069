package kerneltests

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sys/unix"
)

// TestMpidAdmitsJobRanks runs the real mpid and a real MPI program with the
// shim: a rank in the job's cgroup registers (and is seen to go at
// MPI_Finalize); the same program outside the cgroup is refused and still
// runs to the end; without any mpid the program runs and says so once.
func TestMpidAdmitsJobRanks(t *testing.T) {
	bin := binDir(t)
	cg := testutil.NewCgroup(t)
	sock := fmt.Sprintf("@mpipause-kt-mpid-%d", os.Getpid())
	ready := filepath.Join(t.TempDir(), "ready")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	keyFile := newKeyFile(t)
	mpid := start(ctx, t, "", nil, filepath.Join(bin, "mpid"), "--cgroup", cg, "--ready-file", ready, "--rank-socket", sock, "--unpin-on-exit",
		"--cluster-key", keyFile, "--peer-port", fmt.Sprint(testPeerPort()))
	log := &mpid.out
	defer func() {
		mpid.cmd.Process.Signal(syscall.SIGTERM) // unpins
		<-mpid.done
	}()
	waitFor(t, "mpid's ready file", time.Minute, mpid.done, func() bool {
		_, err := os.Stat(ready)
		return err == nil
	})

	app := filepath.Join(bin, "apps", "xchg.mpich")
	want := serial(t, app, 1, "-n", "3", "-s", "1K")
	run := func(t *testing.T, inJob bool, env ...string) string {
		t.Helper()
		in := ""
		if inJob {
			in = cg
		}
		p := start(ctx, t, in, append([]string{"LD_PRELOAD=" + filepath.Join(bin, "libmpipause.so")}, env...), app, "-n", "3", "-s", "1K")
		p.finish(ctx, t, "the shimmed program", want)
		return p.out.String()
	}

	t.Run("a rank in the job's cgroup registers", func(t *testing.T) {
		out := run(t, true, "MPIPAUSE_MPID_SOCKET="+sock, "MPIPAUSE_JOBID=kt-job", jobKeyEnv(t, keyFile, "kt-job"))
		if strings.Contains(out, "mpipause:") {
			t.Errorf("a registered rank printed a warning:\n%s", out)
		}
		waitFor(t, "mpid to log the rank's registration and departure", 30*time.Second, nil, func() bool {
			l := log.String()
			return strings.Contains(l, `msg="rank registered" job=kt-job rank=0 size=1`) && strings.Contains(l, `msg="rank gone" job=kt-job`)
		})
	})
	t.Run("a process outside the cgroup is refused", func(t *testing.T) {
		run(t, false, "MPIPAUSE_MPID_SOCKET="+sock, "MPIPAUSE_JOBID=outsider", jobKeyEnv(t, keyFile, "outsider"))
		waitFor(t, "mpid to refuse a process outside the job", 30*time.Second, nil, func() bool {
			return strings.Contains(log.String(), `msg="rank refused"`) && strings.Contains(log.String(), "not in the job's cgroup")
		})
		if strings.Contains(log.String(), "job=outsider") {
			t.Errorf("mpid registered a process outside the job:\n%s", log.String())
		}
	})
	t.Run("without mpid, one warning", func(t *testing.T) {
		out := run(t, true, "MPIPAUSE_MPID_SOCKET=@mpipause-kt-nobody")
		if n := strings.Count(out, "mpipause: no mpid at @mpipause-kt-nobody"); n != 1 {
			t.Errorf("without mpid: %d warning lines, want 1:\n%s", n, out)
		}
	})
	t.Run("without mpid, MPIPAUSE_QUIET=1 silences it", func(t *testing.T) {
		out := run(t, true, "MPIPAUSE_MPID_SOCKET=@mpipause-kt-nobody", "MPIPAUSE_QUIET=1")
		if strings.Contains(out, "mpipause:") {
			t.Errorf("MPIPAUSE_QUIET=1 did not silence the shim:\n%s", out)
		}
	})
}

// TestShimSurvivesMpidLoss: mpid goes away while a rank's gate is closed;
// the rank reopens its gate, says so once, registers with the next mpid on
// the same socket (whose gate word works), and finishes correctly.
func TestShimSurvivesMpidLoss(t *testing.T) {
	bin := binDir(t)
	sock := fmt.Sprintf("@mpipause-kt-loss-%d", os.Getpid())
	srv, err := ranks.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srvCtx, stopSrv := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(srvCtx) }()

	p, hold := shimmedRank(ctx, t, sock, "loss")
	srv2Ctx, stopSrv2 := context.WithCancel(ctx)
	defer stopSrv2()
	var r *ranks.Rank
	// Each stage goes on from where the one before left the rank: after a
	// failed one, the rest would only report its consequences.
	for _, stage := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"the gate closed under mpid", func(t *testing.T) {
			if err := srv.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
				t.Fatal(err)
			}
			r = srv.Ranks(jobid.Key(0, "loss"))[0]
			if g, err := r.Close(ctx); err != nil || g.State != "closed" {
				t.Fatalf("close: %+v %v", g, err)
			}
			if g, err := r.State(ctx); err != nil || g.State != "closed" {
				t.Fatalf("state: %+v %v", g, err)
			}
		}},
		{"mpid gone, the shim reopens its gate", func(t *testing.T) {
			stopSrv() // mpid dies
			<-served
			waitFor(t, "the shim to notice and reopen", 30*time.Second, p.done, func() bool {
				return strings.Contains(p.out.String(), "mpipause: lost mpid while paused; the send gate is open again")
			})
			atHold(t, hold, 1, p)
		}},
		// A new mpid on the same socket: the shim registers again, same pid,
		// and its gate answers the new mpid.
		{"the next mpid on the same socket", func(t *testing.T) {
			srv2, err := ranks.Listen(sock)
			if err != nil {
				t.Fatal(err)
			}
			go srv2.Serve(srv2Ctx)
			if err := srv2.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
				t.Fatalf("the shim did not register with the new mpid: %v", err)
			}
			r2 := srv2.Ranks(jobid.Key(0, "loss"))[0]
			if r2.Pid != r.Pid {
				t.Errorf("registered again as pid %d, was %d", r2.Pid, r.Pid)
			}
			if !r2.HasGatePage() {
				t.Error("no gate page shared with the new mpid")
			}
			if err := r2.CloseGate(ctx); err != nil {
				t.Fatalf("close under the new mpid: %v", err)
			}
			if g, err := r2.State(ctx); err != nil || g.State != "closed" {
				t.Fatalf("state under the new mpid: %+v %v", g, err)
			}
			if err := r2.ReopenGate(ctx); err != nil {
				t.Fatalf("reopen under the new mpid: %v", err)
			}
		}},
		{"the rank finishes, having said so once", func(t *testing.T) {
			release(t, hold)
			p.finish(ctx, t, "the rank after losing mpid", serial(t, filepath.Join(bin, "apps", "xchg.mpich"), 1, "-n", "3", "-s", "1K"))
			if n := strings.Count(p.out.String(), "mpipause:"); n != 1 {
				t.Errorf("%d lines from the shim, want 1:\n%s", n, p.out.String())
			}
		}},
	} {
		if !t.Run(stage.name, stage.run) {
			return
		}
	}
}

// TestSignalsAskMpid: SIGTSTP to a registered rank does not stop it but
// reaches mpid as a pause request; SIGCONT as a resume request; each
// stamped with the moment of the signal.
func TestSignalsAskMpid(t *testing.T) {
	bin := binDir(t)
	sock := fmt.Sprintf("@mpipause-kt-sig-%d", os.Getpid())
	srv, err := ranks.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 4)
	srv.Jobs = rankHooks{event: func(r *ranks.Rank, ev string) { events <- ev }}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	go srv.Serve(ctx)

	p, hold := shimmedRank(ctx, t, sock, "sig")
	atHold(t, hold, 1, p)
	for _, sig := range []struct {
		s    syscall.Signal
		want string
	}{{syscall.SIGTSTP, "pause"}, {syscall.SIGCONT, "resume"}} {
		// The clock is read before the signal goes: the rank's handler
		// may well run before this goroutine runs again.
		var ts unix.Timespec
		unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
		if err := p.cmd.Process.Signal(sig.s); err != nil {
			t.Fatal(err)
		}
		select {
		case ev := <-events:
			// Stamped with the moment the rank's handler ran, on the
			// clock mpid reads: a request a resume has answered since
			// is left alone by it.
			if q, err := ranks.ParseRequest(ev); err != nil || q.Op != sig.want || q.At < ts.Nano() {
				t.Errorf("after %v mpid heard %q, want %q stamped after %d", sig.s, ev, sig.want, ts.Nano())
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("after %v mpid heard nothing", sig.s)
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:])); len(f) == 0 || f[0] == "T" {
			t.Errorf("after %v the rank is stopped (%s): SIGTSTP must not stop a registered rank", sig.s, f[0])
		}
	}
	release(t, hold)
	p.finish(ctx, t, "the signalled rank", serial(t, filepath.Join(bin, "apps", "xchg.mpich"), 1, "-n", "3", "-s", "1K"))
}

// TestFortranRanksRegister: a Fortran MPI program's ranks register too,
// with either library (Open MPI's Fortran init bypasses the C MPI_Init).
func TestFortranRanksRegister(t *testing.T) {
	bin := binDir(t)
	for _, lib := range []string{"openmpi", "mpich"} {
		t.Run(lib, func(t *testing.T) {
			sock := fmt.Sprintf("@mpipause-kt-f-%s-%d", lib, os.Getpid())
			srv, err := ranks.Listen(sock)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var seen []string
			srv.Jobs = rankHooks{changed: func(r *ranks.Rank, gone bool, err error) {
				mu.Lock()
				defer mu.Unlock()
				if r != nil {
					seen = append(seen, fmt.Sprintf("%s rank=%d size=%d gone=%v", r.Job, r.Rank, r.Size, gone))
				}
			}}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			go srv.Serve(ctx)
			cmd := exec.CommandContext(ctx, filepath.Join(bin, "apps", "fhello."+lib))
			cmd.Env = append(os.Environ(), "LD_PRELOAD="+filepath.Join(bin, "libmpipause.so"), "MPIPAUSE_MPID_SOCKET="+sock, "MPIPAUSE_JOBID=f-"+lib, fakeJobKey)
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "fhello ranks=1") {
				t.Fatalf("fhello: %v\n%s", err, out)
			}
			want := []string{"f-" + lib + " rank=0 size=1 gone=false", "f-" + lib + " rank=0 size=1 gone=true"}
			waitFor(t, "registration and departure", 30*time.Second, nil, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return strings.Join(seen, "|") == strings.Join(want, "|")
			})
		})
	}
}

// TestCrashedRankIsNoticed: a rank killed outright is gone from mpid's
// view as soon as the kernel closes its end of the channel.
func TestCrashedRankIsNoticed(t *testing.T) {
	binDir(t)
	sock := fmt.Sprintf("@mpipause-kt-crash-%d", os.Getpid())
	srv, err := ranks.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	go srv.Serve(ctx)
	p, _ := shimmedRank(ctx, t, sock, "crash")
	if err := srv.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 1 }); err != nil {
		t.Fatal(err)
	}
	p.cmd.Process.Kill()
	if err := srv.Wait(ctx, func(all []*ranks.Rank) bool { return len(all) == 0 }); err != nil {
		t.Fatalf("the killed rank is still registered: %v", err)
	}
}

// TestShimMalformedRequests: a peer that is not a well-behaved mpid gets
// "ERROR" for what the shim does not know, and a stream that is not line
// protocol at all ends the channel; the rank runs to the end either way.
func TestShimMalformedRequests(t *testing.T) {
	bin := binDir(t)
	sock := fmt.Sprintf("@mpipause-kt-bad-%d", os.Getpid())
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, hold := shimmedRank(ctx, t, sock, "bad")
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	if l, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(l, "HELLO 2 job=bad ") {
		t.Fatalf("hello: %q %v", l, err)
	}
	for _, req := range []string{"FREEZE", "", "CLOSE now"} {
		fmt.Fprintf(c, "%s\n", req)
		if l, err := br.ReadString('\n'); err != nil || l != "ERROR unknown request\n" {
			t.Errorf("request %q: reply %q %v", req, l, err)
		}
	}
	// Still a working channel: a real request after the bad ones.
	fmt.Fprint(c, "STATE\n")
	if l, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(l, "STATE gate=open ") {
		t.Errorf("STATE after bad requests: %q %v", l, err)
	}
	// 4 KiB without a newline: not the protocol; the shim hangs up.
	c.Write(bytes.Repeat([]byte("x"), 4096))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := br.ReadString('\n'); err == nil {
		t.Error("the shim answered a 4 KiB garbage line")
	}
	atHold(t, hold, 1, p)
	release(t, hold)
	p.finish(ctx, t, "the rank after a bad peer", serial(t, filepath.Join(bin, "apps", "xchg.mpich"), 1, "-n", "3", "-s", "1K"))
}

// newKeyFile makes a cluster key with mpid keygen, as a user would.
func newKeyFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "cluster.key")
	if out, err := exec.Command(filepath.Join(binDir(t), "mpid"), "keygen", path).CombinedOutput(); err != nil {
		t.Fatalf("mpid keygen: %v\n%s", err, out)
	}
	return path
}

// jobKeyEnv is the environment entry that gives a rank the job key of job
// id, for root (the tests' uid), as the mpid with keyFile on this host (its
// node name, the host name) checks it: what `mpipause run` would hand it.
func jobKeyEnv(t *testing.T, keyFile, id string) string {
	t.Helper()
	k, err := quiesce.LoadKeys(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	return mpid.TokenEnv + "=" + mpid.JobToken(k.Current(), 0, id, host)
}

// fakeJobKey is a job key for ranks that register with a rank server of
// the test's own, which checks none.
const fakeJobKey = "MPIPAUSE_JOBKEY=test:00"

// testPeerPort is a peer port for an mpid of the test's own, in the host's
// network namespace, away from the default one.
func testPeerPort() int { return 20000 + os.Getpid()%20000 }

// TestMpidClusterKey: mpid refuses to start without a usable cluster key
// (one line saying what to do, exit 2), and its peer port serves only peers
// that hold the key: a client without it or with another key gets nothing
// done and is logged, without the key.
func TestMpidClusterKey(t *testing.T) {
	bin := binDir(t)
	mpidBin := filepath.Join(bin, "mpid")
	key := newKeyFile(t)
	loose := filepath.Join(t.TempDir(), "loose.key")
	b, _ := os.ReadFile(key)
	os.WriteFile(loose, b, 0o644)
	os.Chmod(loose, 0o644)
	for name, c := range map[string]struct {
		args []string
		say  string
	}{
		"no key file":       {[]string{"--cluster-key", filepath.Join(t.TempDir(), "none")}, "mpid keygen"},
		"loose mode":        {[]string{"--cluster-key", loose}, "chmod 600"},
		"keygen over a key": {[]string{"keygen", key}, "never overwritten"},
	} {
		t.Run("refused: "+name, func(t *testing.T) {
			out, err := exec.Command(mpidBin, c.args...).CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 2 || strings.Count(strings.TrimSpace(string(out)), "\n") != 0 || !strings.Contains(string(out), c.say) {
				t.Errorf("%s: %v, output %q; want exit 2 and one line saying %q", name, err, out, c.say)
			}
			if strings.Contains(string(out), strings.TrimSpace(string(b))) {
				t.Errorf("%s: the key appears in the output", name)
			}
		})
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	port := testPeerPort() + 1
	ready := filepath.Join(t.TempDir(), "ready")
	d := start(ctx, t, "", nil, mpidBin, "--cluster-key", key, "--peer-port", fmt.Sprint(port), "--ready-file", ready,
		"--rank-socket", fmt.Sprintf("@mpipause-kt-key-r-%d", os.Getpid()), "--ctl-socket", fmt.Sprintf("@mpipause-kt-key-c-%d", os.Getpid()),
		"--cgroup-parent", "mpipause-kt-key")
	defer func() {
		d.cmd.Process.Signal(syscall.SIGTERM)
		<-d.done
	}()
	waitFor(t, "mpid's ready file", time.Minute, d.done, func() bool {
		_, err := os.Stat(ready)
		return err == nil
	})
	// mpid is named after the host (no --node): its certificate says so.
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	resolve := func(string) (string, error) { return fmt.Sprintf("127.0.0.1:%d", port), nil }
	req := mpid.ControlRequest("nojob", host, "pause", 0)
	other, _ := quiesce.GenerateKey()
	good, err := quiesce.LoadKeys(key)
	if err != nil {
		t.Fatal(err)
	}
	identity := func(keys *quiesce.Keyring) *quiesce.Identity {
		id, err := quiesce.NewIdentity("test client", keys)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	for name, tr := range map[string]*quiesce.TCPTransport{"no key": {Resolve: resolve},
		"another key": {Resolve: resolve, Identity: identity(quiesce.NewKeyring(other))}} {
		t.Run("peer port, "+name, func(t *testing.T) {
			if _, err := tr.Call(ctx, host, req); err == nil {
				t.Errorf("%s: the peer port answered", name)
			}
		})
	}
	// The holder of the key is answered (about a job that does not exist).
	withKey := &quiesce.TCPTransport{Resolve: resolve, Identity: identity(good)}
	t.Run("peer port, the key", func(t *testing.T) {
		rep, err := withKey.Call(ctx, host, req)
		if code, cerr := mpid.ControlRefusal(rep); err != nil || cerr != nil || code != "unknown-job" {
			t.Errorf("with the key: %+v, %v, %v; want the answer that there is no such job", rep, err, cerr)
		}
	})
	t.Run("refused peers logged, the key not", func(t *testing.T) {
		waitFor(t, "mpid to log the refused peers", 10*time.Second, d.done, func() bool {
			return strings.Contains(d.out.String(), "does not speak TLS") && strings.Contains(d.out.String(), "another cluster key")
		})
		if strings.Contains(d.out.String(), strings.TrimSpace(string(b))) {
			t.Error("the key appears in mpid's log")
		}
	})
}

// rankHooks is ranks.Jobs for a rank server of a test's own: every rank
// admitted, no JOIN taken, and what the test listens to.
type rankHooks struct {
	changed func(r *ranks.Rank, gone bool, err error)
	event   func(r *ranks.Rank, ev string)
}

func (rankHooks) Join(ranks.JoinRequest) error { return errors.New("joining is not supported here") }
func (rankHooks) Admit(*ranks.Rank) error      { return nil }

func (h rankHooks) Changed(r *ranks.Rank, gone bool, err error) {
	if h.changed != nil {
		h.changed(r, gone, err)
	}
}

func (h rankHooks) Event(r *ranks.Rank, ev string) {
	if h.event != nil {
		h.event(r, ev)
	}
}

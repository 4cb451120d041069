package mpid

import (
	"context"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// TestSignalPendingWhileFrozen: what watchContinue and Thawing rest on,
// asked of the kernel: a SIGCONT (and a SIGTSTP) sent to a process frozen
// in its cgroup, which handles them as the shim does, stays pending where
// signalPending reads it until the thaw, and is taken then.
func TestSignalPendingWhileFrozen(t *testing.T) {
	cg := testutil.NewCgroup(t)
	// sh's traps are handlers: the kernel keeps the signals for them.
	cmd := exec.Command("sh", "-c", `trap 'echo cont' CONT; trap 'echo tstp' TSTP; echo ready; while :; do sleep 0.05; done`)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	buf := make([]byte, 6)
	if _, err := out.Read(buf); err != nil || string(buf) != "ready\n" {
		t.Fatalf("the shell did not start: %q %v", buf, err)
	}
	pid := cmd.Process.Pid
	if err := cgroupv2.AddProc(cg, pid); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := cgroupv2.Freeze(ctx, cg); err != nil {
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGCONT, syscall.SIGTSTP} {
		if signalPending(pid, sig) {
			t.Fatalf("%v pending before it was sent", sig)
		}
		if err := syscall.Kill(pid, sig); err != nil {
			t.Fatal(err)
		}
		if !signalPending(pid, sig) {
			t.Errorf("%v sent to the frozen process: not pending", sig)
		}
	}
	if err := cgroupv2.Thaw(ctx, cg); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); signalPending(pid, syscall.SIGCONT) || signalPending(pid, syscall.SIGTSTP); {
		if time.Now().After(deadline) {
			t.Fatal("still pending 10 s after the thaw")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestSignalClockOrdersRequests: mpid's registry with the kernel's signal
// clock (loader.SignalClock), the rank this test's own process: its
// HELLO has the kernel time its signals, a SIGTSTP sent before a SIGCONT
// leaves the request its handler makes after both alone (what a freeze
// that held the handler gives, TestSignalFramedAtFreeze), a SIGTSTP after
// it pauses, and the rank's end stops the clock on it.
func TestSignalClockOrdersRequests(t *testing.T) {
	testutil.RequirePrivileged(t)
	clock, err := loader.OpenSignalClock()
	if err != nil {
		t.Fatalf("signal clock: %v", err)
	}
	defer clock.Close()
	// This process is the rank: it takes its SIGTSTP by ignoring it (the
	// kernel generates it all the same), and SIGCONT does nothing here.
	signal.Ignore(syscall.SIGTSTP)
	defer signal.Reset(syscall.SIGTSTP)
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer mem.Close()
	n := startNode(t, "node0", mem, testKeys(t))
	n.reg.signals = clock
	n.reg.procs = fakeProcs{tstp: func(int) bool { return false }, frame: func(int, uint64) bool { return false }}
	created := n.ask(t, ctl.OpCreate, "j1")
	s := n.rank(t, "j1", created.Token, 0, 1)
	handled, waitState, requests := rankRequestChecks(t, n, s, "j1")
	self := os.Getpid()
	if _, ok := clock.Last(self); !ok {
		t.Fatal("the rank's registration did not start the kernel's clock on it")
	}
	kill := func(sig syscall.Signal) {
		t.Helper()
		if err := syscall.Kill(self, sig); err != nil {
			t.Fatal(err)
		}
	}

	kill(syscall.SIGTSTP)
	kill(syscall.SIGCONT)
	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	if got := requests(); got != 0 {
		t.Fatalf("a SIGTSTP sent before the SIGCONT paused the job (%d requests)", got)
	}
	if st := n.ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State != ctl.StateRunning {
		t.Fatalf("after the late request: %+v", st.Job)
	}
	kill(syscall.SIGTSTP)
	s.send("EVENT pause at=%d\n", monotonic())
	handled()
	waitState(ctl.StatePaused)
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil {
		t.Fatalf("resume: %+v", rep.Err)
	}

	s.conn.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, ok := clock.Last(self); !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the rank is gone and the kernel's clock still watches its process")
		}
	}
}

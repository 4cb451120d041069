package mpid

import (
	"context"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
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

package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
	"golang.org/x/sys/unix"
)

// TestSignalFramedAtFreeze: what mpid's look at a frozen rank's threads
// (ranks.SignalFramed) rests on, asked of the kernel with the real shim.
// A SIGTSTP the kernel delivers to a rank's thread just as the rank's
// cgroup freezes has its handler's frame built and leaves the pending set;
// the thread stops in the freezer with the handler's entry, which the
// rank's HELLO names, as its next instruction. A SIGCONT then taken by
// another thread does not cancel it: after the thaw the rank still asks
// for a pause, stamped after the thaw (on the VMs this paused a job again
// right after Slurm's resume). A SIGCONT taken by the framed thread itself
// runs first and the shim reports the stop as overtaken. The kernel's
// signal clock (loader.SignalClock), which mpid orders a rank's requests
// by, has the SIGTSTP generated before the SIGCONT all the same.
//
// The delivery is made to meet the freeze by ptrace: the thread is held in
// its signal-delivery stop while the cgroup freezes, then let go with the
// signal.
func TestSignalFramedAtFreeze(t *testing.T) {
	for _, c := range []struct {
		name    string
		another bool // the SIGCONT goes to a thread other than the framed one
		want    string
	}{
		{"continued on another thread", true, "pause"},
		{"continued on the framed thread", false, "pause overtaken"},
	} {
		t.Run(c.name, func(t *testing.T) { framedAtFreeze(t, c.another, c.want) })
	}
}

func framedAtFreeze(t *testing.T, another bool, want string) {
	sock := fmt.Sprintf("@mpipause-kt-frame-%d-%v", os.Getpid(), another)
	srv, err := ranks.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan string, 8)
	var hello atomic.Pointer[ranks.Rank]
	srv.Jobs = rankHooks{
		changed: func(r *ranks.Rank, gone bool, _ error) {
			if r != nil && !gone {
				hello.Store(r)
			}
		},
		event: func(_ *ranks.Rank, ev string) { events <- ev },
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	go srv.Serve(ctx)
	// The rank is a grandchild: the child's waiter (start) would take the
	// tracer's stops.
	bin := binDir(t)
	hold := t.TempDir()
	xchg := filepath.Join(bin, "apps", "xchg.mpich")
	p := start(ctx, t, "", []string{"LD_PRELOAD=" + filepath.Join(bin, "libmpipause.so"), "MPIPAUSE_MPID_SOCKET=" + sock, "MPIPAUSE_JOBID=frame", fakeJobKey},
		"sh", "-c", `"$@" & wait $!`, "sh", xchg, "-n", "3", "-s", "1K", "-w", hold)
	atHold(t, hold, 1, p)
	// The shim's thread sends the HELLO after MPI_Init, beside the rank
	// going on to its hold point: either may come first.
	waitFor(t, "the rank's HELLO", 2*time.Minute, p.done, func() bool { return hello.Load() != nil })
	r := hello.Load()
	if r.Tstp == 0 {
		t.Fatalf("the rank's HELLO names no SIGTSTP handler: %+v", r)
	}
	pid := r.Pid
	clock, err := loader.OpenSignalClock()
	if err != nil {
		t.Fatalf("signal clock: %v", err)
	}
	defer clock.Close()
	if err := clock.Watch(pid); err != nil {
		t.Fatal(err)
	}
	cg := testutil.NewCgroup(t)
	if err := cgroupv2.AddProc(cg, pid); err != nil {
		t.Fatal(err)
	}

	// ptrace's requests come from the thread that attached.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.PtraceSeize(pid); err != nil {
		t.Fatalf("PTRACE_SEIZE: %v", err)
	}
	if err := unix.Tgkill(pid, pid, unix.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil || !ws.Stopped() || ws.StopSignal() != unix.SIGTSTP {
		t.Fatalf("the rank's main thread did not stop on its SIGTSTP's delivery: %v %v", ws, err)
	}
	detached := false
	defer func() {
		if !detached {
			unix.PtraceDetach(pid)
		}
	}()
	if err := cgroupv2.Freeze(ctx, cg); err != nil {
		t.Fatal(err)
	}
	if _, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_DETACH, uintptr(pid), 0, uintptr(unix.SIGTSTP), 0, 0); e != 0 {
		t.Fatalf("PTRACE_DETACH with SIGTSTP: %v", e)
	}
	detached = true
	waitFor(t, "the SIGTSTP's frame on the frozen main thread", 30*time.Second, p.done, func() bool {
		return ranks.SignalFramed(pid, r.Tstp)
	})
	if st := procStatus(t, pid); maskHas(st["ShdPnd"], unix.SIGTSTP) || maskHas(st["SigPnd"], unix.SIGTSTP) {
		t.Errorf("the framed SIGTSTP is still pending: the pending set alone would have told")
	}
	if ranks.SignalFramed(pid, r.Tstp+1) {
		t.Errorf("a thread is framed at an entry the HELLO did not name")
	}

	to := pid
	if another {
		to = otherThread(t, pid)
	}
	if err := unix.Tgkill(pid, to, unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	thawed := monotonicNs()
	if err := cgroupv2.Thaw(ctx, cg); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for len(got) < 2 {
		select {
		case ev := <-events:
			q, err := ranks.ParseRequest(ev)
			if err != nil {
				t.Fatalf("the rank sent %q: %v", ev, err)
			}
			k := q.Op
			if q.Overtaken {
				k += " overtaken"
			}
			got[k] = q.At
		case <-time.After(30 * time.Second):
			t.Fatalf("after the thaw the rank sent only %v", got)
		}
	}
	if at, ok := got[want]; !ok || at < thawed {
		t.Errorf("after the thaw the rank sent %v, want %q stamped after the thaw (%d)", got, want, thawed)
	}
	if _, ok := got["resume"]; !ok {
		t.Errorf("after the thaw the rank sent %v, want its resume too", got)
	}
	if ranks.SignalFramed(pid, r.Tstp) {
		t.Errorf("the frame is still there after its handler ran")
	}
	if sig, ok := clock.Last(pid); !ok || sig.Tstp == 0 || sig.Tstp >= sig.Cont || sig.Cont >= thawed {
		t.Errorf("the kernel's times %+v (watched %v): want the SIGTSTP generated before the SIGCONT, both before the thaw (%d)", sig, ok, thawed)
	}
	release(t, hold)
	p.finish(ctx, t, "the framed rank", serial(t, xchg, 1, "-n", "3", "-s", "1K"))
}

// otherThread is a thread of pid other than its main one that takes
// SIGCONT (not blocked there).
func otherThread(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil || tid == pid {
			continue
		}
		if st := procStatus(t, tid); !maskHas(st["SigBlk"], unix.SIGCONT) {
			return tid
		}
	}
	t.Fatalf("the rank has no thread besides its main one that takes SIGCONT")
	return 0
}

// maskHas says whether a proc(5) status signal mask (SigBlk, ShdPnd) has sig.
func maskHas(mask string, sig syscall.Signal) bool {
	m, err := strconv.ParseUint(strings.TrimSpace(mask), 16, 64)
	return err == nil && m&(1<<(sig-1)) != 0
}

func monotonicNs() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

package mpid

import (
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
	"golang.org/x/sys/unix"
)

// TestStrangerWorkNotRealtime: from a thread under SCHED_RR at nice -10
// (as mpid runs), asStranger runs its work on another thread, under
// SCHED_OTHER at nice 0, which ends with the work: no later goroutine runs
// on a lowered thread, and the caller's thread keeps its policy.
func TestStrangerWorkNotRealtime(t *testing.T) {
	testutil.RequirePrivileged(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	self := unix.Gettid()
	was, err := unix.SchedGetAttr(self, 0)
	if err != nil {
		t.Fatal(err)
	}
	rt := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_RR, Priority: 1, Nice: -10}
	if err := unix.SchedSetAttr(self, &rt, 0); err != nil {
		t.Fatalf("SCHED_RR for the test's thread: %v", err)
	}
	defer unix.SchedSetAttr(self, was, 0)

	var tid int
	var in unix.SchedAttr
	var nice int
	asStranger(func() {
		tid = unix.Gettid()
		a, err := unix.SchedGetAttr(0, 0)
		if err != nil {
			t.Error(err)
			return
		}
		in = *a
		p, _ := unix.Getpriority(unix.PRIO_PROCESS, 0)
		nice = 20 - p
	})
	if tid == self {
		t.Fatal("the stranger's work ran on the caller's thread")
	}
	if in.Policy != unix.SCHED_NORMAL || nice != strangerNice {
		t.Errorf("the stranger's work ran under policy %d at nice %d; want SCHED_OTHER (0) at nice %d", in.Policy, nice, strangerNice)
	}
	if a, _ := unix.SchedGetAttr(self, 0); a == nil || a.Policy != unix.SCHED_RR {
		t.Errorf("the caller's thread lost its real-time policy")
	}
	// The lowered thread ends with the goroutine that locked it (the
	// runtime exits it a moment after the goroutine ends), unless it was
	// the process's main thread, which the runtime never ends: it parks
	// it for good instead (runtime.mexit), and no goroutine runs on it
	// again. Which thread runs the work is the scheduler's choice.
	if tid == os.Getpid() {
		return
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the lowered thread %d still runs 10 s after the stranger's work ended", tid)
		}
	}
}

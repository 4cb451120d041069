package loader

import (
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/testutil"
)

func monoNow(tb testing.TB) int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		tb.Fatal(err)
	}
	return ts.Nano()
}

// TestSignalClock: the kernel's times of a watched process's SIGTSTP and
// SIGCONT, on the clock the shim stamps with, whoever sends them and to
// whichever thread; nothing for a process not watched; a second Watch
// keeps what the first has; Forget ends it.
func TestSignalClock(t *testing.T) {
	testutil.RequirePrivileged(t)
	c, err := OpenSignalClock()
	if err != nil {
		t.Fatalf("OpenSignalClock: %v", err)
	}
	defer c.Close()
	child := func() *exec.Cmd {
		cmd := exec.Command("sleep", "600")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	watched, other := child(), child()
	pid := watched.Process.Pid
	if err := c.Watch(pid); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	if got, ok := c.Last(pid); !ok || got != (SignalTimes{}) {
		t.Fatalf("a process just watched: %+v, %v; want zero times", got, ok)
	}
	send := func(p int, sig syscall.Signal) (before, after int64) {
		before = monoNow(t)
		if err := syscall.Kill(p, sig); err != nil {
			t.Fatal(err)
		}
		return before, monoNow(t)
	}
	b, a := send(pid, syscall.SIGTSTP)
	got, _ := c.Last(pid)
	if got.Tstp < b || got.Tstp > a || got.Cont != 0 {
		t.Fatalf("after SIGTSTP sent in [%d, %d]: %+v", b, a, got)
	}
	tstp := got.Tstp
	b, a = send(pid, syscall.SIGCONT)
	got, _ = c.Last(pid)
	if got.Cont < b || got.Cont > a || got.Tstp != tstp {
		t.Fatalf("after SIGCONT sent in [%d, %d]: %+v (SIGTSTP was %d)", b, a, got, tstp)
	}
	send(other.Process.Pid, syscall.SIGTSTP)
	send(other.Process.Pid, syscall.SIGCONT)
	if got, ok := c.Last(other.Process.Pid); ok {
		t.Fatalf("a process not watched has times: %+v", got)
	}
	if err := c.Watch(pid); err != nil {
		t.Fatalf("Watch again: %v", err)
	}
	if again, _ := c.Last(pid); again != got {
		t.Fatalf("a second Watch changed the times: %+v, were %+v", again, got)
	}

	// A SIGTSTP sent to one thread (tgkill) is the process's: this test's
	// own, with SIGTSTP ignored (the kernel still generates it).
	signal.Ignore(syscall.SIGTSTP)
	defer signal.Reset(syscall.SIGTSTP)
	self := os.Getpid()
	if err := c.Watch(self); err != nil {
		t.Fatal(err)
	}
	defer c.Forget(self)
	tids, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	tid := 0
	for _, d := range tids {
		if n, _ := strconv.Atoi(d.Name()); n != self {
			tid = n
			break
		}
	}
	if tid == 0 {
		t.Fatal("the test process has one thread")
	}
	b = monoNow(t)
	if err := unix.Tgkill(self, tid, unix.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	if mine, _ := c.Last(self); mine.Tstp < b {
		t.Fatalf("a SIGTSTP to thread %d of %d is not timed: %+v (sent after %d)", tid, self, mine, b)
	}

	c.Forget(pid)
	if got, ok := c.Last(pid); ok {
		t.Fatalf("a process forgotten has times: %+v", got)
	}
}

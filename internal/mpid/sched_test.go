package mpid

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
	"golang.org/x/sys/unix"
)

// TestMonitorThreadIsSysmon: the thread monitorThread names is the Go
// runtime's monitor, told by what only the monitor does: while a goroutine
// is blocked in a system call it sleeps in nanosleep (runtime.usleep)
// between its looks; the runtime's other threads wait in futex or
// epoll_wait. Of the process's threads, the one found in nanosleep most
// often over a few hundred samples must be the one named.
func TestMonitorThreadIsSysmon(t *testing.T) {
	m, err := monitorThread()
	if err != nil {
		t.Fatal(err)
	}
	if m == 0 || m == os.Getpid() {
		t.Fatalf("monitorThread() = %d (pid %d): want a thread other than the main one", m, os.Getpid())
	}
	stop := make(chan struct{})
	blocked := make(chan struct{})
	go func() {
		defer close(blocked)
		for {
			select {
			case <-stop:
				return
			default:
			}
			unix.Poll(nil, 5) // a blocking system call, as a drain check's read
		}
	}()
	seen := map[int]int{}
	for range 400 {
		tids, err := taskIDs()
		if err != nil {
			t.Fatal(err)
		}
		for _, tid := range tids {
			b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/syscall", tid))
			if err != nil {
				continue // ended meanwhile
			}
			if nr, _, _ := strings.Cut(string(b), " "); nr == strconv.Itoa(unix.SYS_NANOSLEEP) {
				seen[tid]++
			}
		}
		time.Sleep(500 * time.Microsecond)
	}
	close(stop)
	<-blocked
	most := 0
	for tid, n := range seen {
		if n > seen[most] {
			most = tid
		}
	}
	if most != m || seen[m] == 0 {
		t.Errorf("monitorThread() = %d, but the thread found sleeping in nanosleep most often is %d (samples in nanosleep by thread: %v)", m, most, seen)
	}
}

// TestRaiseLeavesMonitorAndStrangers: start puts every thread of the
// process under SCHED_RR at the given niceness but the runtime's monitor,
// which keeps the process's own scheduling; a pass while a thread runs a
// stranger's work (lower) leaves that thread under SCHED_OTHER at
// strangerNice; a thread started at the monitor's scheduling (as the
// threads the monitor starts are) is raised by the next pass.
func TestRaiseLeavesMonitorAndStrangers(t *testing.T) {
	testutil.RequirePrivileged(t)
	// The test's process starts under SCHED_OTHER at nice 0; so must it
	// end, for the package's other tests.
	t.Cleanup(func() {
		tids, _ := taskIDs()
		for _, tid := range tids {
			a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL}
			unix.SchedSetAttr(tid, &a, 0)
			unix.Setpriority(unix.PRIO_PROCESS, tid, 0)
		}
	})
	// A monitor niced before start (mpid started niced) is put at
	// strangerNice all the same.
	if m, err := monitorThread(); err != nil || m == 0 {
		t.Fatalf("no monitor thread: %d, %v", m, err)
	} else if err := unix.Setpriority(unix.PRIO_PROCESS, m, 5); err != nil {
		t.Fatal(err)
	}
	s := &threadSched{lowered: map[int]bool{}}
	rtErr, err := s.start(-10, 1)
	if err != nil || rtErr != nil {
		t.Fatalf("start: %v, %v", err, rtErr)
	}
	check := func(when string, want func(tid int) (policy uint32, nice int)) {
		t.Helper()
		tids, err := taskIDs()
		if err != nil {
			t.Fatal(err)
		}
		for _, tid := range tids {
			a, err := unix.SchedGetAttr(tid, 0)
			if err != nil {
				continue // ended meanwhile
			}
			if p, n := want(tid); a.Policy != p || niceOf(tid) != n {
				t.Errorf("%s: thread %d (monitor %d) has policy %d, nice %d; want policy %d, nice %d", when, tid, s.monitor, a.Policy, niceOf(tid), p, n)
			}
		}
	}
	check("after start", func(tid int) (uint32, int) {
		if tid == s.monitor {
			return unix.SCHED_NORMAL, 0
		}
		return unix.SCHED_RR, -10
	})

	// A stranger's thread, and a thread that looks as the monitor's new
	// ones do, while passes run.
	type thread struct {
		tid  int
		done chan struct{}
	}
	startThread := func(stranger bool) thread {
		got := make(chan int)
		done := make(chan struct{})
		go func() {
			runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
			if stranger {
				defer s.lower()()
			} else {
				a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL}
				if err := unix.SchedSetAttr(0, &a, 0); err != nil {
					t.Error(err)
				}
			}
			got <- unix.Gettid()
			<-done
		}()
		return thread{<-got, done}
	}
	stranger, born := startThread(true), startThread(false)
	for range 20 {
		if err := s.raise(); err != nil {
			t.Fatal(err)
		}
	}
	check("after passes", func(tid int) (uint32, int) {
		if tid == s.monitor || tid == stranger.tid {
			return unix.SCHED_NORMAL, 0
		}
		return unix.SCHED_RR, -10 // born among them
	})
	close(stranger.done)
	close(born.done)
}

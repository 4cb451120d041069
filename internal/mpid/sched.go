package mpid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// mpid's own scheduling (docs/mpid.md, "Priority"; docs/security.md,
// "Scheduling"): every thread under SCHED_RR and at --nice, but for two
// kinds, which run under SCHED_OTHER at strangerNice (nice 0):
//
//   - the Go runtime's monitor thread (sysmon). While mpid works it wakes
//     every 20 µs for as long as a goroutine sits in a system call (a drain
//     check's netlink read, a freeze's wait for cgroup.events), so at a
//     real-time priority it takes a core from the busy ranks every 20 µs
//     through a pause, and a pause waits for those ranks: their shims
//     answer the DRAIN and each of their threads must run once to be
//     frozen. Measured on the rig (MPICH 3 x 2 ping-pong, three mpids on two
//     cores): the monitors alone ran 7 ms of every pause and resume, the
//     freeze step took 4.2-6.1 ms with the monitor real-time and 2.4 ms
//     without. It schedules goroutines, it runs none of mpid's steps.
//   - the threads asStranger lowers for work anyone can cause.
//
// A thread inherits its creator's policy, and the monitor starts threads
// of its own when it hands a blocked system call's processor on: those
// start at the monitor's policy, and raise puts them under mpid's again on
// its next pass (every resweep).
var sched = &threadSched{lowered: map[int]bool{}}

// resweep is how often mpid raises the threads started since its last pass
// (threadSched.keep).
const resweep = 5 * time.Second

type threadSched struct {
	mu       sync.Mutex
	nice, rt int
	monitor  int          // the runtime's monitor thread; 0 until set
	lowered  map[int]bool // threads asStranger runs a stranger's work on
	rtErr    error        // the kernel refused SCHED_RR: nice alone from then on
}

// monitorThread is the Go runtime's monitor thread of this process: the
// first thread the runtime starts after the main one, in runtime.main
// before any package is initialised, so it is the one whose id comes
// first after the process's in the order the kernel hands ids out
// (wrapping at pid_max). Only while the process is young: after the kernel
// has handed out pid_max ids, a new thread may take an id between the two.
// So mpid asks once, at start (start). 0 if the process has no other
// thread.
func monitorThread() (int, error) {
	pidMax := 1 << 22
	if b, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n > 0 {
			pidMax = n
		}
	}
	pid := os.Getpid()
	tids, err := taskIDs()
	if err != nil {
		return 0, err
	}
	first, best := 0, pidMax
	for _, tid := range tids {
		if tid == pid {
			continue
		}
		if off := ((tid-pid)%pidMax + pidMax) % pidMax; off < best {
			first, best = tid, off
		}
	}
	return first, nil
}

func taskIDs() ([]int, error) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, t := range tasks {
		if tid, err := strconv.Atoi(t.Name()); err == nil {
			out = append(out, tid)
		}
	}
	return out, nil
}

// start sets the niceness of every thread of the process but the monitor
// and, if rt is not 0, puts each under SCHED_RR at priority rt. mpid wants
// to run before the ranks it pauses: on a node whose cores are all busy
// polling, every wake-up of mpid otherwise waits for a rank's time slice
// to end, and a pause and a resume take a few per node. The resume suffers
// most: its replies travel while the thawed ranks are already polling
// (measured on the rig with MPICH: resume p50 11.3 ms with nice -10 alone,
// 2.0 ms under SCHED_RR). mpid sleeps but for short steps; the kernel's
// real-time throttling (sched_rt_runtime_us) bounds it if it ever did not.
// A kernel that refuses SCHED_RR (no CAP_SYS_NICE, or a cgroup without
// real-time budget) is reported in rtErr, not fatal.
func (s *threadSched) start(nice, rt int) (rtErr, err error) {
	m, err := monitorThread()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.nice, s.rt, s.monitor = nice, rt, m
	s.mu.Unlock()
	// The monitor is put at strangerNice, not left at what mpid was
	// started with: a niced start would otherwise leave the thread that
	// hands mpid's goroutines a processor waiting behind every rank. As
	// far as the kernel lets it (raising a niceness takes CAP_SYS_NICE).
	if m != 0 {
		a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL, Nice: strangerNice}
		_ = unix.SchedSetAttr(m, &a, 0)
	}
	// Two passes, for threads started during the first from a raised
	// one, which inherit its scheduling.
	for range 2 {
		if err := s.raise(); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rtErr, nil
}

// raise puts every thread but the monitor and the lowered ones under
// mpid's scheduling, as far as the kernel lets it; the first refusal of a
// niceness is its error.
func (s *threadSched) raise() (first error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	tids, err := taskIDs()
	if err != nil {
		return err
	}
	for _, tid := range tids {
		if tid == s.monitor || s.lowered[tid] {
			continue
		}
		if a, err := unix.SchedGetAttr(tid, 0); err == nil && niceOf(tid) == s.nice && (a.Policy == unix.SCHED_RR || s.rt == 0 || s.rtErr != nil) {
			continue // raised already
		}
		if s.nice != 0 {
			if err := unix.Setpriority(unix.PRIO_PROCESS, tid, s.nice); err != nil && !errors.Is(err, unix.ESRCH) && first == nil {
				first = fmt.Errorf("--nice %d: %w", s.nice, err)
			}
		}
		if s.rt != 0 && s.rtErr == nil {
			attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_RR, Priority: uint32(s.rt)}
			if err := unix.SchedSetAttr(tid, &attr, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				s.rtErr = fmt.Errorf("--rt-priority %d: %w", s.rt, err)
			}
		}
	}
	return first
}

// niceOf is thread tid's niceness (sched_getattr reports none for a
// real-time thread), -100 if the kernel does not say.
func niceOf(tid int) int {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return -100
	}
	return 20 - p // the system call's value, not glibc's
}

// keep raises, every resweep until ctx ends, the threads started since
// the last pass. A pass the kernel refuses is logged once: such a thread
// runs mpid's goroutines at the monitor's scheduling, slower on a busy
// node but not wrong, which is no reason to stop mpid.
func (s *threadSched) keep(ctx context.Context, log *slog.Logger) error {
	t := time.NewTicker(resweep)
	defer t.Stop()
	warned := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := s.raise(); err != nil && !warned {
				warned = true
				log.Warn("a thread of mpid's started since its start stays at nice 0 under SCHED_OTHER", "error", err)
			}
		}
	}
}

// lower puts the calling thread, which the caller has locked, under
// SCHED_OTHER at strangerNice and keeps raise off it until the returned
// func is called (when the thread is about to end).
func (s *threadSched) lower() (done func()) {
	tid := unix.Gettid()
	s.mu.Lock()
	s.lowered[tid] = true
	a := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL, Nice: strangerNice}
	_ = unix.SchedSetAttr(0, &a, 0)
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		delete(s.lowered, tid)
		s.mu.Unlock()
	}
}

package kerneltests

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sys/unix"
)

// N4: a rank of the attacker's own job preloads libnamethief.so
// (kernel-tests/apps/namethief.c) beside the shim: it renames the shim's
// control thread and gives its own thread that name; the moment that
// thread is raised it forks a child, which keeps what it inherited. The
// attacker pauses and resumes its own job (the control) three times.
// Refused: no thread of the ranks, nor any child they made, ever had
// real-time policy or a negative niceness (the thief's notes, and every
// thread read after each resume).
func secN4(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	notes, err := os.MkdirTemp(e.dir, "namethief-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(notes, 0o777)
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("n4"),
		"LD_PRELOAD="+filepath.Join(e.dir, "libnamethief.so"), "NAMETHIEF_DIR="+notes)
	note := func(pid int) string { b, _ := os.ReadFile(filepath.Join(notes, strconv.Itoa(pid))); return string(b) }
	// The thief holds the name once the shim's thread has started and been
	// renamed: only then would a daemon picking by name pick the thief's.
	t.Cleanup(func() {
		if t.Failed() {
			for _, pid := range a.ranks {
				env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
				t.Logf("rank pid %d: thief's notes %q; LD_PRELOAD in its environment: %v", pid, note(pid), strings.Contains(string(env), "libnamethief"))
			}
		}
	})
	waitFor(t, "the thief to hold the control thread's name in every rank", time.Minute, nil, func() bool {
		for _, pid := range a.ranks {
			if !strings.Contains(note(pid), "renamed shim") {
				return false
			}
		}
		return true
	})
	var children []int
	t.Cleanup(func() {
		for _, c := range children {
			syscall.Kill(c, syscall.SIGKILL)
		}
	})
	var raised []string
	row.controlOK = true
	for i := 0; i < 3 && len(raised) == 0; i++ {
		ok, why := e.pauseResume(ctx, t, attackerUID, "node0", a)
		row.control = why
		if !ok {
			row.controlOK = false
			break
		}
		for _, pid := range a.ranks {
			for _, l := range strings.Split(note(pid), "\n") {
				if f := strings.Fields(l); len(f) == 4 && f[0] == "raised" {
					c, _ := strconv.Atoi(f[3])
					children = append(children, c)
					raised = append(raised, fmt.Sprintf("rank pid %d's thread saw policy %s, nice %s and forked %d (now %s)", pid, f[1], f[2], c, schedOf(c)))
				}
			}
			for _, tid := range tasksOf(pid) {
				if s := schedOf(tid); s != "normal" {
					raised = append(raised, fmt.Sprintf("rank pid %d thread %d after the resume: %s", pid, tid, s))
				}
			}
		}
	}
	row.refused = len(raised) == 0
	row.outcome = "no thread of the ranks, nor a child, ever real-time or below nice 0 (3 pauses of its own job)"
	if !row.refused {
		row.outcome = "root RAISED a thread the attacker chose: " + strings.Join(raised, "; ")
	}
}

// tasksOf are pid's thread ids.
func tasksOf(pid int) []int {
	var out []int
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, tid)
		}
	}
	return out
}

// schedOf says how tid is scheduled: "normal" for SCHED_OTHER (or
// SCHED_BATCH, SCHED_IDLE) at nice 0 or above, else its policy and nice;
// "gone" once it has exited.
func schedOf(tid int) string {
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return "gone"
	}
	// sched_getattr reports no niceness for a real-time thread;
	// getpriority does (as 20 - nice).
	p, _ := unix.Getpriority(unix.PRIO_PROCESS, tid)
	nice := 20 - p
	if (a.Policy == unix.SCHED_NORMAL || a.Policy == unix.SCHED_BATCH || a.Policy == unix.SCHED_IDLE) && nice >= 0 {
		return "normal"
	}
	return fmt.Sprintf("policy %d, nice %d", a.Policy, nice)
}

// attackHandshakes is N7's stranger: args addr=, secs=, par=. par workers
// open TLS handshakes to addr in a loop for secs seconds (or until stdin
// closes), without a
// certificate, and count those the server took part in (TLS 1.3 lets the
// client finish first) and those it closed before. "handshaking" once the
// first has been tried, "handshook ok=N refused=M ms=T" at the end.
func attackHandshakes(args []string) error {
	m := kv(args)
	secs, _ := strconv.Atoi(m["secs"])
	par, _ := strconv.Atoi(m["par"])
	var ok, refused atomic.Int64
	stop := stopAfter(time.Duration(secs) * time.Second)
	var once sync.Once
	var wg sync.WaitGroup
	start := time.Now()
	for range max(par, 1) {
		wg.Go(func() {
			for !stop() {
				c, err := net.DialTimeout("tcp", m["addr"], 2*time.Second)
				if err != nil {
					refused.Add(1)
					continue
				}
				c.SetDeadline(time.Now().Add(2 * time.Second))
				tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13})
				if tc.Handshake() == nil {
					ok.Add(1)
				} else {
					refused.Add(1)
				}
				c.Close()
				once.Do(func() { say("handshaking") })
			}
		})
	}
	wg.Wait()
	say("handshook ok=%d refused=%d ms=%d", ok.Load(), refused.Load(), time.Since(start).Milliseconds())
	return nil
}

// N7: a stranger on node1 (no cluster key) opens TLS handshakes to
// node0's peer port in a loop, while the victim pauses and resumes its job
// on node0. Judged on node0: the CPU mpid spends under its real-time
// policy during the flood (a stranger's handshakes must not run there),
// the handshakes mpid took part in (bounded by the per-address rate), and
// the victim's pauses (median of three) against the same before the flood.
func secN7(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const secs = 6
	v := e.startUserJob(ctx, t, victimUID, "node0", name("n7v"))
	pauses := func() (time.Duration, string) {
		var took []time.Duration
		for range 3 {
			start := time.Now()
			r := e.userCLI(ctx, t, victimUID, "node0", "pause", v.id)
			d, fr := time.Since(start), v.frozen()
			e.userCLI(ctx, t, victimUID, "node0", "resume", v.id)
			if r.code != 0 || !fr {
				return 0, fmt.Sprintf("exit %d, frozen %v: %s", r.code, fr, oneLineOf(r.stderr))
			}
			took = append(took, d)
		}
		slices.Sort(took)
		return took[1], ""
	}
	idle, bad := pauses()
	row.controlOK = bad == ""
	row.control = fmt.Sprintf("victim's pause p50 of 3 before the flood: %v %s", idle.Round(time.Millisecond), bad)
	if !row.controlOK {
		return
	}
	mpidPid := statusOf(t, jobRig).Nodes[0].MPIDPid
	s := e.attacker(ctx, t, "node1", "handshakes", node0Peer, fmt.Sprintf("secs=%d", secs), "par=4")
	s.wait(t, "handshaking", time.Minute)
	rt0, cpu0, w0 := rtCPU(mpidPid), procCPU(mpidPid), time.Now()
	busy, bad := pauses()
	res := s.wait(t, "handshook", time.Minute)
	wall := time.Since(w0)
	rt := rtCPU(mpidPid) - rt0
	cpu := procCPU(mpidPid) - cpu0
	var ok, refused, ms int
	fmt.Sscanf(res, "handshook ok=%d refused=%d ms=%d", &ok, &refused, &ms)
	// The per-address rate and its burst, with a second to spare.
	bound := int(quiesce.DefaultHandshakeRatePerAddr)*(secs+1) + 2*int(quiesce.DefaultHandshakeRatePerAddr)
	// The flood's own work runs at nice 0, and so does the Go runtime's
	// system monitor thread (sysmon), which polls every 20 µs while the
	// process is busy and so switches in and out tens of thousands of times
	// a second; what stays real-time is the victim's pauses.
	// The victim's pause may wait for a CPU at each of its rounds while
	// the flood keeps the cores busy, not be stalled: three times its
	// idle time and 20 ms. On the rig the stranger's own loop runs on the
	// same cores as node0 (the project's machine has two), beside mpid's
	// refusals, which alone can make the pause 2.6 to 3.0 times slower;
	// a stall (the handshakes run real-time, or unbounded) costs seconds.
	row.refused = bad == "" && rt < wall/2 && ok <= bound && busy <= 3*idle+20*time.Millisecond
	row.outcome = fmt.Sprintf("%d handshakes done, %d refused in %d ms (bound %d); node0's mpid: %v of CPU in %v, %v of it real-time; victim's pause p50 %v (x%.1f of idle) %s",
		ok, refused, ms, bound, cpu.Round(time.Millisecond), wall.Round(time.Millisecond), rt.Round(time.Millisecond),
		busy.Round(time.Millisecond), float64(busy)/float64(idle), bad)
}

// rtCPU is the user and system time so far of pid's threads that run
// under a real-time policy now (field 41 of /proc/PID/task/TID/stat).
// A thread that ended between two reads is not counted in the second, so
// the difference of two reads can only understate what strangers cost if
// real-time threads ended in between (mpid's do not: the runtime keeps
// them).
func rtCPU(pid int) time.Duration {
	var total int
	for _, tid := range tasksOf(pid) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(f) < 39 || f[38] == "0" {
			continue
		}
		u, _ := strconv.Atoi(f[11])
		st, _ := strconv.Atoi(f[12])
		total += u + st
	}
	return time.Duration(total) * time.Second / 100 // USER_HZ
}

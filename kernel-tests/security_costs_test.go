package kerneltests

// The security tier's rows on what a user's own job costs mpid as a
// product: a host list times its registrations (N2), a cgroup tree a user
// owns times the JOINs made from it (N5), a host list times a pause's
// cross-check (N9). Each is judged on the victim and on mpid (the
// victim's status time and pause, mpid's RSS and CPU), its positive
// control the same route working for the attacker's own job.

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
)

// attackCosts is the stand-in's "costs" mode: it makes its own job job=
// (as `mpipause run` does: the job key comes from mpid) and, with mkdirs=N
// dir=D, first makes N cgroups in D (a cgroup it was delegated); then
// joins=K JOINs of its own process, all at once;
// then hellos=K registrations of rank 0 of the job, each on a connection
// of its own, each with the same hosts= of names= host names none of which
// runs mpid. It says "joined OK/K in T", "hellos K closed C" (C: those mpid
// cut off) and holds the connections until stdin closes.
func attackCosts(args []string) error {
	m := kv(args)
	job := m["job"]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	rep, err := ctl.Do(ctx, ctl.Addr(), ctl.Request{Op: ctl.OpCreate, Job: job}, nil)
	cancel()
	if err != nil {
		return fmt.Errorf("create job %s: %w", job, err)
	}
	key := rep.Token
	rankAddr := attackRankAddrs()[0]
	if n, _ := strconv.Atoi(m["mkdirs"]); n > 0 {
		start := time.Now()
		for i := range n {
			if err := os.Mkdir(filepath.Join(m["dir"], fmt.Sprintf("c%d", i)), 0o755); err != nil {
				return err
			}
		}
		say("made %d cgroups in %v", n, time.Since(start).Round(time.Millisecond))
	}
	joins, _ := strconv.Atoi(m["joins"])
	if joins > 0 {
		// All at once, as a user's many processes may: each waits for
		// mpid's lock behind the others.
		start := time.Now()
		var mu sync.Mutex
		var wg sync.WaitGroup
		var ok int
		var last string
		for range joins {
			c, err := net.Dial("unix", rankAddr)
			if err != nil {
				return err
			}
			// The line right after the connect, as a shim writes it:
			// mpid serves a uid's connections past MaxPendingPerUID
			// only if their line is there already.
			fmt.Fprintf(c, "JOIN 2 job=%s pid=%d key=%s\n", job, os.Getpid(), key)
			wg.Go(func() {
				defer c.Close()
				c.SetReadDeadline(time.Now().Add(2 * time.Minute))
				l, _ := bufio.NewReader(c).ReadString('\n')
				mu.Lock()
				defer mu.Unlock()
				if last = l; l == "OK\n" {
					ok++
				}
			})
		}
		wg.Wait()
		say("joined %d/%d in %v (last %q)", ok, joins, time.Since(start).Round(time.Millisecond), strings.TrimSpace(last))
	}
	hellos, _ := strconv.Atoi(m["hellos"])
	if hellos > 0 {
		names, _ := strconv.Atoi(m["names"])
		hs := make([]string, names)
		for i := range hs {
			hs[i] = fmt.Sprintf("n%05d.rack%03d.costs.example.org", i, i%1000)
		}
		hello := fmt.Sprintf("HELLO 2 job=%s rank=0 size=%d pid=%d host=%s key=%s hosts=%s\n", job, hellos, os.Getpid(), m["host"], key, strings.Join(hs, ","))
		var conns []net.Conn
		for range hellos {
			c, err := net.Dial("unix", rankAddr)
			if err != nil {
				return err
			}
			c.SetWriteDeadline(time.Now().Add(time.Minute))
			if _, err := c.Write([]byte(hello)); err != nil {
				say("hello: %v", err)
			}
			conns = append(conns, c)
		}
		time.Sleep(2 * time.Second)
		closed := 0
		for _, c := range conns {
			c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
			if _, err := c.Read(make([]byte, 1)); err != nil && !os.IsTimeout(err) {
				closed++
			}
		}
		say("hellos %d of %d bytes closed %d", hellos, len(hello), closed)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
	}
	say("ready")
	bufio.NewReader(os.Stdin).ReadString('\n')
	return nil
}

// delegate makes a cgroup that uid owns, as systemd delegates one to
// every logged-in user (user@UID.service): the directory and the files
// its owner writes to move processes and enable controllers. It is
// removed with everything below it when the test ends.
func delegate(t *testing.T, uid int) string {
	t.Helper()
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, name("mpipause-sec-delegated"))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"} {
		if err := os.Chown(filepath.Join(dir, f), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { removeTree(t, dir) })
	return dir
}

// removeTree removes the cgroup dir and every cgroup below it, deepest
// first, once the processes in it are gone.
func removeTree(t *testing.T, dir string) {
	var dirs []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		for try := 0; try < 100; try++ {
			err := syscall.Rmdir(dirs[i])
			if err == nil || err == syscall.ENOENT || err != syscall.EBUSY {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if _, err := os.Stat(dir); err == nil {
		t.Logf("cgroup %s left behind", dir)
	}
}

// N5: the attacker makes 20,000 cgroups in a cgroup delegated to it and
// JOINs its own job 40 times at once from there, while the victim asks
// for its job's status.
func secN5(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("n5v"))
	status := func() (time.Duration, int) {
		start := time.Now()
		r := e.userCLI(ctx, t, victimUID, "node0", "status", v.id)
		return time.Since(start), r.code
	}
	before, _ := status()
	dir := delegate(t, attackerUID)
	s := e.attackerIn(ctx, t, dir, "node0", "costs", "job="+name("n5"), "dir="+dir, "mkdirs=20000", "joins=40")
	s.wait(t, "made ", 3*time.Minute)
	// The victim's status, over and over, while the JOINs go on.
	var worst time.Duration
	var asked, failed int
	for {
		took, code := status()
		worst, asked = max(worst, took), asked+1
		if code != 0 {
			failed++
		}
		if strings.Contains(s.out.String(), "joined ") || ctx.Err() != nil {
			break
		}
	}
	joined := s.wait(t, "joined ", 5*time.Minute)
	ok, msg := e.pauseResume(ctx, t, victimUID, "node0", v)
	row.refused = worst < time.Second && failed == 0 && ok
	row.outcome = fmt.Sprintf("victim's status %v before, at worst %v over %d asked during the JOINs (%d failed); victim's pause after: %s",
		before.Round(time.Millisecond), worst.Round(time.Millisecond), asked, failed, msg)
	// Control: the attacker's own job joined from its delegated cgroup.
	row.controlOK = strings.HasPrefix(joined, "joined 40/40 ")
	row.control = "attacker's JOINs from its delegated cgroup of 20,000: " + strings.TrimPrefix(joined, "joined ")
}

// N2: 320 registrations of rank 0 of the attacker's own job, each with the
// same 528 KB host list.
func secN2(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("n2v"))
	mpidPid := statusOf(t, jobRig).Nodes[0].MPIDPid
	rss0 := statusKB(mpidPid, "VmRSS")
	s := e.attacker(ctx, t, "node0", "costs", "job="+name("n2"), "host=node0", "joins=1", "hellos=320", "names=16000")
	sent := s.wait(t, "hellos ", 5*time.Minute)
	peak := statusKB(mpidPid, "VmRSS")
	for range 10 {
		time.Sleep(200 * time.Millisecond)
		peak = max(peak, statusKB(mpidPid, "VmRSS"))
	}
	ok, msg := e.pauseResume(ctx, t, victimUID, "node0", v)
	s.stop()
	grew := (peak - rss0) / 1024
	row.refused = grew < 64 && ok
	row.outcome = fmt.Sprintf("mpid's RSS %d -> %d MiB (+%d) with the registrations held; victim's pause: %s", rss0/1024, peak/1024, grew, msg)
	// Control: mpid registered the attacker's rank 0s (it cut none off).
	f := strings.Fields(sent) // hellos K of B bytes closed C
	row.controlOK = len(f) == 7 && f[6] == "0"
	row.control = "attacker's own rank 0 registered " + strings.TrimPrefix(sent, "hellos ") + " (closed: cut off by mpid)"
}

// N9: the attacker's own job, rank 0 registered 10 times with a list of
// 16,000 hosts that run no mpid, paused 3 times (each refused for those
// hosts).
func secN9(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("n9v"))
	mpidPid := statusOf(t, jobRig).Nodes[0].MPIDPid
	job := name("n9")
	s := e.attacker(ctx, t, "node0", "costs", "job="+job, "host=node0", "joins=1", "hellos=10", "names=16000")
	s.wait(t, "ready", 5*time.Minute)
	cpu0 := procCPU(mpidPid)
	start := time.Now()
	var last cliResult
	refusedAll := true
	for range 3 {
		last = e.userCLI(ctx, t, attackerUID, "node0", "pause", job)
		refusedAll = refusedAll && last.code != 0 && strings.Contains(last.stderr, "rank 0 says it has ranks on")
	}
	cpu, took := procCPU(mpidPid)-cpu0, time.Since(start)
	ok, msg := e.pauseResume(ctx, t, victimUID, "node0", v)
	s.stop()
	row.refused = cpu < time.Second && ok
	row.outcome = fmt.Sprintf("mpid's CPU for 3 refused pauses of the attacker's job: %v (in %v); victim's pause after: %s",
		cpu.Round(time.Millisecond), took.Round(time.Millisecond), msg)
	// Control: the cross-check still refuses the attacker's pause, naming
	// the hosts its rank 0 lists.
	row.controlOK = refusedAll
	row.control = "attacker's pauses refused by the cross-check: " + oneLineOf(last.stderr)
	if len(row.control) > 300 {
		row.control = row.control[:300] + "..."
	}
}

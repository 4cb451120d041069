package kerneltests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
	"github.com/mpipause/mpipause/loader"
)

// rigCgroups is the cgroup under which the rig's mpids make their job
// cgroups (mpipause-rig/<rig>/<node>/<job>).
var rigCgroups = "mpipause-rig/" + jobRig

// cliResult is one run of the mpipause command inside a rig node.
type cliResult struct {
	stdout, stderr string
	code           int
}

// cli runs `mpipause args...` on node (as a user would, inside the node).
func cli(ctx context.Context, t testing.TB, node string, env []string, args ...string) cliResult {
	t.Helper()
	return runInNode(ctx, t, node, env, append([]string{"mpipause"}, args...)...)
}

// runInNode runs argv inside a rig node.
func runInNode(ctx context.Context, t testing.TB, node string, env []string, argv ...string) cliResult {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir(t), "rig"), append([]string{"exec", node, "--"}, argv...)...)
	cmd.Env = append(append(os.Environ(), "MPIPAUSE_RIG="+jobRig), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := cliResult{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		t.Fatalf("%v: %v", argv, err)
	}
	return r
}

// jobJSON runs `mpipause OP --json ID` on node0 and decodes the job.
func jobJSON(ctx context.Context, t testing.TB, op, id string, extra ...string) (ctl.Job, cliResult) {
	t.Helper()
	r := cli(ctx, t, "node0", nil, append(append([]string{op, "--json"}, extra...), id)...)
	var j ctl.Job
	if err := json.Unmarshal([]byte(r.stdout), &j); err != nil {
		t.Fatalf("mpipause %s --json %s (exit %d): not JSON: %v\n%s%s", op, id, r.code, err, r.stdout, r.stderr)
	}
	return j, r
}

// allRegistered reports whether every rank of job id (2 a node) has
// registered with its node's mpid, which a pause needs, and if not what
// each node says. The job's size (Ranks) and its cgroups say less: any
// rank's HELLO gives the size, a rank's JOIN (before MPI_Init) its cgroup.
func allRegistered(ctx context.Context, t testing.TB, id string) (bool, string) {
	t.Helper()
	n, why := 0, ""
	for k := range jobNodes {
		node := fmt.Sprintf("node%d", k)
		r := cli(ctx, t, node, nil, "status", "--json", id)
		var j ctl.Job
		if r.code != 0 || json.Unmarshal([]byte(r.stdout), &j) != nil {
			return false, fmt.Sprintf("%s: exit %d %s", node, r.code, r.stderr)
		}
		n += len(j.LocalRanks)
		why += fmt.Sprintf("%s: ranks %v unpausable %q; ", node, j.LocalRanks, j.Unpausable)
		if j.Unpausable != "" {
			return false, why
		}
	}
	return n == 2*jobNodes, why
}

// runJob launches app on the rig with `mpipause run` on node0, as a user
// would, and waits for it to print its job id.
func runJob(ctx context.Context, t testing.TB, lib mpiLib, id, app string, args ...string) *proc {
	t.Helper()
	return runJobEnv(ctx, t, lib, id, nil, app, args...)
}

// runJobEnv is runJob with env added to the launch's environment.
func runJobEnv(ctx context.Context, t testing.TB, lib mpiLib, id string, env []string, app string, args ...string) *proc {
	t.Helper()
	argv := append([]string{filepath.Join(binDir(t), "rig"), "exec", "node0", "--", "mpipause", "run", "--jobid", id, "--"}, lib.launch(app, args...)...)
	p := start(ctx, t, "", append([]string{"MPIPAUSE_RIG=" + jobRig}, env...), argv...)
	killJobOnCleanup(t, id)
	waitFor(t, "mpipause run to print the job id", time.Minute, p.done, func() bool {
		return strings.HasPrefix(p.out.String(), "job "+id+"\n")
	})
	return p
}

// killJobOnCleanup kills job id's ranks on every node when the test ends,
// before the cleanups registered earlier (which kill the launcher's
// wrapper), so that nothing of a test that stopped early outlives it; a
// finished job has no cgroups left, and this does nothing.
func killJobOnCleanup(t testing.TB, id string) {
	t.Cleanup(func() {
		for _, cg := range nodeJobCgroups(t, id) {
			os.WriteFile(filepath.Join(cg, "cgroup.kill"), []byte("1"), 0)
		}
	})
}

// nodeJobCgroups are the job's cgroups on every rig node: mpid names each
// by the job's key (its owner's uid and id); one not made yet is taken to
// be root's, the tests' own uid.
func nodeJobCgroups(t testing.TB, id string) []string {
	t.Helper()
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for k := 0; k < jobNodes; k++ {
		dir := filepath.Join(root, rigCgroups, fmt.Sprintf("node%d", k))
		cg := filepath.Join(dir, jobid.Key(0, id))
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if _, name, ok := jobid.SplitKey(e.Name()); ok && name == id {
				cg = filepath.Join(dir, e.Name())
			}
		}
		out = append(out, cg)
	}
	return out
}

// cgroupCPU is the CPU time the processes of dirs have used (cpu.stat
// usage_usec, which cgroup v2 keeps without any controller enabled).
func cgroupCPU(t testing.TB, dirs []string) time.Duration {
	t.Helper()
	var us int64
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cpu.stat"))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "usage_usec "); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				us += n
			}
		}
	}
	return time.Duration(us) * time.Microsecond
}

// checkPaused is what must hold at every COMMIT, read independently of mpid:
// every job connection on every node empty (BPF and sock_diag), every
// node's job cgroup frozen.
func checkPaused(ctx context.Context, t testing.TB, what string, j ctl.Job, cgs []string, readers ...loader.Observer) {
	t.Helper()
	if j.State != ctl.StatePaused || j.InflightBytes != 0 || j.Connections == 0 || len(j.Nodes) != jobNodes {
		t.Fatalf("%s: mpipause reports state %q, %d bytes in flight, %d connections checked, nodes %v",
			what, j.State, j.InflightBytes, j.Connections, j.Nodes)
	}
	for _, o := range readers {
		conns, err := o.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !allEmpty(conns) {
			t.Fatalf("%s: committed, but %s finds bytes queued: %v", what, o.Kind(), nonEmpty(conns))
		}
	}
	for _, cg := range cgs {
		if f, err := cgroupv2.Frozen(cg); err != nil || !f {
			t.Fatalf("%s: committed, but %s is not frozen (%v)", what, cg, err)
		}
	}
}

// rigReaders are the test's own kernel readers of every job on the rig's
// nodes, independent of mpid's: a BPF observer (attached before the job
// starts, so its counters see every byte) and sock_diag.
func rigReaders(ctx context.Context, t testing.TB) (obs, check loader.Observer) {
	t.Helper()
	obs = jobObserver(ctx, t, rigCgroups)
	check, err := loader.Open(ctx, loader.Config{Cgroup: rigCgroups, FollowJob: true, Require: loader.KindSockDiag, Unbounded: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { check.Close() })
	return obs, check
}

func retransmits(ctx context.Context, obs loader.Observer) uint64 {
	cs, err := obs.Snapshot(ctx)
	if err != nil {
		return 0
	}
	var s uint64
	for _, c := range cs {
		s += c.Retransmits
	}
	return s
}

// TestPauseResume is the product as a user runs it, on a real 3 x 2 job of
// each library with a heavy all-to-all of MB-sized messages: `mpipause run`
// launches it (every rank joins its job cgroup on its node before opening a
// socket), then `mpipause ID` and `mpipause resume ID` pause and resume it
// many times at random moments. At every COMMIT two kernel readers of the
// test's own (a BPF observer and sock_diag) find every job connection on
// every node empty and every node's job cgroup frozen, and no connection
// retransmits while frozen; the first time, the frozen ranks use no CPU for
// a second. Then Ctrl-Z (SIGTSTP to `mpipause
// run`) and SIGTSTP to a rank (what Slurm's suspend sends) pause it the same
// way (the SIGTSTP to ranks on a node other than rank 0's, whose mpid passes
// it to the coordinator), and a SIGTSTP to ranks while frozen does not pause
// the job again after the resume. The job ends with the output of an
// unpaused run.
func TestPauseResume(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testPauseResume(t, lib) })
	}
}

func testPauseResume(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	obs, check := rigReaders(ctx, t)

	id := fmt.Sprintf("e2e-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	// Until told to stop: a fixed count of iterations ended the job in the
	// middle of the pauses on a quiet machine (pause 44 of 100, MPICH).
	args, stop := []string{"-m", "a2a", "-s", "1M"}, t.TempDir()
	job := runJob(ctx, t, lib, id, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	cgs := nodeJobCgroups(t, id)
	// Whatever happens, the job must not stay frozen past the test.
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitProgress(ctx, t, obs, job.done, 0, 8<<20)
	// The bridge of a busy 2-core machine drops packets anyway: the rate of
	// retransmissions per byte unpaused, for three seconds, is the baseline.
	r0, s0, t0 := retransmits(ctx, obs), sentBytes(ctx, obs), time.Now()
	for time.Since(t0) < 3*time.Second {
		time.Sleep(100 * time.Millisecond)
	}
	baseRetrans, baseSent := retransmits(ctx, obs)-r0, sentBytes(ctx, obs)-s0

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	t.Logf("random moments from seed %d", seed)
	retrans0, sent0 := retransmits(ctx, obs), sentBytes(ctx, obs)
	var pauseMs, resumeMs, drainedMB []float64
	cycles := envCount("MPIPAUSE_PAUSE_CYCLES", 100)
	for made := 0; made < cycles; {
		select {
		case <-job.done:
			t.Fatalf("the job ended after %d of %d pauses; make it longer (MPIPAUSE_E2E_ITERS)\n%s", made, cycles, job.out.String())
		default:
		}
		// A random moment of the exchange: 0 to 200 ms after the last resume.
		time.Sleep(time.Duration(rng.IntN(200)) * time.Millisecond)
		j, r := jobJSON(ctx, t, "pause", id)
		if r.code != 0 {
			t.Fatalf("pause %d: exit %d: %s\n%s", made+1, r.code, r.stderr, r.stdout)
		}
		what := fmt.Sprintf("pause %d", made+1)
		frozenFrom := retransmits(ctx, obs)
		checkPaused(ctx, t, what, j, cgs, obs, check)
		if made == 0 {
			cpu0, t0 := cgroupCPU(t, cgs), time.Now()
			for time.Since(t0) < time.Second {
				time.Sleep(100 * time.Millisecond)
			}
			if used := cgroupCPU(t, cgs) - cpu0; used > 20*time.Millisecond {
				t.Errorf("paused ranks used %v of CPU in %v", used, time.Since(t0))
			}
		}
		// An empty connection has nothing to retransmit: a retransmission
		// while the job is frozen means bytes were in flight at the freeze.
		if n := retransmits(ctx, obs); n > frozenFrom {
			t.Errorf("%s: %d TCP retransmissions while the job was frozen", what, n-frozenFrom)
		}
		pauseMs = append(pauseMs, j.TotalMs)
		drainedMB = append(drainedMB, float64(j.DrainedBytes)/(1<<20))
		j, r = jobJSON(ctx, t, "resume", id)
		if r.code != 0 || j.State != ctl.StateRunning {
			t.Fatalf("resume %d: exit %d, state %q: %s", made+1, r.code, j.State, r.stderr)
		}
		resumeMs = append(resumeMs, j.TotalMs)
		made++
	}
	retrans, sent := retransmits(ctx, obs)-retrans0, sentBytes(ctx, obs)-sent0

	// Ctrl-Z in the terminal of `mpipause run`: SIGTSTP to it.
	wrapper := wrapperPid(t, id)
	before := sentBytes(ctx, obs)
	syscall.Kill(wrapper, syscall.SIGTSTP)
	waitFor(t, "mpipause run to stop itself after pausing the job", time.Minute, job.done, func() bool { return procState(wrapper) == "T" })
	j, _ := jobJSON(ctx, t, "status", id)
	checkPaused(ctx, t, "Ctrl-Z", j, cgs, obs, check)
	syscall.Kill(wrapper, syscall.SIGCONT) // the shell's fg
	waitFor(t, "the job to resume after fg", time.Minute, job.done, func() bool {
		j, _ := jobJSON(ctx, t, "status", id)
		return j.State == ctl.StateRunning
	})
	waitProgress(ctx, t, obs, job.done, before, 4<<20)

	// SIGTSTP to the ranks of one node that is not rank 0's (Slurm's
	// suspend sends it to every rank; this is the harder case): their mpid
	// passes the request to the coordinator.
	procs, err := cgroupv2.Procs(cgs[2])
	if err != nil || len(procs) == 0 {
		t.Fatalf("ranks of node2: %v %v", procs, err)
	}
	for _, p := range procs {
		syscall.Kill(p, syscall.SIGTSTP)
	}
	waitFor(t, "SIGTSTP to the ranks to pause the job", time.Minute, job.done, func() bool {
		j, _ = jobJSON(ctx, t, "status", id)
		return j.State == ctl.StatePaused
	})
	checkPaused(ctx, t, "SIGTSTP to the ranks", j, cgs, obs, check)
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume after SIGTSTP: exit %d %s", r.code, r.stderr)
	}
	// SIGTSTP to the same ranks while the job is paused: frozen, they run
	// their handlers only after the resume, which has answered that
	// Ctrl-Z; the job must not pause again (it did, 43 ms after the resume,
	// before node2's mpid looked at its ranks' pending signals).
	if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
		t.Fatalf("pause before SIGTSTP to frozen ranks: exit %d %s", r.code, r.stderr)
	}
	const stale = "pause request left alone: signalled before the last resume"
	staleLogged := func() int { b, _ := os.ReadFile(mpidLog(2)); return strings.Count(string(b), stale) }
	stale0 := staleLogged()
	for _, p := range procs {
		syscall.Kill(p, syscall.SIGTSTP)
	}
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume after SIGTSTP to frozen ranks: exit %d %s", r.code, r.stderr)
	}
	waitFor(t, "node2's mpid to leave alone the SIGTSTPs its frozen ranks got", time.Minute, job.done, func() bool {
		return staleLogged() >= stale0+len(procs)
	})
	if j, _ := jobJSON(ctx, t, "status", id); j.State != ctl.StateRunning {
		t.Fatalf("SIGTSTP to frozen ranks paused the job again after the resume: %s", j.State)
	}

	job.stopAndCheck(ctx, t, fmt.Sprintf("the job paused %d times", cycles+3), stop, app, 6, args...)
	// Nothing of the job is left on the nodes: mpid forgets an ended job.
	waitFor(t, "the job's cgroups to go", time.Minute, nil, func() bool {
		for _, cg := range cgs {
			if _, err := os.Stat(cg); err == nil {
				return false
			}
		}
		return true
	})
	// The rate of retransmissions per byte against the unpaused baseline is
	// a figure, not an assertion: bursts after a thaw meet a bridge that drops
	// packets with the machine's load (1.3x, 0.6x and 4.8x in three CI runs).
	// What a pause can get wrong is asserted above: none while frozen.
	perGiB := func(r, s uint64) float64 { return float64(r) / (float64(s)/(1<<30) + 1e-9) }
	ratio := perGiB(retrans, sent) / max(perGiB(baseRetrans, baseSent), 1)
	t.Logf("%d pauses at random moments: pause p50 %.1f ms p99 %.1f ms, resume p50 %.1f ms p99 %.1f ms, drained p50 %.2f MiB; retransmissions %.1f per GiB (%.2fx unpaused), none while frozen; every COMMIT verified empty by BPF and sock_diag; output unchanged",
		cycles, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 0.99), bench.Percentile(resumeMs, 0.5), bench.Percentile(resumeMs, 0.99), bench.Percentile(drainedMB, 0.5), perGiB(retrans, sent), ratio)
}

// wrapperPid finds the `mpipause run` process of job id.
func wrapperPid(t testing.TB, id string) int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		a := strings.Split(string(b), "\x00")
		if len(a) > 3 && filepath.Base(a[0]) == "mpipause" && a[1] == "run" && slices.Contains(a, id) {
			return pid
		}
	}
	t.Fatalf("no mpipause run process for job %s", id)
	return 0
}

// procState is the state letter of /proc/PID/stat ("T": stopped).
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// TestPauseBusyRank: a pause while one rank is in a long compute phase (no
// MPI call until the test lets it go on) with its peers' messages unread
// in its receive queue. The rank's shim moves those bytes into its own
// memory (the receive-side drain), so the pause commits in milliseconds
// with every connection empty as the kernel reports it, again and again
// while the rank computes; after the resumes the rank reads the bytes from
// its shim, and the job ends with the output of an unpaused run.
func TestPauseBusyRank(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) {
			sharedRig(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			id := fmt.Sprintf("busy-%s-%d", lib.name, os.Getpid())
			job := startBusyJob(ctx, t, lib, id)
			defer cli(context.Background(), t, "node0", nil, "resume", id)
			obs, check := rigReaders(ctx, t)
			cgs := nodeJobCgroups(t, id)
			cycles := envCount("MPIPAUSE_BUSY_CYCLES", 50)
			var pauseMs []float64
			for c := 1; c <= cycles; c++ {
				j, r := jobJSON(ctx, t, "pause", id, "--timeout", "5s")
				if r.code != 0 {
					t.Fatalf("pause %d of a job with a busy rank: exit %d: %s\n%s", c, r.code, r.stderr, r.stdout)
				}
				checkPaused(ctx, t, fmt.Sprintf("pause %d", c), j, cgs, obs, check)
				pauseMs = append(pauseMs, j.TotalMs)
				if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
					t.Fatalf("resume %d: exit %d, state %q: %s", c, r.code, j.State, r.stderr)
				}
			}
			t.Logf("%s: %d pauses with a busy rank: p50 %.1f ms, max %.1f ms", lib.name, cycles,
				bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1))
			job.end(ctx, t, "the job paused while a rank computed")
		})
	}
}

// TestPauseUndrainedRankRollsBack: the same busy rank, its shim's drain
// turned off (MPIPAUSE_RECV_DRAIN=0, for programs that read their sockets
// other than through the wrapped calls), cannot drain: with --timeout 1s the
// pause fails with exit 1, names the rank that does not read and the
// connections holding bytes, rolls back (no node frozen), and the job
// completes with unchanged output.
func TestPauseUndrainedRankRollsBack(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) {
			sharedRig(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			id := fmt.Sprintf("undrained-%s-%d", lib.name, os.Getpid())
			job := startUndrainedJob(ctx, t, lib, id)
			defer cli(context.Background(), t, "node0", nil, "resume", id)
			j, r := jobJSON(ctx, t, "pause", id, "--timeout", "1s")
			f := j.Failure
			if r.code != 1 || j.State != ctl.StateRunning || f == nil {
				t.Fatalf("pause of a job with an undrained busy rank: exit %d, state %q, failure %+v; want exit 1, running, a failure report\n%s", r.code, j.State, f, r.stdout)
			}
			if f.Phase != "DRAIN" || len(f.Conns) == 0 || !slices.Equal(f.NotReading, []int{5}) || f.Rank != 5 {
				t.Errorf("failure report: phase %s, %d connections, ranks not reading %v, rank %d; want DRAIN, some, [5], 5 (reason: %s)",
					f.Phase, len(f.Conns), f.NotReading, f.Rank, f.Reason)
			}
			for _, c := range f.Conns {
				if c.Node != "node2" || c.Unread == 0 || c.Rank != 5 {
					t.Errorf("connection held: %+v; want node2's rank 5 with unread bytes", c)
				}
			}
			checkFrozen(t, id, false, "after the rollback")
			// Human form of the same: one line on stderr, the report on stdout.
			if lines := strings.Count(strings.TrimSpace(r.stderr), "\n"); lines != 0 {
				t.Errorf("stderr has %d lines, want 1: %q", lines+1, r.stderr)
			}
			job.end(ctx, t, "the job after a rolled-back pause")
		})
	}
}

// TestPauseHeldRankRollsBackAtOnce: the busy job's last rank, with bytes
// unread, is held still by something other than the pause, as Open MPI's
// orted does with a SIGSTOP when Slurm suspends a batch job and Slurm does
// with a freeze of the step: neither the rank nor its shim's drain can
// read, so the pause fails at once (long before its --timeout), naming the
// rank and what holds it, and rolls back; once the rank is let go, a pause
// commits and the job ends with the output of an unpaused run.
func TestPauseHeldRankRollsBackAtOnce(t *testing.T) {
	holds := []struct {
		name, says  string
		hold, leave func(t *testing.T, pid int, cg string)
	}{
		{"SIGSTOP", "stopped by a signal",
			func(t *testing.T, pid int, _ string) { kill(t, pid, syscall.SIGSTOP) },
			func(t *testing.T, pid int, _ string) { kill(t, pid, syscall.SIGCONT) }},
		{"frozen", "frozen by its cgroup",
			func(t *testing.T, _ int, cg string) { writeFreeze(t, cg, "1") },
			func(t *testing.T, _ int, cg string) { writeFreeze(t, cg, "0") }},
	}
	for _, lib := range mpiLibs {
		for _, h := range holds {
			t.Run(lib.name+"/"+h.name, func(t *testing.T) {
				sharedRig(t)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
				defer cancel()
				id := fmt.Sprintf("held-%s-%s-%d", lib.name, h.name, os.Getpid())
				job := startBusyJob(ctx, t, lib, id)
				defer cli(context.Background(), t, "node0", nil, "resume", id)
				cgs := nodeJobCgroups(t, id)
				pid := rankPidOn(t, cgs[2], 5)
				h.hold(t, pid, cgs[2])
				const timeout = 60 * time.Second
				t0 := time.Now()
				j, r := jobJSON(ctx, t, "pause", id, "--timeout", timeout.String())
				took := time.Since(t0)
				h.leave(t, pid, cgs[2])
				f := j.Failure
				if r.code != 1 || j.State != ctl.StateRunning || f == nil {
					t.Fatalf("pause with rank 5 %s: exit %d, state %q, failure %+v; want exit 1, running, a failure report\n%s%s", h.name, r.code, j.State, f, r.stdout, r.stderr)
				}
				if took > timeout/2 || f.Phase != "DRAIN" || f.Rank != 5 || !strings.Contains(f.Reason, h.says) {
					t.Errorf("pause with rank 5 %s failed after %v (--timeout %v) in %s, blaming rank %d: %s; want at once, in DRAIN, rank 5, %q",
						h.name, took.Round(time.Millisecond), timeout, f.Phase, f.Rank, f.Reason, h.says)
				}
				t.Logf("%s: failed after %v: %s", h.name, took.Round(time.Millisecond), f.Reason)
				checkFrozen(t, id, false, "after the rollback")
				obs, check := rigReaders(ctx, t)
				j, r = jobJSON(ctx, t, "pause", id, "--timeout", "10s")
				if r.code != 0 {
					t.Fatalf("pause once rank 5 was let go: exit %d: %s\n%s", r.code, r.stderr, r.stdout)
				}
				checkPaused(ctx, t, "pause once rank 5 was let go", j, cgs, obs, check)
				if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
					t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
				}
				job.end(ctx, t, "the job after a pause that a held rank rolled back")
			})
		}
	}
}

// rankPidOn is the pid of rank in cgroup cg, by the rank variable its MPI
// library's launcher gave it.
func rankPidOn(t *testing.T, cg string, rank int) int {
	t.Helper()
	pids, err := cgroupv2.Procs(cg)
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		if err != nil {
			continue
		}
		for _, kv := range strings.Split(string(env), "\x00") {
			if kv == fmt.Sprintf("OMPI_COMM_WORLD_RANK=%d", rank) || kv == fmt.Sprintf("PMI_RANK=%d", rank) {
				return pid
			}
		}
	}
	t.Fatalf("no rank %d among %v in %s", rank, pids, cg)
	return 0
}

func kill(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(pid, sig); err != nil {
		t.Fatalf("kill %d %v: %v", pid, sig, err)
	}
}

// writeFreeze sets cgroup.freeze of cg as a scheduler would, outside mpid.
func writeFreeze(t *testing.T, cg, v string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(cg, "cgroup.freeze"), []byte(v), 0o644); err != nil {
		t.Fatal(err)
	}
}

// startUndrainedJob is startBusyJob with the shims' receive-side drain off
// (MPIPAUSE_RECV_DRAIN=0): a pause of it waits in DRAIN for as long as the
// last rank computes, which the tests of faults in mid-pause need.
func startUndrainedJob(ctx context.Context, t *testing.T, lib mpiLib, id string) *busyJob {
	t.Helper()
	return startBusyJob(ctx, t, withEnv(lib, "MPIPAUSE_RECV_DRAIN", "0"), id)
}

// withEnv is lib launching its ranks with name=value in their environment.
func withEnv(lib mpiLib, name, value string) mpiLib {
	if lib.name == "mpich" {
		return withArgs(lib, lib.name, "-genv", name, value)
	}
	return withArgs(lib, lib.name, "-x", name+"="+value)
}

// withArgs is lib, named name, with extra launcher options ahead of its own.
func withArgs(lib mpiLib, name string, opts ...string) mpiLib {
	return mpiLib{name: name, launch: func(app string, args ...string) []string {
		argv := lib.launch(app, args...)
		return append(append([]string{argv[0]}, opts...), argv[1:]...)
	}}
}

// TestPauseBadInput: every mistake gets one line on stderr, its own exit
// code and no change of the job's state.
func TestPauseBadInput(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	lib := mpiLibs[0]
	hold := t.TempDir()
	id := fmt.Sprintf("bad-%d", os.Getpid())
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "4", "-s", "64K", "-w", hold}
	job := runJob(ctx, t, lib, id, app, args...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitFor(t, "the ranks at the hold point", 2*time.Minute, job.done, func() bool {
		m, _ := filepath.Glob(filepath.Join(hold, "ready.*"))
		return len(m) == 6
	})
	state := func(t *testing.T) string {
		j, _ := jobJSON(ctx, t, "status", id)
		return j.State
	}
	nobody := asNobody(t)
	for _, c := range []struct {
		name  string
		node  string
		env   []string
		argv  []string
		code  int
		say   string
		after string // the job's state afterwards
	}{
		{name: "unknown job", argv: []string{"pause", "no-such-job"}, code: 3, say: "no job no-such-job on node0", after: ctl.StateRunning},
		{name: "unknown job, short form", argv: []string{"no-such-job"}, code: 3, say: "is not a command", after: ctl.StateRunning},
		{name: "resume of a running job", argv: []string{"resume", id}, code: 5, say: "is running, not paused", after: ctl.StateRunning},
		{name: "pause", argv: []string{"pause", id}, code: 0, after: ctl.StatePaused},
		{name: "second pause", argv: []string{id}, code: 5, say: "already paused", after: ctl.StatePaused},
		{name: "second pause, from another node", node: "node1", argv: []string{"pause", id}, code: 5, say: "already paused", after: ctl.StatePaused},
		{name: "bad job id", argv: []string{"resume", "a/b"}, code: 2, say: "job id \"a/b\"", after: ctl.StatePaused},
		{name: "bad timeout", argv: []string{"pause", "--timeout", "-1s", id}, code: 2, say: "--timeout", after: ctl.StatePaused},
		{name: "no mpid", env: []string{"MPIPAUSE_CTL_SOCKET=@mpipause-kt-nobody"}, argv: []string{"status", id}, code: 6, say: "no mpid at @mpipause-kt-nobody", after: ctl.StatePaused},
		// Another user's job gets the answer of a job that does not exist:
		// not that it exists, not whose it is.
		{name: "another user's job", argv: append(slices.Clone(nobody), "resume", id), code: 3, say: "mpipause resume: no job " + id + " on node0: see `mpipause list`", after: ctl.StatePaused},
		{name: "another user's status", argv: append(slices.Clone(nobody), "status", id), code: 3, say: "mpipause status: no job " + id + " on node0: see `mpipause list`", after: ctl.StatePaused},
		{name: "resume, from another node", node: "node2", argv: []string{"resume", id}, code: 0, after: ctl.StateRunning},
		{name: "pause, from another node", node: "node1", argv: []string{id}, code: 0, after: ctl.StatePaused},
		{name: "another user's job, from another node", node: "node1", argv: append(slices.Clone(nobody), "resume", id), code: 3, say: "mpipause resume: no job " + id + " on node1: see `mpipause list`", after: ctl.StatePaused},
		{name: "resume", argv: []string{"resume", id}, code: 0, after: ctl.StateRunning},
	} {
		// Each case starts from the state the one before left the job in:
		// after a failed one, the rest would only report its consequences.
		if !t.Run(c.name, func(t *testing.T) {
			node := c.node
			if node == "" {
				node = "node0"
			}
			var r cliResult
			if filepath.Base(c.argv[0]) == "setpriv" {
				r = runInNode(ctx, t, node, c.env, c.argv...)
			} else {
				r = cli(ctx, t, node, c.env, c.argv...)
			}
			if r.code != c.code {
				t.Errorf("%s: exit %d, want %d\nstdout: %s\nstderr: %s", c.name, r.code, c.code, r.stdout, r.stderr)
			}
			if c.say != "" && (!strings.Contains(r.stderr, c.say) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0) {
				t.Errorf("%s: stderr %q, want one line saying %q", c.name, r.stderr, c.say)
			}
			if s := state(t); s != c.after {
				t.Errorf("%s: the job is %s afterwards, want %s", c.name, s, c.after)
			}
		}) {
			return
		}
	}
	t.Run("the job finishes as if unpaused", func(t *testing.T) {
		if err := os.WriteFile(filepath.Join(hold, "go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		job.finish(ctx, t, "the job after the bad input", serial(t, app, 6, args...))
	})
}

// asNobody is the command line that runs mpipause as uid 65534: a copy of
// the binary in a directory anyone may enter (the checkout may be private).
func asNobody(t testing.TB) []string {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed to act as another user: %v", err)
	}
	dir, err := os.MkdirTemp("", "mpipause-kt-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	b, err := os.ReadFile(filepath.Join(binDir(t), "mpipause"))
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "mpipause")
	if err := os.WriteFile(exe, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return []string{setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", exe}
}

// TestRankExitsDuringPause: a rank killed while a pause is draining fails
// the pause with its own exit code (9) and the rank named; the others are
// rolled back, not left gated or frozen.
func TestRankExitsDuringPause(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	id := fmt.Sprintf("exit-%d", os.Getpid())
	// The last rank computes for as long as the test runs, its peers' data
	// unread and its shim's drain off: the drain waits.
	job := startUndrainedJob(ctx, t, mpiLibs[0], id)
	cgs := nodeJobCgroups(t, id)
	victims, err := cgroupv2.Procs(cgs[2])
	if err != nil || len(victims) != 2 {
		t.Fatalf("ranks on node2: %v %v", victims, err)
	}
	pause := exec.CommandContext(ctx, filepath.Join(bin, "rig"), "exec", "node0", "--", "mpipause", "pause", "--json", "--timeout", "60s", id)
	pause.Env = append(os.Environ(), "MPIPAUSE_RIG="+jobRig)
	var out, errb bytes.Buffer
	pause.Stdout, pause.Stderr = &out, &errb
	if err := pause.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pause to be draining", time.Minute, nil, func() bool {
		j, _ := jobJSON(ctx, t, "status", id)
		return j.State == ctl.StatePausing
	})
	// One of node2's ranks (4 or 5) dies mid-pause.
	syscall.Kill(victims[0], syscall.SIGKILL)
	err = pause.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 9 {
		t.Fatalf("pause with a rank killed: %v, want exit 9\nstdout: %s\nstderr: %s", err, out.String(), errb.String())
	}
	var j ctl.Job
	if err := json.Unmarshal(out.Bytes(), &j); err != nil || j.Failure == nil {
		t.Fatalf("--json: %v\n%s", err, out.String())
	}
	if j.State == ctl.StatePaused || j.Failure.Rank < 4 || !strings.Contains(j.Failure.Reason, "exited during the pause") {
		t.Errorf("state %s, failure %+v; want not paused, rank 4 or 5 named as exited", j.State, j.Failure)
	}
	for _, cg := range cgs {
		if f, err := cgroupv2.Frozen(cg); err == nil && f {
			t.Errorf("%s is frozen after the failed pause", cg)
		}
	}
	// The job itself then fails (its launcher sees a rank killed), which is
	// the launcher's business; it must end, not hang.
	select {
	case <-job.done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("the job did not end after one of its ranks was killed:\n%s", job.out.String())
	}
}

// TestCtrlZInTerminal: `mpipause run` on a real terminal (a pty made by
// script(1)), Ctrl-Z typed into it. The terminal sends SIGTSTP to its
// foreground process group: `mpipause run` alone, since it puts the
// launcher in a group of its own (Open MPI's mpirun would turn SIGTSTP into
// SIGSTOP of the ranks). The job pauses consistently, the command stops
// itself as a shell expects, the launcher is not stopped; SIGCONT (the
// shell's fg) resumes the job, which ends with the output of an unpaused run.
func TestCtrlZInTerminal(t *testing.T) {
	script, err := exec.LookPath("script")
	if err != nil {
		t.Fatalf("script (util-linux) makes the terminal: %v", err)
	}
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) {
			bin := binDir(t)
			sharedRig(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			obs, check := rigReaders(ctx, t)
			id := fmt.Sprintf("tty-%s-%d", lib.name, os.Getpid())
			app := filepath.Join(bin, "apps", "xchg."+lib.name)
			args := []string{"-m", "a2a", "-n", "400", "-s", "1M"}
			line := "exec " + shellJoin(append([]string{filepath.Join(bin, "rig"), "exec", "node0", "--", "mpipause", "run", "--jobid", id, "--"}, lib.launch(app, args...)...))
			p := &proc{cmd: exec.CommandContext(ctx, script, "-q", "-e", "-c", line, "/dev/null"), done: make(chan struct{})}
			p.cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+jobRig)
			p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
			p.cmd.WaitDelay = 10 * time.Second
			tty, err := p.cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := p.cmd.Start(); err != nil {
				t.Fatal(err)
			}
			go func() { p.err = p.cmd.Wait(); close(p.done) }()
			cgs := nodeJobCgroups(t, id)
			t.Cleanup(func() {
				tty.Close()
				p.cmd.Process.Kill()
				<-p.done
			})
			killJobOnCleanup(t, id) // runs first: cleanups run last-in first-out
			t.Cleanup(func() {
				if t.Failed() {
					// What the terminal showed says whether the pause failed
					// (mpipause run then lets the job run on) or never came.
					t.Logf("the terminal:\n%s", p.out.String())
				}
			})
			waitFor(t, "the job to start", time.Minute, p.done, func() bool { return strings.Contains(p.out.String(), "job "+id) })
			waitProgress(ctx, t, obs, p.done, 0, 8<<20)
			wrapper := wrapperPid(t, id)
			launcher := childOf(wrapper)

			if _, err := tty.Write([]byte{0x1a}); err != nil { // Ctrl-Z
				t.Fatal(err)
			}
			waitFor(t, "mpipause run to stop itself after the pause", time.Minute, p.done, func() bool { return procState(wrapper) == "T" })
			j, _ := jobJSON(ctx, t, "status", id)
			checkPaused(ctx, t, "Ctrl-Z on a terminal", j, cgs, obs, check)
			if launcher == 0 || procState(launcher) == "T" {
				t.Errorf("the launcher (pid %d) is stopped or missing: Ctrl-Z reached it", launcher)
			}
			// The shell's fg: SIGCONT to the stopped job, here script(1) (which
			// stops itself when its child stops) and mpipause run.
			syscall.Kill(p.cmd.Process.Pid, syscall.SIGCONT)
			syscall.Kill(wrapper, syscall.SIGCONT)
			p.finish(ctx, t, "the job paused by Ctrl-Z", serial(t, app, 6, args...))
			if !strings.Contains(p.out.String(), "'fg' resumes it") || !strings.Contains(p.out.String(), "resumed in") {
				t.Errorf("the terminal did not show the pause and the resume:\n%s", p.out.String())
			}
		})
	}
}

// shellJoin quotes args for sh -c.
func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// childOf is a child process of pid (0 if none), from any of its threads.
func childOf(pid int) int {
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, task := range tasks {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		if f := strings.Fields(string(b)); len(f) > 0 {
			c, _ := strconv.Atoi(f[0])
			return c
		}
	}
	return 0
}

// stuckUnread reports a job connection whose unread bytes stay the same
// for 200 ms: data waiting for a rank that does not read.
func stuckUnread(ctx context.Context, t testing.TB, obs loader.Observer) bool {
	t.Helper()
	snap := func() map[uint64]uint32 {
		cs, err := obs.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		m := map[uint64]uint32{}
		for _, c := range cs {
			if c.Unread > 0 {
				m[c.Cookie] = c.Unread
			}
		}
		return m
	}
	before := snap()
	if len(before) == 0 {
		return false
	}
	time.Sleep(200 * time.Millisecond) // the span over which "stuck" is judged
	for k, v := range snap() {
		if before[k] == v {
			return true
		}
	}
	return false
}

// busyJob is a 3x2 xchg job whose last rank computes, calling no MPI, until
// end is called, with its peers' messages waiting unread for it: a pause
// cannot drain it (xchg -B).
type busyJob struct {
	*proc
	app  string
	args []string
	dir  string
}

// startBusyJob launches a busy job and returns once its last rank computes
// and bytes wait, unread, for it.
func startBusyJob(ctx context.Context, t *testing.T, lib mpiLib, id string) *busyJob {
	t.Helper()
	obs, _ := rigReaders(ctx, t)
	b := &busyJob{app: filepath.Join(binDir(t), "apps", "xchg."+lib.name), dir: t.TempDir()}
	b.args = []string{"-m", "a2a", "-n", "40", "-s", "256K", "-B", b.dir}
	b.proc = runJob(ctx, t, lib, id, b.app, b.args...)
	waitFor(t, "the last rank's compute phase", 2*time.Minute, b.done, func() bool {
		return strings.Contains(b.out.String(), "computes until")
	})
	// Its peers' messages must have reached it, unread: a pause before
	// they are sent is a clean cut (the peers' shims hold them) and
	// rightly commits.
	waitFor(t, "bytes waiting, unread, for the busy rank", time.Minute, b.done, func() bool {
		return stuckUnread(ctx, t, obs)
	})
	return b
}

// end lets the busy rank go on and checks that the job finishes with the
// output of an unpaused run.
func (b *busyJob) end(ctx context.Context, t *testing.T, what string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(b.dir, "done"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	b.finish(ctx, t, what, serial(t, b.app, 6, b.args...))
}

// repairRigOnCleanup restarts, when the test ends, the rig's mpids that the
// test killed: the other tests share the rig.
func repairRigOnCleanup(t *testing.T) {
	t.Cleanup(func() {
		if out, err := rigCommand(context.Background(), jobRig, "up", fmt.Sprint(jobNodes)); err != nil {
			t.Errorf("rig up to restart the mpids: %v\n%s", err, out)
		}
	})
}

// checkFrozen fails the test unless every node's cgroup of job id is frozen
// (want) or thawed (!want), as the kernel says.
func checkFrozen(t *testing.T, id string, want bool, when string) {
	t.Helper()
	for _, cg := range nodeJobCgroups(t, id) {
		if fr, err := cgroupv2.Frozen(cg); err != nil || fr != want {
			t.Errorf("%s: %s frozen %v (%v), want %v", when, cg, fr, err, want)
		}
	}
}

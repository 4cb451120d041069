// Package kerneltests holds mpipause's multi-node tier: real Open MPI and
// MPICH jobs on the netns rig (kernel-tests/rig), observed by the real
// kernel observer. `make test-multinode` runs it with MPIPAUSE_BIN set to
// the repository's bin/, where `make build` put rig, mpipause and the apps.
package kerneltests

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
	"github.com/mpipause/mpipause/loader"
)

// jobRig is the rig the MPI tests share ("kt", or MPIPAUSE_TEST_RIG, so that
// two checkouts can run this tier side by side); rig tests of their own use
// other names, so a user's default rig is never touched.
var jobRig = cmp.Or(os.Getenv("MPIPAUSE_TEST_RIG"), "kt")

// jobNodes is the shared rig's size: 3, or MPIPAUSE_RIG_NODES for the
// benchmarks' 4 x 4 jobs (make bench); the tests' jobs use nodes 0 to 2.
var jobNodes = envCount("MPIPAUSE_RIG_NODES", 3)

var (
	jobRigOnce sync.Once
	jobRigErr  error
	jobRigUp   bool
)

// rigDir is the state directory of the rig named name: its mpids' logs
// and ready files.
func rigDir(name string) string { return filepath.Join(rig.DefaultStateRoot, name) }

// nodeHostPath is the host's path of path as node i of the rig named name
// sees it: a node's /run/mpipause (its mpid's sockets and state) is its own
// (rig.NodeRunMount).
func nodeHostPath(t testing.TB, name string, i int, path string) string {
	t.Helper()
	r, err := rig.New(rig.Config{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	return r.NodePath(i, path)
}

func TestMain(m *testing.M) {
	if mode := os.Getenv(attackEnv); mode != "" {
		// The security tier's stand-in attacker (attacker_test.go).
		os.Exit(attackMain(mode, os.Args[1:]))
	}
	if addr := os.Getenv(squatEnv); addr != "" {
		os.Exit(squat(addr)) // the test binary as another user's squatter
	}
	if code, ok := sideServerMain(); ok {
		os.Exit(code) // TestPauseSideIO's server, in a rig node
	}
	// The shared rig's mpids get the failpoint directory of the fault
	// table (faulttable_test.go); without its files it does nothing. Only
	// the test build of mpid has the hook: the rigs run that one.
	os.Setenv(node.FailpointsEnv, failpointRoot)
	if bin := os.Getenv("MPIPAUSE_BIN"); bin != "" {
		os.Setenv(rig.MPIDEnv, filepath.Join(bin, testMPID))
	}
	code := m.Run()
	os.RemoveAll(failpointRoot)
	if jobRigUp {
		if out, err := rigCommand(context.Background(), jobRig, "down"); err != nil {
			fmt.Fprintf(os.Stderr, "rig %s down: %v\n%s", jobRig, err, out)
			code = 1
		}
	}
	os.Exit(code)
}

// testMPID, in binDir, is mpid built with the failpoint hook (make build).
const testMPID = "test/mpid"

// binDir is where `make build` left the binaries the tests run.
func binDir(t testing.TB) string {
	t.Helper()
	testutil.RequirePrivileged(t)
	d := os.Getenv("MPIPAUSE_BIN")
	if d == "" {
		t.Fatal("MPIPAUSE_BIN is not set: run this tier with `make test-multinode` (it builds bin/ and sets it)")
	}
	for _, f := range []string{"rig", "mpipause", testMPID, "apps/xchg.openmpi", "apps/xchg.mpich"} {
		if _, err := os.Stat(filepath.Join(d, f)); err != nil {
			t.Fatalf("%s: %v (run `make build`)", filepath.Join(d, f), err)
		}
	}
	return d
}

// rigCommand runs `rig ARGS...` on the rig called name and returns its
// combined output. Before an up, this process holds the rig for the rest
// of its life (rig.Rig.Hold): another test binary, or a person's rig
// command, on the same rig would restart mpids under this one's jobs.
func rigCommand(ctx context.Context, name string, args ...string) (string, error) {
	if len(args) > 0 && args[0] == "up" {
		r, err := rig.New(rig.Config{Name: name})
		if err == nil {
			err = r.Hold()
		}
		if err != nil {
			return err.Error() + "\n", err
		}
	}
	cmd := exec.CommandContext(ctx, filepath.Join(os.Getenv("MPIPAUSE_BIN"), "rig"), args...)
	cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+name)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// mustRig is rigCommand that fails the test on error.
func mustRig(t testing.TB, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := rigCommand(ctx, name, args...)
	if err != nil {
		t.Fatalf("rig %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// sharedRig brings the MPI tests' rig up once; TestMain takes it down.
func sharedRig(t testing.TB) {
	t.Helper()
	binDir(t)
	jobRigOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var out string
		out, jobRigErr = rigCommand(ctx, jobRig, "up", fmt.Sprint(jobNodes))
		if jobRigErr != nil {
			jobRigErr = fmt.Errorf("%w\n%s", jobRigErr, out)
		}
		jobRigUp = true // down also cleans a half-made rig
	})
	if jobRigErr != nil {
		t.Fatalf("rig up %d: %v", jobNodes, jobRigErr)
	}
}

// waitFor polls cond until it holds, the deadline passes or stop closes: a
// readiness check on state the test can see, never a fixed sleep.
func waitFor(t testing.TB, what string, timeout time.Duration, stop <-chan struct{}, cond func() bool) {
	t.Helper()
	waitForWhy(t, what, timeout, stop, func() (bool, string) { return cond(), "" })
}

// waitForWhy is waitFor whose condition also says why it does not hold
// yet; the last reason goes into the failure.
func waitForWhy(t testing.TB, what string, timeout time.Duration, stop <-chan struct{}, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if why != "" {
			why = ": " + why
		}
		select {
		case <-stop:
			t.Fatalf("gave up waiting for %s: the job ended%s", what, why)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s after %v%s", what, timeout, why)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// proc is a process a test started; done closes when it has exited, with
// err its exit status.
type proc struct {
	cmd  *exec.Cmd
	out  testutil.Buffer
	done chan struct{}
	err  error
}

// start runs argv with env added to the test's environment, inside the
// cgroup v2 directory cg unless it is empty (a launcher started there keeps
// its ranks on every node in it), and waits for it in the background. The
// process is killed when the test ends.
func start(ctx context.Context, t testing.TB, cg string, env []string, argv ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.CommandContext(ctx, argv[0], argv[1:]...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	// Ranks on other nodes inherit the output pipe; if the test ends with
	// them still running, Wait must not wait for them to close it.
	p.cmd.WaitDelay = 10 * time.Second
	if cg != "" {
		fd, err := os.Open(cg)
		if err != nil {
			t.Fatal(err)
		}
		defer fd.Close()
		p.cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// finish waits for p to exit and checks that it succeeded and printed want
// (a checksum line, from the serial computation).
// stopped tells an app that runs until told (xchg or mt -E dir) to stop,
// waits for it to end and returns the iterations it says it ran (iters=),
// failing the test if it does not end or say.
func (p *proc) stopped(ctx context.Context, t testing.TB, dir string) string {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatalf("the job did not stop when told: %v\n%s", ctx.Err(), p.out.String())
	}
	m := itersRE.FindStringSubmatch(p.out.String())
	if m == nil {
		t.Fatalf("the job printed no result (%v):\n%s", p.err, p.out.String())
	}
	return m[1]
}

func (p *proc) finish(ctx context.Context, t testing.TB, what, want string) {
	t.Helper()
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatalf("%s did not finish: %v\n%s", what, ctx.Err(), p.out.String())
	}
	if p.err != nil {
		t.Fatalf("%s failed: %v\n%s", what, p.err, p.out.String())
	}
	if got, w := checksum(p.out.String()), checksum(want); got == "" || got != w {
		t.Fatalf("%s printed %q, the serial computation %q:\n%s", what, got, w, p.out.String())
	}
}

// stopAndCheck tells a job started with `-n <many> -E stop` to stop, and
// checks that it printed what an unpaused run of as many iterations (with
// args and ranks ranks) prints.
func (p *proc) stopAndCheck(ctx context.Context, t testing.TB, what, stop, app string, ranks int, args ...string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(stop, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatalf("%s did not stop: %v\n%s", what, ctx.Err(), p.out.String())
	}
	m := itersRE.FindStringSubmatch(p.out.String())
	if m == nil {
		t.Fatalf("%s printed no result: %v\n%s", what, p.err, p.out.String())
	}
	p.finish(ctx, t, what, serial(t, app, ranks, append(slices.Clone(args), "-n", m[1])...))
}

// serial is what a correct run of app with args prints: its -x computation
// for ranks ranks.
func serial(t testing.TB, app string, ranks int, args ...string) string {
	t.Helper()
	out, err := exec.Command(app, append(args, "-x", strconv.Itoa(ranks))...).Output()
	if err != nil {
		t.Fatalf("%s -x: %v", app, err)
	}
	return string(out)
}

// nodeNetns is the network namespace of node k of the shared rig, held
// until the test ends.
func nodeNetns(t testing.TB, k int) *testutil.Netns {
	t.Helper()
	return testutil.OpenNetns(t, fmt.Sprintf("%s-node%d", jobRig, k))
}

// atHold waits for ranks ranks to reach xchg's hold point in dir.
func atHold(t testing.TB, dir string, ranks int, p *proc) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d ranks at the hold point", ranks), 2*time.Minute, p.done, func() bool {
		m, _ := filepath.Glob(filepath.Join(dir, "ready.*"))
		return len(m) == ranks
	})
}

// release lets the ranks held in dir go on.
func release(t testing.TB, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

// shimmedRank starts a one-rank MPICH xchg with the shim preloaded, talking
// to the rank socket sock under job id job, and holding in a fresh
// directory, which it returns.
func shimmedRank(ctx context.Context, t testing.TB, sock, job string, env ...string) (*proc, string) {
	t.Helper()
	bin := binDir(t)
	hold := t.TempDir()
	env = append([]string{"LD_PRELOAD=" + filepath.Join(bin, "libmpipause.so"), "MPIPAUSE_MPID_SOCKET=" + sock, "MPIPAUSE_JOBID=" + job, fakeJobKey}, env...)
	return start(ctx, t, "", env, filepath.Join(bin, "apps", "xchg.mpich"), "-n", "3", "-s", "1K", "-w", hold), hold
}

// envCount is the positive integer in the environment variable name, or def.
func envCount(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// startJob launches app with args as a 3 x 2 job of lib from node0 of the
// shared rig, inside the job cgroup cg, with env added.
func startJob(ctx context.Context, t testing.TB, lib mpiLib, cg, app string, env []string, args ...string) *proc {
	t.Helper()
	rig := filepath.Join(binDir(t), "rig")
	return start(ctx, t, cg, append([]string{"MPIPAUSE_RIG=" + jobRig}, env...),
		append([]string{rig, "exec", "node0", "--"}, lib.launch(app, args...)...)...)
}

// sentBytes is what the BPF counters say the job's connections have sent.
func sentBytes(ctx context.Context, obs loader.Observer) uint64 {
	cs, err := obs.Snapshot(ctx)
	if err != nil {
		return 0
	}
	var s uint64
	for _, c := range cs {
		s += c.BytesSent
	}
	return s
}

// waitProgress waits until the job has sent more bytes past since: it runs
// again after a pause.
func waitProgress(ctx context.Context, t testing.TB, obs loader.Observer, done <-chan struct{}, since, more uint64) {
	t.Helper()
	waitFor(t, "the job to make progress", time.Minute, done, func() bool { return sentBytes(ctx, obs) > since+more })
}

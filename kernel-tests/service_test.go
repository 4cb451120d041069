package kerneltests

import (
	"bufio"
	"context"
	"fmt"
	"net"
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
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// unitFile is mpid's systemd unit: the tests below take its capability set
// from it, so the unit and what was tested cannot drift apart.
const unitFile = "../dist/systemd/mpid.service"

// unitValues returns the values of key= in the unit's [Service] section,
// one per line that sets it.
func unitValues(t testing.TB, key string) []string {
	t.Helper()
	f, err := os.Open(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(l, "[") {
			section = l
			continue
		}
		if k, v, ok := strings.Cut(l, "="); ok && section == "[Service]" && !strings.HasPrefix(l, "#") && strings.TrimSpace(k) == key {
			out = append(out, strings.TrimSpace(v))
		}
	}
	return out
}

// unitCaps is the unit's CapabilityBoundingSet (systemd joins the lines
// that set it; an empty one resets it).
func unitCaps(t testing.TB) []string {
	t.Helper()
	var caps []string
	for _, v := range unitValues(t, "CapabilityBoundingSet") {
		if v == "" {
			caps = nil
			continue
		}
		if strings.HasPrefix(v, "~") {
			t.Fatalf("%s: CapabilityBoundingSet=%s: the test reads only a list of the capabilities kept", unitFile, v)
		}
		caps = append(caps, strings.Fields(v)...)
	}
	if len(caps) == 0 {
		t.Fatalf("%s sets no CapabilityBoundingSet", unitFile)
	}
	for _, v := range unitValues(t, "AmbientCapabilities") {
		if v != "" {
			t.Fatalf("%s: AmbientCapabilities=%s: mpid runs as root and needs none; the test does not model them", unitFile, v)
		}
	}
	return caps
}

// capWrap is the command line that starts mpid the way systemd would
// under the unit: as root, with nothing inheritable or ambient, the
// bounding set reduced to caps (at exec, root's permitted and effective
// sets become exactly the bounding set), and no_new_privs if the unit asks
// for it. setpriv execs mpid in place.
func capWrap(t testing.TB, caps []string) []string {
	t.Helper()
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux, scripts/deps.sh) starts mpid with the unit's capabilities: %v", err)
	}
	var set []string
	for _, c := range caps {
		set = append(set, "+"+strings.ToLower(strings.TrimPrefix(c, "CAP_")))
	}
	argv := []string{setpriv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all," + strings.Join(set, ",")}
	if slices.Contains(unitValues(t, "NoNewPrivileges"), "yes") {
		argv = append(argv, "--no-new-privs")
	}
	return append(argv, "--")
}

// capMask is caps as a /proc/PID/status bit mask; capability numbers are
// positions in `setpriv --list-caps`, which lists them in order.
func capMask(t testing.TB, caps []string) uint64 {
	t.Helper()
	out, err := exec.Command("setpriv", "--list-caps").Output()
	if err != nil {
		t.Fatalf("setpriv --list-caps: %v", err)
	}
	names := strings.Fields(string(out))
	var m uint64
	for _, c := range caps {
		k := slices.Index(names, strings.ToLower(strings.TrimPrefix(c, "CAP_")))
		if k < 0 {
			t.Fatalf("%s: %s is not a capability this kernel's setpriv knows", unitFile, c)
		}
		m |= 1 << k
	}
	return m
}

// procStatus returns the fields of /proc/PID/status.
func procStatus(t testing.TB, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			out[k] = strings.TrimSpace(v)
		}
	}
	return out
}

// restartRigMPIDs stops the shared rig's mpids (SIGTERM: they exit
// cleanly) and starts new ones with `rig up`, its environment plus env,
// which waits for their ready files. It returns the new mpids' pids by
// node, or `rig up`'s error and output.
func restartRigMPIDs(t *testing.T, env ...string) ([]int, error) {
	t.Helper()
	stopRigMPIDs(t)
	return startRigMPIDs(t, env...)
}

// startRigMPIDs starts, with `rig up`, its environment plus env, an mpid on
// every node of the shared rig that has none running, and waits for their
// ready files. It returns the mpids' pids by node, or `rig up`'s error and
// output.
func startRigMPIDs(t *testing.T, env ...string) ([]int, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(os.Getenv("MPIPAUSE_BIN"), "rig"), "up", fmt.Sprint(jobNodes))
	cmd.Env = append(append(os.Environ(), "MPIPAUSE_RIG="+jobRig), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("rig up: %v: %s", err, out)
	}
	var pids []int
	for _, n := range statusOf(t, jobRig).Nodes {
		if n.MPIDPid <= 0 || !running(n.MPIDPid) {
			t.Fatalf("rig up: no mpid running on %s", n.Name)
		}
		pids = append(pids, n.MPIDPid)
	}
	return pids, nil
}

// stopRigMPIDs stops the shared rig's mpids (only those of the nodes at
// the indices given, if any) and waits until they are gone.
func stopRigMPIDs(t *testing.T, only ...int) []int {
	t.Helper()
	var pids []int
	for i, n := range statusOf(t, jobRig).Nodes {
		if len(only) > 0 && !slices.Contains(only, i) {
			continue
		}
		if n.MPIDPid > 0 && running(n.MPIDPid) {
			syscall.Kill(n.MPIDPid, syscall.SIGTERM)
			pids = append(pids, n.MPIDPid)
		}
	}
	for _, pid := range pids {
		waitFor(t, fmt.Sprintf("mpid %d to exit after SIGTERM", pid), time.Minute, nil, func() bool { return !running(pid) })
	}
	return pids
}

// restoreRigOnCleanup gives the shared rig its ordinary mpids back when the
// test ends, whatever it did to them.
func restoreRigOnCleanup(t *testing.T) {
	t.Cleanup(func() {
		if _, err := restartRigMPIDs(t); err != nil {
			t.Errorf("restoring the rig's mpids: %v", err)
		}
	})
}

// notifySocket is the service manager's end of $NOTIFY_SOCKET: a unix
// datagram socket with SO_PASSCRED, so each message comes with its sender's
// pid, as systemd reads them.
type notifySocket struct {
	path string
	c    *net.UnixConn
}

func listenNotify(t testing.TB) *notifySocket {
	t.Helper()
	// A path, not an abstract name: those are per network namespace, and
	// each mpid lives in its node's.
	dir := t.TempDir()
	p := filepath.Join(dir, "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	raw.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_PASSCRED, 1) })
	if serr != nil {
		t.Fatal(serr)
	}
	return &notifySocket{path: p, c: c}
}

// receive returns the next message and its sender's pid.
func (n *notifySocket) receive(t testing.TB) (int, string) {
	t.Helper()
	n.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, oob := make([]byte, 4096), make([]byte, 1024)
	k, oobn, _, _, err := n.c.ReadMsgUnix(b, oob)
	if err != nil {
		t.Fatalf("no notification on %s: %v", n.path, err)
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) == 0 {
		t.Fatalf("notification without credentials: %v", err)
	}
	cred, err := syscall.ParseUnixCredentials(&msgs[0])
	if err != nil {
		t.Fatal(err)
	}
	return int(cred.Pid), string(b[:k])
}

// expectNotify reads one message from each of pids and checks that it
// holds every line of want.
func (n *notifySocket) expectNotify(t testing.TB, pids []int, want ...string) map[int]string {
	t.Helper()
	got := map[int]string{}
	for range pids {
		pid, msg := n.receive(t)
		if !slices.Contains(pids, pid) {
			t.Fatalf("notification %q from pid %d, not from an mpid (%v)", msg, pid, pids)
		}
		if _, dup := got[pid]; dup {
			t.Fatalf("mpid %d notified twice before the others: %q, then %q", pid, got[pid], msg)
		}
		lines := strings.Split(strings.TrimSuffix(msg, "\n"), "\n")
		for _, w := range want {
			if !slices.Contains(lines, w) {
				t.Errorf("mpid %d notified %q, want a line %q", pid, msg, w)
			}
		}
		got[pid] = msg
	}
	return got
}

// mpidLog is the log file of node i's mpid: its stdout and stderr.
func mpidLog(i int) string {
	return filepath.Join(rigDir(jobRig), fmt.Sprintf("mpid-node%d.log", i))
}

// lastRunLog is what node i's mpid logged since `rig up` last started it.
func lastRunLog(t testing.TB, i int) string {
	t.Helper()
	b, err := os.ReadFile(mpidLog(i))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	if k := strings.LastIndex(s, "--- rig up:"); k >= 0 {
		s = s[k:]
	}
	return s
}

// TestMPIDMinimalCaps: the rig's mpids run with exactly the capabilities
// of dist/systemd/mpid.service (read from it) and no_new_privs, as systemd
// would start them, and the product works: each tells the service manager
// READY=1 (Type=notify) on $NOTIFY_SOCKET, a real Open MPI job launched
// with `mpipause run` is paused (COMMIT, every connection found empty and
// every node frozen by the test's own kernel readers) and resumed, and it
// ends with the output of an unpaused run; so does a job of another user
// (otherUserJob); SCHED_RR worked; node0's mpid, told its stderr is the
// journal's, logs journald-style; on SIGTERM each mpid says STOPPING=1.
func TestMPIDMinimalCaps(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	caps := unitCaps(t)
	want := capMask(t, caps)
	restoreRigOnCleanup(t)
	ns := listenNotify(t)
	// node0's stderr (its log file, which up appends to) passes for the
	// journal's stream, as systemd would say it in $JOURNAL_STREAM; the
	// other nodes' logs do not match it.
	var st syscall.Stat_t
	if err := syscall.Stat(mpidLog(0), &st); err != nil {
		t.Fatal(err)
	}
	journal := fmt.Sprintf("JOURNAL_STREAM=%d:%d", st.Dev, st.Ino)
	var pids []int
	if !t.Run("mpids start with only the unit's capabilities", func(t *testing.T) {
		var err error
		pids, err = restartRigMPIDs(t, "MPIPAUSE_RIG_MPID_WRAP="+strings.Join(capWrap(t, caps), " "), "NOTIFY_SOCKET="+ns.path, journal)
		if err != nil {
			t.Fatalf("mpid with only %v: %v", caps, err)
		}
		for i, pid := range pids {
			st := procStatus(t, pid)
			for _, f := range []string{"CapEff", "CapPrm", "CapBnd"} {
				got, err := strconv.ParseUint(st[f], 16, 64)
				if err != nil || got != want {
					t.Errorf("node%d's mpid (pid %d): %s %s, want %016x (%v)", i, pid, f, st[f], want, caps)
				}
			}
			if st["CapInh"] != "0000000000000000" || st["CapAmb"] != "0000000000000000" {
				t.Errorf("node%d's mpid: CapInh %s CapAmb %s, want none", i, st["CapInh"], st["CapAmb"])
			}
			if slices.Contains(unitValues(t, "NoNewPrivileges"), "yes") && st["NoNewPrivs"] != "1" {
				t.Errorf("node%d's mpid: NoNewPrivs %s, want 1", i, st["NoNewPrivs"])
			}
		}
		// READY=1 comes before the ready file `rig up` waited for.
		ready := ns.expectNotify(t, pids, "READY=1")
		for i, pid := range pids {
			if !strings.Contains(ready[pid], fmt.Sprintf("STATUS=serving node node%d:", i)) || !strings.Contains(ready[pid], fmt.Sprintf("MAINPID=%d\n", pid)) {
				t.Errorf("node%d's mpid notified %q, want its STATUS and MAINPID", i, ready[pid])
			}
		}
	}) {
		return
	}
	obs, check := rigReaders(ctx, t)
	var j ctl.Job
	t.Run("a job paused and resumed", func(t *testing.T) {
		lib := mpiLibs[0]
		id := fmt.Sprintf("caps-%d", os.Getpid())
		app := filepath.Join(bin, "apps", "xchg."+lib.name)
		args := []string{"-m", "a2a", "-n", "300", "-s", "256K"}
		job := runJob(ctx, t, lib, id, app, args...)
		cgs := nodeJobCgroups(t, id)
		defer cli(context.Background(), t, "node0", nil, "resume", id)
		waitProgress(ctx, t, obs, job.done, 0, 4<<20)
		var r cliResult
		j, r = jobJSON(ctx, t, "pause", id)
		if r.code != 0 {
			t.Fatalf("pause with only %v: exit %d: %s\n%s", caps, r.code, r.stderr, job.out.String())
		}
		checkPaused(ctx, t, "the pause with the unit's capabilities", j, cgs, obs, check)
		if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
			t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
		}
		job.finish(ctx, t, "the job paused by mpids with the unit's capabilities", serial(t, app, 6, args...))
	})
	t.Run("another user's job", func(t *testing.T) { otherUserJob(ctx, t, bin, obs, check) })
	t.Run("another user's held rank named at once", func(t *testing.T) { otherUserHeldRank(ctx, t, bin, obs) })
	t.Run("logs journald-style on the journal only, no refusals", func(t *testing.T) {
		for i := range pids {
			// A kernel refusal mpid lives with (SCHED_RR refused: it runs on
			// with --nice alone) shows only in its log.
			l := lastRunLog(t, i)
			// On the journal, each line starts with its priority and has no
			// time (journald adds it); elsewhere, the time comes first.
			// The line that says mpid serves, wherever it is (other lines,
			// such as the metrics endpoint's, may come first).
			serving := "level=INFO msg=serving node=node" + strconv.Itoa(i)
			var line string
			for _, ln := range strings.Split(strings.TrimSpace(l), "\n")[1:] { // after up's mark
				if strings.Contains(ln, serving) {
					line = ln
					break
				}
			}
			if i == 0 && (!strings.HasPrefix(line, "<6>"+serving) || strings.Contains(l, "time=")) {
				t.Errorf("node0's mpid, its stderr the journal's stream: want lines like \"<6>%s ...\" without time=, got:\n%s", serving, l)
			}
			if i != 0 && (!strings.HasPrefix(line, "time=") || strings.Contains(l, "<6>")) {
				t.Errorf("node%d's mpid, its stderr not the journal's: want lines like \"time=... %s ...\", got:\n%s", i, serving, l)
			}
			own := withoutKernelRefusals(t, l)
			for _, bad := range []string{"no real-time scheduling", "permission denied", "operation not permitted", "level=ERROR"} {
				if strings.Contains(own, bad) {
					t.Errorf("node%d's mpid logged %q with the unit's capabilities:\n%s", i, bad, l)
				}
			}
		}
	})
	t.Run("STOPPING=1 on SIGTERM", func(t *testing.T) {
		stopRigMPIDs(t)
		ns.expectNotify(t, pids, "STOPPING=1")
		t.Logf("mpids with only %s (CapEff %016x, no_new_privs): READY=1 and STOPPING=1 received; node0 logged journald-style; %d connections empty at COMMIT; output unchanged",
			strings.Join(caps, " "), want, j.Connections)
	})
}

// otherUserJob runs a job of uid 65534 on node0 under the mpids of the
// unit's capabilities: they move its ranks (another user's processes) into
// the job's cgroup, and pause it (held after its first iteration, every connection up) and
// resume it; it ends with the output of an unpaused run.
func otherUserJob(ctx context.Context, t *testing.T, bin string, readers ...loader.Observer) {
	t.Helper()
	dir, hold := nobodysCopy(t, bin, "hold")
	id := fmt.Sprintf("caps-uid-%d", os.Getpid())
	app := filepath.Join(dir, "xchg.mpich")
	args := []string{"-m", "a2a", "-n", "40", "-s", "256K"}
	argv := []string{filepath.Join(bin, "rig"), "exec", "node0", "--",
		"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
		filepath.Join(dir, "mpipause"), "run", "--jobid", id, "--", "mpiexec.mpich", "-launcher", "fork", "-n", "2", app}
	job := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig}, append(argv, append(args, "-w", hold)...)...)
	killJobOnCleanup(t, id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	atHold(t, hold, 2, job)
	cg := nodeJobCgroups(t, id)[0]
	procs, err := cgroupv2.Procs(cg)
	if err != nil || len(procs) != 2 {
		t.Fatalf("uid 65534's job: %v in its cgroup %s (%v), want its 2 ranks\n%s", procs, cg, err, job.out.String())
	}
	for _, pid := range procs {
		if uid := strings.Fields(procStatus(t, pid)["Uid"]); len(uid) == 0 || uid[0] != "65534" {
			t.Fatalf("rank %d in %s runs as uid %v, want 65534", pid, cg, uid)
		}
	}
	j, r := jobJSON(ctx, t, "pause", id)
	if r.code != 0 || j.State != ctl.StatePaused || j.InflightBytes != 0 || j.Connections == 0 {
		t.Fatalf("pause of uid 65534's job: exit %d, state %q, %d bytes in flight, %d connections: %s", r.code, j.State, j.InflightBytes, j.Connections, r.stderr)
	}
	if f, err := cgroupv2.Frozen(cg); err != nil || !f {
		t.Fatalf("uid 65534's job committed, but %s is not frozen (%v)", cg, err)
	}
	for _, o := range readers {
		conns, err := o.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !allEmpty(conns) {
			t.Fatalf("uid 65534's job committed, but %s finds bytes queued: %v", o.Kind(), nonEmpty(conns))
		}
	}
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume of uid 65534's job: exit %d, state %q: %s", r.code, j.State, r.stderr)
	}
	release(t, hold)
	job.finish(ctx, t, "uid 65534's job", serial(t, app, 2, args...))
	t.Logf("uid 65534's MPICH job: its ranks moved into %s, paused (%d connections empty, frozen) and resumed; output unchanged", cg, j.Connections)
}

// nobodysCopy copies mpipause, the shim and MPICH's xchg into a new
// directory that uid 65534 may use, with a subdirectory sub it may write
// (removed when the test ends): what the user runs must be theirs to read,
// and the checkout may be private. mpipause finds the shim next to itself.
func nobodysCopy(t *testing.T, bin, sub string) (dir, subdir string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "mpipause-kt-uid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, f := range []string{"mpipause", "libmpipause.so", "apps/xchg.mpich"} {
		b, err := os.ReadFile(filepath.Join(bin, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	subdir = filepath.Join(dir, sub)
	if err := os.Mkdir(subdir, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{dir, subdir} {
		if err := os.Chmod(d, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	return dir, subdir
}

// otherUserHeldRank: a job of uid 65534 whose last rank has bytes waiting,
// unread, and is stopped by a signal, under the mpids of the unit's
// capabilities. The pause fails at once naming that rank and what holds it,
// not at its --timeout with "still hold bytes": mpid finds which rank owns
// a connection by copying the ranks' descriptors (pidfd_getfd, with
// CAP_SYS_PTRACE), where /proc/PID/fd, mode 0500 and the user's, is shut
// to a root without CAP_DAC_READ_SEARCH.
func otherUserHeldRank(ctx context.Context, t *testing.T, bin string, obs loader.Observer) {
	t.Helper()
	dir, busy := nobodysCopy(t, bin, "busy")
	id := fmt.Sprintf("caps-held-%d", os.Getpid())
	app := filepath.Join(dir, "xchg.mpich")
	args := []string{"-m", "a2a", "-n", "40", "-s", "256K", "-B", busy}
	argv := []string{filepath.Join(bin, "rig"), "exec", "node0", "--",
		"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
		filepath.Join(dir, "mpipause"), "run", "--jobid", id, "--", "mpiexec.mpich", "-launcher", "fork", "-n", "2", app}
	job := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig}, append(argv, args...)...)
	killJobOnCleanup(t, id)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitFor(t, "the last rank's compute phase", 2*time.Minute, job.done, func() bool {
		return strings.Contains(job.out.String(), "computes until")
	})
	waitFor(t, "bytes waiting, unread, for the busy rank", time.Minute, job.done, func() bool {
		return stuckUnread(ctx, t, obs)
	})
	cg := nodeJobCgroups(t, id)[0]
	pid := rankPidOn(t, cg, 1)
	if uid := strings.Fields(procStatus(t, pid)["Uid"]); len(uid) == 0 || uid[0] != "65534" {
		t.Fatalf("rank 1 (pid %d) runs as uid %v, want 65534", pid, uid)
	}
	kill(t, pid, syscall.SIGSTOP)
	// Every thread of the rank stops only once it is scheduled: on a busy
	// machine its shim's thread could otherwise still answer the pause's
	// DRAIN and drain the bytes the test is about.
	waitFor(t, "every thread of rank 1 stopped", time.Minute, job.done, func() bool {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil || len(tasks) == 0 {
			t.Fatalf("rank 1 (pid %d): its threads: %v", pid, err)
		}
		for _, task := range tasks {
			tid, _ := strconv.Atoi(task.Name())
			if !strings.HasPrefix(procStatus(t, tid)["State"], "T") {
				return false
			}
		}
		return true
	})
	const timeout = 60 * time.Second
	t0 := time.Now()
	j, r := jobJSON(ctx, t, "pause", id, "--timeout", timeout.String())
	took := time.Since(t0)
	kill(t, pid, syscall.SIGCONT)
	f := j.Failure
	if r.code != 1 || j.State != ctl.StateRunning || f == nil {
		t.Fatalf("pause of uid 65534's job with rank 1 stopped: exit %d, state %q, failure %+v; want exit 1, running, a failure report\n%s%s", r.code, j.State, f, r.stdout, r.stderr)
	}
	if took > timeout/2 || f.Phase != "DRAIN" || f.Rank != 1 || !strings.Contains(f.Reason, "stopped by a signal") {
		t.Errorf("pause of uid 65534's job with rank 1 stopped failed after %v (--timeout %v) in %s, blaming rank %d: %s; want at once, in DRAIN, rank 1, \"stopped by a signal\"",
			took.Round(time.Millisecond), timeout, f.Phase, f.Rank, f.Reason)
	}
	if err := os.WriteFile(filepath.Join(busy, "done"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	job.finish(ctx, t, "uid 65534's job after a pause its stopped rank rolled back", serial(t, app, 2, args...))
	t.Logf("uid 65534's job, rank 1 stopped with bytes unread: the pause failed after %v: %s", took.Round(time.Millisecond), f.Reason)
}

// TestMPIDEachCapNeeded takes each capability of the unit away in turn and
// shows what then fails, with which message: none of them is spare.
func TestMPIDEachCapNeeded(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	caps := unitCaps(t)
	restoreRigOnCleanup(t)
	// What fails without each: mpid's start ("start": the kernel
	// observer's check, or the scheduling mpid asks for itself), or, for
	// CAP_SYS_PTRACE, reading which network namespace a rank is in, which
	// is how the observer follows a job's ranks into theirs ("netns").
	want := map[string]struct{ where, msg string }{
		"CAP_BPF":        {"start", "kernel observer: not privileged for BPF: missing CAP_BPF"},
		"CAP_PERFMON":    {"start", "kernel observer: not privileged for BPF: missing CAP_PERFMON"},
		"CAP_NET_ADMIN":  {"start", "kernel observer: not privileged for BPF: missing CAP_NET_ADMIN"},
		"CAP_SYS_ADMIN":  {"start", "kernel observer: not privileged for BPF: missing CAP_SYS_ADMIN"},
		"CAP_SYS_NICE":   {"start", "--nice -10: permission denied"},
		"CAP_SYS_PTRACE": {"netns", "Permission denied"},
	}
	lib := mpiLibs[0]
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	for _, c := range caps {
		w, ok := want[c]
		if !ok {
			t.Errorf("%s lists %s, which this test does not know how to show needed", unitFile, c)
			continue
		}
		t.Run(c, func(t *testing.T) {
			less := slices.DeleteFunc(slices.Clone(caps), func(x string) bool { return x == c })
			_, err := restartRigMPIDs(t, "MPIPAUSE_RIG_MPID_WRAP="+strings.Join(capWrap(t, less), " "))
			if w.where == "start" {
				if err == nil || !strings.Contains(err.Error(), w.msg) {
					t.Fatalf("mpid without %s: rig up: %v; want mpid to refuse to start with %q", c, err, w.msg)
				}
				t.Logf("without %s mpid does not start: %q", c, w.msg)
				return
			}
			if err != nil {
				t.Fatalf("mpid without %s: %v", c, err)
			}
			hold := t.TempDir()
			id := fmt.Sprintf("nocap-%s-%d", strings.ToLower(strings.TrimPrefix(c, "CAP_")), os.Getpid())
			args := []string{"-m", "a2a", "-n", "20", "-s", "64K", "-w", hold}
			job := runJob(ctx, t, lib, id, app, args...)
			atHold(t, hold, 6, job)
			switch w.where {
			case "netns":
				// What the observer does for every process of the job: read
				// its /proc/PID/ns/net (loader's jobNetns), as mpid would,
				// with the reduced set and with the unit's.
				rank := rankPid(t, id)
				probe := func(set []string) (string, error) {
					r := runInNode(ctx, t, "node0", nil, append(capWrap(t, set), "readlink", "-v", fmt.Sprintf("/proc/%d/ns/net", rank))...)
					if r.code != 0 {
						return r.stderr, fmt.Errorf("exit %d", r.code)
					}
					return r.stdout, nil
				}
				if out, err := probe(caps); err != nil {
					t.Fatalf("with the unit's capabilities, reading rank %d's network namespace: %v: %s", rank, err, out)
				}
				if out, err := probe(less); err == nil || !strings.Contains(out, w.msg) {
					t.Errorf("without %s, reading rank %d's network namespace: %v %q; want %q", c, rank, err, out, w.msg)
				}
			}
			release(t, hold)
			job.finish(ctx, t, "the job under mpids without "+c, serial(t, app, 6, args[:len(args)-2]...))
			t.Logf("without %s: %s fails with %q", c, w.where, w.msg)
		})
	}
}

// rankPid is a pid of job id's ranks on node0.
func rankPid(t testing.TB, id string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(nodeJobCgroups(t, id)[0], "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); strings.HasSuffix(exe, "xchg.openmpi") {
				return pid
			}
		}
	}
	t.Fatalf("no rank of job %s on node0: %s", id, b)
	return 0
}

// TestMPIDUnitVerifies: systemd-analyze verify accepts the unit, in a root
// made of this machine's units, the unit and bin/mpid as /usr/sbin/mpid
// (no running systemd needed). It prints, but does not fail on, a setting
// it cannot parse: any output fails the test.
func TestMPIDUnitVerifies(t *testing.T) {
	bin := binDir(t)
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		testutil.RequirePrivileged(t)
		t.Fatalf("systemd-analyze (package systemd, scripts/deps.sh): %v", err)
	}
	root := t.TempDir()
	for _, d := range []string{"usr/sbin", "etc/mpipause", "lib/systemd"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("cp", "-a", "/lib/systemd/system", filepath.Join(root, "lib/systemd/")).CombinedOutput(); err != nil {
		t.Fatalf("copy the machine's units: %v: %s", err, out)
	}
	for src, dst := range map[string]string{filepath.Join(bin, "mpid"): "usr/sbin/mpid", unitFile: "lib/systemd/system/mpid.service"} {
		if out, err := exec.Command("cp", src, filepath.Join(root, dst)).CombinedOutput(); err != nil {
			t.Fatalf("cp %s: %v: %s", src, err, out)
		}
	}
	out, err := exec.Command(sa, "verify", "--man=no", "--root="+root, "mpid.service").CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Fatalf("systemd-analyze verify %s: %v\n%s", unitFile, err, out)
	}
	sec, err := exec.Command(sa, "security", "--offline=true", "--root="+root, "mpid.service").CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, sec)
	}
	lines := strings.Split(strings.TrimSpace(string(sec)), "\n")
	t.Logf("systemd-analyze verify: clean; %s", strings.TrimSpace(lines[len(lines)-1]))
}

// withoutKernelRefusals is mpid's log l without its lines about BPF programs
// that this kernel refuses to root with every capability too (the test's
// own probe): those refusals are the kernel's, not the unit's capabilities'
// (a kernel may refuse a program with EPERM whoever loads it).
func withoutKernelRefusals(t *testing.T, l string) string {
	t.Helper()
	f, err := loader.Probe()
	if err != nil {
		t.Fatalf("probe as root: %v", err)
	}
	var keep []string
	for _, ln := range strings.Split(l, "\n") {
		drop := false
		for _, fb := range f.Fallbacks {
			if strings.Contains(ln, `msg="BPF program refused by this kernel; using its fallback" program=`+fb.Program+" ") {
				drop = true
			}
		}
		if !drop {
			keep = append(keep, ln)
		}
	}
	return strings.Join(keep, "\n")
}

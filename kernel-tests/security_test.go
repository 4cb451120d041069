package kerneltests

// The security tier (`make test-security`, docs/security.md's table): each attack
// a local user could make on mpid, made on the rig by uid 1001 against a
// job of uid 1002, with the real shim and CLI where the attack goes
// through them and the stand-in of attacker_test.go for crafted messages.
// Each row judges the outcome on the victim (its cgroup frozen or not, its
// process's cgroup, mpid's memory, a thread's policy, what root's CLI
// printed), never the attacker's error text, and runs a positive control:
// the same route still works for the attacker's own job. The table at the
// end has one line per row; every row must read "refused".

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"golang.org/x/sys/unix"
)

const (
	attackerUID = 1001
	victimUID   = 1002
)

// secRow is one line of the table.
type secRow struct {
	id, attack string
	// outcome: what happened to the victim; refused: the victim was not
	// affected (the row passes only then).
	outcome string
	refused bool
	// control: the same route for the attacker's own job; controlOK: it
	// worked (else the row proves nothing).
	control   string
	controlOK bool
}

// secEnv is what the rows share: copies of the binaries in a directory
// the two users may read (the checkout may be private).
type secEnv struct {
	dir string
}

func TestSecurity(t *testing.T) {
	bin := binDir(t)
	sharedRig(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	e := &secEnv{dir: publicCopies(t, map[string]string{
		filepath.Join(bin, "mpipause"): "mpipause", filepath.Join(bin, "libmpipause.so"): "libmpipause.so",
		filepath.Join(bin, "apps", "xchg.mpich"): "xchg.mpich", self: "attacker",
		filepath.Join(bin, "apps", "libnamethief.so"): "libnamethief.so",
	})}
	rows := []struct {
		id, attack string
		run        func(context.Context, *testing.T, *secEnv, *secRow)
	}{
		{"C1", "fake rank of the victim's job on node1 (root=node0) sends EVENT pause/resume", secC1},
		{"C2", "job with the victim's id on node1, hosts=node1,node0, paused by the attacker", secC2},
		{"H1", "JOIN pid=<dead child's pid, now a victim's process>", secH1},
		{"H2", "from node1, no key: 20 conns to node0's peer port each announcing 64 MiB and sending 60; 10 silent; 10 plain hellos then silent", secH2},
		{"H3", "one endless line on the rank channel", secH3},
		{"H4", "thread named mpipause-ctl + HELLO; the shim's own thread outside a pause", secH4},
		{"N4", "a rank of the attacker's own job takes the shim control thread's name; that thread forks once raised, during its own pause", secN4},
		{"H5", "node0's /etc/hosts maps node1 to node2's address; root pauses a job on node0..node2", secH5},
		{"M1", "attacker claims job id 4243.0 first", secM1},
		{"M2", "flood: JOINs of new ids, half HELLOs, 20k EVENT lines", secM2},
		{"M3", "attacker binds the rank and control endpoints while mpid is down", secM3},
		{"N7", "from node1, no key: TLS handshakes to node0's peer port in a loop (4 at a time, 6 s) while the victim pauses on node0", secN7},
		{"N3", "20,000 idle connections each to node0's control and rank sockets, held", secN3},
		{"L3", "from node1, no key: 2,000 conns to node0's peer port (plain hello or TLS, then garbage) in about a second", secL3},
		{"L4", "terminal escapes in hosts=; a stranger's status of the victim's job", secL4},
		{"L5", "failpoint hook in the production bin/mpid", secL5},
		{"L7", "a second rig's mpid starts beside the first", secL7},
		{"N2", "320 registrations of its own job's rank 0, each with the same 528 KB hosts=", secN2},
		{"N5", "20,000 cgroups in a cgroup delegated to it; 40 JOINs at once of its own job from there", secN5},
		{"N9", "its own job's rank 0 registered 10 times with 16,000 hosts that run no mpid; 3 pauses of it", secN9},
		{"ALL", "two users flood every endpoint of node0 at once (and a stranger node0's peer port from node1) while a third pauses and resumes its job 20 times", secAll},
	}
	var table []secRow
	for _, r := range rows {
		row := secRow{id: r.id, attack: r.attack, outcome: "not measured (the row's setup failed)", control: "not run"}
		ran := false // not when -run leaves the row out
		t.Run(r.id, func(t *testing.T) {
			ran = true
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			r.run(ctx, t, e, &row)
			if !row.refused {
				t.Errorf("%s: the attack succeeded: %s", r.id, row.outcome)
			}
			if !row.controlOK {
				t.Errorf("%s: positive control failed: %s", r.id, row.control)
			}
		})
		if ran {
			table = append(table, row)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "security | %-3s | %-5s | %-7s | %s\n", "row", "", "control", "attack -> outcome")
	for _, r := range table {
		verdict, ctl := "FAIL", "FAIL"
		if r.refused {
			verdict = "ok"
		}
		if r.controlOK {
			ctl = "ok"
		}
		fmt.Fprintf(&b, "security | %-3s | %-5s | %-7s | %s -> %s (control: %s)\n", r.id, verdict, ctl, r.attack, r.outcome, r.control)
	}
	t.Logf("attack x outcome (ok: refused, victim unaffected)\n%s", b.String())
}

// asUser runs what follows as uid, with no supplementary groups.
func asUser(uid int) []string {
	return []string{"setpriv", fmt.Sprintf("--reuid=%d", uid), fmt.Sprintf("--regid=%d", uid), "--clear-groups", "--"}
}

// userCLI runs the mpipause CLI as uid on node.
func (e *secEnv) userCLI(ctx context.Context, t *testing.T, uid int, node string, args ...string) cliResult {
	t.Helper()
	return runInNode(ctx, t, node, nil, append(asUser(uid), append([]string{filepath.Join(e.dir, "mpipause")}, args...)...)...)
}

// userJob is a 2-rank MPICH job of one user on one node, launched with
// `mpipause run` (the shim, its JOIN and HELLO, as the user), held after
// its first iteration.
type userJob struct {
	id    string
	p     *proc
	ranks []int
}

// startUserJob starts it; env (K=V) is set for `mpipause run` and so for
// the launcher and the ranks.
func (e *secEnv) startUserJob(ctx context.Context, t *testing.T, uid int, node, id string, env ...string) *userJob {
	t.Helper()
	hold := filepath.Join(e.dir, fmt.Sprintf("hold-%d-%s", uid, id))
	if err := os.Mkdir(hold, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(hold, 0o777)
	argv := append([]string{filepath.Join(binDir(t), "rig"), "exec", node, "--"}, asUser(uid)...)
	if len(env) > 0 {
		argv = append(append(argv, "env"), env...)
	}
	argv = append(argv, filepath.Join(e.dir, "mpipause"), "run", "--jobid", id, "--",
		"mpiexec.mpich", "-launcher", "fork", "-n", "2", filepath.Join(e.dir, "xchg.mpich"), "-m", "a2a", "-n", "1000", "-s", "1K", "-w", hold)
	j := &userJob{id: id, p: start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig}, argv...)}
	atHold(t, hold, 2, j.p)
	j.ranks = ranksHolding(hold)
	if len(j.ranks) != 2 {
		t.Fatalf("job %s of uid %d: ranks %v, want 2\n%s", id, uid, j.ranks, j.p.out.String())
	}
	t.Cleanup(func() {
		for _, pid := range j.ranks {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return j
}

// ranksHolding are the xchg processes holding in dir.
func ranksHolding(dir string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if strings.HasSuffix(exe, "xchg.mpich") && bytes.Contains(cmd, []byte(dir+"\x00")) {
			out = append(out, pid)
		}
	}
	return out
}

// cgroupOf is pid's cgroup v2 directory, "" if it has none (gone).
func cgroupOf(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return ""
	}
	root, _ := cgroupv2.Root()
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return filepath.Join(root, p)
		}
	}
	return ""
}

// frozen: the kernel says the job's ranks' cgroup is frozen.
func (j *userJob) frozen() bool {
	f, _ := cgroupv2.Frozen(cgroupOf(j.ranks[0]))
	return f
}

// within polls cond until it holds (true) or d has passed (false): for
// the rows that watch for something that must not happen, d is how long
// the same route took to act on the attacker's own job, with a margin.
func within(d time.Duration, cond func() bool) bool {
	end := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pauseResume pauses and resumes the job as uid from node with the CLI:
// the attacker's own job, the positive control of most rows.
func (e *secEnv) pauseResume(ctx context.Context, t *testing.T, uid int, node string, j *userJob) (bool, string) {
	t.Helper()
	r := e.userCLI(ctx, t, uid, node, "pause", j.id)
	fr := j.frozen()
	e.userCLI(ctx, t, uid, node, "resume", j.id)
	if r.code != 0 || !fr {
		return false, fmt.Sprintf("uid %d's pause of its own job exited %d, frozen %v: %s", uid, r.code, fr, oneLineOf(r.stderr))
	}
	return true, fmt.Sprintf("uid %d paused (frozen) and resumed its own job with the CLI", uid)
}

func oneLineOf(s string) string { return strings.Join(strings.Fields(s), " ") }

// standIn is a running stand-in attacker.
type standIn struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   testutil.Buffer
	done  chan struct{}
	mode  string
	extra []string
}

// attacker runs the stand-in in mode as uid 1001 on node.
func (e *secEnv) attacker(ctx context.Context, t *testing.T, node, mode string, args ...string) *standIn {
	t.Helper()
	return e.attackerAs(ctx, t, attackerUID, node, mode, args...)
}

// attackerAs runs the stand-in in mode as uid on node.
func (e *secEnv) attackerAs(ctx context.Context, t *testing.T, uid int, node, mode string, args ...string) *standIn {
	t.Helper()
	return e.standIn(ctx, t, uid, "", node, mode, args...)
}

// attackerIn is attacker with the stand-in started in the cgroup cg.
func (e *secEnv) attackerIn(ctx context.Context, t *testing.T, cg, node, mode string, args ...string) *standIn {
	t.Helper()
	return e.standIn(ctx, t, attackerUID, cg, node, mode, args...)
}

// standIn runs the stand-in in mode as uid on node, in the cgroup cg if
// it is not "".
func (e *secEnv) standIn(ctx context.Context, t *testing.T, uid int, cg, node, mode string, args ...string) *standIn {
	t.Helper()
	argv := append([]string{"exec", node, "--"}, asUser(uid)...)
	argv = append(argv, append([]string{filepath.Join(e.dir, "attacker")}, args...)...)
	s := &standIn{cmd: exec.CommandContext(ctx, filepath.Join(binDir(t), "rig"), argv...), done: make(chan struct{}), mode: mode}
	s.cmd.Env = append(os.Environ(), "MPIPAUSE_RIG="+jobRig, attackEnv+"="+mode)
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	if cg != "" {
		fd, err := os.Open(cg)
		if err != nil {
			t.Fatal(err)
		}
		defer fd.Close()
		s.cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	}
	in, err := s.cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	s.in = in
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() {
		s.in.Close()
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
			s.cmd.Process.Kill()
			<-s.done
		}
		if t.Failed() {
			t.Logf("stand-in %s said:\n%s", mode, s.out.String())
		}
	})
	return s
}

// wait returns the first output line starting with prefix.
func (s *standIn) wait(t *testing.T, prefix string, timeout time.Duration) string {
	t.Helper()
	var line string
	waitFor(t, "the stand-in to say "+prefix, timeout, nil, func() bool {
		sc := bufio.NewScanner(strings.NewReader(s.out.String()))
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), prefix) {
				line = sc.Text()
				return true
			}
		}
		select {
		case <-s.done:
			t.Fatalf("the stand-in %s exited before saying %q:\n%s", s.mode, prefix, s.out.String())
		default:
		}
		return false
	})
	return line
}

func (s *standIn) send(t *testing.T, line string) {
	t.Helper()
	if _, err := io.WriteString(s.in, line+"\n"); err != nil {
		t.Fatalf("stand-in %s: %v", s.mode, err)
	}
}

// stop ends the stand-in and waits for it.
func (s *standIn) stop() {
	s.in.Close()
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		s.cmd.Process.Kill()
		<-s.done
	}
}

// name is a job id unique to this run.
func name(prefix string) string { return fmt.Sprintf("%s-%d", prefix, os.Getpid()) }

// C1: a crafted rank of the victim's job on another node, naming the
// victim's coordinator, asks for a pause (then a resume).
func secC1(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("c1v"))
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("c1a"))
	// Control: the attacker's own rank's SIGTSTP pauses its own job
	// (shim -> EVENT pause -> coordinator). A frozen rank cannot run its
	// SIGCONT handler, so the CLI resumes it.
	start := time.Now()
	syscall.Kill(a.ranks[0], syscall.SIGTSTP)
	ok := within(time.Minute, a.frozen)
	took := time.Since(start)
	r := e.userCLI(ctx, t, attackerUID, "node0", "resume", a.id)
	row.controlOK = ok && r.code == 0
	row.control = fmt.Sprintf("own rank's SIGTSTP froze its job in %v; resume exit %d", took.Round(time.Millisecond), r.code)
	if !ok {
		row.control = "own rank's SIGTSTP did not freeze its job within a minute"
	}
	watch := min(max(10*took, 5*time.Second), 30*time.Second)

	s := e.attacker(ctx, t, "node1", "rank", "job="+v.id, "rank=1", "size=2", "host=node1", "root=node0")
	s.wait(t, "hello sent", time.Minute)
	s.send(t, "EVENT pause")
	paused := within(watch, v.frozen)
	s.send(t, "EVENT resume")
	row.refused = !paused
	row.outcome = fmt.Sprintf("victim's job not frozen within %v", watch)
	if paused {
		row.outcome = "victim's job FROZEN by the fake rank's EVENT pause"
		cli(ctx, t, "node0", nil, "resume", v.id)
	}
}

// C2: the attacker makes a job with the victim's id on its own node whose
// rank 0 lists the victim's node, and pauses it.
func secC2(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("c2v"))
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("c2a"))
	row.controlOK, row.control = e.pauseResume(ctx, t, attackerUID, "node0", a)

	s := e.attacker(ctx, t, "node1", "rank", "job="+v.id, "rank=0", "size=1", "host=node1", "hosts=node1,node0", "join=1")
	s.wait(t, "hello sent", time.Minute)
	// The attacker retries until its node knows the job as coordinated
	// there (the HELLO is taken in the background).
	var r cliResult
	within(10*time.Second, func() bool {
		r = e.userCLI(ctx, t, attackerUID, "node1", "pause", v.id)
		return r.code == 0
	})
	fr := v.frozen()
	defer func() {
		e.userCLI(ctx, t, attackerUID, "node1", "resume", v.id)
		if v.frozen() {
			os.WriteFile(filepath.Join(cgroupOf(v.ranks[0]), "cgroup.freeze"), []byte("0"), 0)
		}
	}()
	row.refused = !fr
	row.outcome = fmt.Sprintf("victim's job not frozen (attacker's pause exited %d: %s)", r.code, oneLineOf(r.stderr))
	if fr {
		row.outcome = fmt.Sprintf("victim's job on node0 FROZEN by the attacker's pause from node1 (exit %d)", r.code)
	}
}

// H1: a socket connected by a child that has exited, whose pid is now a
// victim's process, sends a JOIN naming that pid.
func secH1(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("h1a"))
	// Control: the JOIN route moves the attacker's own ranks (the shim's
	// JOIN, from their own connections) out of the launcher's cgroup.
	launcher, rank := cgroupOf(a.p.cmd.Process.Pid), cgroupOf(a.ranks[0])
	row.controlOK = launcher != "" && rank != "" && rank != launcher
	row.control = fmt.Sprintf("own ranks joined their job cgroup %s (launcher in %s)", rank, launcher)

	for attempt := 0; attempt < 3; attempt++ {
		s := e.attacker(ctx, t, "node0", "reuse", "job="+a.id)
		line := s.wait(t, "child ", time.Minute)
		pid, _ := strconv.Atoi(strings.TrimPrefix(line, "child "))
		victim := reusePid(t, pid)
		if victim == 0 {
			s.stop()
			continue
		}
		before := cgroupOf(victim)
		s.send(t, "go")
		<-s.done
		after := cgroupOf(victim)
		row.refused = before == after
		row.outcome = fmt.Sprintf("victim's process (uid %d, reused pid %d) stayed in %s", victimUID, victim, before)
		if !row.refused {
			row.outcome = fmt.Sprintf("victim's process (reused pid %d) MOVED from %s to %s", victim, before, after)
		}
		return
	}
	row.outcome = "not measured: no victim process got the dead child's pid in 3 tries"
}

// reusePid starts a process of the victim with pid, free again: the
// kernel hands out pid last+1 next, so with ns_last_pid (the machine's
// pid namespace, the one mpid sees pids in) set to pid-1 the shell's next
// fork gets it, unless another process forked in between (then it tries
// again). It returns 0 if it never got it.
func reusePid(t *testing.T, pid int) int {
	t.Helper()
	script := fmt.Sprintf(`echo %d > /proc/sys/kernel/ns_last_pid; %s sleep 600 </dev/null >/dev/null 2>&1 & echo $!`,
		pid-1, strings.Join(asUser(victimUID), " "))
	for range 30 {
		out, err := exec.Command("sh", "-c", script).Output()
		if err != nil {
			t.Fatalf("starting the victim's process: %v", err)
		}
		got, _ := strconv.Atoi(strings.TrimSpace(string(out)))
		if got == pid {
			t.Cleanup(func() { syscall.Kill(got, syscall.SIGKILL) })
			return got
		}
		if got > 0 {
			syscall.Kill(got, syscall.SIGKILL)
		}
	}
	return 0
}

// H3: one line that never ends, sent on the rank channel.
func secH3(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const mib = 256
	mpidPid := statusOf(t, jobRig).Nodes[0].MPIDPid
	rss0 := statusKB(mpidPid, "VmRSS")
	s := e.attacker(ctx, t, "node0", "endless", "job="+name("h3"), "host=node0", fmt.Sprintf("mib=%d", mib))
	sent := s.wait(t, "sent ", 3*time.Minute)
	rss1 := statusKB(mpidPid, "VmRSS")
	list := cli(ctx, t, "node0", nil, "list")
	s.stop()
	grew := (rss1 - rss0) / 1024
	row.refused = grew < 64 && list.code == 0
	row.outcome = fmt.Sprintf("%s of %d MiB offered (twice per address): mpid's RSS %d -> %d MiB (+%d), root's list exit %d",
		strings.TrimPrefix(sent, "sent ")+" bytes", mib, rss0/1024, rss1/1024, grew, list.code)
	// Control: the rank channel still serves the attacker's own ranks.
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("h3a"))
	row.controlOK, row.control = e.pauseResume(ctx, t, attackerUID, "node0", a)
}

// statusKB is a kB field of /proc/PID/status.
func statusKB(pid int, field string) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	return 0
}

// H4: a thread named like the shim's control thread, and the shim's own
// thread, outside any pause of their job: neither gets real-time policy
// or a lower nice from root.
func secH4(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	s := e.attacker(ctx, t, "node0", "rank", "job="+name("h4"), "rank=0", "size=1", "host=node0", "thread=mpipause-ctl")
	tid, _ := strconv.Atoi(strings.TrimPrefix(s.wait(t, "thread ", time.Minute), "thread "))
	s.wait(t, "hello sent", time.Minute)
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("h4a"))
	favoured := func() string {
		tids := map[int]string{tid: "the stand-in's"}
		for _, pid := range a.ranks {
			for _, x := range shimCtlTids(pid) {
				tids[x] = "own shim's"
			}
		}
		for x, whose := range tids {
			if at, err := unix.SchedGetAttr(x, 0); err == nil && (at.Policy != 0 /* SCHED_OTHER */ || at.Nice != 0) {
				return fmt.Sprintf("%s thread %d: policy %d, nice %d", whose, x, at.Policy, at.Nice)
			}
		}
		return ""
	}
	// mpid raises a thread within a second of its HELLO, or not at all.
	var why string
	within(3*time.Second, func() bool { why = favoured(); return why != "" })
	row.controlOK, row.control = e.pauseResume(ctx, t, attackerUID, "node0", a)
	if why == "" {
		// A fix may raise the shim's thread during a pause of its own job;
		// once resumed, it must be put back.
		if !within(2*time.Second, func() bool { why = favoured(); return why == "" }) {
			why += " (2 s after its job's resume)"
		}
	}
	row.refused = why == ""
	row.outcome = "the stand-in's and own shim's mpipause-ctl threads stay SCHED_OTHER, nice 0"
	if why != "" {
		row.outcome = "root RAISED " + why
	}
}

// publicCopies copies files (source: name) into a fresh directory that
// other users may read and run from (t.TempDir's parent, like the
// checkout, may be private to root) and returns it.
func publicCopies(t *testing.T, files map[string]string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mpipause-kt-public-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for src, dst := range files {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, dst), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// shimCtlTids are pid's threads named mpipause-ctl.
func shimCtlTids(pid int) []int {
	var out []int
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, e := range ents {
		tid, _ := strconv.Atoi(e.Name())
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/comm", pid, tid))
		if strings.TrimSpace(string(comm)) == "mpipause-ctl" {
			out = append(out, tid)
		}
	}
	return out
}

// M1: the attacker takes a predictable id (a Slurm step's) first; the
// victim's job of that id must still join and pause.
func secM1(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const id = "4243.0"
	a := e.startUserJob(ctx, t, attackerUID, "node0", id)
	row.controlOK, row.control = e.pauseResume(ctx, t, attackerUID, "node0", a)
	v := e.startUserJob(ctx, t, victimUID, "node0", id)
	launcher, vcg, acg := cgroupOf(v.p.cmd.Process.Pid), cgroupOf(v.ranks[0]), cgroupOf(a.ranks[0])
	joined := vcg != launcher && vcg != acg
	r := e.userCLI(ctx, t, victimUID, "node0", "pause", id)
	vfr, afr := v.frozen(), a.frozen()
	e.userCLI(ctx, t, victimUID, "node0", "resume", id)
	row.refused = joined && r.code == 0 && vfr && !afr
	row.outcome = fmt.Sprintf("victim's ranks joined a cgroup of their own: %v (%s); victim's pause exit %d, victim frozen %v, attacker's job frozen %v: %s",
		joined, vcg, r.code, vfr, afr, oneLineOf(r.stderr))
}

// M2: a flood from the attacker while the victim pauses its job.
func secM2(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("m2v"))
	pause := func() (time.Duration, cliResult, bool) {
		start := time.Now()
		r := e.userCLI(ctx, t, victimUID, "node0", "pause", v.id)
		took, fr := time.Since(start), v.frozen()
		e.userCLI(ctx, t, victimUID, "node0", "resume", v.id)
		return took, r, fr
	}
	t0, r0, fr0 := pause()
	row.controlOK = r0.code == 0 && fr0
	row.control = fmt.Sprintf("victim's pause before the flood: exit %d in %v", r0.code, t0.Round(time.Millisecond))
	mpidPid := statusOf(t, jobRig).Nodes[0].MPIDPid
	lines0, cpu0 := logLines(t, 0), procCPU(mpidPid)
	s := e.attacker(ctx, t, "node0", "flood", "job="+name("m2"), "host=node0", "joins=300", "hellos=100", "events=20000")
	s.wait(t, "flooding", time.Minute)
	t1, r1, fr1 := pause()
	s.send(t, "stop")
	flooded := s.wait(t, "flooded", 3*time.Minute)
	lines, cpu := logLines(t, 0)-lines0, procCPU(mpidPid)-cpu0
	row.refused = r1.code == 0 && fr1 && lines < 1000
	row.outcome = fmt.Sprintf("victim's pause during the flood: exit %d in %v (x%.1f), mpid CPU %v, %d log lines (%s)",
		r1.code, t1.Round(time.Millisecond), float64(t1)/float64(t0), cpu.Round(time.Millisecond), lines, strings.TrimPrefix(flooded, "flooded "))
}

// logLines counts node k's mpid log lines.
func logLines(t *testing.T, k int) int {
	b, err := os.ReadFile(mpidLog(k))
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Count(b, []byte("\n"))
}

// procCPU is pid's user and system time so far.
func procCPU(pid int) time.Duration {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.Atoi(f[11])
	st, _ := strconv.Atoi(f[12])
	return time.Duration(u+st) * time.Second / 100 // USER_HZ
}

// M3: the attacker holds the endpoints while node2's mpid is down.
func secM3(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	stopRigMPIDs(t, 2)
	t.Cleanup(func() {
		if _, err := startRigMPIDs(t); err != nil {
			t.Errorf("restarting node2's mpid: %v", err)
		}
	})
	probe := name("m3")
	s := e.attacker(ctx, t, "node2", "squat")
	bound := s.wait(t, "bound", time.Minute)
	_, upErr := startRigMPIDs(t)
	st := cli(ctx, t, "node2", nil, "status", "--json", probe)
	all := cli(ctx, t, "node2", nil, "status")
	forged := strings.Contains(st.stdout+st.stderr+all.stdout+all.stderr, forgedMarker)
	row.refused = upErr == nil && !forged
	row.outcome = fmt.Sprintf("attacker %s; mpid started: %v; root's status exit %d, forged answer printed: %v", bound, upErr == nil, st.code, forged)
	if upErr != nil {
		row.outcome += " (" + oneLineOf(upErr.Error()) + ")"
	}
	// Control: without the squatter, mpid comes back and answers for real.
	s.stop()
	_, err := startRigMPIDs(t)
	st = cli(ctx, t, "node2", nil, "status", "--json", probe)
	row.controlOK = err == nil && st.code != 0 && !strings.Contains(st.stdout, forgedMarker)
	row.control = fmt.Sprintf("squatter gone: mpid up (%v), root's status of a job nobody runs exits %d", err, st.code)
}

// L4: terminal escapes in what a rank reports; a stranger asks about the
// victim's job.
func secL4(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("l4v"))
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("l4a"))
	own := e.userCLI(ctx, t, attackerUID, "node0", "status", a.id)
	list := cli(ctx, t, "node0", nil, "status")
	row.controlOK = own.code == 0 && strings.Contains(list.stdout, a.id)
	row.control = fmt.Sprintf("own status exit %d; root's status lists the attacker's job: %v", own.code, strings.Contains(list.stdout, a.id))

	id := name("l4")
	esc := "\x1b]0;owned\x07\x1b[2J\x1b[31m"
	s := e.attacker(ctx, t, "node0", "rank", "job="+id, "rank=0", "size=1", "host=node0"+esc, "hosts=node0,evil"+esc, "join=1")
	s.wait(t, "hello sent", time.Minute)
	// Until mpid has taken the HELLO (or 5 s: it refused it).
	within(5*time.Second, func() bool { return cli(ctx, t, "node0", nil, "status", id).code == 0 })
	one, all := cli(ctx, t, "node0", nil, "status", id), cli(ctx, t, "node0", nil, "status")
	escOut := strings.Contains(one.stdout+one.stderr+all.stdout+all.stderr, "\x1b")

	stranger := e.userCLI(ctx, t, attackerUID, "node0", "status", v.id)
	nosuch := e.userCLI(ctx, t, attackerUID, "node0", "status", name("l4-nosuch"))
	same := stranger.code == nosuch.code &&
		strings.ReplaceAll(stranger.stderr, v.id, "ID") == strings.ReplaceAll(nosuch.stderr, name("l4-nosuch"), "ID")
	// The uid as a number of its own: the job's id carries the test's pid,
	// which may have the uid's digits in it.
	owner := regexp.MustCompile(`(^|[^0-9])` + strconv.Itoa(victimUID) + `([^0-9]|$)`).MatchString(stranger.stdout + stranger.stderr)
	row.refused = !escOut && same && !owner
	row.outcome = fmt.Sprintf("ESC in root's status: %v; stranger's status of the victim's job: exit %d %q (a job nobody runs: exit %d), owner uid shown: %v",
		escOut, stranger.code, oneLineOf(stranger.stderr), nosuch.code, owner)
}

// L5: the failpoint hook, for the fault tests only, in the binary the
// rig and the package run.
func secL5(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	b, err := os.ReadFile(filepath.Join(binDir(t), "mpid"))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, m := range []string{"MPIPAUSE_FAILPOINTS", "failpoint reached", "mpid.failpoints"} {
		if bytes.Contains(b, []byte(m)) {
			found = append(found, m)
		}
	}
	row.refused = len(found) == 0
	row.outcome = "bin/mpid has no failpoint hook"
	if len(found) > 0 {
		row.outcome = fmt.Sprintf("bin/mpid CONTAINS the failpoint hook (%s)", strings.Join(found, ", "))
	}
	// Control: the scan finds what is in it (mpid's serving line).
	row.controlOK = bytes.Contains(b, []byte("main.main")) && bytes.Contains(b, []byte("serving"))
	row.control = fmt.Sprintf("the scan finds main.main and \"serving\" in bin/mpid: %v", row.controlOK)
}

// L7: a second rig on the machine; the first rig's paused job's record
// must survive the second rig's mpid starting.
func secL7(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	v := e.startUserJob(ctx, t, victimUID, "node0", name("l7v"))
	dirA := stateDirOf(statusOf(t, jobRig).Nodes[0].MPIDPid)
	r := e.userCLI(ctx, t, victimUID, "node0", "pause", v.id)
	defer e.userCLI(ctx, t, victimUID, "node0", "resume", v.id)
	recs := jsonFiles(dirA)
	row.controlOK = r.code == 0 && len(recs) > 0
	row.control = fmt.Sprintf("victim's pause exit %d, %d record(s) in %s", r.code, len(recs), dirA)

	other := jobRig + "-l7"
	t.Cleanup(func() { rigCommand(context.Background(), other, "down") })
	mustRig(t, other, "up", "1")
	dirB := stateDirOf(statusOf(t, other).Nodes[0].MPIDPid)
	var lost []string
	left := jsonFiles(dirA)
	for _, f := range recs {
		if !strings.Contains(strings.Join(left, "\n"), f) {
			lost = append(lost, f)
		}
	}
	// Judged on the records alone: where a rig's mpid keeps them is the
	// fix's choice (a control with no record found says the dir is wrong).
	row.refused = len(lost) == 0
	row.outcome = fmt.Sprintf("state dirs %s and %s; the first rig's records lost when the second's mpid started: %v", dirA, dirB, lost)
}

// stateDirOf is where the mpid of pid keeps its records (its --state-dir,
// else the default of internal/mpid), as the host reaches it: through the
// mpid's own root, since a rig node's /run/mpipause is its own.
func stateDirOf(pid int) string {
	return filepath.Join(fmt.Sprintf("/proc/%d/root", pid), mpidStateDir(pid))
}

func mpidStateDir(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
	node := ""
	for i, a := range args {
		for _, f := range []string{"state-dir", "node"} {
			v, ok := "", false
			if strings.HasPrefix(a, "--"+f+"=") || strings.HasPrefix(a, "-"+f+"=") {
				_, v, _ = strings.Cut(a, "=")
				ok = true
			} else if (a == "--"+f || a == "-"+f) && i+1 < len(args) {
				v, ok = args[i+1], true
			}
			if ok && f == "state-dir" {
				return v
			}
			if ok && f == "node" {
				node = v
			}
		}
	}
	return filepath.Join("/run/mpipause", "mpid-"+node)
}

// jsonFiles lists the records in dir.
func jsonFiles(dir string) []string {
	m, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	return m
}

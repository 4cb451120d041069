package rig

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/kernel-tests/internal/links"
	"github.com/mpipause/mpipause/quiesce"
)

// TestMain lets the test binary stand in for the rig binary: Up runs
// Config.Exe with InitNodeCommand in every new node.
func TestMain(m *testing.M) {
	if root := os.Getenv(holdHelperEnv); root != "" {
		os.Exit(holdHelper(root))
	}
	if len(os.Args) == 3 && os.Args[1] == InitNodeCommand {
		if err := RunInitNode(os.Args[2]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// fakeMPID takes the real mpid's flags, records what it was given next to
// its ready file (.args, .env, .hostname), and is ready until SIGTERM.
// BinDir/mpid.mode-NODE makes the one of NODE fail at once (fail) or never
// get ready and ignore SIGTERM (stubborn).
const fakeMPID = `#!/bin/sh
node= ready=
all="$*"
while [ $# -gt 0 ]; do
	case $1 in
	--node) node=$2; shift ;;
	--ready-file) ready=$2; shift ;;
	esac
	shift
done
out=${ready%.ready}
echo "$all" > "$out.args"
env > "$out.env"
hostname > "$out.hostname"
case $(cat "$0.mode-$node" 2>/dev/null) in
fail) echo "fake mpid: cannot start on $node" >&2; exit 3 ;;
stubborn) trap '' TERM; while :; do sleep 1; done ;;
esac
trap 'kill $! 2>/dev/null; exit 0' TERM
echo "fake mpid: up on $node"
echo ready > "$ready"
sleep 1000 & wait
`

// testRig is a rig of its own (state and /etc/netns under temporary
// directories, a name no one else uses) whose BinDir holds a fake mpid;
// the test's cleanup takes it down.
func testRig(t *testing.T, suffix string, withMPID bool) (*Rig, string) {
	t.Helper()
	testutil.RequirePrivileged(t)
	for _, p := range []string{"nsenter", "unshare"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("%s not installed (util-linux)", p)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	if withMPID {
		if err := os.WriteFile(filepath.Join(bin, MPIDBinary), []byte(fakeMPID), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Present, so a preload would be added if the daemon's env had one.
	if err := os.WriteFile(filepath.Join(bin, FinalizeFixLib), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{
		Name:      fmt.Sprintf("ut%d%s", os.Getpid()%100000, suffix),
		StateRoot: t.TempDir(),
		EtcNetns:  t.TempDir(),
		Exe:       exe,
		BinDir:    bin,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Down(context.Background()); err != nil {
			t.Errorf("cleanup: down: %v", err)
		}
	})
	return r, bin
}

func TestDaemonsLifecycle(t *testing.T) {
	r, bin := testRig(t, "life", true)
	ctx := context.Background()
	const n = 2
	if err := r.Up(ctx, n); err != nil {
		t.Fatalf("up: %v", err)
	}
	st, err := r.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(st.MPID) != n {
		t.Fatalf("state records %d daemons, want %d: %+v", len(st.MPID), n, st.MPID)
	}
	first := map[string]int{}
	for i := 0; i < n; i++ {
		node := NodeName(i)
		d, ok := st.daemon(node)
		if !ok || !d.alive() {
			t.Fatalf("%s: daemon %+v recorded=%v, not alive", node, d, ok)
		}
		first[node] = d.Pid
		if _, err := os.Stat(r.readyFile(i)); err != nil {
			t.Errorf("%s: ready file: %v", node, err)
		}
		base := strings.TrimSuffix(r.readyFile(i), ".ready")
		wantArgs := fmt.Sprintf("--node %s --cgroup-parent mpipause-rig/%s/%s --ready-file %s --cluster-key %s --config /dev/null", node, r.Name(), node, r.readyFile(i), r.KeyFile())
		if got := readTrim(t, base+".args"); got != wantArgs {
			t.Errorf("%s: args %q, want %q", node, got, wantArgs)
		}
		// One key for the rig's mpids, private to root.
		if st, err := os.Stat(r.KeyFile()); err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("rig cluster key: %v %v; want a 0600 file", st, err)
		} else if _, err := quiesce.LoadKeys(r.KeyFile()); err != nil {
			t.Errorf("rig cluster key: %v", err)
		}
		if got := readTrim(t, base+".hostname"); got != node {
			t.Errorf("%s: daemon's host name %q", node, got)
		}
		env := "\n" + readTrim(t, base+".env") + "\n"
		for _, want := range []string{"\n" + NodeEnv + "=" + node + "\n", "\n" + NameEnv + "=" + r.Name() + "\n", "\nPATH=" + bin + ":"} {
			if !strings.Contains(env, want) {
				t.Errorf("%s: daemon's environment lacks %q:%s", node, strings.TrimSpace(want), env)
			}
		}
		if strings.Contains(env, "\nLD_PRELOAD=") {
			t.Errorf("%s: daemon has an LD_PRELOAD:%s", node, env)
		}
		// In the node's network namespace, detached: own session, stdin
		// /dev/null, output in its log.
		ino, err := links.NetnsInode(r.NodeNetns(i))
		if err != nil {
			t.Fatal(err)
		}
		proc := "/proc/" + strconv.Itoa(d.Pid)
		if l, _ := os.Readlink(proc + "/ns/net"); l != fmt.Sprintf("net:[%d]", ino) {
			t.Errorf("%s: daemon's netns %q, want the node's (%d)", node, l, ino)
		}
		if sid, err := unix.Getsid(d.Pid); err != nil || sid != d.Pid {
			t.Errorf("%s: daemon's session %d (%v), want its own", node, sid, err)
		}
		if l, _ := os.Readlink(proc + "/fd/0"); l != os.DevNull {
			t.Errorf("%s: daemon's stdin is %q", node, l)
		}
		if log := readTrim(t, r.logFile(i)); !strings.Contains(log, "fake mpid: up on "+node) {
			t.Errorf("%s: log lacks the daemon's output:\n%s", node, log)
		}
	}
	s, err := r.Status()
	if err != nil {
		t.Fatal(err)
	}
	for _, ns := range s.Nodes {
		if ns.MPIDPid != first[ns.Name] || !ns.MPIDAlive || !ns.MPIDReady {
			t.Errorf("status of %s: mpid pid %d alive %v ready %v, want pid %d alive and ready", ns.Name, ns.MPIDPid, ns.MPIDAlive, ns.MPIDReady, first[ns.Name])
		}
	}

	// A dead daemon: status says so, a second up restarts it alone.
	if err := syscall.Kill(first["node1"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	d1, _ := st.daemon("node1")
	waitUntil(t, "node1's mpid to die", func() bool { return !d1.alive() })
	if s, _ := r.Status(); s.Up || s.Nodes[1].MPIDAlive || !s.Nodes[0].MPIDAlive {
		t.Errorf("status with node1's mpid dead: up=%v, node0 alive=%v, node1 alive=%v", s.Up, s.Nodes[0].MPIDAlive, s.Nodes[1].MPIDAlive)
	}
	if err := r.Up(ctx, n); err != nil {
		t.Fatalf("second up: %v", err)
	}
	st2, _ := r.Load()
	d0, _ := st2.daemon("node0")
	d1b, _ := st2.daemon("node1")
	if d0.Pid != first["node0"] || !d0.alive() {
		t.Errorf("second up replaced node0's live mpid (%d, now %d)", first["node0"], d0.Pid)
	}
	if d1b.Pid == first["node1"] || !d1b.alive() {
		t.Errorf("second up did not restart node1's mpid: %+v", d1b)
	}
	if s, _ := r.Status(); !s.Up {
		t.Errorf("status after the repair: not up: %+v", s.Nodes)
	}

	cg, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	cg = filepath.Join(cg, CgroupParent, r.Name())
	if _, err := os.Stat(filepath.Join(cg, "node1")); err != nil {
		t.Errorf("cgroup parent of node1: %v", err)
	}
	if err := os.Mkdir(filepath.Join(cg, "node1", "job"), 0o755); err != nil { // as mpid would
		t.Fatal(err)
	}
	if err := r.Down(ctx); err != nil {
		t.Fatalf("down: %v", err)
	}
	for _, d := range []Daemon{d0, d1b} {
		if d.alive() {
			t.Errorf("mpid of %s (pid %d) survives down", d.Node, d.Pid)
		}
		if _, err := os.Stat(d.Ready); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("ready file of %s after down: %v", d.Node, err)
		}
	}
	if _, err := os.Stat(cg); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cgroup %s after down: %v", cg, err)
	}
	if err := r.Down(ctx); err != nil {
		t.Errorf("second down: %v", err)
	}
}

func TestDaemonFails(t *testing.T) {
	r, bin := testRig(t, "fail", true)
	if err := os.WriteFile(filepath.Join(bin, "mpid.mode-node1"), []byte("fail"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := r.Up(context.Background(), 2)
	if err == nil || !strings.Contains(err.Error(), "mpid on node1 exited") || !strings.Contains(err.Error(), "fake mpid: cannot start on node1") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("up with node1's mpid failing: %v; want one line naming node1 and quoting its log", err)
	}
	assertNoDaemons(t, r)
}

func TestDaemonNeverReady(t *testing.T) {
	defer func(r, s time.Duration) { readyTimeout, stopTimeout = r, s }(readyTimeout, stopTimeout)
	readyTimeout, stopTimeout = time.Second, 200*time.Millisecond
	r, bin := testRig(t, "hang", true)
	if err := os.WriteFile(filepath.Join(bin, "mpid.mode-node0"), []byte("stubborn"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := r.Up(context.Background(), 2)
	if err == nil || !strings.Contains(err.Error(), "mpid on node0 not ready after 1s") {
		t.Fatalf("up with node0's mpid never ready: %v", err)
	}
	assertNoDaemons(t, r)
}

// assertNoDaemons checks that a failed up stopped what it started.
func assertNoDaemons(t *testing.T, r *Rig) {
	t.Helper()
	st, err := r.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(st.MPID) != 0 {
		t.Errorf("state still records daemons: %+v", st.MPID)
	}
	for i := 0; i < st.Nodes; i++ {
		pids, _ := r.Pids(i)
		for _, p := range pids {
			if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p)); strings.Contains(string(b), MPIDBinary) {
				t.Errorf("%s: mpid left running: pid %d %q", NodeName(i), p, b)
			}
		}
	}
}

func TestUpNoMPID(t *testing.T) {
	r, _ := testRig(t, "none", false)
	err := r.Up(context.Background(), 1)
	if !errors.Is(err, ErrNoMPID) || !strings.HasSuffix(err.Error(), ": run make build") {
		t.Fatalf("up without mpid: %v, want ErrNoMPID ending in run make build", err)
	}
	if _, err := os.Stat(r.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("up without mpid made %s: %v", r.Dir(), err)
	}
	cfg := r.Config()
	cfg.NoMPID = true
	r2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.Up(context.Background(), 1); err != nil {
		t.Fatalf("up with NoMPID: %v", err)
	}
	s, _ := r2.Status()
	if !s.Up || s.Nodes[0].MPIDPid != 0 {
		t.Errorf("status with NoMPID: up=%v, mpid pid %d", s.Up, s.Nodes[0].MPIDPid)
	}
}

func TestMissingMPIDIsOneLine(t *testing.T) {
	r, err := New(Config{Name: "x", Exe: "/nonexistent/rig", BinDir: t.TempDir(), StateRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	err = r.Up(context.Background(), 2)
	if !errors.Is(err, ErrNoMPID) || strings.Contains(err.Error(), "\n") || !strings.HasSuffix(err.Error(), ": run make build") {
		t.Errorf("up without mpid: %q", err)
	}
}

func TestAlive(t *testing.T) {
	exe, _ := os.Executable()
	start, state, err := procStat(os.Getpid())
	if err != nil || state == 'Z' {
		t.Fatalf("procStat(self): %d %c %v", start, state, err)
	}
	self := Daemon{Pid: os.Getpid(), Start: start, Exe: exe}
	if !self.alive() {
		t.Errorf("this process is not alive by its own record %+v", self)
	}
	for what, d := range map[string]Daemon{
		"pid reused":       {Pid: os.Getpid(), Start: start + 1, Exe: exe},
		"another program":  {Pid: os.Getpid(), Start: start, Exe: "/usr/bin/mpid", Ready: "/x"},
		"no such process":  {Pid: 1 << 30, Exe: exe},
		"nothing recorded": {},
	} {
		if d.alive() {
			t.Errorf("%s: %+v counts as alive", what, d)
		}
	}
}

func TestLogTail(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log")
	os.WriteFile(p, []byte(logMark+" old\nold failure\n"+logMark+" new\n\na\nb\nc\nd\ne\n"), 0o644)
	if got, want := logTail(p), fmt.Sprintf("last lines of %s: %q", p, "b | c | d | e"); got != want {
		t.Errorf("logTail: %s, want %s", got, want)
	}
	os.WriteFile(p, []byte(logMark+" new\n"), 0o644)
	if got := logTail(p); !strings.HasSuffix(got, " is empty") {
		t.Errorf("logTail of a run with no output: %s", got)
	}
}

func readTrim(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(daemonPoll)
	}
}

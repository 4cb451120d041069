package kerneltests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
)

// hostTrace is what a rig may change on the host while it is up and must
// have put back after down.
type hostTrace struct {
	links, netns, etc, mounts []string
}

func traceHost(t *testing.T, name string) hostTrace {
	t.Helper()
	var h hostTrace
	out, err := exec.Command("ip", "-o", "link", "show").Output()
	if err != nil {
		t.Fatalf("ip link: %v", err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if f := strings.Fields(l); len(f) > 1 {
			h.links = append(h.links, strings.TrimSuffix(f[1], ":"))
		}
	}
	h.netns = globBase("/run/netns/*" + name + "*")
	h.etc = globBase("/etc/netns/" + name + "-*")
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(mi), "\n") {
		if strings.Contains(l, rigDir(name)+"/") || strings.Contains(l, "/netns/"+name+"-") {
			h.mounts = append(h.mounts, l)
		}
	}
	sort.Strings(h.links)
	return h
}

func globBase(pattern string) []string {
	m, _ := filepath.Glob(pattern)
	for i := range m {
		m[i] = filepath.Base(m[i])
	}
	return m
}

// rigStatus is what the tests read of `rig status --json`.
type rigStatus struct {
	Up    bool `json:"up"`
	Nodes []struct {
		Name      string `json:"name"`
		Exists    bool   `json:"exists"`
		LinkUp    bool   `json:"link_up"`
		MPIDPid   int    `json:"mpid_pid"`
		MPIDAlive bool   `json:"mpid_alive"`
		MPIDReady bool   `json:"mpid_ready"`
	} `json:"nodes"`
}

func statusOf(t *testing.T, name string) rigStatus {
	t.Helper()
	var st rigStatus
	if err := json.Unmarshal([]byte(mustRig(t, name, "status", "--json")), &st); err != nil {
		t.Fatalf("status --json: %v", err)
	}
	return st
}

// running reports whether pid is a live process (a zombie is not: where
// nothing reaps orphans, a stopped daemon stays one).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && len(s) > i+2 && s[i+2] != 'Z' && s[i+2] != 'X'
}

// TestRigLifecycle is the rig as a user drives it: up with an mpid in each
// node, idempotent up, a command in each node, status, and down leaving
// nothing behind.
func TestRigLifecycle(t *testing.T) {
	bin := binDir(t)
	const name = "ktlife"
	before := traceHost(t, name)
	t.Cleanup(func() { rigCommand(context.Background(), name, "down") })

	mpids := map[string]int{}
	// Every node has its mpid, running the one TestMain chose (the test
	// build, bin/test/mpid) and ready, as soon as up returns.
	if !t.Run("up starts a ready mpid in each node", func(t *testing.T) {
		mustRig(t, name, "up", "3")
		for _, n := range statusOf(t, name).Nodes {
			if n.MPIDPid == 0 || !n.MPIDAlive || !n.MPIDReady {
				t.Errorf("after up, %s's mpid: pid %d alive %v ready %v", n.Name, n.MPIDPid, n.MPIDAlive, n.MPIDReady)
				continue
			}
			mpids[n.Name] = n.MPIDPid
			if exe, err := os.Readlink("/proc/" + strconv.Itoa(n.MPIDPid) + "/exe"); err != nil || strings.TrimSuffix(exe, " (deleted)") != filepath.Join(bin, testMPID) {
				t.Errorf("%s's mpid (pid %d) runs %q (%v), want %s", n.Name, n.MPIDPid, exe, err, filepath.Join(bin, testMPID))
			}
			if _, err := os.Stat(filepath.Join(rigDir(name), "mpid-"+n.Name+".ready")); err != nil {
				t.Errorf("%s's mpid ready file: %v", n.Name, err)
			}
			// mpid runs its threads under SCHED_RR (its default
			// --rt-priority 1), so that its steps are not queued behind
			// busy-polling ranks; the accept loops of its sockets (three,
			// four with metrics) and any handshake under way run under
			// SCHED_OTHER, being work any stranger can cause
			// (mpid.asStranger), and so does the Go runtime's monitor
			// thread (docs/mpid.md, "Priority").
			pol := threadPolicies(n.MPIDPid)
			other := slices.DeleteFunc(slices.Clone(pol), func(p string) bool { return p != "0" })
			if rr := slices.DeleteFunc(slices.Clone(pol), func(p string) bool { return p != "2" }); len(rr) < 2 ||
				len(rr)+len(other) != len(pol) || len(other) < 3 {
				t.Errorf("%s's mpid threads' scheduling policies %v; want 2 (SCHED_RR) but for the accept loops and the runtime's monitor, 0 (SCHED_OTHER)", n.Name, pol)
			}
		}
		if len(mpids) != 3 {
			t.Fatalf("after up: mpids %v, want one in each of 3 nodes", mpids)
		}
	}) {
		return
	}
	t.Run("status shows each mpid ready", func(t *testing.T) {
		txt := mustRig(t, name, "status")
		for node, pid := range mpids {
			if !regexp.MustCompile(`(?m)^` + node + `\s.*\s` + strconv.Itoa(pid) + ` ready$`).MatchString(txt) {
				t.Errorf("rig status does not show %s's mpid %d as ready:\n%s", node, pid, txt)
			}
		}
	})
	t.Run("up again keeps the live mpids", func(t *testing.T) {
		mustRig(t, name, "up", "3") // idempotent: the live daemons stay
		for _, n := range statusOf(t, name).Nodes {
			if n.MPIDPid != mpids[n.Name] || !n.MPIDAlive {
				t.Errorf("second up: %s's mpid is %d (alive %v), was %d", n.Name, n.MPIDPid, n.MPIDAlive, mpids[n.Name])
			}
		}
	})
	t.Run("exec runs in the node's own view", func(t *testing.T) {
		for _, node := range []string{"node0", "node1", "node2"} {
			if got := strings.TrimSpace(mustRig(t, name, "exec", node, "--", "hostname")); got != node {
				t.Errorf("rig exec %s -- hostname: %q, want %q", node, got, node)
			}
		}
		// Names resolve through the node's own /etc/hosts.
		if got := mustRig(t, name, "exec", "node0", "--", "getent", "hosts", "node2"); !strings.HasPrefix(got, "10.77.0.3 ") {
			t.Errorf("node0 resolves node2 as %q, want 10.77.0.3", got)
		}
		// A node sees cgroup v2 and a bpffs (what `ip netns exec` would hide),
		// and bin/ first on PATH.
		mi := mustRig(t, name, "exec", "node1", "--", "cat", "/proc/self/mountinfo")
		for _, fs := range []string{" - cgroup2 ", " - bpf "} {
			if !strings.Contains(mi, fs) {
				t.Errorf("node1's mounts have no%s:\n%s", fs, mi)
			}
		}
		path := strings.TrimSpace(mustRig(t, name, "exec", "node1", "--", "sh", "-c", "echo $PATH"))
		if !strings.HasPrefix(path, os.Getenv("MPIPAUSE_BIN")+":") {
			t.Errorf("PATH in a node is %q, want %s first", path, os.Getenv("MPIPAUSE_BIN"))
		}
		// Only the node's own interfaces: lo and eth0.
		links := mustRig(t, name, "exec", "node2", "--", "ls", "/sys/class/net")
		if f := strings.Fields(links); len(f) != 2 || !strings.Contains(links, "eth0") || !strings.Contains(links, "lo") {
			t.Errorf("node2 interfaces: %q, want eth0 and lo", links)
		}
	})
	// The nodes share this machine's cores, so a launcher that binds each
	// node's ranks as if the node had cores of its own piles the nodes'
	// first ranks onto one core. Two ranks, one a node, as the benchmarks'
	// 2 x 1 jobs run.
	t.Run("a rank may run on every core its node may", func(t *testing.T) {
		const allowed = "Cpus_allowed_list:"
		own := strings.TrimSpace(mustRig(t, name, "exec", "node0", "--", "grep", allowed, "/proc/self/status"))
		for lib, launch := range map[string][]string{
			"openmpi": {"mpirun.openmpi", "-np", "2", "-H", "node0:1,node1:1"},
			"mpich":   {"mpiexec.mpich", "-n", "2", "-hosts", "node0:1,node1:1"},
		} {
			out := mustRig(t, name, append(append([]string{"exec", "node0", "--"}, launch...), "grep", allowed, "/proc/self/status")...)
			ranks := strings.Split(strings.TrimSpace(out), "\n")
			if len(ranks) != 2 {
				t.Errorf("%s: %d lines from 2 ranks: %q", lib, len(ranks), out)
			}
			for _, r := range ranks {
				if strings.TrimSpace(r) != own {
					t.Errorf("%s: a rank's %q, want its node's %q", lib, strings.TrimSpace(r), own)
				}
			}
		}
	})
	t.Run("status shows the nodes up", func(t *testing.T) {
		st := statusOf(t, name)
		if !st.Up || len(st.Nodes) != 3 {
			t.Fatalf("status: up=%v with %d nodes, want up with 3", st.Up, len(st.Nodes))
		}
		for _, n := range st.Nodes {
			if !n.Exists || !n.LinkUp {
				t.Errorf("status: %s exists=%v link_up=%v", n.Name, n.Exists, n.LinkUp)
			}
		}
	})
	// One line, non-zero exit, nothing changed.
	t.Run("bad input refused", func(t *testing.T) {
		for _, args := range [][]string{{"up", "4"}, {"up", "x"}, {"up", "--bogus", "3"}, {"exec", "node7", "--", "true"}, {"exec", "node0"}} {
			out, err := rigCommand(context.Background(), name, args...)
			if err == nil {
				t.Errorf("rig %v: succeeded, want an error", args)
			}
			if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], "rig:") {
				t.Errorf("rig %v: want one line starting with rig:, got %q", args, out)
			}
		}
	})
	t.Run("down leaves nothing behind", func(t *testing.T) {
		mustRig(t, name, "down")
		mustRig(t, name, "down") // idempotent
		after := traceHost(t, name)
		if strings.Join(after.links, " ") != strings.Join(before.links, " ") {
			t.Errorf("host links changed: before %v, after %v", before.links, after.links)
		}
		for what, left := range map[string][]string{"netns": after.netns, "/etc/netns": after.etc, "mounts": after.mounts} {
			if len(left) != 0 {
				t.Errorf("left behind in %s: %v", what, left)
			}
		}
		if _, err := os.Stat(rigDir(name)); !os.IsNotExist(err) {
			t.Errorf("state directory left behind: %v", err)
		}
		for node, pid := range mpids {
			if running(pid) {
				t.Errorf("%s's mpid (pid %d) survives down", node, pid)
			}
		}
		if cg, err := cgroupv2.Root(); err == nil {
			if _, err := os.Stat(filepath.Join(cg, "mpipause-rig", name)); !os.IsNotExist(err) {
				t.Errorf("cgroup mpipause-rig/%s left behind: %v", name, err)
			}
		}
		if out, err := rigCommand(context.Background(), name, "exec", "node1", "--", "hostname"); err == nil {
			t.Errorf("exec after down succeeded: %q", out)
		}
	})
}

// TestRigNoMPID: `up --no-mpid` brings the nodes up without daemons, and
// `up` with no mpid next to the rig binary fails in one line before
// making anything.
func TestRigNoMPID(t *testing.T) {
	bin := binDir(t)
	const name = "ktnompid"
	t.Cleanup(func() { rigCommand(context.Background(), name, "down") })
	mustRig(t, name, "up", "--no-mpid", "2")
	st := statusOf(t, name)
	if !st.Up || len(st.Nodes) != 2 {
		t.Fatalf("up --no-mpid: up=%v with %d nodes", st.Up, len(st.Nodes))
	}
	for _, n := range st.Nodes {
		if n.MPIDPid != 0 {
			t.Errorf("up --no-mpid: %s has an mpid, pid %d", n.Name, n.MPIDPid)
		}
	}
	mustRig(t, name, "down")

	lone := filepath.Join(t.TempDir(), "rig")
	b, err := os.ReadFile(filepath.Join(bin, "rig"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(lone, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(lone, "--name", name, "up", "2")
	// Without the test build TestMain names for the tier's rigs: a rig
	// binary alone, as a user might copy it.
	cmd.Env = append(os.Environ(), rig.MPIDEnv+"=")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("up without mpid succeeded: %s", out)
	}
	if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); len(lines) != 1 || !strings.HasSuffix(lines[0], ": run make build") {
		t.Errorf("up without mpid: want one line ending in run make build, got %q", out)
	}
	if _, err := os.Stat(rigDir(name)); !os.IsNotExist(err) {
		t.Errorf("up without mpid left %s: %v", rigDir(name), err)
	}
}

// threadPolicies is the scheduling policy of each thread of pid (field 41
// of /proc/PID/task/TID/stat: 0 normal, 2 SCHED_RR).
func threadPolicies(pid int) []string {
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	var out []string
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) > 38 {
			out = append(out, f[38]) // field 41; f[0] is field 3
		}
	}
	return out
}

// TestRigOneUser: while a test binary holds a rig, `rig up` and `rig
// down` by anyone else (a person's shell, another test binary) fail at
// once with one line naming it, and change nothing; the rig commands the
// holder starts act for it.
func TestRigOneUser(t *testing.T) {
	bin := binDir(t)
	name := "kt-user"
	r, err := rig.New(rig.Config{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Hold(); err != nil {
		t.Fatal(err)
	}
	var stranger []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, rig.HolderEnv+"=") {
			stranger = append(stranger, kv)
		}
	}
	for _, args := range [][]string{{"up", "2"}, {"down"}} {
		cmd := exec.Command(filepath.Join(bin, "rig"), append([]string{"--name", name}, args...)...)
		cmd.Env = stranger
		out, err := cmd.CombinedOutput()
		want := fmt.Sprintf("rig %s is in use by pid %d (", name, os.Getpid())
		if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); err == nil || len(lines) != 1 || !strings.Contains(lines[0], want) {
			t.Errorf("rig %s by another process while this one holds it: %v, %q; want a failure, one line with %q", args[0], err, out, want)
		}
		if _, err := os.Stat(rigDir(name)); !os.IsNotExist(err) {
			t.Errorf("a refused rig %s made %s: %v", args[0], rigDir(name), err)
		}
	}
	mustRig(t, name, "down") // the holder's own: acts for it
}

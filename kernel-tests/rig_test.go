package kerneltests

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
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
		if strings.Contains(l, "/rig/"+name) || strings.Contains(l, "/netns/"+name+"-") {
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

// TestRigLifecycle is the rig as a user drives it: up, idempotent up, a
// command in each node, status, and down leaving nothing behind.
func TestRigLifecycle(t *testing.T) {
	binDir(t)
	const name = "ktlife"
	before := traceHost(t, name)
	t.Cleanup(func() { rigCommand(context.Background(), name, "down") })

	mustRig(t, name, "up", "3")
	mustRig(t, name, "up", "3") // idempotent

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

	var st struct {
		Up    bool `json:"up"`
		Nodes []struct {
			Name   string `json:"name"`
			Exists bool   `json:"exists"`
			LinkUp bool   `json:"link_up"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal([]byte(mustRig(t, name, "status", "--json")), &st); err != nil {
		t.Fatalf("status --json: %v", err)
	}
	if !st.Up || len(st.Nodes) != 3 {
		t.Fatalf("status: up=%v with %d nodes, want up with 3", st.Up, len(st.Nodes))
	}
	for _, n := range st.Nodes {
		if !n.Exists || !n.LinkUp {
			t.Errorf("status: %s exists=%v link_up=%v", n.Name, n.Exists, n.LinkUp)
		}
	}

	// Bad input: one line, non-zero exit, nothing changed.
	for _, args := range [][]string{{"up", "4"}, {"up", "x"}, {"exec", "node7", "--", "true"}, {"exec", "node0"}} {
		out, err := rigCommand(context.Background(), name, args...)
		if err == nil {
			t.Errorf("rig %v: succeeded, want an error", args)
		}
		if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 || !strings.HasPrefix(lines[0], "rig:") {
			t.Errorf("rig %v: want one line starting with rig:, got %q", args, out)
		}
	}

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
	if _, err := os.Stat("/run/mpipause/rig/" + name); !os.IsNotExist(err) {
		t.Errorf("state directory left behind: %v", err)
	}
	if out, err := rigCommand(context.Background(), name, "exec", "node1", "--", "hostname"); err == nil {
		t.Errorf("exec after down succeeded: %q", out)
	}
}

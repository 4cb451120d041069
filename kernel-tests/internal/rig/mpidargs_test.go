package rig

import (
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestMPIDArgsEnv: MPIPAUSE_RIG_MPID_ARGS adds to every node's mpid
// command line, after the rig's own arguments.
func TestMPIDArgsEnv(t *testing.T) {
	r, err := New(Config{Name: "x", Exe: "/opt/bin/rig", BinDir: "/opt/bin", StateRoot: "/run/x"})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(MPIDArgsEnv, "")
	base := r.MPIDArgs(1, 3)
	if slices.Contains(base, "--metrics-listen") {
		t.Fatalf("without %s: %v", MPIDArgsEnv, base)
	}
	t.Setenv(MPIDArgsEnv, " --metrics-listen  127.0.0.1:9717\t--drain-timeout 5s ")
	want := append(slices.Clone(base), "--metrics-listen", "127.0.0.1:9717", "--drain-timeout", "5s")
	if d := cmp.Diff(want, r.MPIDArgs(1, 3)); d != "" {
		t.Errorf("MPIDArgs (-want +got):\n%s", d)
	}
}

// TestMPIDEnv: MPIPAUSE_RIG_MPID picks the mpid binary up starts (the
// tests' build with failpoints); without it, BinDir/mpid.
func TestMPIDEnv(t *testing.T) {
	r, err := New(Config{Name: "x", Exe: "/opt/bin/rig", BinDir: "/opt/bin", StateRoot: "/run/x"})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(MPIDEnv, "")
	if p := r.mpidPath(); p != "/opt/bin/mpid" {
		t.Errorf("without %s: %s, want /opt/bin/mpid", MPIDEnv, p)
	}
	t.Setenv(MPIDEnv, "/opt/bin/test/mpid")
	if p := r.mpidPath(); p != "/opt/bin/test/mpid" {
		t.Errorf("%s=/opt/bin/test/mpid: %s", MPIDEnv, p)
	}
}

// TestNodePath: a node's /run/mpipause is its own directory on the host;
// every other path is the host's.
func TestNodePath(t *testing.T) {
	r, err := New(Config{Name: "x", Exe: "/opt/bin/rig", StateRoot: "/run/x"})
	if err != nil {
		t.Fatal(err)
	}
	for in, want := range map[string]string{
		"/run/mpipause/ctl.sock":      "/run/x/x/run/node1/ctl.sock",
		"/run/mpipause/mpid-node1/j1": "/run/x/x/run/node1/mpid-node1/j1",
		"/run/mpipause":               "/run/x/x/run/node1",
		"/run/mpipause-rig/x/ssh":     "/run/mpipause-rig/x/ssh",
		"/run/mpipausex/a":            "/run/mpipausex/a",
		"/etc/hosts":                  "/etc/hosts",
	} {
		if got := r.NodePath(1, in); got != want {
			t.Errorf("NodePath(1, %s) = %s, want %s", in, got, want)
		}
	}
}

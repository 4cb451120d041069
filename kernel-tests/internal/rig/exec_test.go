package rig

import (
	"os"
	"strings"
	"testing"
)

func TestParseSSH(t *testing.T) {
	for _, tc := range []struct {
		args          []string
		host, command string
		err           string
	}{
		// What Open MPI's plm_rsh and Hydra's ssh launcher pass.
		{args: []string{"-x", "node1", "orted", "-mca", "ess", "env"}, host: "node1", command: "orted -mca ess env"},
		{args: []string{"node2", "/usr/bin/hydra_pmi_proxy --control-port node0:3456"}, host: "node2", command: "/usr/bin/hydra_pmi_proxy --control-port node0:3456"},
		{args: []string{"-p", "22", "-oBatchMode=yes", "root@node0", "true"}, host: "node0", command: "true"},
		{args: []string{"-xq", "-l", "root", "node1", "a", "b"}, host: "node1", command: "a b"},
		{args: []string{"--", "node1", "true"}, host: "node1", command: "true"},
		{args: []string{"-x"}, err: "no host"},
		{args: []string{"-p", "22"}, err: "no host"},
		{args: []string{"node1"}, err: "no command"},
	} {
		host, command, err := ParseSSH(tc.args)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseSSH(%q): err %v, want %q", tc.args, err, tc.err)
			}
			continue
		}
		if err != nil || host != tc.host || command != tc.command {
			t.Errorf("ParseSSH(%q) = %q, %q, %v; want %q, %q", tc.args, host, command, err, tc.host, tc.command)
		}
	}
}

func TestNodeEnv(t *testing.T) {
	r, err := New(Config{Name: "x", Exe: "/opt/bin/rig", BinDir: "/opt/bin"})
	if err != nil {
		t.Fatal(err)
	}
	st := &State{Agent: "/run/mpipause-rig/x/ssh"}
	env := r.nodeEnv([]string{"PATH=/usr/bin", "HOSTNAME=host", "MPIPAUSE_RIG_NODE=node9", "UCX_TLS=rc", "HOME=/root"}, 1, st)
	get := func(k string) []string {
		var v []string
		for _, kv := range env {
			if strings.HasPrefix(kv, k+"=") {
				v = append(v, kv[len(k)+1:])
			}
		}
		return v
	}
	for k, want := range map[string]string{
		"PATH":                   "/opt/bin:/usr/bin",
		NameEnv:                  "x",
		NodeEnv:                  "node1",
		"UCX_TLS":                "rc", // the user's choice wins
		"HOME":                   "/root",
		"OMPI_MCA_plm_rsh_agent": st.Agent,
		"HYDRA_LAUNCHER_EXEC":    st.Agent,
	} {
		if v := get(k); len(v) != 1 || v[0] != want {
			t.Errorf("%s = %q, want exactly %q", k, v, want)
		}
	}
	if v := get("HOSTNAME"); len(v) != 0 {
		t.Errorf("HOSTNAME passed through as %q: it names the caller's node", v)
	}
}

func TestNodeEnvPreloadsFinalizeFix(t *testing.T) {
	bin := t.TempDir()
	if err := os.WriteFile(bin+"/"+FinalizeFixLib, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{Name: "x", Exe: bin + "/rig", BinDir: bin})
	if err != nil {
		t.Fatal(err)
	}
	fix := bin + "/" + FinalizeFixLib
	for user, want := range map[string]string{
		"":                          fix,
		"LD_PRELOAD=/lib/shim.so":   fix + ":/lib/shim.so", // the user's preload still loads
		"LD_PRELOAD=" + fix + ":/a": fix + ":/a",           // not twice (rig exec inside a node)
	} {
		env := []string{"PATH=/usr/bin"}
		if user != "" {
			env = append(env, user)
		}
		var got []string
		for _, kv := range r.nodeEnv(env, 0, &State{}) {
			if strings.HasPrefix(kv, "LD_PRELOAD=") {
				got = append(got, strings.TrimPrefix(kv, "LD_PRELOAD="))
			}
		}
		if len(got) != 1 || got[0] != want {
			t.Errorf("with %q: LD_PRELOAD %q, want exactly %q", user, got, want)
		}
	}
}

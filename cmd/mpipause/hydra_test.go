package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestInjectHydraRemoteRanks runs MPICH's real mpiexec with inject's command
// line and environment, its proxies started on two "remote" nodes by an ssh
// stand-in that, as sshd does, gives them a clean environment: each rank must
// see the job id and the job key, which then can only have come through
// Hydra's control connection (-genv, -genvlist), and the key must be on no
// command line the launcher agent was given. Before the key was put first
// in mpiexec's environment, Hydra 4.0 dropped it here (inject's comment).
func TestInjectHydraRemoteRanks(t *testing.T) {
	mpiexec, err := exec.LookPath("mpiexec.mpich")
	if err != nil {
		t.Skip("no mpiexec.mpich (MPICH's Hydra; make deps installs it)")
	}
	dir := t.TempDir()
	agentLog := filepath.Join(dir, "agent.log")
	// ssh [options] host command...: the command words joined by spaces,
	// run by sh in an environment with nothing of the caller's.
	agent := filepath.Join(dir, "ssh")
	write(t, agent, `#!/bin/sh
printf '%s\n' "$*" >>`+agentLog+`
while [ "${1#-}" != "$1" ]; do shift; done
shift
exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/ sh -c "$*"
`)
	rank := filepath.Join(dir, "rank")
	write(t, rank, "#!/bin/sh\necho \"rank id=$MPIPAUSE_JOBID key=$"+ctl.TokenEnv+"\"\n")

	const key = "node0:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	// Non-local host names, so that Hydra starts both proxies with the agent.
	argv := []string{mpiexec, "-launcher", "ssh", "-launcher-exec", agent,
		"-hosts", "mpipause-test-remote1,mpipause-test-remote2", "-n", "2", rank}
	environ := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	argv, env := inject("hydra", argv, environ, "j1", key, "")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%q: %v\n%s", argv, err, out)
	}
	want := "rank id=j1 key=" + key
	if n := strings.Count(string(out), want+"\n"); n != 2 {
		t.Errorf("%d of 2 ranks started through the ssh agent have the job id and key (%q); output:\n%s", n, want, out)
	}
	b, err := os.ReadFile(agentLog)
	if err != nil {
		t.Fatalf("the ssh agent was not used: %v", err)
	}
	if strings.Count(string(b), "\n") != 2 {
		t.Errorf("the ssh agent started %q, want 2 proxies", b)
	}
	if strings.Contains(string(b), key[len("node0:"):]) {
		t.Errorf("the job key is on a proxy's command line: %q", b)
	}
}

func write(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o755); err != nil {
		t.Fatal(err)
	}
}

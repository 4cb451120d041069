package kerneltests

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/ranks"
)

// squatEnv makes the test binary a squatter (squat) on the address it names.
const squatEnv = "MPIPAUSE_KT_SQUAT"

// squat is what another local user would do while mpid is down: bind
// mpid's address and, to whoever connects, read a request and answer with
// a forged "paused" and a forged job key (what the SPANK plugin asks mpid
// for). It says "bound" or "refused: why" on stdout and serves until
// killed.
func squat(addr string) int {
	ln, err := net.Listen("unix", addr)
	if err != nil {
		fmt.Println("refused:", err)
		return 3
	}
	fmt.Println("bound")
	for {
		c, err := ln.Accept()
		if err != nil {
			return 1
		}
		bufio.NewReader(c).ReadString('\n')
		fmt.Fprintln(c, `{"job":{"job":"j1","state":"paused","owner_uid":0,"ranks":2,"nodes":["node1"],"node":"node1"},"token":"`+forgedMarker+`","final":true}`)
		c.Close()
	}
}

// squatter is a copy of the test binary that uid 1001 may run (the test
// binary's own directory is private).
func squatter(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(publicCopies(t, map[string]string{exe: "squat"}), "squat")
}

// startSquat runs the squatter as uid in node on addr and returns it once
// it has said whether it bound.
func startSquat(ctx context.Context, t *testing.T, bin string, uid int, node, addr string) (*proc, bool) {
	t.Helper()
	p := start(ctx, t, "", []string{"MPIPAUSE_RIG=" + jobRig, squatEnv + "=" + addr},
		append(append([]string{filepath.Join(binDir(t), "rig"), "exec", node, "--"}, asUser(uid)...), bin)...)
	var said string
	waitFor(t, "the squatter on "+addr+" to say whether it bound", time.Minute, p.done, func() bool {
		said = p.out.String()
		return strings.Contains(said, "\n")
	})
	if !strings.HasPrefix(said, "bound") && !strings.HasPrefix(said, "refused:") {
		t.Fatalf("squatter on %s in %s: %q", addr, node, said)
	}
	return p, strings.HasPrefix(said, "bound")
}

// TestEndpointsNotSquattable (docs/security.md, M3): while a node's mpid is down, an
// unprivileged user cannot take its rank or control socket (the defaults
// are paths in a directory only root may write, no longer abstract names
// anyone can bind), so mpid starts again on them and the real CLI talks to
// it; and where an address is abstract (configured, as tests do), root's
// CLI refuses the answer of the user who took it rather than print it.
func TestEndpointsNotSquattable(t *testing.T) {
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	repairRigOnCleanup(t)
	bin := squatter(t)
	stopRigMPIDs(t, 1)
	for _, addr := range []string{ranks.DefaultAddr, ctl.DefaultAddr} {
		p, bound := startSquat(ctx, t, bin, attackerUID, "node1", addr)
		if bound {
			t.Errorf("uid 1001 took %s on node1 while its mpid was down", addr)
			p.cmd.Process.Kill()
			<-p.done
		}
	}
	// The control: that user can take an abstract name, and what answers
	// there is not believed.
	abs := fmt.Sprintf("@mpipause-kt-squat-%d", os.Getpid())
	p, bound := startSquat(ctx, t, bin, attackerUID, "node1", abs)
	if !bound {
		t.Fatalf("uid 1001 could not take the abstract %s either: %s", abs, p.out.String())
	}
	r := cli(ctx, t, "node1", []string{"MPIPAUSE_CTL_SOCKET=" + abs}, "status", "j1")
	if want := abs + " is served by uid 1001, not by root"; r.code != 6 || !strings.Contains(r.stderr, want) || strings.Contains(r.stdout, "paused") {
		t.Errorf("root's mpipause status against uid 1001's server: exit %d, stdout %q, stderr %q; want exit 6 (no mpid) and %q", r.code, r.stdout, r.stderr, want)
	}
	p.cmd.Process.Kill()
	<-p.done

	if _, err := startRigMPIDs(t); err != nil {
		t.Fatalf("node1's mpid does not start again: %v", err)
	}
	if r := cli(ctx, t, "node1", nil, "list"); r.code != 0 {
		t.Errorf("mpipause list on node1 once its mpid is back: exit %d: %s%s", r.code, r.stdout, r.stderr)
	}
	for _, addr := range []string{ranks.DefaultAddr, ctl.DefaultAddr} {
		host := nodeHostPath(t, jobRig, 1, addr)
		fi, err := os.Stat(host)
		if err != nil {
			t.Errorf("node1's %s (on the host %s): %v", addr, host, err)
		} else if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o666 {
			t.Errorf("node1's %s (on the host %s): mode %v; want a socket, mode 0666", addr, host, fi.Mode())
		}
	}
}

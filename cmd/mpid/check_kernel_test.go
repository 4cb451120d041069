package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
	"golang.org/x/sys/unix"
)

// TestCheckOnThisNode runs the real, built `mpid check` on this machine, as
// a site runs it, with a settings file of its own (a key it made, sockets,
// state and cgroup parent of its own, a free peer port): the table and the
// JSON say the same rows, the exit code follows them, the kernel row names
// this kernel, and the check left nothing behind. Then with a real mpid
// serving that configuration, the check names it as what holds the port
// and the sockets.
func TestCheckOnThisNode(t *testing.T) {
	testutil.RequirePrivileged(t)
	dir := t.TempDir()
	bin := filepath.Join(dir, "mpid")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// The shim where mpipause run would look beside this mpid, if the
	// tree has one built (make build, which make test runs first).
	shim := false
	if b, err := os.ReadFile("../../bin/libmpipause.so"); err == nil {
		if err := os.WriteFile(filepath.Join(dir, "libmpipause.so"), b, 0o644); err != nil {
			t.Fatal(err)
		}
		shim = true
	}
	key := filepath.Join(dir, "cluster.key")
	if out, err := exec.Command(bin, "keygen", key).CombinedOutput(); err != nil {
		t.Fatalf("mpid keygen: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	parent := fmt.Sprintf("mpipause-checktest-%d", os.Getpid())
	state := filepath.Join(dir, "state")
	conf := filepath.Join(dir, "mpid.conf")
	settings := fmt.Sprintf("cluster-key = %s\npeer-port = %d\nrank-socket = %s\nctl-socket = %s\nstate-dir = %s\ncgroup-parent = %s\nnice = 0\nrt-priority = 0\n",
		key, port, filepath.Join(dir, "rank.sock"), filepath.Join(dir, "ctl.sock"), state, parent)
	if err := os.WriteFile(conf, []byte(settings), 0o644); err != nil {
		t.Fatal(err)
	}
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(u.Release[:])

	run := func(args ...string) (string, int) {
		t.Helper()
		cmd := exec.Command(bin, append([]string{"check", "--config", conf}, args...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if stderr.Len() > 0 {
			t.Errorf("mpid check %q wrote to stderr: %s", args, stderr.String())
		}
		return string(out), code
	}
	check := func() map[string]checkRow {
		t.Helper()
		table, code := run()
		js, jcode := run("--json")
		t.Logf("mpid check:\n%s", table)
		var rep checkReport
		if err := json.Unmarshal([]byte(js), &rep); err != nil {
			t.Fatalf("--json does not parse: %v\n%s", err, js)
		}
		lines := strings.Split(strings.TrimRight(table, "\n"), "\n")
		if f := strings.Fields(lines[0]); len(f) < 3 || f[0] != "check" || f[1] != "status" {
			t.Errorf("table header %q", lines[0])
		}
		rows := map[string]checkRow{}
		missing := false
		for _, r := range rep.Rows {
			rows[r.Name] = r
			missing = missing || r.Status == statusMissing
			found := false
			for _, l := range lines {
				// Name and status: the two runs read a live node, whose
				// details (the bpffs mounts other tests make) may change
				// between them; the in-process tests compare details of
				// one report.
				if f := strings.Fields(l); len(f) >= 2 && f[0] == r.Name && f[1] == r.Status {
					found = true
				}
			}
			if !found {
				t.Errorf("JSON row %+v is not a row of the table", r)
			}
			if (r.Status == statusOK) != (r.Fix == "") {
				t.Errorf("row %+v: a fix for each row not ok, and only those", r)
			}
		}
		want := 0
		if missing {
			want = 1
		}
		if code != want || jcode != want || rep.Ready == missing {
			t.Errorf("exit %d (--json %d), ready %v; want %d: a row missing is %v", code, jcode, rep.Ready, want, missing)
		}
		if r := rows["kernel"]; !strings.Contains(r.Detail, release) {
			t.Errorf("kernel row %+v does not name this kernel, %s", r, release)
		}
		for _, name := range []string{"config", "btf", "capabilities", "cap-sys-ptrace", "cap-sys-nice", "memlock", "bpf-sockops", "cgroup2", "freezer", "state-dir", "cluster-key"} {
			if r := rows[name]; r.Status != statusOK {
				t.Errorf("row %s: %+v; want ok on this machine, as root", name, r)
			}
		}
		if r := rows["shim"]; (r.Status == statusOK) != shim {
			t.Errorf("shim row %+v; a shim beside mpid: %v", r, shim)
		}
		return rows
	}

	rows := check()
	for name, want := range map[string]string{"peer-port": fmt.Sprintf("TCP :%d free", port), "rank-socket": "free", "ctl-socket": "free", "config": conf + ": 8 settings"} {
		if r := rows[name]; r.Status != statusOK || !strings.Contains(r.Detail, want) {
			t.Errorf("row %s: %+v; want ok, %q", name, r, want)
		}
	}
	// Nothing made, nothing left.
	for _, p := range []string{filepath.Join(root, parent), state, filepath.Join(dir, "rank.sock"), filepath.Join(dir, "ctl.sock")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("mpid check left %s", p)
		}
	}

	// With an mpid serving this configuration.
	ready := filepath.Join(dir, "ready")
	d := exec.Command(bin, "--config", conf, "--ready-file", ready)
	var log bytes.Buffer
	d.Stderr = &log
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		d.Process.Signal(unix.SIGTERM)
		d.Wait()
		os.Remove(filepath.Join(root, parent)) // the cgroup parent, if mpid made one
	}()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(ready); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("mpid not ready after 20 s:\n%s", log.String())
		}
	}
	rows = check()
	pid := strconv.Itoa(d.Process.Pid)
	for _, name := range []string{"peer-port", "rank-socket", "ctl-socket"} {
		if r := rows[name]; r.Status != statusOK || !strings.Contains(r.Detail, "mpid (pid "+pid+")") {
			t.Errorf("row %s: %+v; want ok, held by mpid (pid %s)", name, r, pid)
		}
	}
}

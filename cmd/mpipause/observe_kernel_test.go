package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/mountinfo"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// The test binary doubles as the mpipause command (for runs with dropped
// capabilities) and as a process that holds a loopback connection with
// unread bytes (for runs against a real job cgroup).
const (
	modeEnv  = "MPIPAUSE_CLI_TEST_MODE"
	holdSize = 70001
)

func TestMain(m *testing.M) {
	switch os.Getenv(modeEnv) {
	case "cli":
		st, _ := os.Stdout.Stat()
		os.Exit(run(context.Background(), &env{stdout: os.Stdout, stderr: os.Stderr, isTTY: st != nil && st.Mode()&os.ModeCharDevice != 0}, os.Args[1:]))
	case "hold":
		os.Exit(hold())
	}
	os.Exit(m.Run())
}

// hold connects to itself over loopback, writes holdSize bytes that nobody
// reads, says where, and keeps everything open until stdin closes.
func hold() int {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		fmt.Println("err", err)
		return 1
	}
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		fmt.Println("err", err)
		return 1
	}
	s, err := ln.Accept()
	if err != nil {
		fmt.Println("err", err)
		return 1
	}
	if _, err := c.Write(make([]byte, holdSize)); err != nil {
		fmt.Println("err", err)
		return 1
	}
	fmt.Println("ready", c.LocalAddr(), s.LocalAddr())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	return 0
}

// cli runs the test binary as mpipause, optionally with every capability dropped.
func cli(t *testing.T, dropCaps bool, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	argv := append([]string{os.Args[0]}, args...)
	if dropCaps {
		argv = append([]string{"setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), modeEnv+"=cli")
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String(), errb.String()
	} else if err != nil {
		t.Fatalf("run %v: %v", argv, err)
	}
	return 0, out.String(), errb.String()
}

// pinned lists what mpipause has pinned in any mounted bpffs.
func pinned(t *testing.T) []string {
	t.Helper()
	mounts, err := mountinfo.Read(mountinfo.Self)
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, m := range mounts {
		if m.FSType != "bpf" {
			continue
		}
		dir := filepath.Join(m.Point, "mpipause")
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			found = append(found, filepath.Join(dir, e.Name()))
		}
	}
	return found
}

func TestObserveBadInput(t *testing.T) {
	testutil.RequirePrivileged(t)
	before := pinned(t)
	tests := []struct {
		name     string
		drop     bool
		args     []string
		wantCode int
		want     string // in stderr
	}{
		{name: "unknown cgroup", args: []string{"observe", "--cgroup", "no/such/job"}, wantCode: 1, want: `"no/such/job" is not a cgroup v2 directory`},
		{name: "bpf without privileges", drop: true, args: []string{"observe", "--observer", "bpf"}, wantCode: 1, want: "run as root"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, _, stderr := cli(t, tt.drop, tt.args...)
			if code != tt.wantCode {
				t.Errorf("exit code = %d, want %d; stderr %q", code, tt.wantCode, stderr)
			}
			if !strings.Contains(stderr, tt.want) {
				t.Errorf("stderr = %q, want it to contain %q", stderr, tt.want)
			}
			if n := strings.Count(strings.TrimRight(stderr, "\n"), "\n"); n != 0 {
				t.Errorf("stderr has %d lines, want one: %q", n+1, stderr)
			}
			if after := pinned(t); len(after) != len(before) {
				t.Errorf("pinned state changed: before %v, after %v", before, after)
			}
		})
	}
}

func TestObserveFallsBackWithoutPrivileges(t *testing.T) {
	testutil.RequirePrivileged(t)
	code, stdout, stderr := cli(t, true, "observe", "--json")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	if !strings.Contains(stderr, "using sock_diag") {
		t.Errorf("stderr = %q, want the fallback named", stderr)
	}
	var rep report
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("stdout is not JSON: %v\n%s", err, stdout)
	}
	if rep.Observer != "sock_diag" {
		t.Errorf("observer = %q, want sock_diag", rep.Observer)
	}
}

// TestObserveJob runs the real command against a fresh cgroup holding a
// connection with a known number of unread bytes, with both observers.
func TestObserveJob(t *testing.T) {
	testutil.RequirePrivileged(t)
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	cg := testutil.NewCgroup(t)

	// The holder enters the cgroup before it creates its sockets: a socket
	// belongs to the cgroup of the process that created it.
	cmd := exec.Command("sh", "-c", `echo $$ > "$0/cgroup.procs" && exec "$1"`, cg, os.Args[0])
	cmd.Env = append(os.Environ(), modeEnv+"=hold")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 3 || f[0] != "ready" {
		t.Fatalf("holder said %q (%v)", line, err)
	}
	client, server := f[1], f[2]

	for _, kind := range []string{"bpf", "sock_diag"} {
		t.Run(kind, func(t *testing.T) {
			rel := strings.TrimPrefix(cg, root+"/")
			code, out, stderr := cli(t, false, "observe", "--cgroup", rel, "--observer", kind, "--json")
			if code != 0 {
				t.Fatalf("exit code %d, stderr %q", code, stderr)
			}
			var rep report
			if err := json.Unmarshal([]byte(out), &rep); err != nil {
				t.Fatalf("stdout is not JSON: %v\n%s", err, out)
			}
			if rep.Observer != kind || rep.Summary.Connections != 2 {
				t.Fatalf("observer %q with %d connections, want %s with 2:\n%s", rep.Observer, rep.Summary.Connections, kind, out)
			}
			for _, c := range rep.Connections {
				wantUnread := uint32(0)
				if c.Local == server && c.Remote == client {
					wantUnread = holdSize
				} else if c.Local != client || c.Remote != server {
					t.Errorf("connection %s -> %s is not the holder's", c.Local, c.Remote)
				}
				if c.Unread != wantUnread || c.SendQueue != 0 {
					t.Errorf("%s -> %s: unread %d, send queue %d; want %d and 0", c.Local, c.Remote, c.Unread, c.SendQueue, wantUnread)
				}
			}
			if rep.Summary.InflightBytes != holdSize || rep.Summary.NonEmpty != 1 {
				t.Errorf("summary %+v, want %d bytes in flight on 1 connection", rep.Summary, holdSize)
			}
		})
	}
}

// TestObserveNamesWhatItCannotSee: an unprivileged observe of a job with
// processes in network namespaces it may not enter (same user, no
// CAP_SYS_ADMIN) or not even name (another user's process) shows what it
// can and lists the rest under "skipped", in JSON and in the table, instead
// of reporting the visible part as the whole job. As root nothing is skipped.
func TestObserveNamesWhatItCannotSee(t *testing.T) {
	testutil.RequirePrivileged(t)
	const me, other = 4242, 4343
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	cg := testutil.NewCgroup(t)
	cgfd, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	defer cgfd.Close()

	// A process in a new network namespace of its own, started in cg.
	sleeper := func(uid uint32) *exec.Cmd {
		c := exec.Command("sleep", "600")
		c.SysProcAttr = &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWNET,
			Credential:  &syscall.Credential{Uid: uid, Gid: uid},
			UseCgroupFD: true,
			CgroupFD:    int(cgfd.Fd()),
		}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Kill(); _ = c.Wait() })
		return c
	}
	mine, others := sleeper(me), sleeper(other)
	// And the job's one visible connection, in the observer's namespace.
	hold := exec.Command(os.Args[0])
	hold.Env = append(os.Environ(), modeEnv+"=hold")
	hold.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cgfd.Fd())}
	stdin, _ := hold.StdinPipe()
	stdout, _ := hold.StdoutPipe()
	if err := hold.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = hold.Wait() })
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("holder said %q (%v)", line, err)
	}

	// The observer runs as user me from a copy of this binary that user may run.
	dir, err := os.MkdirTemp("", "mpipause-observe-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "mpipause")
	if b, err := os.ReadFile(os.Args[0]); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	rel := strings.TrimPrefix(cg, root+"/")
	asUser := func(args ...string) (string, string) {
		t.Helper()
		argv := append([]string{"--reuid", strconv.Itoa(me), "--regid", strconv.Itoa(me), "--clear-groups",
			"--inh-caps=-all", "--bounding-set=-all", "--", bin, "observe", "--cgroup", rel}, args...)
		c := exec.Command("setpriv", argv...)
		c.Env = append(os.Environ(), modeEnv+"=cli")
		var out, errb strings.Builder
		c.Stdout, c.Stderr = &out, &errb
		if err := c.Run(); err != nil {
			t.Fatalf("observe as uid %d: %v; stderr %q", me, err, errb.String())
		}
		return out.String(), errb.String()
	}

	out, stderr := asUser("--json")
	var rep report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("stdout is not JSON: %v\n%s\nstderr %s", err, out, stderr)
	}
	if rep.Observer != "sock_diag" || rep.Summary.Connections != 2 {
		t.Errorf("observer %s saw %d connections, want sock_diag and the holder's 2", rep.Observer, rep.Summary.Connections)
	}
	var enter, name bool
	for _, s := range rep.Skipped {
		enter = enter || strings.Contains(s, "CAP_SYS_ADMIN")
		name = name || strings.Contains(s, "pid "+strconv.Itoa(others.Process.Pid)) && strings.Contains(s, "not readable")
		if strings.Contains(s, "pid "+strconv.Itoa(mine.Process.Pid)) {
			t.Errorf("skipped %q: the observer's own user's process is readable", s)
		}
	}
	if len(rep.Skipped) != 2 || !enter || !name {
		t.Errorf("skipped %q; want the namespace it may not enter and pid %d's it may not name", rep.Skipped, others.Process.Pid)
	}

	table, _ := asUser()
	if n := strings.Count(table, "\nnot seen: "); n != 2 || !strings.Contains(table, "run as root") {
		t.Errorf("table has %d \"not seen\" lines, want 2 that say to run as root:\n%s", n, table)
	}

	// As root every namespace is entered: nothing skipped.
	for _, kind := range []string{"bpf", "sock_diag"} {
		code, out, stderr := cli(t, false, "observe", "--cgroup", rel, "--observer", kind, "--json")
		if code != 0 {
			t.Fatalf("%s as root: exit %d, stderr %q", kind, code, stderr)
		}
		var rep report
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("%s: stdout is not JSON: %v\n%s", kind, err, out)
		}
		if rep.Skipped == nil || len(rep.Skipped) != 0 || rep.Summary.Connections != 2 {
			t.Errorf("%s as root: skipped %q, %d connections; want [] and 2", kind, rep.Skipped, rep.Summary.Connections)
		}
	}
}

// TestObserveTreeBound: `mpipause observe` of a cgroup with more cgroups
// below it than mpid's observers read (loader.MaxBelow), as a Slurm or
// systemd parent has, reads the whole tree with both observers: the
// person running it named the tree, and the bound is mpid's.
func TestObserveTreeBound(t *testing.T) {
	testutil.RequirePrivileged(t)
	cg := testutil.NewCgroup(t)
	for i := range loader.MaxBelow + 1 {
		dir := filepath.Join(cg, fmt.Sprintf("c%d", i))
		if err := cgroupv2.Create(dir); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cgroupv2.RemoveEmpty(dir) })
	}
	for _, kind := range []string{loader.KindBPF, loader.KindSockDiag} {
		t.Run(kind, func(t *testing.T) {
			code, stdout, stderr := cli(t, false, "observe", "--cgroup", cg, "--observer", kind, "--json")
			var rep report
			if code != 0 || json.Unmarshal([]byte(stdout), &rep) != nil {
				t.Fatalf("a tree of %d cgroups below: exit %d, stderr %q, stdout %q; want exit 0 and a report", loader.MaxBelow+1, code, stderr, stdout)
			}
		})
	}
}

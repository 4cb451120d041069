package ctl

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

// fakeEnv makes the test binary a fake mpid of uid 1001 at the address it
// names (TestDoRefusesOtherUser).
const fakeEnv = "MPIPAUSE_CTL_TEST_FAKE"

func TestMain(m *testing.M) {
	if addr := os.Getenv(fakeEnv); addr != "" {
		os.Exit(fakeMpid(addr))
	}
	os.Exit(m.Run())
}

// fakeMpid becomes uid 1001, serves addr with a forged "paused" for every
// request, says "ready" on stdout and exits when stdin closes.
func fakeMpid(addr string) int {
	for _, err := range []error{syscall.Setgroups(nil), syscall.Setresgid(1001, 1001, 1001), syscall.Setresuid(1001, 1001, 1001)} {
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake mpid: become uid 1001:", err)
			return 1
		}
	}
	ln, err := net.Listen("unix", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake mpid:", err)
		return 1
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ReadRequest(bufio.NewReader(c))
			Write(c, Reply{Job: &Job{ID: "j1", State: StatePaused}, Final: true})
			c.Close()
		}
	}()
	fmt.Println("ready")
	os.Stdin.Read(make([]byte, 1))
	return 0
}

// TestDoRefusesOtherUser: a control socket served by a user other than
// root (and the caller) is refused before its answer is read: the forged
// "paused" of a squatter on the address never reaches the caller.
func TestDoRefusesOtherUser(t *testing.T) {
	testutil.RequirePrivileged(t) // setresuid, in the fake
	addr := fmt.Sprintf("@mpipause-ctl-test-squat-%d", os.Getpid())
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), fakeEnv+"="+addr)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	if l, err := bufio.NewReader(stdout).ReadString('\n'); l != "ready\n" {
		t.Fatalf("fake mpid did not start: %q %v", l, err)
	}
	r, err := Do(context.Background(), addr, Request{Op: OpStatus, Job: "j1"}, nil)
	var ce *Error
	want := addr + " is served by uid 1001, not by root"
	if !errors.As(err, &ce) || ce.Code != CodeUnavailable || !strings.Contains(ce.Message, want) || strings.Contains(ce.Message, "\n") {
		t.Fatalf("Do against uid 1001's server: %+v, %v; want an unavailable error, one line saying %q", r, err, want)
	}
}

func TestReadRequest(t *testing.T) {
	good := []string{
		`{"version":1,"op":"pause","job":"j1"}`,
		`{"version":1,"op":"pause","job":"j1","timeout_ns":1000000000}`,
		`{"version":1,"op":"status"}`,
		`{"version":1,"op":"list"}`,
	}
	for _, l := range good {
		if _, err := ReadRequest(bufio.NewReader(strings.NewReader(l + "\n"))); err != nil {
			t.Errorf("%s: %v", l, err)
		}
	}
	bad := map[string]string{
		`{"version":2,"op":"pause","job":"j1"}`:                          "version 2",
		`{"version":1,"op":"kill","job":"j1"}`:                           `unknown operation "kill"`,
		`{"version":1,"op":"pause"}`:                                     `job id ""`,
		`{"version":1,"op":"resume","job":"../x"}`:                       `job id "../x"`,
		`{"version":1,"op":"pause","job":"j","uid":0}`:                   "unknown field",
		`{"version":1,"op":"pause","job":"j","timeout_ns":-1}`:           "negative timeout",
		`{"version":1,"op":"pause","job":"j","timeout_ns":600000000001}`: "at most 10m0s",
		`not json`: "malformed",
		`{"version":1,"op":"list","job":"` + strings.Repeat("a", MaxRequest) + `"}`: "longer than",
	}
	for l, want := range bad {
		_, err := ReadRequest(bufio.NewReader(strings.NewReader(l + "\n")))
		var ce *Error
		if !errors.As(err, &ce) || ce.Code != CodeBadRequest || !strings.Contains(ce.Message, want) {
			t.Errorf("%.60s: %v; want a bad-request error saying %q", l, err, want)
		}
	}
}

func TestValidJobID(t *testing.T) {
	for _, id := range []string{"j", "12345.0", "a-b_c:d@e", strings.Repeat("x", 128)} {
		if err := ValidJobID(id); err != nil {
			t.Errorf("%q: %v", id, err)
		}
	}
	for _, id := range []string{"", ".", "..", "a/b", "a b", "a=b", "a,b", "a\n", strings.Repeat("x", 129), "café"} {
		if err := ValidJobID(id); err == nil {
			t.Errorf("%q accepted", id)
		}
	}
}

// TestDo: progress lines reach the callback in order, the final line ends
// the exchange, a refusal comes back as *Error, a peer that hangs up early
// is "unavailable".
func TestDo(t *testing.T) {
	addr := fmt.Sprintf("@mpipause-ctl-test-%d", time.Now().UnixNano())
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			req, _ := ReadRequest(bufio.NewReader(c))
			switch req.Job {
			case "ok":
				Write(c, Reply{Progress: &Progress{Phase: "PREPARE", Round: 1}})
				Write(c, Reply{Progress: &Progress{Phase: "DRAIN", Round: 2}})
				Write(c, Reply{Job: &Job{ID: "ok", State: StatePaused}, Final: true})
			case "no":
				Write(c, Reply{Err: Errorf(CodeState, "already paused"), Final: true})
			}
			c.Close()
		}
	}()
	ctx := context.Background()
	var phases []string
	r, err := Do(ctx, addr, Request{Op: OpPause, Job: "ok"}, func(p Progress) { phases = append(phases, p.Phase) })
	if err != nil || r.Job == nil || r.Job.State != StatePaused || strings.Join(phases, ",") != "PREPARE,DRAIN" {
		t.Errorf("ok: %+v %v, phases %v", r, err, phases)
	}
	_, err = Do(ctx, addr, Request{Op: OpPause, Job: "no"}, nil)
	var ce *Error
	if !errors.As(err, &ce) || ce.Code != CodeState {
		t.Errorf("refusal: %v", err)
	}
	_, err = Do(ctx, addr, Request{Op: OpPause, Job: "mute"}, nil)
	if !errors.As(err, &ce) || ce.Code != CodeUnavailable || !strings.Contains(ce.Message, "without an answer") {
		t.Errorf("hang-up: %v", err)
	}
	_, err = Do(ctx, "@mpipause-ctl-test-nobody", Request{Op: OpList}, nil)
	if !errors.As(err, &ce) || ce.Code != CodeUnavailable || !strings.Contains(ce.Message, "no mpid at @mpipause-ctl-test-nobody") {
		t.Errorf("no mpid: %v", err)
	}
}

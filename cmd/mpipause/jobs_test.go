package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// fakeMpid serves the control socket with canned answers, per operation,
// and records the requests: the CLI's side of the protocol without a
// kernel or a job.
type fakeMpid struct {
	mu       sync.Mutex
	requests []ctl.Request
	answer   func(req ctl.Request) []ctl.Reply
}

func serveFake(t *testing.T, answer func(ctl.Request) []ctl.Reply) *fakeMpid {
	t.Helper()
	addr := fmt.Sprintf("@mpipause-test-ctl-%s-%d", t.Name(), time.Now().UnixNano())
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("MPIPAUSE_CTL_SOCKET", addr)
	f := &fakeMpid{answer: answer}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := ctl.ReadRequest(bufio.NewReader(c))
				if err != nil {
					ctl.Write(c, ctl.Reply{Err: ctl.Errorf(ctl.CodeBadRequest, "%v", err), Final: true})
					return
				}
				f.mu.Lock()
				f.requests = append(f.requests, req)
				f.mu.Unlock()
				for _, r := range f.answer(req) {
					ctl.Write(c, r)
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return f
}

var pausedJob = ctl.Job{ID: "j1", State: ctl.StatePaused, Ranks: 6, Nodes: []string{"n0", "n1", "n2"}, LocalRanks: []int{0, 1},
	Coordinator: "n0", Connections: 36, DrainedBytes: 3 << 20, TotalMs: 52.5, DrainMs: 40,
	Phases: []ctl.Phase{{Name: "PREPARE", Rounds: 1, Ms: 4}, {Name: "DRAIN", Rounds: 3, Ms: 40}, {Name: "FREEZE", Rounds: 1, Ms: 2},
		{Name: "VERIFY", Rounds: 1, Ms: 1.5}, {Name: "COMMIT", Rounds: 1, Ms: 1}}}

func TestPauseOutput(t *testing.T) {
	f := serveFake(t, func(req ctl.Request) []ctl.Reply {
		return []ctl.Reply{
			{Progress: &ctl.Progress{Phase: "PREPARE", Round: 1, Done: true, Nodes: 3, Ms: 4}},
			{Progress: &ctl.Progress{Phase: "DRAIN", Round: 1, Nodes: 3, NodesClean: 1, Conns: 4, InflightBytes: 1 << 20}},
			{Progress: &ctl.Progress{Phase: "DRAIN", Round: 3, Done: true, Nodes: 3, Ms: 44}},
			{Job: &pausedJob, Final: true},
		}
	})
	// Options after the job id count as well as before it.
	code, _, errOut := runCLI(t, "j1", "--timeout", "3s")
	f.mu.Lock()
	req := f.requests[len(f.requests)-1]
	f.mu.Unlock()
	if code != 0 || errOut != "" || req.Job != "j1" || req.Timeout != 3*time.Second {
		t.Errorf("options after the id: exit %d, stderr %q, request %+v", code, errOut, req)
	}
	code, out, errOut := runCLI(t, "pause", "--timeout", "2s", "j1")
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	for _, want := range []string{"pausing job j1", "PREPARE", "DRAIN    3 nodes, 3 rounds  ok", "job j1: paused",
		"ranks 6 on 3 nodes (n0,n1,n2); here: 0,1", "36 connections, 0 B queued; 3.0 MiB drained"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "round 1:") {
		t.Errorf("drain rounds redrawn on a non-terminal:\n%s", out)
	}
	f.mu.Lock()
	req = f.requests[len(f.requests)-1]
	f.mu.Unlock()
	if req.Op != ctl.OpPause || req.Job != "j1" || req.Timeout != 2*time.Second || req.Version != ctl.Version {
		t.Errorf("request %+v", req)
	}

	code, out, _ = runCLI(t, "pause", "--json", "j1")
	var got ctl.Job
	if err := json.Unmarshal([]byte(out), &got); err != nil || code != 0 {
		t.Fatalf("--json: exit %d, %v:\n%s", code, err, out)
	}
	if got.State != ctl.StatePaused || got.Connections != 36 || got.TotalMs != 52.5 || len(got.Phases) != 5 {
		t.Errorf("--json decoded %+v", got)
	}
	for _, key := range []string{`"job"`, `"state"`, `"ranks"`, `"nodes"`, `"connections"`, `"inflight_bytes"`, `"drain_ms"`, `"total_ms"`} {
		if !strings.Contains(out, key) {
			t.Errorf("--json lacks %s", key)
		}
	}
}

// TestRefusals: each refusal from mpid is one line on stderr and its own
// exit code; with --json it is a JSON object on stdout and the same code.
func TestRefusals(t *testing.T) {
	var code string
	serveFake(t, func(req ctl.Request) []ctl.Reply {
		return []ctl.Reply{{Err: ctl.Errorf(code, "refused: %s", code), Final: true}}
	})
	for c, want := range exitCodes {
		code = c
		got, out, errOut := runCLI(t, "resume", "j1")
		if got != want || errOut != "mpipause resume: refused: "+c+"\n" || out != "resuming job j1\n" {
			t.Errorf("%s: exit %d (want %d), stdout %q, stderr %q", c, got, want, out, errOut)
		}
		got, out, errOut = runCLI(t, "resume", "--json", "j1")
		var v struct{ Error ctl.Error }
		if err := json.Unmarshal([]byte(out), &v); err != nil || got != want || v.Error.Code != c || errOut != "" {
			t.Errorf("%s --json: exit %d, stdout %q (%v), stderr %q", c, got, out, err, errOut)
		}
	}
	code = ctl.CodeUnknownJob
	if got, _, errOut := runCLI(t, "frobnicate"); got != 3 || !strings.Contains(errOut, `"frobnicate" is not a command`) {
		t.Errorf("unknown word: exit %d, stderr %q", got, errOut)
	}
}

func TestFailedPauseReport(t *testing.T) {
	failed := pausedJob
	failed.State = ctl.StateRunning
	failed.Failure = &ctl.Failure{Phase: "DRAIN", Node: "n2", Rank: 5, NotReading: []int{5},
		Reason: "the drain timed out: 1 connection on 1 node still hold bytes",
		Conns:  []ctl.Conn{{Node: "n2", Local: "10.0.0.3:1026", Remote: "10.0.0.1:4000", Unread: 40, Rank: 5, Peer: 0}}}
	serveFake(t, func(req ctl.Request) []ctl.Reply {
		return []ctl.Reply{{Job: &failed, Err: ctl.Errorf(ctl.CodeFailed, "pause of job j1 failed in DRAIN: rolled back"), Final: true}}
	})
	code, out, errOut := runCLI(t, "pause", "j1")
	if code != 1 || strings.Count(errOut, "\n") != 1 {
		t.Errorf("exit %d, stderr %q", code, errOut)
	}
	for _, want := range []string{"failed in DRAIN: the drain timed out", "n2 10.0.0.3:1026 (rank 5) -> 10.0.0.1:4000 (rank 0): 0 B unacknowledged, 40 B unread"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestNoMpid(t *testing.T) {
	t.Setenv("MPIPAUSE_CTL_SOCKET", "@mpipause-test-nobody-here")
	for _, args := range [][]string{{"list"}, {"status"}, {"pause", "j"}, {"resume", "j"}, {"run", "--launcher", "hydra", "--shim", "/dev/null", "--", "true"}} {
		code, _, errOut := runCLI(t, args...)
		if args[0] == "run" {
			// The shim is checked first: /dev/null is not a library.
			if code != 2 || !strings.Contains(errOut, "no shim library") {
				t.Errorf("%v: exit %d, stderr %q", args, code, errOut)
			}
			continue
		}
		if code != 6 || !strings.Contains(errOut, "no mpid at @mpipause-test-nobody-here") {
			t.Errorf("%v: exit %d, stderr %q", args, code, errOut)
		}
	}
}

func TestJobUsage(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"pause"}, "want exactly one job id, got 0"},
		{[]string{"pause", "a", "b"}, "want exactly one job id, got 2"},
		{[]string{"pause", "a", "--json", "b"}, "want exactly one job id, got 2"},
		{[]string{"pause", "j", "--timeout", "-1s"}, "--timeout -1s"},
		{[]string{"pause", "j", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"status", "a", "--", "--json"}, "at most one job id"},
		{[]string{"pause", "--timeout", "-1s", "j"}, "--timeout -1s"},
		{[]string{"pause", "--timeout", "11m", "j"}, "--timeout 11m0s: want a positive duration of at most 10m0s"},
		{[]string{"resume", "a/b"}, `job id "a/b"`},
		{[]string{"resume", "--timeout", "1s", "j"}, "flag provided but not defined: -timeout"},
		{[]string{"status", "a", "b"}, "at most one job id"},
		{[]string{"list", "x"}, `unexpected argument "x"`},
		{[]string{"run"}, "want a launcher command"},
		{[]string{"run", "--launcher", "slurm", "--", "srun"}, `--launcher "slurm"`},
		{[]string{"run", "--jobid", "a b", "--", "mpirun"}, `job id "a b"`},
	} {
		code, _, errOut := runCLI(t, tt.args...)
		if code != 2 || !strings.Contains(errOut, tt.want) || strings.Count(errOut, "\n") != 1 {
			t.Errorf("%v: exit %d, stderr %q; want 2 and one line with %q", tt.args, code, errOut, tt.want)
		}
	}
}

func TestInject(t *testing.T) {
	environ := []string{"HOME=/root", "MPIPAUSE_JOBKEY=old", "PATH=/bin", "MPIPAUSE_JOBID=old"}
	got, env := inject("openmpi", []string{"mpirun", "-np", "4", "./a"}, environ, "j1", "n0:k", "/x/libmpipause.so")
	want := "mpirun -x MPIPAUSE_JOBID=j1 -x LD_PRELOAD=/x/libmpipause.so -x MPIPAUSE_JOBKEY -np 4 ./a"
	if strings.Join(got, " ") != want {
		t.Errorf("openmpi: %q, want %q", got, want)
	}
	got, env2 := inject("hydra", []string{"mpiexec", "-n", "4", "./a"}, environ, "j1", "n0:k", "/x/libmpipause.so")
	want = "mpiexec -genv MPIPAUSE_JOBID j1 -genv LD_PRELOAD /x/libmpipause.so -genvlist MPIPAUSE_JOBKEY -n 4 ./a"
	if strings.Join(got, " ") != want {
		t.Errorf("hydra: %q, want %q", got, want)
	}
	// The key first, never last: Hydra's -genvlist does not find the
	// last variable of mpiexec's environment (inject's comment); the
	// caller's own id and key are replaced, not shadowed.
	wantEnv := "MPIPAUSE_JOBKEY=n0:k HOME=/root PATH=/bin MPIPAUSE_JOBID=j1"
	for _, e := range [][]string{env, env2} {
		if strings.Join(e, " ") != wantEnv {
			t.Errorf("launcher environment %q, want %q", e, wantEnv)
		}
	}
	if _, env := inject("hydra", []string{"mpiexec"}, nil, "j1", "n0:k", "/s.so"); len(env) != 2 || env[len(env)-1] == "MPIPAUSE_JOBKEY=n0:k" {
		t.Errorf("empty caller environment: launcher environment %q, want the key first and not last", env)
	}
	for _, arg := range got {
		if strings.Contains(arg, "n0:k") {
			t.Errorf("the job key is on the launcher's command line: %q", got)
		}
	}
	for _, tt := range []struct{ have, want string }{
		{"", "/s.so"},
		{"/a.so", "/a.so:/s.so"},
		{"/a.so /b.so", "/a.so:/b.so:/s.so"},
		{"/s.so:/a.so", "/s.so:/a.so"},
	} {
		if got := preload(tt.have, "/s.so"); got != tt.want {
			t.Errorf("preload(%q) = %q, want %q", tt.have, got, tt.want)
		}
	}
}

// TestUntrustedTextEscaped: node names, reasons and ids in mpid's answers
// come from ranks and other nodes; whatever they hold (here terminal
// escapes: clear screen, set title, C1 CSI, bidi override, DEL), the CLI's
// human output shows them as text and its JSON stays JSON of the same
// value with none of them raw.
func TestUntrustedTextEscaped(t *testing.T) {
	const evil = "n1\x1b[2J\x1b]0;owned\x07\u009b31m\u202e\x7f"
	job := pausedJob
	job.ID = "j\x1b[8m"
	job.Nodes = []string{"n0", evil}
	job.Coordinator = evil
	job.Unpausable = "rank on " + evil
	job.State = ctl.StateRunning
	job.Failure = &ctl.Failure{Phase: "DRAIN", Reason: "node " + evil + " said: \x1b[1mno", Unconfirmed: []string{evil},
		Conns: []ctl.Conn{{Node: evil, Local: "10.0.0.1:1", Remote: "10.0.0.2:2", Rank: 1, Peer: 2}}}
	serveFake(t, func(req ctl.Request) []ctl.Reply {
		switch {
		case req.Op == ctl.OpList || req.Op == ctl.OpStatus && req.Job == "":
			return []ctl.Reply{{Jobs: []ctl.Job{job}, Final: true}}
		case req.Op == ctl.OpStatus && req.Job == "gone":
			return []ctl.Reply{{Err: ctl.Errorf(ctl.CodeUnknownJob, "no job on %s", evil), Final: true}}
		case req.Op == ctl.OpStatus:
			return []ctl.Reply{{Job: &job, Final: true}}
		}
		return []ctl.Reply{{Err: ctl.Errorf(ctl.CodeFailed, "failed on %s", evil), Job: &job, Final: true}}
	})
	raw := func(s string) bool {
		for _, r := range s {
			if r != '\n' && (r < ' ' || r == 0x7f || r >= 0x80 && r <= 0x9f || r == 0x202e) {
				return true
			}
		}
		return false
	}
	for _, args := range [][]string{{"status"}, {"status", "j1"}, {"status", "gone"}, {"list"}, {"pause", "j1"}} {
		code, out, errOut := runCLI(t, args...)
		if raw(out) || raw(errOut) {
			t.Errorf("mpipause %v (exit %d) printed raw control characters:\n%q\n%q", args, code, out, errOut)
		}
		if !strings.Contains(out+errOut, `n1\x1b[2J\x1b]0;owned\a\u009b31m\u202e\x7f`) {
			t.Errorf("mpipause %v: the node's name is not shown escaped:\n%s%s", args, out, errOut)
		}
	}
	for _, args := range [][]string{{"status", "--json", "j1"}, {"status", "--json"}, {"list", "--json"}, {"pause", "--json", "j1"}} {
		_, out, _ := runCLI(t, args...)
		if raw(out) {
			t.Errorf("mpipause %v printed raw control characters:\n%q", args, out)
		}
		var v struct {
			Nodes []string `json:"nodes"`
			Jobs  []ctl.Job
		}
		if args[0] == "list" {
			err := json.Unmarshal([]byte(out), &v.Jobs)
			if err != nil || len(v.Jobs) != 1 || v.Jobs[0].Coordinator != evil {
				t.Errorf("mpipause %v: %v, %+v: want the same names back from the JSON", args, err, v.Jobs)
			}
			continue
		}
		if err := json.Unmarshal([]byte(out), &v); err != nil || (len(v.Nodes) != 2 || v.Nodes[1] != evil) && (len(v.Jobs) != 1 || v.Jobs[0].Nodes[1] != evil) {
			t.Errorf("mpipause %v: %v, %+v: want the same names back from the JSON\n%s", args, err, v, out)
		}
	}
}

// TestPrintJobCoordinator: status says which node coordinates the job,
// here or another by name, and never guesses one when it is not known (the
// coordinator is the node the job key names, not rank 0's).
func TestPrintJobCoordinator(t *testing.T) {
	for _, tc := range []struct{ coordinator, want string }{
		{"n1", "(coordinated here)"},
		{"n0", "(coordinated by n0)"},
		{"", "(its coordinator not known here)"},
	} {
		job := pausedJob
		job.Node, job.Coordinator = "n1", tc.coordinator
		var b strings.Builder
		printJob(&b, job)
		if first, _, _ := strings.Cut(b.String(), "\n"); !strings.HasSuffix(first, tc.want) || strings.Contains(b.String(), "rank 0") {
			t.Errorf("coordinator %q: %q; want it to end %q", tc.coordinator, first, tc.want)
		}
	}
	if strings.Contains(exitCodeHelp, "rank 0") {
		t.Errorf("exit status help names rank 0's node as the coordinator:\n%s", exitCodeHelp)
	}
}

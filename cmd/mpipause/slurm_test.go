package main

import (
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestSlurmJobID: a bare Slurm job id names its one step's job (the SPANK
// plugin calls it JOBID.STEPID); with several steps on the node, one line
// lists them; a number that names no step stays an unknown job.
func TestSlurmJobID(t *testing.T) {
	jobs := map[string]ctl.Job{}
	for _, id := range []string{"77.0", "88.0", "88.1", "770.0", "ab.0"} {
		j := pausedJob
		j.ID = id
		jobs[id] = j
	}
	f := serveFake(t, func(req ctl.Request) []ctl.Reply {
		if req.Op == ctl.OpList {
			var all []ctl.Job
			for _, j := range jobs {
				all = append(all, j)
			}
			return []ctl.Reply{{Jobs: all, Final: true}}
		}
		j, ok := jobs[req.Job]
		if !ok {
			return []ctl.Reply{{Err: ctl.Errorf(ctl.CodeUnknownJob, "no job %s on this node", req.Job), Final: true}}
		}
		return []ctl.Reply{{Job: &j, Final: true}}
	})
	for _, tc := range []struct {
		name     string
		args     []string
		code     int
		out, err string // substrings
		last     string // the job of the last request
	}{
		{"pause by Slurm id", []string{"pause", "77"}, 0, "job 77.0: paused", "", "77.0"},
		{"bare form", []string{"77"}, 0, "job 77.0: paused", "", "77.0"},
		{"resume", []string{"resume", "--json", "77"}, 0, `"job": "77.0"`, "", "77.0"},
		{"status", []string{"status", "77"}, 0, "job 77.0: paused", "", "77.0"},
		{"step id", []string{"status", "88.1"}, 0, "job 88.1: paused", "", "88.1"},
		{"several steps", []string{"status", "88"}, 2, "", "Slurm job 88 has 2 steps on this node: 88.0, 88.1; say which one (mpipause 88.0)", ""},
		{"no step", []string{"pause", "99"}, 3, "", "no job 99 on this node", ""},
		{"not a number", []string{"status", "ab"}, 3, "", "no job ab on this node", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f.mu.Lock()
			f.requests = nil
			f.mu.Unlock()
			code, out, errOut := runCLI(t, tc.args...)
			if code != tc.code || !strings.Contains(out, tc.out) || !strings.Contains(errOut, tc.err) {
				t.Errorf("exit %d (want %d)\nstdout %q (want %q)\nstderr %q (want %q)", code, tc.code, out, tc.out, errOut, tc.err)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if last := f.requests[len(f.requests)-1]; tc.last != "" && last.Job != tc.last {
				t.Errorf("last request %+v, want job %s", last, tc.last)
			}
		})
	}
}

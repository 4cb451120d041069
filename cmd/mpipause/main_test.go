package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// runCLI runs one command line in-process and returns its exit code and output.
func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), &env{stdout: &out, stderr: &errb}, args)
	return code, out.String(), errb.String()
}

func TestUsage(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		wantCode   int
		wantStdout string
		wantStderr string
	}{
		{name: "no args", args: nil, wantCode: 2, wantStderr: "usage: mpipause COMMAND"},
		{name: "help", args: []string{"--help"}, wantCode: 0, wantStdout: "observe"},
		{name: "-h", args: []string{"-h"}, wantCode: 0, wantStdout: "usage: mpipause COMMAND"},
		{name: "unknown option", args: []string{"--frobnicate"}, wantCode: 2, wantStderr: `unknown option "--frobnicate"`},
		{name: "observe -h", args: []string{"observe", "-h"}, wantCode: 0, wantStdout: "--cgroup"},
		{name: "observe bad flag", args: []string{"observe", "--nope"}, wantCode: 2, wantStderr: "flag provided but not defined: -nope; see --help"},
		{name: "observe stray arg", args: []string{"observe", "job1"}, wantCode: 2, wantStderr: `unexpected argument "job1"`},
		{name: "observe count without watch", args: []string{"observe", "--count", "3"}, wantCode: 2, wantStderr: "--count needs --watch"},
		{name: "observe bad observer", args: []string{"observe", "--observer", "ebpf"}, wantCode: 2, wantStderr: `--observer "ebpf": want auto, bpf or sock_diag`},
		{name: "observe bad duration", args: []string{"observe", "--watch", "soon"}, wantCode: 2, wantStderr: "invalid value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runCLI(t, tt.args...)
			if code != tt.wantCode {
				t.Errorf("exit code = %d, want %d (stderr %q)", code, tt.wantCode, stderr)
			}
			if !strings.Contains(stdout, tt.wantStdout) {
				t.Errorf("stdout = %q, want it to contain %q", stdout, tt.wantStdout)
			}
			if !strings.Contains(stderr, tt.wantStderr) {
				t.Errorf("stderr = %q, want it to contain %q", stderr, tt.wantStderr)
			}
			if tt.wantCode != 0 && strings.Count(strings.TrimSpace(stderr), "\n") > 0 && !strings.Contains(stderr, "usage:") {
				t.Errorf("an error must be one line, got %q", stderr)
			}
		})
	}
}

func TestHuman(t *testing.T) {
	tests := []struct {
		in   uint64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1024, "1.0 KiB"}, {4200000, "4.0 MiB"}, {3 << 30, "3.0 GiB"}}
	for _, tt := range tests {
		if got := human(tt.in); got != tt.want {
			t.Errorf("human(%d) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
)

// TestLaunchPassesStatus: `mpipause run` exits with its launcher's status,
// whatever it is: a launcher's own exit code unchanged, and a launcher
// killed by a signal as a shell reports it (128 + the signal), so that a
// script sees the same with mpipause run as without.
func TestLaunchPassesStatus(t *testing.T) {
	for _, tt := range []struct {
		script string
		want   int
	}{
		{"exit 0", 0},
		{"exit 1", 1},
		{"exit 7", 7},
		{"exit 139", 139},
		{"kill -KILL $$", 137},
		{"kill -SEGV $$", 139},
	} {
		t.Run(tt.script, func(t *testing.T) {
			var out, errb bytes.Buffer
			err := launch(context.Background(), &env{stdout: &out, stderr: &errb}, "status-test", []string{"/bin/sh", "-c", tt.script}, os.Environ())
			got := 0
			var st exitStatus
			switch {
			case errors.As(err, &st):
				got = int(st)
			case err != nil:
				t.Fatalf("launch: %v (stderr %q)", err, errb.String())
			}
			if got != tt.want {
				t.Errorf("status %d, want %d", got, tt.want)
			}
			// and says nothing of it: the launcher has spoken.
			errb.Reset()
			if code := exit(&env{stdout: &out, stderr: &errb}, "run", err); code != tt.want || errb.Len() != 0 {
				t.Errorf("exit code %d, want %d; stderr %q, want nothing", code, tt.want, errb.String())
			}
		})
	}
}

package node

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

func TestStatusDying(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		want         bool
	}{
		{"running", "Name:\txchg\nState:\tR (running)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n", false},
		{"frozen, other signal pending", "State:\tS (sleeping)\nSigPnd:\t0000000000004000\nShdPnd:\t0000000000000002\n", false},
		{"SIGKILL pending on the thread", "State:\tS (sleeping)\nSigPnd:\t0000000000000100\nShdPnd:\t0000000000000000\n", true},
		{"SIGKILL pending, shared", "State:\tD (disk sleep)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000104\n", true},
		{"zombie", "State:\tZ (zombie)\n", true},
		{"dead", "State:\tX (dead)\n", true},
		{"unparsable mask is no evidence", "State:\tS (sleeping)\nSigPnd:\tzz\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := statusDying(tc.status); got != tc.want {
				t.Errorf("statusDying(%q) = %v, want %v", tc.status, got, tc.want)
			}
		})
	}
}

func TestDying(t *testing.T) {
	if dying(os.Getpid()) {
		t.Error("the test process itself reads as dying")
	}
	// A child that exited and was not waited for is a zombie.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for !dying(cmd.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatalf("exited child %d never read as dying", cmd.Process.Pid)
		}
		time.Sleep(time.Millisecond)
	}
	cmd.Wait()
	if !dying(cmd.Process.Pid) {
		t.Errorf("reaped child %d does not read as dying", cmd.Process.Pid)
	}
}

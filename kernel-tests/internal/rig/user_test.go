package rig

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// holdHelperEnv makes the test binary hold rig "h" under the state root
// it names, say "held", and keep it until its stdin closes.
const holdHelperEnv = "MPIPAUSE_RIG_TEST_HOLD"

func holdHelper(root string) int {
	r, err := New(Config{Name: "h", StateRoot: root})
	if err == nil {
		err = r.Hold()
	}
	if err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Println("held")
	io.Copy(io.Discard, os.Stdin)
	return 0
}

// TestHoldOneUser: while a process holds a rig, another's Hold and its rig
// commands' check fail at once, naming the holder; a process that acts for
// the holder (its child, HolderEnv) passes; once the holder is gone,
// however it ended, the rig is free, with nothing to clear.
func TestHoldOneUser(t *testing.T) {
	root := t.TempDir()
	t.Setenv(HolderEnv, "")
	r, err := New(Config{Name: "h", StateRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CheckUser(); err != nil {
		t.Fatalf("CheckUser of a rig nobody ever held: %v", err)
	}
	for _, end := range []string{"exit", "kill"} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), holdHelperEnv+"="+root)
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil || line != "held\n" {
			cmd.Process.Kill()
			t.Fatalf("the holder said %q (%v), want held", line, err)
		}
		pid := strconv.Itoa(cmd.Process.Pid)
		for what, err := range map[string]error{"CheckUser": r.CheckUser(), "Hold": r.Hold()} {
			if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "by pid "+pid+" (") || strings.Contains(err.Error(), "\n") {
				t.Errorf("%s while pid %s holds the rig: %v; want one line, in use by pid %s", what, pid, err, pid)
			}
		}
		os.Setenv(HolderEnv, pid)
		if err := r.CheckUser(); err != nil {
			t.Errorf("CheckUser acting for the holder (%s=%s): %v", HolderEnv, pid, err)
		}
		os.Setenv(HolderEnv, "")
		if end == "kill" {
			cmd.Process.Kill()
		}
		in.Close()
		cmd.Wait()
		if err := r.CheckUser(); err != nil {
			t.Errorf("CheckUser after the holder's %s: %v", end, err)
		}
	}
	if err := r.Hold(); err != nil {
		t.Fatalf("Hold of a free rig: %v", err)
	}
	if got := os.Getenv(HolderEnv); got != strconv.Itoa(os.Getpid()) {
		t.Errorf("%s after Hold: %q, want this process's pid", HolderEnv, got)
	}
	if err := r.Hold(); err != nil {
		t.Errorf("a second Hold by the holder: %v", err)
	}
	if err := r.CheckUser(); err != nil {
		t.Errorf("CheckUser by the holder: %v", err)
	}
}

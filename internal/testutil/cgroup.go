package testutil

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
)

// CgroupParent is the directory, under the cgroup v2 mount, that holds the
// tests' cgroups: one place to look for what a killed test run left.
const CgroupParent = "mpipause-test"

// NewCgroup makes a cgroup v2 directory for tb alone,
// <v2 mount>/mpipause-test/<random>, and returns its absolute path. At
// cleanup whatever is still in it is killed and it is removed; cgroups a
// test makes inside it must be removed by cleanups of their own, which run
// first.
func NewCgroup(tb testing.TB) string {
	tb.Helper()
	RequirePrivileged(tb)
	root, err := cgroupv2.Root()
	if err != nil {
		unavailable(tb, "cgroup v2: %v", err)
	}
	id := make([]byte, 4)
	if _, err := rand.Read(id); err != nil {
		tb.Fatal(err)
	}
	dir := filepath.Join(root, CgroupParent, hex.EncodeToString(id))
	if err := cgroupv2.Create(dir); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		KillTree(dir)
		if err := cgroupv2.Remove(dir); err != nil {
			tb.Error(err)
		}
		os.Remove(filepath.Dir(dir)) // shared by parallel runs: only if empty
	})
	return dir
}

// KillTree kills the processes of the cgroup dir and of every cgroup below
// it until none is left (a launcher may fork while it dies) or a second
// has passed; Remove moves any still there out of the way.
func KillTree(dir string) {
	for range 50 {
		procs, _ := cgroupv2.Members(dir)
		if len(procs) == 0 {
			return
		}
		for _, p := range procs {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// NewThreadedCgroup is NewCgroup with a threaded cgroup below it, as
// libvirt makes one for each VM's emulator and vCPU threads (its
// cgroup.procs refuses reads), and a sleeping process in the domain above
// it; it returns the domain and the sleeper's pid. Every walk of a node's
// cgroups must go past such a cgroup.
func NewThreadedCgroup(tb testing.TB) (dom string, pid int) {
	tb.Helper()
	dom = NewCgroup(tb)
	threaded := filepath.Join(dom, "emulator")
	if err := cgroupv2.Create(threaded); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := cgroupv2.RemoveEmpty(threaded); err != nil {
			tb.Error(err)
		}
	})
	if err := os.WriteFile(filepath.Join(threaded, "cgroup.type"), []byte("threaded"), 0); err != nil {
		tb.Fatal(err)
	}
	fd, err := os.Open(dom)
	if err != nil {
		tb.Fatal(err)
	}
	defer fd.Close()
	sleeper := exec.Command("sleep", "600")
	sleeper.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	if err := sleeper.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	return dom, sleeper.Process.Pid
}

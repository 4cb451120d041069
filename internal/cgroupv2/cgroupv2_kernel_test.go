package cgroupv2_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/testutil"
)

// The kernel's half of the tests, in a package of their own: testutil,
// which they take their fixtures from, imports cgroupv2.

func TestTreeIDsCgroup(t *testing.T) {
	job := testutil.NewCgroup(t)
	child := filepath.Join(job, "rank0")
	if err := cgroupv2.Create(child); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cgroupv2.Remove(child); err != nil {
			t.Error(err)
		}
	})
	jobID, err := cgroupv2.ID(job)
	if err != nil {
		t.Fatal(err)
	}
	childID, err := cgroupv2.ID(child)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cgroupv2.TreeIDs(job)
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint64{jobID, childID}; !slices.Equal(got, want) {
		t.Fatalf("TreeIDs(%s) = %v, want %v", job, got, want)
	}
}

// TestFreezeThaw freezes and thaws a cgroup holding a process that spins
// in user space and one asleep in a system call, in that order: each case
// starts from the state the one before left.
func TestFreezeThaw(t *testing.T) {
	dir := testutil.NewCgroup(t)
	fd, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	var procs []*exec.Cmd
	for _, script := range []string{"while :; do :; done", "sleep 1000"} {
		c := exec.Command("sh", "-c", script)
		c.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, c)
	}
	t.Cleanup(func() {
		cgroupv2.Thaw(context.Background(), dir)
		for _, c := range procs {
			c.Process.Kill()
			c.Wait()
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	frozen := func(t *testing.T, want bool) {
		t.Helper()
		if f, err := cgroupv2.Frozen(dir); err != nil || f != want {
			t.Fatalf("frozen %v, %v; want %v", f, err, want)
		}
	}

	t.Run("freeze", func(t *testing.T) {
		if err := cgroupv2.Freeze(ctx, dir); err != nil {
			t.Fatal(err)
		}
		frozen(t, true)
	})
	t.Run("freeze again", func(t *testing.T) {
		if err := cgroupv2.Freeze(ctx, dir); err != nil {
			t.Fatal(err)
		}
		frozen(t, true)
	})
	t.Run("thaw", func(t *testing.T) {
		if err := cgroupv2.Thaw(ctx, dir); err != nil {
			t.Fatal(err)
		}
		frozen(t, false)
	})
	t.Run("missing cgroup", func(t *testing.T) {
		if err := cgroupv2.Freeze(ctx, filepath.Join(dir, "nonexistent")); err == nil {
			t.Error("Freeze of a missing cgroup succeeded")
		}
	})
}

// TestPathOf finds a cgroup's path by its id, and says a removed one does
// not exist.
func TestPathOf(t *testing.T) {
	job := testutil.NewCgroup(t)
	child := filepath.Join(job, "rank0")
	if err := cgroupv2.Create(child); err != nil {
		t.Fatal(err)
	}
	id, err := cgroupv2.ID(child)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cgroupv2.PathOf(id); err != nil || got != child {
		t.Errorf("PathOf(%d) = %q, %v; want %q", id, got, err, child)
	}
	if err := cgroupv2.Remove(child); err != nil {
		t.Fatal(err)
	}
	if got, err := cgroupv2.PathOf(id); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("PathOf(%d) of a removed cgroup = %q, %v; want os.ErrNotExist", id, got, err)
	}
}

// TestMembersAcrossThreaded: a threaded cgroup below (libvirt puts each
// VM's emulator and vCPU threads in ones) refuses cgroup.procs; its
// processes are its threaded domain's, and Members lists them from there.
func TestMembersAcrossThreaded(t *testing.T) {
	dom, pid := testutil.NewThreadedCgroup(t)
	if _, err := cgroupv2.Procs(filepath.Join(dom, "emulator")); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Fatalf("cgroup.procs of a threaded cgroup: %v, want EOPNOTSUPP (the case this test is for)", err)
	}
	for _, dir := range []string{dom, filepath.Dir(dom)} {
		pids, err := cgroupv2.Members(dir)
		if err != nil || !slices.Contains(pids, pid) {
			t.Errorf("Members(%s) = %v, %v; want the sleeper's pid %d", dir, pids, err, pid)
		}
	}
}

// TestBoundCgroup: on a real cgroup tree (a threaded cgroup in it, as
// libvirt makes), a Bound's walks read the cgroups below within Below,
// the threaded one counted and passed over, and fail past it; MembersMax
// counts its root among its cgroups.
func TestBoundCgroup(t *testing.T) {
	dom, pid := testutil.NewThreadedCgroup(t) // dom and its threaded "emulator"
	child := filepath.Join(dom, "rank0")
	if err := cgroupv2.Create(child); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cgroupv2.RemoveEmpty(child) })
	pids, err := (&cgroupv2.Bound{Below: 2, Procs: 10}).Members(dom)
	if err != nil || !slices.Contains(pids, pid) {
		t.Fatalf("Members of 2 below within 2: %v, %v; want the sleeper %d", pids, err, pid)
	}
	if ids, err := (&cgroupv2.Bound{Below: 2}).TreeIDs(dom); err != nil || len(ids) != 3 {
		t.Fatalf("TreeIDs of 2 below within 2: %v, %v", ids, err)
	}
	for name, walk := range map[string]func() error{
		"Members":    func() error { _, err := (&cgroupv2.Bound{Below: 1, Procs: 10}).Members(dom); return err },
		"TreeIDs":    func() error { _, err := (&cgroupv2.Bound{Below: 1}).TreeIDs(dom); return err },
		"procs":      func() error { _, err := (&cgroupv2.Bound{Below: 2, Procs: 0}).Members(dom); return err },
		"MembersMax": func() error { _, err := cgroupv2.MembersMax(dom, 2); return err },
	} {
		if err := walk(); !errors.Is(err, cgroupv2.ErrTooMany) || !strings.Contains(err.Error(), dom) {
			t.Errorf("%s past its bound: %v, want ErrTooMany naming %s", name, err, dom)
		}
	}
}

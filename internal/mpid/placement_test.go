package mpid

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

func TestPlace(t *testing.T) {
	const (
		root = "/sys/fs/cgroup"
		job  = "1001:run7"
		task = root + "/system.slice/slurmstepd.scope/job_12/step_0/user/task_1"
		scop = root + "/system.slice/run-r1.scope"
	)
	parent := root + "/mpipause"
	for _, tc := range []struct {
		name string
		in   placeInput
		want placement
		err  string
	}{
		{"a Slurm task cgroup holding only the rank is watched where it is",
			placeInput{Cg: task, Members: []int{40}},
			placement{Dir: task, Mode: PlaceOwn}, ""},
		{"a second rank in a cgroup that holds only the job's ranks",
			placeInput{Cg: task, Members: []int{40, 41}, Own: map[int]bool{41: true}},
			placement{Dir: task, Mode: PlaceOwn}, ""},
		{"a scope shared with mpirun: a cgroup inside it",
			placeInput{Cg: scop, Members: []int{7, 40}},
			placement{Dir: scop + "/mpipause-" + job, Mode: PlaceInner, Move: true}, ""},
		{"a rank whose cgroup also holds a rank of another job",
			placeInput{Cg: task, Members: []int{40, 41}, Own: map[int]bool{}},
			placement{Dir: task + "/mpipause-" + job, Mode: PlaceInner, Move: true}, ""},
		{"the rank is not among the members it was read with (it moved)",
			placeInput{Cg: task, Members: []int{41}, Own: map[int]bool{41: true}},
			placement{Dir: task + "/mpipause-" + job, Mode: PlaceInner, Move: true}, ""},
		{"already inside its job's inner cgroup (a restarted mpid, a forked child)",
			placeInput{Cg: scop + "/mpipause-" + job, Members: []int{7, 40}},
			placement{Dir: scop + "/mpipause-" + job, Mode: PlaceInner}, ""},
		{"another job's inner cgroup is a cgroup like any other",
			placeInput{Cg: scop + "/mpipause-1001:other", Members: []int{40, 50}},
			placement{Dir: scop + "/mpipause-1001:other/mpipause-" + job, Mode: PlaceInner, Move: true}, ""},
		{"the hierarchy's root: nobody placed it, mpid's own cgroup",
			placeInput{Cg: root, Members: []int{1, 40}},
			placement{Dir: parent + "/" + job, Mode: PlaceCreated, Move: true}, ""},
		{"already in mpid's own cgroup for the job",
			placeInput{Cg: parent + "/" + job, Members: []int{40}},
			placement{Dir: parent + "/" + job, Mode: PlaceCreated}, ""},
		{"--cgroup: the one cgroup mpid was given",
			placeInput{Cg: task, Members: []int{40}, Fixed: root + "/jobs"},
			placement{Dir: root + "/jobs", Mode: PlaceFixed}, ""},
		{"a cgroup outside the hierarchy is refused",
			placeInput{Cg: "/elsewhere/x", Members: []int{40}},
			placement{}, "outside the cgroup v2 hierarchy"},
		{"a path that climbs out with .. is refused",
			placeInput{Cg: root + "/../x", Members: []int{40}},
			placement{}, "outside the cgroup v2 hierarchy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.in
			in.Job, in.Pid, in.Root = job, 40, root
			if in.Parent == "" {
				in.Parent = parent
			}
			got, err := place(in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("place = %+v, %v; want an error saying %q", got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("place = %+v, %v; want %+v", got, err, tc.want)
			}
			// Never out of the rank's cgroup, unless nobody placed it.
			if got.Mode != PlaceCreated && got.Mode != PlaceFixed && got.Dir != in.Cg && !strings.HasPrefix(got.Dir, in.Cg+"/") {
				t.Fatalf("place moved the rank from %s out to %s", in.Cg, got.Dir)
			}
		})
	}
}

// TestPlaceErrorSaysWhatToDo: a cgroup of mpid's inside one its user owns
// (Slurm's task cgroup shared with mpirun's orted) refused for permission
// names the cgroup and the capability to grant; other refusals are left
// as they are.
func TestPlaceErrorSaysWhatToDo(t *testing.T) {
	task := "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_6/step_0/user/task_0"
	denied := fmt.Errorf("create cgroup %s/mpipause-1000:6.batch: %w", task, os.ErrPermission)
	err := placeError(placement{Dir: task + "/mpipause-1000:6.batch", Mode: PlaceInner, Move: true}, denied)
	if !errors.Is(err, os.ErrPermission) {
		t.Errorf("%v: lost the cause", err)
	}
	for _, want := range []string{task + " is not root's", "CAP_DAC_OVERRIDE", "docs/slurm.md"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%v: lacks %q", err, want)
		}
	}
	if err := placeError(placement{Dir: "/sys/fs/cgroup/mpipause/1000:j", Mode: PlaceCreated, Move: true}, denied); err != denied {
		t.Errorf("mpid's own parent refused: %v, want the error as it was", err)
	}
	other := errors.New("no such file")
	if err := placeError(placement{Dir: task + "/x", Mode: PlaceInner, Move: true}, other); err != other {
		t.Errorf("another error: %v, want it as it was", err)
	}
}

package mpid

import (
	"fmt"
	"strings"
	"testing"
)

// TestJobsPerUser: one user makes mpid keep at most maxJobsPerUser jobs on
// a node; the next is refused with what to do, another user's is not, and
// root's are not bounded.
func TestJobsPerUser(t *testing.T) {
	r := &registry{jobs: map[string]*job{}, node: "node0"}
	for i := range maxJobsPerUser {
		if _, err := r.newJobLocked(1001, fmt.Sprintf("j%d", i), "node0"); err != nil {
			t.Fatalf("job %d of uid 1001: %v", i, err)
		}
	}
	_, err := r.newJobLocked(1001, "one-more", "node0")
	if err == nil || !strings.Contains(err.Error(), "let some end first") {
		t.Errorf("job %d of uid 1001: %v; want a refusal saying to let some end", maxJobsPerUser+1, err)
	}
	if _, err := r.newJobLocked(1002, "j0", "node0"); err != nil {
		t.Errorf("another user's first job refused: %v", err)
	}
	for i := range maxJobsPerUser + 1 {
		if _, err := r.newJobLocked(0, fmt.Sprintf("j%d", i), "node0"); err != nil {
			t.Fatalf("root's job %d refused: %v", i, err)
		}
	}
}

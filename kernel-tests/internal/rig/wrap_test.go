package rig

import (
	"context"
	"slices"
	"strings"
	"testing"
)

// TestUpMPIDWrap: with MPIDWrap, each mpid is started through the wrapper,
// which execs it in place: it gets the wrapper's doing (here env's
// variable), its own arguments, and up finds it alive and ready.
func TestUpMPIDWrap(t *testing.T) {
	r, _ := testRig(t, "wrap", true)
	cfg := r.Config()
	cfg.MPIDWrap = []string{"env", "MPIPAUSE_WRAPPED=yes"}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Up(context.Background(), 1); err != nil {
		t.Fatalf("up: %v", err)
	}
	st, err := r.Load()
	if err != nil {
		t.Fatal(err)
	}
	d, ok := st.daemon(NodeName(0))
	if !ok || !d.alive() {
		t.Fatalf("daemon %+v recorded=%v, not alive", d, ok)
	}
	base := strings.TrimSuffix(r.readyFile(0), ".ready")
	if env := readTrim(t, base+".env"); !slices.Contains(strings.Split(env, "\n"), "MPIPAUSE_WRAPPED=yes") {
		t.Errorf("mpid's environment lacks the wrapper's variable:\n%s", env)
	}
	if args := readTrim(t, base+".args"); !strings.HasPrefix(args, "--node node0 ") {
		t.Errorf("mpid's arguments %q: the wrapper's must not reach it", args)
	}
}

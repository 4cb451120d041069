package loader

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/testutil"
)

// kernelModes are the kernels the BPF observer meets, as what each refuses
// of its programs: the refusals forced on this kernel (refuseForTest), so
// that every fallback runs here too, beside the real old kernels of `make
// check-kernels`.
var kernelModes = []struct {
	name    string
	refused []string
}{
	{"as this kernel allows", nil},
	// Linux 5.11 to 6.1: no bpf_rdonly_cast.
	{"before 6.2", []string{ProgConnIter}},
	// Linux 5.10: no socket storage in tracing programs either (the state
	// tracepoint, iter/tcp).
	{"5.10", []string{ProgConnIter, ProgState, ProgTCPIter}},
	// A locked-down build that refuses iterators over maps.
	{"map iterators refused", []string{ProgConnIter, ProgConnIterSkc}},
}

// withRefused makes the probe of the test's observers refuse progs, and
// reports whether the BPF observer can run so: where the kernel refuses
// the rest of what it needs (no iter/tcp on 5.10, and map iterators
// refused by the test), it checks that Open says so in one line instead,
// and the caller's test of the mode ends there.
func withRefused(t testing.TB, progs []string) bool {
	t.Helper()
	refuse := map[string]error{}
	for _, p := range progs {
		refuse[p] = errors.New("refused by the test")
	}
	refuseForTest = refuse
	t.Cleanup(func() { refuseForTest = nil })
	_, err := Probe()
	if err == nil {
		return true
	}
	if !errors.Is(err, ErrBPFUnavailable) || !strings.Contains(err.Error(), "nothing can read the job's connections") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("refusing %v on this kernel: %v; want the one line that nothing can read the job's connections", progs, err)
	}
	t.Logf("this kernel with %v refused too: the observer cannot run, and says so: %v", progs, err)
	return false
}

// TestDecide is the probe's decision over a table of what kernels refuse:
// each program's fallback, the mode, and the kernels below the floor.
func TestDecide(t *testing.T) {
	refused := func(progs ...string) map[string]error {
		m := map[string]error{}
		for _, p := range probeOrder {
			m[p] = nil
		}
		for _, p := range progs {
			m[p] = errors.New("load program: invalid argument: unknown func " + p + "\nverifier log line 2")
		}
		return m
	}
	for _, tt := range []struct {
		kernel    string
		refused   map[string]error
		connIter  string
		adoption  bool
		state     bool
		mode      string
		fallbacks []string // programs, in order
		err       string   // a refusal to run, with what it names
	}{
		{kernel: "6.2+", refused: refused(), connIter: ProgConnIter, adoption: true, state: true, mode: ModeFull},
		{kernel: "5.11-6.1", refused: refused(ProgConnIter), connIter: ProgConnIterSkc, adoption: true, state: true, mode: ModeFull, fallbacks: []string{ProgConnIter}},
		{kernel: "5.10", refused: refused(ProgConnIter, ProgState, ProgTCPIter), connIter: ProgConnIterSkc, mode: ModeDegraded, fallbacks: []string{ProgState, ProgTCPIter, ProgConnIter}},
		{kernel: "locked down", refused: refused(ProgConnIter, ProgConnIterSkc), adoption: true, state: true, mode: ModeDegraded, fallbacks: []string{ProgConnIter, ProgConnIterSkc}},
		{kernel: "adoption without the state tracepoint", refused: refused(ProgState), connIter: ProgConnIter, adoption: true, mode: ModeDegraded, fallbacks: []string{ProgState}},
		{kernel: "no iterator at all", refused: refused(ProgConnIter, ProgConnIterSkc, ProgTCPIter), err: "nothing can read the job's connections"},
		{kernel: "below 5.10 (no sockops with socket storage)", refused: refused(ProgSockops, ProgState, ProgTCPIter, ProgConnIter, ProgConnIterSkc, ProgSignals), err: "needs Linux 5.10 or later with BTF"},
		{kernel: "no signal tracepoint", refused: refused(ProgSignals), connIter: ProgConnIter, adoption: true, state: true, mode: ModeDegraded, fallbacks: []string{ProgSignals}},
	} {
		t.Run(tt.kernel, func(t *testing.T) {
			f, err := decide(tt.refused)
			// Each program tried is in Loads, with its reason, failed or not.
			if len(f.Loads) != len(probeOrder) {
				t.Errorf("Loads %+v: want every program of %v", f.Loads, probeOrder)
			}
			for _, l := range f.Loads {
				if (l.Refused != "") != (tt.refused[l.Program] != nil) || strings.Contains(l.Refused, "\n") {
					t.Errorf("Loads: %+v; refused: %v", l, tt.refused[l.Program])
				}
			}
			if tt.err != "" {
				if !errors.Is(err, ErrBPFUnavailable) || !strings.Contains(err.Error(), tt.err) || strings.Contains(err.Error(), "\n") {
					t.Fatalf("err %v; want one line, ErrBPFUnavailable, saying %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var progs []string
			for _, fb := range f.Fallbacks {
				progs = append(progs, fb.Program)
				if fb.Reason == "" || strings.Contains(fb.Reason, "\n") || fb.Instead == "" {
					t.Errorf("fallback %+v: want the kernel's reason on one line and what replaces it", fb)
				}
			}
			if f.ConnIter != tt.connIter || f.Adoption != tt.adoption || f.State != tt.state || f.Mode() != tt.mode || !slices.Equal(progs, tt.fallbacks) {
				t.Errorf("got conniter %q adoption %v state %v mode %s fallbacks %v; want %q %v %v %s %v",
					f.ConnIter, f.Adoption, f.State, f.Mode(), progs, tt.connIter, tt.adoption, tt.state, tt.mode, tt.fallbacks)
			}
			if (f.Mode() == ModeDegraded) != (len(f.Weaker()) > 0) {
				t.Errorf("mode %s with weaker %q", f.Mode(), f.Weaker())
			}
		})
	}
}

// TestComplementedSeesOld: on a kernel without adoption (5.10's refusals,
// forced here), Open's BPF observer still finds a connection established
// before its cgroup was watched, through sock_diag, uncounted, beside the
// counted ones the programs registered, each once.
func TestComplementedSeesOld(t *testing.T) {
	testutil.RequirePrivileged(t)
	if !withRefused(t, []string{ProgConnIter, ProgState, ProgTCPIter}) {
		return
	}
	r, client, server := newPair(t)
	old, _ := connect(t, r, client, server)
	o, err := Open(context.Background(), Config{Cgroup: r.cgroup, FollowJob: true, Require: KindBPF})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	if _, ok := o.(*Complemented); !ok {
		t.Fatalf("Open gave a %T without adoption, want *Complemented", o)
	}
	fresh, _ := connect(t, r, client, server)
	client.do("write %s 1000", fresh.id)
	cs := waitFor(t, o, "the new connection counted", has(fresh.cookie, func(c Conn) bool { return c.Counted && c.BytesSent == 1000 }))
	if c, ok := byCookie(cs, old.cookie); !ok || c.Counted {
		t.Errorf("the connection from before the watch: found %v, counted %v; want found, uncounted:\n%s", ok, c.Counted, dump(cs))
	}
	if len(cs) != 4 {
		t.Errorf("%d connections, want the job's 4 ends, each once:\n%s", len(cs), dump(cs))
	}
}

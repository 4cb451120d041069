package metrics

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// scrape serves m's handler in memory and parses what a Prometheus server
// would get.
func scrape(t *testing.T, m *Metrics) Samples {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", Path, nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", Path, rec.Code, rec.Body)
	}
	s, err := Parse(rec.Body)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestNames checks every mpipause metric against Prometheus' own linter
// (promlint: units, _total on counters, help text) and the conventions the
// package documents: the prefix, base units, and label values from the
// fixed sets only.
func TestNames(t *testing.T) {
	m := New()
	m.WatchGauges(func() Gauges { return Gauges{} })
	m.PauseDone(Committed, 20*time.Millisecond, []Phase{{"PREPARE", time.Millisecond}, {"DRAIN", 5 * time.Millisecond}}, 1<<20)
	m.ResumeDone(Resumed, 2*time.Millisecond)
	m.Step("DRAIN", time.Millisecond, nil)
	m.Snapshot(time.Millisecond)
	problems, err := testutil.GatherAndLint(m.Registry())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, Namespace+"_") {
			t.Errorf("%s: %s", p.Metric, p.Text)
		}
	}
	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	allowed := map[string][]string{"outcome": append(PauseOutcomes, Resumed), "phase": Phases, "step": Steps, "socket": Sockets}
	var names []string
	for _, f := range fams {
		name := f.GetName()
		if !strings.HasPrefix(name, Namespace+"_") {
			if !strings.HasPrefix(name, "go_") && !strings.HasPrefix(name, "process_") {
				t.Errorf("metric %s: neither %s_ nor the Go runtime's or the process's", name, Namespace)
			}
			continue
		}
		names = append(names, name)
		if f.GetType().String() == "COUNTER" && !strings.HasSuffix(name, "_total") {
			t.Errorf("counter %s does not end in _total", name)
		}
		if strings.Contains(name, "milli") || strings.Contains(name, "_ms") || strings.Contains(name, "kib") {
			t.Errorf("metric %s: not in base units", name)
		}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				vals, ok := allowed[l.GetName()]
				if !ok {
					t.Errorf("metric %s: label %s is not one of the documented ones", name, l.GetName())
				} else if !slices.Contains(vals, l.GetValue()) {
					t.Errorf("metric %s: %s=%q is not in %v", name, l.GetName(), l.GetValue(), vals)
				}
			}
		}
	}
	want := []string{
		"mpipause_closed_gates", "mpipause_connections_refused_total", "mpipause_gate_violation_bytes_total", "mpipause_gated_sockets", "mpipause_held_bytes",
		"mpipause_jobs", "mpipause_node_lease_expiries_total", "mpipause_node_step_duration_seconds",
		"mpipause_node_step_errors_total", "mpipause_observer_snapshot_duration_seconds", "mpipause_pause_drained_bytes",
		"mpipause_pause_duration_seconds", "mpipause_pause_phase_duration_seconds", "mpipause_pauses_total",
		"mpipause_peer_dials_total", "mpipause_ranks", "mpipause_resume_duration_seconds", "mpipause_resumes_total",
	}
	if d := cmp.Diff(want, names); d != "" {
		t.Errorf("metric names (-want +got):\n%s", d)
	}
}

// TestRecord checks what each recording does to the exposition, read back
// the way a Prometheus server reads it.
func TestRecord(t *testing.T) {
	m := New()
	gauges := Gauges{Jobs: 2, Ranks: 4, ClosedGates: 3, GatedSockets: 5, HeldBytes: 4096}
	m.WatchGauges(func() Gauges { return gauges })
	s0 := scrape(t, m)
	for _, o := range PauseOutcomes {
		if v, ok := s0[Series("mpipause_pauses_total", "outcome", o)]; !ok || v != 0 {
			t.Errorf("pauses_total{outcome=%q} before any pause: %v, present %v; want 0, present", o, v, ok)
		}
	}
	// A pause that drained again after VERIFY: one observation per phase,
	// DRAIN's two added up.
	m.PauseDone(Committed, 40*time.Millisecond, []Phase{
		{"PREPARE", 2 * time.Millisecond}, {"DRAIN", 10 * time.Millisecond}, {"FREEZE", 3 * time.Millisecond},
		{"VERIFY", 2 * time.Millisecond}, {"THAW", time.Millisecond}, {"DRAIN", 5 * time.Millisecond},
		{"FREEZE", 3 * time.Millisecond}, {"VERIFY", 2 * time.Millisecond}, {"COMMIT", 3 * time.Millisecond},
		{"CONTROL", time.Second}, // not a phase: never a label value
	}, 3<<20)
	m.PauseDone(RolledBack, 10*time.Second, []Phase{{"PREPARE", time.Millisecond}, {"DRAIN", 10 * time.Second}, {"ABORT", 5 * time.Millisecond}}, 1<<20)
	m.PauseRefused()
	m.ResumeDone(Resumed, 2*time.Millisecond)
	m.ResumeDone(Failed, 30*time.Second)
	m.ResumeRefused()
	m.Step("DRAIN", time.Millisecond, nil)
	m.Step("OPEN", time.Millisecond, errors.New("rank gone"))
	m.Step("BOGUS", time.Millisecond, errors.New("x"))
	m.LeaseExpired()
	m.PeerDialled()
	m.PeerDialled()
	m.ConnectionRefused("ctl")
	m.ConnectionRefused("ctl")
	m.Violations(100)
	m.Violations(0)
	m.Snapshot(300 * time.Microsecond)
	s := scrape(t, m)
	want := map[string]float64{
		Series("mpipause_pauses_total", "outcome", "committed"):                       1,
		Series("mpipause_pauses_total", "outcome", "rolled_back"):                     1,
		Series("mpipause_pauses_total", "outcome", "failed"):                          0,
		Series("mpipause_pauses_total", "outcome", "refused"):                         1,
		Series("mpipause_resumes_total", "outcome", "resumed"):                        1,
		Series("mpipause_resumes_total", "outcome", "failed"):                         1,
		Series("mpipause_resumes_total", "outcome", "refused"):                        1,
		Series("mpipause_pause_duration_seconds_count", "outcome", "committed"):       1,
		Series("mpipause_pause_duration_seconds_sum", "outcome", "committed"):         0.04,
		Series("mpipause_pause_duration_seconds_count", "outcome", "rolled_back"):     1,
		Series("mpipause_resume_duration_seconds_count", "outcome", "resumed"):        1,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "prepare"):     2,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "drain"):       2,
		Series("mpipause_pause_phase_duration_seconds_sum", "phase", "drain"):         10.015,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "freeze"):      1,
		Series("mpipause_pause_phase_duration_seconds_sum", "phase", "freeze"):        0.006,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "thaw"):        1,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "commit"):      1,
		Series("mpipause_pause_phase_duration_seconds_count", "phase", "abort"):       1,
		Series("mpipause_pause_drained_bytes_count"):                                  1, // committed pauses only
		Series("mpipause_pause_drained_bytes_sum"):                                    3 << 20,
		Series("mpipause_pause_drained_bytes_bucket", "le", "1.048576e+06"):           0,
		Series("mpipause_pause_drained_bytes_bucket", "le", "4.194304e+06"):           1,
		Series("mpipause_node_step_duration_seconds_count", "step", "drain"):          1,
		Series("mpipause_node_step_duration_seconds_count", "step", "open"):           1,
		Series("mpipause_node_step_errors_total", "step", "open"):                     1,
		Series("mpipause_node_step_errors_total", "step", "drain"):                    0,
		Series("mpipause_node_lease_expiries_total"):                                  1,
		Series("mpipause_peer_dials_total"):                                           2,
		Series("mpipause_connections_refused_total", "socket", "ctl"):                 2,
		Series("mpipause_connections_refused_total", "socket", "peer"):                0,
		Series("mpipause_gate_violation_bytes_total"):                                 100,
		Series("mpipause_observer_snapshot_duration_seconds_count"):                   1,
		Series("mpipause_observer_snapshot_duration_seconds_bucket", "le", "0.00025"): 0,
		Series("mpipause_observer_snapshot_duration_seconds_bucket", "le", "0.0005"):  1,
		Series("mpipause_jobs"):          2,
		Series("mpipause_ranks"):         4,
		Series("mpipause_closed_gates"):  3,
		Series("mpipause_gated_sockets"): 5,
		Series("mpipause_held_bytes"):    4096,
	}
	got := map[string]float64{}
	for k := range want {
		got[k] = s[k]
		if _, ok := s[k]; !ok {
			t.Errorf("no series %s", k)
		}
	}
	if d := cmp.Diff(want, got, cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })); d != "" {
		t.Errorf("scrape (-want +got):\n%s", d)
	}
	for k := range s {
		if strings.Contains(k, `"control"`) || strings.Contains(k, `"bogus"`) {
			t.Errorf("series %s: a label value outside the documented set", k)
		}
	}
}

// TestNil: metrics off is a nil *Metrics, and recording into it is a no-op.
func TestNil(t *testing.T) {
	var m *Metrics
	m.PauseDone(Committed, time.Second, []Phase{{"DRAIN", time.Second}}, 1)
	m.PauseRefused()
	m.ResumeDone(Resumed, time.Second)
	m.ResumeRefused()
	m.Step("drain", time.Second, nil)
	m.LeaseExpired()
	m.PeerDialled()
	m.PeerDialled()
	m.ConnectionRefused("ctl")
	m.Violations(1)
	m.Snapshot(time.Second)
	m.WatchGauges(func() Gauges { t.Error("gauges read with metrics off"); return Gauges{} })
}

func TestCheckAddr(t *testing.T) {
	for _, tc := range []struct {
		addr string
		want string // a part of the error; "" for none
	}{
		{"127.0.0.1:9717", ""},
		{"[::1]:9717", ""},
		{"localhost:9717", ""},
		{"0.0.0.0:9717", ""},
		{"[::]:9717", ""},
		{":9717", "no host; write 127.0.0.1:9717 for this node only, or 0.0.0.0:9717 or [::]:9717"},
		{"9717", "want HOST:PORT"},
		{"127.0.0.1", "want HOST:PORT"},
		{"127.0.0.1:0", "want a port 1-65535"},
		{"127.0.0.1:65536", "want a port 1-65535"},
		{"127.0.0.1:http", "want a port 1-65535"},
	} {
		err := CheckAddr(tc.addr)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("CheckAddr(%q): %v", tc.addr, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("CheckAddr(%q) = %v, want an error with %q", tc.addr, err, tc.want)
		case err != nil && strings.Contains(err.Error(), "\n"):
			t.Errorf("CheckAddr(%q): more than one line: %q", tc.addr, err)
		}
	}
}

// TestServe serves on loopback, scrapes over HTTP, and checks that the
// server ends with its context and stops listening.
func TestServe(t *testing.T) {
	m := New()
	ln, err := Listen("127.0.0.1:0")
	if err == nil {
		t.Fatal("Listen accepted port 0")
	}
	ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- m.Serve(ctx, ln, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	m.PauseRefused()
	resp, err := http.Get("http://" + addr + Path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Parse(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if v := s[Series("mpipause_pauses_total", "outcome", "refused")]; v != 1 {
		t.Errorf("pauses_total{refused} over HTTP = %v, want 1", v)
	}
	if _, ok := s["go_goroutines"]; !ok {
		t.Error("no Go runtime metrics")
	}
	if resp, err := http.Get("http://" + addr + "/other"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /other: %v %v, want 404", resp, err)
	}
	// A client scraping in a loop is answered at ScrapeRate (its burst of
	// twice that, less the scrape above), the rest at once with 429.
	var ok, many int
	start := time.Now()
	for range 100 {
		resp, err := http.Get("http://" + addr + Path)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			ok++
		case http.StatusTooManyRequests:
			many++
		}
	}
	if most := int(2*ScrapeRate) + int(float64(ScrapeRate)*time.Since(start).Seconds()) + 1; ok > most || many == 0 || ok+many != 100 {
		t.Errorf("100 scrapes in %v: %d answered, %d refused with 429; want at most %d answered, the rest refused", time.Since(start), ok, many, most)
	}
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
	if c, err := net.Dial("tcp", addr); err == nil {
		c.Close()
		t.Errorf("%s still accepts connections after Serve returned", addr)
	}
}

package metrics

import (
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Namespace prefixes every mpipause metric.
const Namespace = "mpipause"

// Outcomes of a pause, as the coordinator decides them (PauseOutcomes).
const (
	// Committed: every node frozen and its connections verified empty.
	Committed = "committed"
	// RolledBack: the pause failed and every node confirmed the rollback;
	// the job runs on.
	RolledBack = "rolled_back"
	// Failed: the pause (or resume) failed and some node did not confirm
	// its thaw: `mpipause status` says which.
	Failed = "failed"
	// Refused: the coordinator did not start it (the job is busy, already
	// paused or running, or cannot be paused cleanly).
	Refused = "refused"
	// Resumed: every node thawed and reopened the job's gates.
	Resumed = "resumed"
)

// PauseOutcomes and ResumeOutcomes are every value of the outcome label.
// Every series of every label set is exported from the start (at 0), so
// that a rate over one that has never moved is 0, not absent.
var (
	PauseOutcomes  = []string{Committed, RolledBack, Failed, Refused}
	ResumeOutcomes = []string{Resumed, Failed, Refused}
)

// Phases are the values of the phase label: the protocol's pause phases
// (quiesce.Kind, lowercase). thaw is the thaw of another drain attempt after
// a VERIFY that found bytes; abort is the rollback of a failed pause.
var Phases = []string{"prepare", "drain", "freeze", "verify", "thaw", "commit", "abort"}

// Steps are the values of the step label: what a node does locally for one
// protocol request (internal/node's Steps). rethaw is THAW for another
// drain attempt, thaw and open are a rollback's or a resume's two halves.
var Steps = []string{"prepare", "drain", "freeze", "verify", "commit", "rethaw", "thaw", "open"}

// Buckets, in seconds, of the pause's phases and of pauses and resumes
// whole: measured on the rig, phases take 0.3-25 ms, pauses 10-71 ms, resumes
// 0.5-1.3 ms (docs/benchmarks.md, "The current figures"); a pause the drain cannot finish
// is rolled back after --drain-timeout (10 s), or the user's --timeout.
var DurationBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// SnapshotBuckets, in seconds, of one kernel snapshot of a job's sockets:
// the BPF observer takes 0.08 ms at 100 sockets, 1.6 ms at 3,000 and 6-10 ms
// at 10,000; sock_diag 80 ms.
var SnapshotBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1}

// DrainedBuckets, in bytes, of what a pause's drain moved: nothing (0), a
// page, up to the 20-35 MiB a SIGSTOP leaves in flight on a 4x4 rig job,
// and beyond.
var DrainedBuckets = []float64{0, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30}

// Metrics is mpid's set of collectors. The zero value is not usable: make
// one with New. A nil *Metrics is valid and records nothing.
type Metrics struct {
	reg *prometheus.Registry

	pauses, resumes *prometheus.CounterVec
	pauseDuration   *prometheus.HistogramVec
	resumeDuration  *prometheus.HistogramVec
	phaseDuration   *prometheus.HistogramVec
	drained         prometheus.Histogram
	stepDuration    *prometheus.HistogramVec
	stepErrors      *prometheus.CounterVec
	leaseExpiries   prometheus.Counter
	peerDials       prometheus.Counter
	refusedConns    *prometheus.CounterVec
	violations      prometheus.Counter
	snapshot        prometheus.Histogram
}

// New makes the collectors and registers them, with the Go runtime's and
// the process's, on a registry of their own.
func New() *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	m.pauses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "pauses_total",
		Help: "Pauses of the jobs this mpid coordinates (made by `mpipause run` on its node, or Slurm steps whose first node it is), by outcome: committed, rolled_back, failed (a rollback some node did not confirm), refused (not started).",
	}, []string{"outcome"})
	m.resumes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "resumes_total",
		Help: "Resumes of the jobs this mpid coordinates, by outcome: resumed, failed (some node did not confirm), refused (the job was not paused, or busy).",
	}, []string{"outcome"})
	m.pauseDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "pause_duration_seconds",
		Help:    "Time from the start of a pause this mpid coordinates to its COMMIT, or to the end of its rollback, by outcome (not refused).",
		Buckets: DurationBuckets,
	}, []string{"outcome"})
	m.resumeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "resume_duration_seconds",
		Help:    "Time a resume this mpid coordinates takes until every node has thawed and reopened the job's gates (or gave up), by outcome (not refused).",
		Buckets: DurationBuckets,
	}, []string{"outcome"})
	m.phaseDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "pause_phase_duration_seconds",
		Help:    "Time one pause this mpid coordinates spent in each protocol phase it reached, all its rounds over every node together; one observation per pause and phase (a pause that drains again after VERIFY adds up its DRAINs).",
		Buckets: DurationBuckets,
	}, []string{"phase"})
	m.drained = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "pause_drained_bytes",
		Help:    "Bytes the job's connections held, on all its nodes, at the first drain check of each committed pause this mpid coordinates: what the drain moved before the freeze.",
		Buckets: DrainedBuckets,
	})
	m.stepDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "node_step_duration_seconds",
		Help:    "Time this node took for its own part of one protocol request, for any job, whoever coordinates it: one observation per local step (a DRAIN that waits for its queues checks them once per millisecond, each check a step).",
		Buckets: DurationBuckets,
	}, []string{"step"})
	m.stepErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "node_step_errors_total",
		Help: "Local protocol steps this node failed, by step.",
	}, []string{"step"})
	m.leaseExpiries = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: Namespace, Name: "node_lease_expiries_total",
		Help: "Pauses this node rolled back on its own because their coordinator sent no next step in time (dead, or cut off).",
	})
	m.peerDials = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: Namespace, Name: "peer_dials_total",
		Help: "Connections this mpid opened to other nodes' mpids and authenticated (a TCP and a TLS handshake each). Jobs' connections are made when their nodes register and kept warm: a rise with every pause means its rounds had to connect first.",
	})
	m.refusedConns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: Namespace, Name: "connections_refused_total",
		Help: "Connections this mpid closed at accept (past a per-peer or total bound, or its heap near its limit) and accept errors it waited out (out of descriptors or buffers), by socket; the peer port's also counts clients refused in their handshake. mpid's log says why, a line per cause.",
	}, []string{"socket"})
	m.violations = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: Namespace, Name: "gate_violation_bytes_total",
		Help: "Bytes the kernel saw the job's processes on this node hand to TCP while every send gate of the node was closed: a send path the shim does not wrap.",
	})
	m.snapshot = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: Namespace, Name: "observer_snapshot_duration_seconds",
		Help:    "Time one kernel snapshot of a job's sockets on this node takes (DRAIN checks and VERIFY).",
		Buckets: SnapshotBuckets,
	})
	for _, o := range PauseOutcomes {
		m.pauses.WithLabelValues(o)
	}
	for _, o := range ResumeOutcomes {
		m.resumes.WithLabelValues(o)
	}
	for _, s := range Steps {
		m.stepErrors.WithLabelValues(s)
		m.stepDuration.WithLabelValues(s)
	}
	for _, p := range Phases {
		m.phaseDuration.WithLabelValues(p)
	}
	for _, s := range Sockets {
		m.refusedConns.WithLabelValues(s)
	}
	for _, o := range []string{Committed, RolledBack, Failed} {
		m.pauseDuration.WithLabelValues(o)
	}
	for _, o := range []string{Resumed, Failed} {
		m.resumeDuration.WithLabelValues(o)
	}
	m.reg.MustRegister(m.pauses, m.resumes, m.pauseDuration, m.resumeDuration, m.phaseDuration, m.drained,
		m.stepDuration, m.stepErrors, m.leaseExpiries, m.peerDials, m.refusedConns, m.violations, m.snapshot,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is where the collectors are registered: what Serve exposes.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Gauges are figures read when scraped, from what mpid holds anyway
// (Gauges.Read). They are read under no lock of the metrics package.
type Gauges struct {
	// Jobs is the number of jobs this mpid knows.
	Jobs int
	// Ranks is the number of ranks registered with this mpid.
	Ranks int
	// ClosedGates is the number of those ranks whose send gate is closed
	// (or still flushing what it held).
	ClosedGates int
	// GatedSockets is the number of sockets on which a shim holds a send
	// under a closed gate, and HeldBytes what they hold.
	GatedSockets int
	HeldBytes    uint64
}

// WatchGauges exports the figures read returns, calling it once per
// scrape. It is set once, by mpid, after New.
func (m *Metrics) WatchGauges(read func() Gauges) {
	if m == nil {
		return
	}
	m.reg.MustRegister(&gaugeCollector{read: read})
}

type gaugeCollector struct{ read func() Gauges }

var (
	jobsDesc   = prometheus.NewDesc(Namespace+"_jobs", "Jobs this mpid knows: jobs with a rank or a process on this node, or a pause under way here.", nil, nil)
	ranksDesc  = prometheus.NewDesc(Namespace+"_ranks", "Ranks (MPI processes with the shim) registered with this mpid.", nil, nil)
	closedDesc = prometheus.NewDesc(Namespace+"_closed_gates", "Ranks registered here whose send gate is closed (a pause under way or holding), or still flushing what it held after the reopen.", nil, nil)
	gatedDesc  = prometheus.NewDesc(Namespace+"_gated_sockets", "Sockets of the ranks registered here on which the shim holds a send under a closed gate, until the reopen flushes it.", nil, nil)
	heldDesc   = prometheus.NewDesc(Namespace+"_held_bytes", "Bytes the shims of the ranks registered here hold under closed gates (sent, in order, at the reopen).", nil, nil)
)

func (g *gaugeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{jobsDesc, ranksDesc, closedDesc, gatedDesc, heldDesc} {
		ch <- d
	}
}

func (g *gaugeCollector) Collect(ch chan<- prometheus.Metric) {
	v := g.read()
	ch <- prometheus.MustNewConstMetric(jobsDesc, prometheus.GaugeValue, float64(v.Jobs))
	ch <- prometheus.MustNewConstMetric(ranksDesc, prometheus.GaugeValue, float64(v.Ranks))
	ch <- prometheus.MustNewConstMetric(closedDesc, prometheus.GaugeValue, float64(v.ClosedGates))
	ch <- prometheus.MustNewConstMetric(gatedDesc, prometheus.GaugeValue, float64(v.GatedSockets))
	ch <- prometheus.MustNewConstMetric(heldDesc, prometheus.GaugeValue, float64(v.HeldBytes))
}

// Phase is one phase of a pause as the coordinator reports it.
type Phase struct {
	// Name is the protocol's kind (PREPARE, DRAIN, ...), in any case.
	Name    string
	Elapsed time.Duration
}

// PauseRefused counts a pause the coordinator did not start.
func (m *Metrics) PauseRefused() {
	if m == nil {
		return
	}
	m.pauses.WithLabelValues(Refused).Inc()
}

// PauseDone records a pause the coordinator ran: its outcome (Committed,
// RolledBack or Failed), how long it took, its phases in the order they ran
// (a phase that ran more than once is observed once, with its times added
// up), and, for a committed pause, the bytes its drain moved.
func (m *Metrics) PauseDone(outcome string, total time.Duration, phases []Phase, drained uint64) {
	if m == nil {
		return
	}
	m.pauses.WithLabelValues(outcome).Inc()
	m.pauseDuration.WithLabelValues(outcome).Observe(total.Seconds())
	sum := map[string]time.Duration{}
	var order []string
	for _, p := range phases {
		name := strings.ToLower(p.Name)
		if !slices.Contains(Phases, name) {
			continue // a label value outside the documented set never appears
		}
		if _, ok := sum[name]; !ok {
			order = append(order, name)
		}
		sum[name] += p.Elapsed
	}
	for _, name := range order {
		m.phaseDuration.WithLabelValues(name).Observe(sum[name].Seconds())
	}
	if outcome == Committed {
		m.drained.Observe(float64(drained))
	}
}

// ResumeRefused counts a resume the coordinator did not start.
func (m *Metrics) ResumeRefused() {
	if m == nil {
		return
	}
	m.resumes.WithLabelValues(Refused).Inc()
}

// ResumeDone records a resume the coordinator ran: Resumed or Failed.
func (m *Metrics) ResumeDone(outcome string, total time.Duration) {
	if m == nil {
		return
	}
	m.resumes.WithLabelValues(outcome).Inc()
	m.resumeDuration.WithLabelValues(outcome).Observe(total.Seconds())
}

// Step records one local protocol step of this node (a value of Steps, in
// any case), and whether it failed.
func (m *Metrics) Step(step string, elapsed time.Duration, err error) {
	if m == nil {
		return
	}
	step = strings.ToLower(step)
	if !slices.Contains(Steps, step) {
		return
	}
	m.stepDuration.WithLabelValues(step).Observe(elapsed.Seconds())
	if err != nil {
		m.stepErrors.WithLabelValues(step).Inc()
	}
}

// LeaseExpired counts a pause this node rolled back on its own.
func (m *Metrics) LeaseExpired() {
	if m == nil {
		return
	}
	m.leaseExpiries.Inc()
}

// PeerDialled counts a connection opened to a peer mpid.
func (m *Metrics) PeerDialled() {
	if m == nil {
		return
	}
	m.peerDials.Inc()
}

// Sockets are the values of connections_refused_total's socket label.
var Sockets = []string{"ctl", "rank", "peer", "metrics"}

// ConnectionRefused counts a connection socket closed at accept, or an
// accept error it waited out.
func (m *Metrics) ConnectionRefused(socket string) {
	if m == nil {
		return
	}
	m.refusedConns.WithLabelValues(socket).Inc()
}

// Violations adds bytes sent through closed gates.
func (m *Metrics) Violations(bytes uint64) {
	if m == nil || bytes == 0 {
		return
	}
	m.violations.Add(float64(bytes))
}

// Snapshot records how long one kernel snapshot took.
func (m *Metrics) Snapshot(elapsed time.Duration) {
	if m == nil {
		return
	}
	m.snapshot.Observe(elapsed.Seconds())
}

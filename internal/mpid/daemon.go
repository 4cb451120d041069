// Package mpid is the node daemon: one per node, root. Its roles, each a
// type of its own that Run wires together and serves as tasks of one group:
//   - registry (registry.go): the jobs with ranks on this node, admitted by
//     their job key (admission.go, authority.go) at JOIN and HELLO, moved
//     into their job's cgroup, watched by the kernel observer;
//     registrations with the jobs' coordinators (registration.go); jobs
//     adopted from a previous mpid (adopt.go); pauses and resumes handed to
//     the coordinator as operations that keep the job's record
//     (operation.go); jobs forgotten once nothing of them is left (sweep);
//   - node role: internal/node's Steps, the quiesce.Node of the agent that
//     runs this node's protocol steps (gates, kernel reports, the freezer),
//     given the registry's jobs and the store's records;
//   - coordinator (coordinator.go, report.go): status, pause, resume and
//     rollback confirmation of the jobs this node coordinates;
//   - control (control.go): the CLI's socket; peer (peer.go): the peer port;
//   - store (state.go): the records that let a restarted mpid take over,
//     written by the registry's operations and a node's COMMIT.
//
// The kernel is passed in (Config.Cgroups, Config.Observers; the peer
// network too, Config.Network), so that in-process tests run whole daemons
// unprivileged (daemon_test.go).
package mpid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/version"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// DefaultPeerPort is the TCP port mpids speak the pause protocol on.
const DefaultPeerPort = 7170

// Config is a daemon's configuration; main fills it from flags.
type Config struct {
	// Node is this node's name: the name peers resolve to reach it, and the
	// name ranks report as their host.
	Node string
	// PeerListen is the TCP address the pause protocol is served on.
	PeerListen string
	// PeerPort is the port dialled on other nodes.
	PeerPort int
	// RankSocket and CtlSocket are the unix sockets of the shims and of the
	// CLI: paths in a directory only root may write (listenSocket), or
	// "@name" (abstract, one per network namespace, which any local user
	// may take while mpid is down: for tests).
	RankSocket string
	CtlSocket  string
	// CgroupParent is where job cgroups are made: <v2 root>/<CgroupParent>/<job>.
	CgroupParent string
	// FixedCgroup, if set, is a cgroup the launcher already put every job's
	// ranks in: mpid admits only its processes, moves nobody, and freezes it
	// whole. For a single job per node (tests, or a scheduler's cgroup).
	FixedCgroup string
	// Unpin detaches the jobs' BPF state on exit (default: leave it for the
	// next mpid).
	Unpin bool
	// LogTimeline logs each operation's steps on this node, one line each
	// (node.Timelines).
	LogTimeline bool
	// Drain is the default drain timeout of a pause.
	Drain time.Duration
	// Nice is the scheduling niceness of every mpid thread (0: leave it).
	Nice int
	// StateDir holds the records of paused jobs that let a restarted mpid
	// resume them (G5, docs/guarantees.md); default /run/mpipause/mpid-<Node>.
	StateDir string
	// ClusterKey is the cluster's keys (quiesce keys.go): the peer port's
	// TLS certificates derive from them (quiesce tls.go), and so do job
	// keys. Required: New fails without it.
	ClusterKey *quiesce.Keyring
	// RTPriority, if not 0, puts every mpid thread under SCHED_RR at this
	// priority (1..99); where the kernel refuses, mpid logs it and runs
	// with Nice alone.
	RTPriority int
	// MetricsListen, if set, is the TCP address (host:port, an explicit
	// host: metrics.CheckAddr) where mpid serves Prometheus metrics at
	// /metrics. Empty: no metrics, nothing listens.
	MetricsListen string
	Log           *slog.Logger

	// Cgroups and Observers are the kernel's (KernelCgroups, BPFObservers)
	// unless set; Network, if set, carries the peer port instead of TCP
	// (PeerListen and PeerPort are then unused). In-process tests set all
	// three (quiesce.MemNetwork for the network).
	Cgroups   Cgroups
	Observers Observers
	Network   PeerNetwork
}

// PeerNetwork is a peer port other than TCP.
type PeerNetwork interface {
	quiesce.Transport
	Register(node string, h quiesce.Handler)
}

// Daemon is a running mpid: its roles, wired by Run.
type Daemon struct {
	cfg Config
	log *slog.Logger
	// metrics is nil when metrics are off (every recording is then a
	// no-op).
	metrics *metrics.Metrics
	// observer is the kernel observer's mode and programs, "" with
	// Config.Observers given.
	observer string
	// signals times the ranks' SIGTSTP and SIGCONT in the kernel; nil
	// where it cannot (and with Config.Observers given).
	signals *loader.SignalClock

	reg   *registry
	coord *coordinator
	peer  *peer
	ctl   *control
	store *store
}

// New prepares a daemon; Run starts it.
func New(cfg Config) (*Daemon, error) {
	if cfg.ClusterKey == nil {
		return nil, errors.New("no cluster key: the peer port is never served unauthenticated")
	}
	if cfg.Node == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, err
		}
		cfg.Node = h
	}
	if cfg.PeerPort == 0 {
		cfg.PeerPort = DefaultPeerPort
	}
	if cfg.PeerListen == "" {
		cfg.PeerListen = ":" + strconv.Itoa(cfg.PeerPort)
	}
	if cfg.RankSocket == "" {
		cfg.RankSocket = ranks.DefaultAddr
	}
	if cfg.CtlSocket == "" {
		cfg.CtlSocket = ctl.DefaultAddr
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "mpipause"
	}
	if cfg.StateDir == "" {
		cfg.StateDir = filepath.Join("/run/mpipause", "mpid-"+cfg.Node)
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d := &Daemon{cfg: cfg, log: cfg.Log}
	if cfg.MetricsListen != "" {
		if err := metrics.CheckAddr(cfg.MetricsListen); err != nil {
			return nil, err
		}
		d.metrics = metrics.New()
	}
	return d, nil
}

// Run serves until ctx ends. ready is called once every socket listens.
func (d *Daemon) Run(ctx context.Context, ready func() error) error {
	if d.cfg.Cgroups == nil {
		if _, err := cgroupv2.Root(); err != nil {
			return err
		}
		d.cfg.Cgroups = KernelCgroups{}
		if d.cfg.FixedCgroup != "" {
			dir, err := cgroupv2.Resolve(d.cfg.FixedCgroup)
			if err != nil {
				return err
			}
			d.cfg.FixedCgroup = dir
		}
	}
	if d.cfg.Observers == nil {
		f, err := loader.CheckBPF(true)
		if err != nil {
			return fmt.Errorf("kernel observer: %w", err)
		}
		d.logFeatures(f)
		d.observer = f.String()
		d.cfg.Observers = BPFObservers{Warn: d.log.Warn}
		if f.Signals {
			// The probe loaded it; attaching may still fail (then as
			// the probe's fallback would be).
			if d.signals, err = loader.OpenSignalClock(); err != nil {
				d.log.Warn("signal clock not attached; a rank's SIGTSTP is ordered by its handler's stamp", "error", err)
			} else {
				defer d.signals.Close()
			}
		}
	}
	if d.cfg.Nice != 0 || d.cfg.RTPriority != 0 {
		rtErr, err := sched.start(d.cfg.Nice, d.cfg.RTPriority)
		if err != nil {
			return err
		}
		if rtErr != nil {
			d.log.Warn("no real-time scheduling; running with --nice alone", "rt_priority", d.cfg.RTPriority, "error", rtErr)
		}
	}
	rl, err := listenSocket(d.cfg.RankSocket)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("rank socket %s: %w (is another mpid running on this node?)", d.cfg.RankSocket, err)
	}
	if err != nil {
		return fmt.Errorf("rank socket %s: %w", d.cfg.RankSocket, err)
	}
	// A failure below ends the process, which closes what is open.
	cl, err := listenSocket(d.cfg.CtlSocket)
	if err != nil {
		return fmt.Errorf("control socket %s: %w", d.cfg.CtlSocket, err)
	}
	var pl net.Listener
	var id *quiesce.Identity
	var tr quiesce.Transport = d.cfg.Network
	var tcp *quiesce.TCPTransport
	if d.cfg.Network == nil {
		if id, err = quiesce.NewIdentity(d.cfg.Node, d.cfg.ClusterKey); err != nil {
			return err
		}
		if pl, err = net.Listen("tcp", d.cfg.PeerListen); err != nil {
			return fmt.Errorf("peer port %s: %w", d.cfg.PeerListen, err)
		}
		tcp = &quiesce.TCPTransport{Resolve: d.resolve, Identity: id, OnDial: func(string) { d.metrics.PeerDialled() }}
		defer tcp.CloseIdle()
		tr = tcp
	}
	ml, err := d.listenMetrics()
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	b := bounds(nofile())
	rs := ranks.NewServer(rl)
	rs.Limits = d.bounded(b.rank, accept.UIDKey, "rank socket", "rank")
	d.wire(rs, tr, ctx.Done())
	if tcp != nil {
		// Calls to this node (every round of a job it coordinates starts
		// with one) skip the loopback and its TLS.
		tcp.ServeLocal(ctx, d.cfg.Node, d.peer.handle)
	}
	for _, rec := range d.reg.adopt() {
		go d.coord.confirmRollback(rec.Job, rec.Nodes)
	}
	// The unix sockets' and the metrics' accept loops, their refusals
	// with them, are work any local user (or, for metrics, any client)
	// can cause: they run where a stranger's work does; the connections
	// they admit are served at mpid's priority.
	g.Go(strangerLoop(func() error { return wrap("rank socket", d.reg.ranks.Serve(ctx)) }))
	peers := "in-process"
	if pl != nil {
		peers = pl.Addr().String()
		g.Go(func() error {
			return wrap("peer port", quiesce.ServeTCPWith(ctx, pl, d.peer.handle, quiesce.ServerOptions{Identity: id, Refused: d.peerRefused(),
				Unauthenticated: asStranger, MaxConns: b.peer.Total, MaxConnsPerAddr: b.peer.PerKey, Busy: heapFull}))
		})
	} else {
		d.cfg.Network.Register(d.cfg.Node, d.peer.handle)
	}
	g.Go(strangerLoop(func() error {
		return wrap("control socket", d.ctl.serve(ctx, accept.New(cl, d.bounded(b.ctl, accept.UIDKey, "control socket", "ctl"))))
	}))
	if ml != nil {
		g.Go(strangerLoop(func() error {
			return wrap("metrics", d.serveMetrics(ctx, ml))
		}))
		d.log.Info("serving metrics", "url", "http://"+ml.Addr().String()+metrics.Path)
	}
	g.Go(func() error { return d.reg.sweep(ctx) })
	if d.cfg.Nice != 0 || d.cfg.RTPriority != 0 {
		g.Go(func() error { return sched.keep(ctx, d.log) })
	}
	g.Go(func() error { return d.coord.keepWarm(ctx, d.reg.treeChanged) })
	d.log.Info("serving", "node", d.cfg.Node, "ranks", d.cfg.RankSocket, "control", d.cfg.CtlSocket,
		"peers", peers, "cgroups", d.cgroupParent(), "version", version.String())
	var first error
	if ready != nil {
		first = ready()
		if first != nil {
			cancel()
		}
	}
	if err := g.Wait(); first == nil {
		first = err
	}
	d.reg.close(d.cfg.Unpin)
	return first
}

// wire makes mpid's roles around the rank server rs and the peer network
// tr; done closes when mpid stops.
func (d *Daemon) wire(rs *ranks.Server, tr quiesce.Transport, done <-chan struct{}) {
	d.store = &store{dir: d.cfg.StateDir, log: d.log}
	d.reg = &registry{node: d.cfg.Node, key: d.cfg.ClusterKey, parent: d.cgroupParent(), fixed: d.cfg.FixedCgroup,
		cgroups: d.cfg.Cgroups, observers: d.cfg.Observers, ranks: rs, store: d.store, tr: tr, log: d.log,
		refusals: newLogLimiter(refusalQuiet), jobs: map[string]*job{}, done: done, treeChanged: make(chan struct{}, 1)}
	role := &node.Role{Name: d.cfg.Node, Ranks: rs, Jobs: d.reg, Freezer: d.cfg.Cgroups,
		Metrics: d.metrics, Log: d.log}
	if d.cfg.LogTimeline {
		role.Timelines = &node.Timelines{}
	}
	local := node.NewSteps(role, d.log)
	local.Records = commitRecords{d.store}
	retry := quiesce.DefaultRetry
	if _, ok := tr.(*quiesce.TCPTransport); ok {
		retry = quiesce.TCPRetry
	}
	agent := quiesce.NewAgent(local, tr, retry)
	agent.Self = d.cfg.Node
	agent.CPUTime = processCPU
	agent.OnExpire = func(job string, err error) {
		// The coordinator died or lost this node mid-pause: the agent
		// thawed and reopened the job here on its own (G3,
		// docs/guarantees.md).
		d.metrics.LeaseExpired()
		if err != nil {
			d.log.Error("pause abandoned by its coordinator; rolling back here failed", "job", job, "error", err)
			return
		}
		d.log.Warn("pause abandoned by its coordinator (no step in time); rolled back here", "job", job)
	}
	agent.OnHeld = func(job string) {
		// COMMIT came, then nothing; the pause's decider says every node
		// committed, so it holds here too.
		d.log.Warn("pause committed, its coordinator silent since; its decider says it holds: paused here", "job", job)
	}
	d.reg.agent = agent
	if d.signals != nil {
		d.reg.signals = d.signals
	}
	d.coord = &coordinator{node: d.cfg.Node, observer: d.observer, reg: d.reg, ranks: rs, agent: agent, tr: tr,
		metrics: d.metrics, drain: d.cfg.Drain, retry: retry, log: d.log, done: done}
	d.peer = &peer{node: d.cfg.Node, key: d.cfg.ClusterKey, reg: d.reg, coord: d.coord, agent: agent, log: d.log}
	d.ctl = &control{key: d.cfg.ClusterKey, reg: d.reg, coord: d.coord}
	d.reg.events = d.coord
	rs.Jobs = d.reg
}

// peerRefused logs the peers the peer port refuses (refusedLog).
func (d *Daemon) peerRefused() func(cause string, peer net.Addr, err error) {
	log := d.refusedLog("peer refused", "peer")
	return func(cause string, peer net.Addr, err error) { log(cause, "", peer, err) }
}

// bounded is o, a socket's bounds, with the rest of its accept options:
// connections keyed by key, refused while the heap is near its limit,
// refusals and accept errors logged as socket's and counted under label.
func (d *Daemon) bounded(o accept.Options, key func(net.Conn) (string, error), socket, label string) accept.Options {
	o.Key, o.Busy, o.Log = key, heapFull, d.refusedLog(socket, label)
	return o
}

func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (d *Daemon) cgroupParent() string {
	if d.cfg.FixedCgroup != "" {
		return d.cfg.FixedCgroup
	}
	root, _ := d.cfg.Cgroups.Root()
	return filepath.Join(root, d.cfg.CgroupParent)
}

func (d *Daemon) resolve(name string) (string, error) {
	return fmt.Sprintf("%s:%d", name, d.cfg.PeerPort), nil
}

// logFeatures says once, at start, what this node's kernel let the
// observer load: one line for each program it replaced, and the mode with
// what is weaker than docs/guarantees.md's full mode.
func (d *Daemon) logFeatures(f loader.Features) {
	for _, fb := range f.Fallbacks {
		d.log.Warn("BPF program refused by this kernel; using its fallback", "program", fb.Program, "reason", fb.Reason, "instead", fb.Instead)
	}
	if w := f.Weaker(); len(w) > 0 {
		d.log.Warn("kernel observer degraded", "observer", f.String(), "weaker", strings.Join(w, "; "))
		return
	}
	d.log.Info("kernel observer", "observer", f.String())
}

// processCPU is mpid's CPU time so far (user and system, every thread), 0
// if the kernel does not say.
func processCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Package mpid is the node daemon: one per node, root. It keeps the registry
// of the jobs whose ranks registered on this node, moves each rank into its
// job's cgroup on this node before the rank opens a socket (the shim's JOIN),
// watches the job's connections with the kernel observer, plays the node role
// of the pause protocol for its peers (quiesce.Agent over TCP), plays the
// coordinator role for the jobs whose rank 0 runs here, and answers the
// mpipause CLI on its control socket.
package mpid

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/internal/version"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
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
	// Drain is the default drain timeout of a pause.
	Drain time.Duration
	// Nice is the scheduling niceness of every mpid thread (0: leave it).
	Nice int
	// StateDir holds the records of paused jobs that let a restarted mpid
	// resume them (G5); default /run/mpipause/mpid-<Node>.
	StateDir string
	// ClusterKey authenticates the peer port both ways (quiesce auth.go):
	// mpid refuses peers without it, and peers that do not prove it.
	// Required: New fails without it.
	ClusterKey *quiesce.Key
	// RTPriority, if not 0, puts every mpid thread under SCHED_RR at this
	// priority (1..99); where the kernel refuses, mpid logs it and runs
	// with Nice alone.
	RTPriority int
	// MetricsListen, if set, is the TCP address (host:port, an explicit
	// host: metrics.CheckAddr) where mpid serves Prometheus metrics at
	// /metrics. Empty: no metrics, nothing listens.
	MetricsListen string
	Log           *slog.Logger
}

// Daemon is a running mpid.
type Daemon struct {
	cfg   Config
	log   *slog.Logger
	ranks *ranks.Server
	agent *quiesce.Agent
	// tr is the peer port's client side, shared by the agent and every
	// coordinator on this node so that its connections are reused (a
	// quiesce.MemNetwork in in-process tests).
	tr quiesce.Transport
	// metrics is nil when metrics are off (every recording is then a
	// no-op).
	metrics *metrics.Metrics

	// refusals keeps a rank that retries a refused JOIN or HELLO from
	// flooding the log.
	refusals *logLimiter

	mu   sync.Mutex
	jobs map[string]*job
	// done closes when Run ends: background work stops.
	done <-chan struct{}
}

// job is what this node knows of one job.
type job struct {
	// id is the job's key (ranks.JobKey: "<owner uid>:<name>"), the name
	// of its cgroup, its records and its protocol messages; name is the id
	// its owner chose, what the CLI shows.
	id     string
	name   string
	dir    string // cgroup v2 directory of the job's ranks on this node
	owner  uint32
	joined int             // ranks moved in by JOIN
	obs    loader.Observer // under mu; opened under obsMu (openObserver)
	obsMu  sync.Mutex
	// unwatched, if set, says why the kernel cannot vouch for the job.
	unwatched string
	// Coordinator side (rank 0 registered here).
	state string // ctl.State*
	busy  bool
	last  ctl.Job // the last pause or resume's figures
	since time.Time
	// adopted: found at start, left by a previous mpid (state.go); what its
	// ranks' registrations told the old mpid comes from its record, until
	// they register again. missing: the adopted ranks (pids) that have not
	// registered again yet; the job cannot be paused before they have.
	adopted bool
	missing map[int]bool
	nodes   []string
	// coordinator is the node named by the job key (authority.go): the
	// only one whose protocol steps this node runs for the job.
	coordinator string
	size        int
	localRanks  []int
	// Coordinator side: remotes are the other nodes whose mpid registered
	// ranks of the job here; creator is the `mpipause run` that created it
	// (the job is kept while it lives, ranks or not).
	remotes map[string]bool
	creator *os.Process
	// Other nodes: registered says the coordinator has confirmed this
	// node (registration is retried by sweep until it has, and repeated
	// so that a restarted coordinator learns its nodes again).
	registered bool
	token      string
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
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	d := &Daemon{cfg: cfg, log: cfg.Log, jobs: map[string]*job{}, refusals: newLogLimiter(refusalQuiet)}
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
	if _, err := cgroupv2.Root(); err != nil {
		return err
	}
	if d.cfg.Nice != 0 || d.cfg.RTPriority != 0 {
		rtErr, err := schedule(d.cfg.Nice, d.cfg.RTPriority)
		if err != nil {
			return err
		}
		if rtErr != nil {
			d.log.Warn("no real-time scheduling; running with --nice alone", "rt_priority", d.cfg.RTPriority, "error", rtErr)
		}
	}
	if d.cfg.FixedCgroup != "" {
		dir, err := cgroupv2.Resolve(d.cfg.FixedCgroup)
		if err != nil {
			return err
		}
		d.cfg.FixedCgroup = dir
	}
	rl, err := listenSocket(d.cfg.RankSocket)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("rank socket %s: %w (is another mpid running on this node?)", d.cfg.RankSocket, err)
	}
	if err != nil {
		return fmt.Errorf("rank socket %s: %w", d.cfg.RankSocket, err)
	}
	rs := ranks.NewServer(rl)
	d.ranks = rs
	rs.Admit = d.admit
	rs.Join = d.join
	rs.OnChange = d.rankChanged
	rs.OnEvent = d.rankEvent
	// A failure below ends the process, which closes what is open.
	cl, err := listenSocket(d.cfg.CtlSocket)
	if err != nil {
		return fmt.Errorf("control socket %s: %w", d.cfg.CtlSocket, err)
	}
	pl, err := net.Listen("tcp", d.cfg.PeerListen)
	if err != nil {
		return fmt.Errorf("peer port %s: %w", d.cfg.PeerListen, err)
	}
	ml, err := d.listenMetrics()
	if err != nil {
		return err
	}
	local := &localNode{d: d, fp: d.failpoints(), Local: &node.Local{Name: d.cfg.Node, Ranks: rs, Observer: d.observer, Cgroup: d.cgroupOf, CtlNice: d.cfg.Nice, CtlRT: d.cfg.RTPriority,
		Metrics: d.metrics,
		Unready: func(id string) string {
			d.mu.Lock()
			defer d.mu.Unlock()
			if j := d.jobs[id]; j != nil {
				return d.missingLocked(j)
			}
			return ""
		}}}
	tcp := &quiesce.TCPTransport{Resolve: d.resolve, Key: d.cfg.ClusterKey}
	defer tcp.CloseIdle()
	d.tr = tcp
	d.agent = quiesce.NewAgent(local, d.tr, quiesce.DefaultRetry)
	d.agent.OnExpire = func(job string, err error) {
		// The coordinator died or lost this node mid-pause: the agent
		// thawed and reopened the job here on its own (G3).
		d.metrics.LeaseExpired()
		if err != nil {
			d.log.Error("pause abandoned by its coordinator; rolling back here failed", "job", job, "error", err)
			return
		}
		d.log.Warn("pause abandoned by its coordinator (no step in time); rolled back here", "job", job)
	}

	interrupted := d.adopt()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	d.done = ctx.Done()
	for _, f := range interrupted {
		go f()
	}
	errs := make(chan error, 4)
	var wg sync.WaitGroup
	wg.Go(func() { errs <- wrap("rank socket", rs.Serve(ctx)) })
	wg.Go(func() {
		errs <- wrap("peer port", quiesce.ServeTCPWith(ctx, pl, d.peer, quiesce.ServerOptions{Key: d.cfg.ClusterKey, Log: d.log.Warn}))
	})
	wg.Go(func() { errs <- wrap("control socket", d.serveCtl(ctx, cl)) })
	if ml != nil {
		wg.Go(func() { errs <- wrap("metrics", d.serveMetrics(ctx, ml)) })
		d.log.Info("serving metrics", "url", "http://"+ml.Addr().String()+metrics.Path)
	}
	wg.Go(func() { d.sweep(ctx) })
	d.log.Info("serving", "node", d.cfg.Node, "ranks", d.cfg.RankSocket, "control", d.cfg.CtlSocket,
		"peers", pl.Addr().String(), "cgroups", d.cgroupParent(), "version", version.String())
	if ready != nil {
		if err := ready(); err != nil {
			cancel()
			wg.Wait()
			return err
		}
	}
	var first error
	select {
	case <-ctx.Done():
	case first = <-errs:
	}
	cancel()
	wg.Wait()
	d.shutdown()
	return first
}

func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// shutdown closes the observers; their pinned state stays unless Unpin.
func (d *Daemon) shutdown() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, j := range d.jobs {
		d.closeJobLocked(j, d.cfg.Unpin)
	}
}

func (d *Daemon) cgroupParent() string {
	if d.cfg.FixedCgroup != "" {
		return d.cfg.FixedCgroup
	}
	root, _ := cgroupv2.Root()
	return filepath.Join(root, d.cfg.CgroupParent)
}

// jobDir is the cgroup of job's ranks on this node.
func (d *Daemon) jobDir(id string) string {
	if d.cfg.FixedCgroup != "" {
		return d.cfg.FixedCgroup
	}
	return filepath.Join(d.cgroupParent(), id)
}

// maxJobsPerUser bounds the jobs one user can make mpid keep (each is a
// cgroup and a set of BPF programs).
const maxJobsPerUser = 64

// authorizeLocked returns the job a process of uid asks to join as job
// name with job key token, making its record (and cgroup) if it is new
// here: the key must be this job's (authority.go). The job then names its
// coordinator; a new job on another node than the coordinator registers
// there (register).
func (d *Daemon) authorizeLocked(uid uint32, name, token string) (*job, error) {
	if err := ctl.ValidJobID(name); err != nil {
		return nil, err
	}
	coord, err := checkToken(d.cfg.ClusterKey, uid, name, token)
	if err != nil {
		return nil, err
	}
	key := ranks.JobKey(uid, name)
	j := d.jobs[key]
	switch {
	case j == nil:
		if j, err = d.newJobLocked(uid, name, coord); err != nil {
			return nil, err
		}
	case j.coordinator == "":
		// Adopted without a record that names it.
		j.coordinator = coord
	case j.coordinator != coord:
		return nil, fmt.Errorf("job %s of uid %d is coordinated by %s, and this rank's job key names %s: two launches under one job id? give each its own", name, uid, j.coordinator, coord)
	}
	if coord != d.cfg.Node && j.token == "" {
		j.token = token
		go d.register(j.id, coord, token, uid)
	}
	return j, nil
}

// newJobLocked makes the record of job name of uid, coordinated by coord.
func (d *Daemon) newJobLocked(uid uint32, name, coord string) (*job, error) {
	if uid != 0 {
		n := 0
		for _, o := range d.jobs {
			if o.owner == uid {
				n++
			}
		}
		if n >= maxJobsPerUser {
			return nil, fmt.Errorf("uid %d has %d jobs on %s, the most one user may have: let some end first", uid, n, d.cfg.Node)
		}
	}
	key := ranks.JobKey(uid, name)
	j := &job{id: key, name: name, dir: d.jobDir(key), owner: uid, coordinator: coord, state: ctl.StateRunning, since: time.Now()}
	if d.cfg.FixedCgroup == "" {
		if err := cgroupv2.Create(j.dir); err != nil {
			return nil, err
		}
	}
	if coord == d.cfg.Node {
		j.remotes = map[string]bool{}
	}
	d.jobs[key] = j
	return j, nil
}

// openObserver attaches the kernel observer to the job's cgroup. Loading
// BPF programs takes tens of milliseconds: it holds the job's own lock, not
// d.mu, which every pause and resume of every job takes.
func (d *Daemon) openObserver(j *job) error {
	j.obsMu.Lock()
	defer j.obsMu.Unlock()
	d.mu.Lock()
	have := j.obs != nil
	d.mu.Unlock()
	if have {
		return nil
	}
	cfg := loader.Config{Cgroup: j.dir, FollowJob: true, Pin: true, Require: loader.KindBPF}
	obs, err := loader.Open(context.Background(), cfg)
	if errors.Is(err, loader.ErrStalePin) {
		// Pinned by an mpid of another build: the job ran, or is paused,
		// across an upgrade. Those maps do not fit this build's programs;
		// fresh ones adopt the job's open connections, history included
		// (loader's TestBPFPinStale), so the old state goes.
		d.log.Warn("replacing the job's BPF state pinned by another mpid build", "job", j.id, "err", err)
		if uerr := loader.Unpin(loader.Config{Cgroup: j.dir}); uerr != nil {
			return fmt.Errorf("observe job %s: %w (and unpinning it failed: %v)", j.id, err, uerr)
		}
		obs, err = loader.Open(context.Background(), cfg)
	}
	if err != nil {
		return fmt.Errorf("observe job %s: %w", j.id, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.jobs[j.id] != j {
		// The job ended meanwhile; its successor of the same key (if
		// any) opens its own.
		obs.Close()
		return fmt.Errorf("job %s ended", j.id)
	}
	j.obs = obs
	return nil
}

// join moves a rank into its job's cgroup before it opens any socket: the
// kernel files a socket under its creator's cgroup at creation, for good.
func (d *Daemon) join(req ranks.JoinRequest) error {
	j, err := d.joinLocked(req)
	if err != nil || j == nil {
		return err
	}
	if err := d.openObserver(j); err != nil {
		return err
	}
	d.log.Info("rank joined", "job", j.id, "pid", req.Proc.Pid, "uid", req.Proc.UID, "cgroup", j.dir)
	return nil
}

func (d *Daemon) joinLocked(req ranks.JoinRequest) (*job, error) {
	p := req.Proc
	d.mu.Lock()
	defer d.mu.Unlock()
	j, err := d.authorizeLocked(p.UID, req.Job, req.Key)
	if err != nil {
		return nil, err
	}
	if d.cfg.FixedCgroup != "" {
		if err := inCgroup(p.Pid, d.cfg.FixedCgroup); err != nil {
			return nil, err
		}
		return nil, p.Alive() // alive after the read: what it read was the process's
	}
	if err := p.MoveTo(j.dir); err != nil {
		return nil, err
	}
	j.joined++
	return j, nil
}

// admit accepts a rank's HELLO. A rank that did not JOIN first may have
// sockets the kernel files under another cgroup: it is admitted (it can be
// frozen) but the job is marked unpausable, because no kernel check could
// vouch for those sockets.
func (d *Daemon) admit(r *ranks.Rank) error {
	j, err := d.admitLocked(r)
	if err != nil {
		return err
	}
	return d.openObserver(j)
}

func (d *Daemon) admitLocked(r *ranks.Rank) (*job, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	j, err := d.authorizeLocked(r.UID, r.Job, r.Key)
	if err != nil {
		return nil, fmt.Errorf("rank %d (pid %d, uid %d) of job %s: %w", r.Rank, r.Pid, r.UID, r.Job, err)
	}
	if r.Size > j.size {
		j.size = r.Size
	}
	if err := inCgroup(r.Pid, j.dir); err != nil {
		if d.cfg.FixedCgroup != "" {
			return nil, err
		}
		if err := r.Proc().MoveTo(j.dir); err != nil {
			return nil, err
		}
		if j.unwatched == "" {
			j.unwatched = fmt.Sprintf("rank %d (pid %d on %s) registered without joining its job cgroup at start, so the kernel cannot check its connections; launch the job with `mpipause run`", r.Rank, r.Pid, d.cfg.Node)
		}
	}
	if j.adopted && j.missing[r.Pid] {
		delete(j.missing, r.Pid)
		if d.missingLocked(j) == "" {
			d.log.Info("every rank of the adopted job registered again; it can be paused", "job", j.id)
			j.adopted = false
		}
	}
	return j, nil
}

// missingLocked says why an adopted job cannot be paused yet: some of the
// ranks the previous mpid had registered have not registered with this one
// (a shim does so as soon as it runs: a paused job's after its resume).
// Ranks that have exited meanwhile are not waited for.
func (d *Daemon) missingLocked(j *job) string {
	if !j.adopted {
		return ""
	}
	var pids []int
	for pid := range j.missing {
		// Only ESRCH means gone: under the unit mpid has no CAP_KILL, and
		// kill(pid, 0) on another user's live rank fails with EPERM.
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			delete(j.missing, pid)
			continue
		}
		pids = append(pids, pid)
	}
	if len(pids) == 0 {
		return ""
	}
	slices.Sort(pids)
	return fmt.Sprintf("mpid on %s restarted since its ranks registered, and %s (pid %s) not registered again yet; "+
		"a rank does as soon as it runs (resume the job first if it is paused)",
		d.cfg.Node, plural(len(pids), "rank"), joinInts(pids))
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

func (d *Daemon) rankChanged(r *ranks.Rank, gone bool, err error) {
	switch {
	case err != nil && !gone:
		if ok, held := d.refusals.allow(err.Error()); ok {
			d.log.Warn("rank refused", "error", err, "repeats_not_logged", held)
		}
	case gone:
		if err == nil {
			d.log.Info("rank gone", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
		} else if ok, held := d.refusals.allow(fmt.Sprintf("cut off: uid %d", r.UID)); ok {
			// One line per user and interval, whatever the pids.
			d.log.Warn("rank cut off", "error", err, "repeats_not_logged", held)
		}
		d.mu.Lock()
		if j := d.jobs[r.Job]; j != nil {
			d.maybeEndLocked(j)
		}
		d.mu.Unlock()
	default:
		// Its shim's control thread is raised only for a pause step
		// (node.Local.Prepare), never for registering.
		d.log.Info("rank registered", "job", r.Job, "rank", r.Rank, "size", r.Size, "pid", r.Pid, "host", r.Host)
	}
}

// maybeEndLocked forgets a job once no process of it is left on this node
// and no pause of it is under way here. A pause whose ranks here all died
// mid-way must still find the job: its next step then names the ranks that
// exited (not "never prepared here", as a forgotten job did), and its
// rollback finds the cgroup to thaw; sweep ends the job after that.
func (d *Daemon) maybeEndLocked(j *job) {
	if j.busy || len(d.ranks.Ranks(j.id)) > 0 || d.agent.Pausing(j.id) || len(j.remotes) > 0 {
		return
	}
	if j.creator != nil {
		if !errors.Is(j.creator.Signal(syscall.Signal(0)), os.ErrProcessDone) {
			return // `mpipause run` is still launching or running it
		}
		j.creator.Release()
		j.creator = nil
	}
	if procs, err := cgroupv2.Procs(j.dir); (err != nil && !errors.Is(err, os.ErrNotExist)) || len(procs) > 0 {
		return
	}
	if j.coordinator != "" && j.coordinator != d.cfg.Node && j.token != "" {
		go d.unregister(j.id, j.coordinator, j.token, j.owner)
	}
	d.log.Info("job ended", "job", j.id)
	d.dropRecord(j.id)
	d.closeJobLocked(j, true)
	delete(d.jobs, j.id)
	d.agent.Forget(j.id)
}

func (d *Daemon) closeJobLocked(j *job, unpin bool) {
	if j.obs != nil {
		j.obs.Close()
		j.obs = nil
		if unpin {
			if err := loader.Unpin(loader.Config{Cgroup: j.dir}); err != nil {
				d.log.Warn("unpin", "job", j.id, "error", err)
			}
		}
	}
	if unpin && d.cfg.FixedCgroup == "" {
		if procs, err := cgroupv2.Procs(j.dir); err == nil && len(procs) == 0 {
			if err := cgroupv2.Remove(j.dir); err != nil {
				d.log.Warn("remove job cgroup", "job", j.id, "error", err)
			}
		}
	}
}

// sweep ends jobs whose processes all left without a rank's goodbye (a JOIN
// whose rank died before MPI_Init registered it).
func (d *Daemon) sweep(ctx context.Context) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.mu.Lock()
		for _, j := range d.jobs {
			d.maybeEndLocked(j)
			if d.jobs[j.id] == j && j.coordinator != "" && j.coordinator != d.cfg.Node && j.token != "" {
				// Again and again: a restarted coordinator learns its
				// nodes back this way.
				go d.register(j.id, j.coordinator, j.token, j.owner)
			}
		}
		d.mu.Unlock()
	}
}

func (d *Daemon) observer(id string) (loader.Observer, error) {
	d.mu.Lock()
	j := d.jobs[id]
	d.mu.Unlock()
	if j == nil {
		return nil, fmt.Errorf("job %s is not known on %s", id, d.cfg.Node)
	}
	if err := d.openObserver(j); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return j.obs, nil
}

func (d *Daemon) cgroupOf(id string) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if j := d.jobs[id]; j != nil {
		return j.dir, nil
	}
	return "", fmt.Errorf("job %s is not known on %s", id, d.cfg.Node)
}

// rankEvent acts on a rank's SIGTSTP or SIGCONT: the whole job pauses or
// resumes, as `mpipause` would do it. Only the coordinator acts; every rank
// of a job usually gets the signal (Slurm, a terminal), rank 0 included.
func (d *Daemon) rankEvent(r *ranks.Rank, ev string) {
	if strings.HasPrefix(ev, "flushed ") {
		o, err := ranks.ParseFlushed(ev)
		switch {
		case err != nil:
			d.log.Warn("rank sent a malformed flush report", "job", r.Job, "rank", r.Rank, "error", err)
		case o.Errors > 0:
			// A connection the peer closed during the pause: the kernel
			// would have dropped those bytes too.
			d.log.Warn("held bytes refused at reopen", "job", r.Job, "rank", r.Rank, "flushed", o.Flushed, "errors", o.Errors, "errno", o.Errno)
		default:
			d.log.Debug("held bytes flushed", "job", r.Job, "rank", r.Rank, "flushed", o.Flushed)
		}
		return
	}
	// ev is the rank's to write: an attribute (quoted), never the message.
	d.log.Info("rank event", "event", ev, "job", r.Job, "rank", r.Rank, "pid", r.Pid)
	op := map[string]string{"pause": ctl.OpPause, "resume": ctl.OpResume}[ev]
	if op == "" {
		return
	}
	go func() {
		// The rank's own uid, for its own job: a rank's signal pauses its
		// job, and nothing else.
		rep, err := d.doAt(context.Background(), ctl.Request{Version: ctl.Version, Op: op, Job: r.JobKey()}, r.UID, nil, true)
		var ce *ctl.Error
		switch {
		case errors.As(err, &ce) && (ce.Code == ctl.CodeElsewhere || ce.Code == ctl.CodeState):
			d.log.Info(ev+" request left alone", "job", r.Job, "reason", ce.Message)
		case err != nil:
			d.log.Warn(ev+" on the rank's request failed", "job", r.Job, "error", err)
		default:
			d.log.Info(ev+" on the rank's request", "job", r.Job, "state", rep.State, "total_ms", rep.TotalMs)
		}
	}()
}

// schedule sets the niceness of every thread of the process and, if rt is
// not 0, puts each under SCHED_RR at priority rt. Linux keeps both per
// thread and a new thread inherits its creator's, so once every thread has
// them (two passes, for threads made during the first), all later ones do
// too. mpid wants to run before the ranks it pauses: on a node whose cores
// are all busy polling, every wake-up of mpid otherwise waits for a rank's
// time slice to end, and a pause and a resume take a few per node. The
// resume suffers most: its replies travel while the thawed ranks are
// already polling (measured on the rig with MPICH: resume p50 11.3 ms with
// nice -10 alone, 2.0 ms under SCHED_RR). mpid sleeps but for short steps;
// the kernel's real-time throttling (sched_rt_runtime_us) bounds it if it
// ever did not. A kernel that refuses SCHED_RR (no CAP_SYS_NICE, or a
// cgroup without real-time budget) is reported in rtErr, not fatal.
func schedule(nice, rt int) (rtErr, err error) {
	for range 2 {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return nil, err
		}
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if nice != 0 {
				if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil && !errors.Is(err, unix.ESRCH) {
					return nil, fmt.Errorf("--nice %d: %w", nice, err)
				}
			}
			if rt != 0 && rtErr == nil {
				attr := unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_RR, Priority: uint32(rt)}
				if err := unix.SchedSetAttr(tid, &attr, 0); err != nil && !errors.Is(err, unix.ESRCH) {
					rtErr = fmt.Errorf("--rt-priority %d: %w", rt, err)
				}
			}
		}
	}
	return rtErr, nil
}

// inCgroup checks that pid lives in the cgroup v2 directory dir or below,
// from /proc/PID/cgroup ("0::/path").
func inCgroup(pid int, dir string) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	root, err := cgroupv2.Root()
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			p = filepath.Join(root, p)
			if p == dir || strings.HasPrefix(p, dir+"/") {
				return nil
			}
			return fmt.Errorf("pid %d is in %s, not in the job's cgroup %s", pid, p, dir)
		}
	}
	return fmt.Errorf("pid %d: no cgroup v2 entry", pid)
}

// serveCtl answers the CLI: one request per connection.
func (d *Daemon) serveCtl(ctx context.Context, ln *net.UnixListener) error {
	context.AfterFunc(ctx, func() { ln.Close() })
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go d.ctlConn(ctx, c)
	}
}

func (d *Daemon) ctlConn(ctx context.Context, c *net.UnixConn) {
	defer c.Close()
	cred, err := ranks.PeerCred(c)
	if err != nil {
		return
	}
	uid := cred.Uid
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	req, err := ctl.ReadRequest(bufio.NewReader(c))
	c.SetReadDeadline(time.Time{})
	if err != nil {
		var ce *ctl.Error
		if !errors.As(err, &ce) {
			ce = ctl.Errorf(ctl.CodeBadRequest, "control request: %v", err)
		}
		ctl.Write(c, ctl.Reply{Err: ce, Final: true})
		return
	}
	// The CLI going away (Ctrl-C) must not cut a pause short: the protocol
	// finishes or rolls back on its own deadlines either way.
	var wmu sync.Mutex
	progress := func(p ctl.Progress) {
		wmu.Lock()
		defer wmu.Unlock()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		ctl.Write(c, ctl.Reply{Progress: &p})
	}
	switch req.Op {
	case ctl.OpList:
		ctl.Write(c, ctl.Reply{Jobs: d.list(uid), Final: true})
		return
	case ctl.OpStatus:
		if req.Job == "" {
			ctl.Write(c, ctl.Reply{Jobs: d.list(uid), Final: true})
			return
		}
	case ctl.OpCreate:
		ctl.Write(c, d.create(req.Job, uid, int(cred.Pid)))
		return
	case ctl.OpToken:
		ctl.Write(c, d.token(req, uid))
		return
	}
	j, err := d.do(context.WithoutCancel(ctx), req, uid, progress)
	wmu.Lock()
	defer wmu.Unlock()
	c.SetWriteDeadline(time.Now().Add(time.Second))
	var ce *ctl.Error
	switch {
	case errors.As(err, &ce):
		r := ctl.Reply{Err: ce, Final: true}
		if j.ID != "" {
			r.Job = &j
		}
		ctl.Write(c, r)
	case err != nil:
		ctl.Write(c, ctl.Reply{Err: ctl.Errorf(ctl.CodeFailed, "%v", err), Final: true})
	default:
		ctl.Write(c, ctl.Reply{Job: &j, Final: true})
	}
}

// list shows the jobs the caller may see: all for root, their own otherwise.
func (d *Daemon) list(uid uint32) []ctl.Job {
	d.mu.Lock()
	ids := make([]string, 0, len(d.jobs))
	for id, j := range d.jobs {
		if uid == 0 || uid == j.owner {
			ids = append(ids, id)
		}
	}
	d.mu.Unlock()
	slices.Sort(ids)
	out := []ctl.Job{}
	for _, id := range ids {
		if v, err := d.view(id); err == nil {
			out = append(out, v)
		}
	}
	return out
}

// view is the job (by key) as this node sees it.
func (d *Daemon) view(id string) (ctl.Job, error) {
	d.mu.Lock()
	j := d.jobs[id]
	if j == nil {
		d.mu.Unlock()
		return ctl.Job{}, d.noJob(id)
	}
	v := j.last
	v.ID, v.Owner, v.Since, v.Unpausable = j.name, j.owner, j.since, j.unwatched
	if v.Unpausable == "" {
		v.Unpausable = d.missingLocked(j)
	}
	state, coordinated := j.state, j.coordinator == d.cfg.Node
	adopted, nodes, coordinator, size, local := j.adopted, j.nodes, j.coordinator, j.size, j.localRanks
	v.Nodes = []string{d.cfg.Node}
	if coordinated {
		remotes := make([]string, 0, len(j.remotes))
		for n := range j.remotes {
			remotes = append(remotes, n)
		}
		slices.Sort(remotes)
		v.Nodes = append(v.Nodes, remotes...)
	}
	d.mu.Unlock()
	rs := d.ranks.Ranks(id)
	if adopted && len(rs) == 0 {
		// What the ranks told the previous mpid, from its record.
		v.Node, v.Ranks, v.LocalRanks, v.Coordinator = d.cfg.Node, size, local, coordinator
		v.State = state
		if coordinated && len(nodes) > len(v.Nodes) {
			v.Nodes = nodes
		}
		if !coordinated {
			v.Nodes = []string{d.cfg.Node}
			if _, ok := d.agent.State(id); ok {
				v.State = agentState(d.agent, id)
			}
		}
		return v, nil
	}
	v.LocalRanks = nil
	v.Ranks = size
	for _, r := range rs {
		v.LocalRanks = append(v.LocalRanks, r.Rank)
		v.Ranks = max(v.Ranks, r.Size)
	}
	slices.Sort(v.LocalRanks)
	v.Node, v.Coordinator = d.cfg.Node, coordinator
	if coordinated {
		v.State = state
	} else {
		v.State = agentState(d.agent, id)
	}
	return v, nil
}

// jobName is the id part of a job key, for messages.
func jobName(key string) string {
	if _, name, ok := ranks.SplitJobKey(key); ok {
		return name
	}
	return key
}

// agentState is a non-coordinator node's idea of the job's state: the last
// protocol step it ran.
func agentState(a *quiesce.Agent, id string) string {
	st, ok := a.State(id)
	if !ok {
		return ctl.StateRunning
	}
	if st.Err != "" && (st.Kind == quiesce.KindAbort || st.Kind == quiesce.KindResume) {
		return ctl.StateFailed
	}
	switch st.Kind {
	case quiesce.KindCommit:
		return ctl.StatePaused
	case quiesce.KindAbort, quiesce.KindResume:
		return ctl.StateRunning
	}
	return ctl.StatePausing
}

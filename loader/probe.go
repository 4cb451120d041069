package loader

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"github.com/mpipause/mpipause/internal/caps"
)

// The BPF observer's programs, by the names the probe reports them under.
const (
	ProgSockops     = "sockops"      // sockops: registers the job's connections (required)
	ProgState       = "sockstat"     // tp_btf/inet_sock_set_state: FINs and closes of adopted connections
	ProgTCPIter     = "tcpiter"      // iter/tcp: adopts connections established before their cgroup was watched
	ProgConnIter    = "conniter"     // iter over the conns map with bpf_rdonly_cast (Linux 6.2+)
	ProgConnIterSkc = "conniter_skc" // the same with bpf_skc_to_tcp_sock (Linux 5.9+)
	ProgSignals     = "signals"      // tp_btf/signal_generate: the ranks' SIGTSTP and SIGCONT times (SignalClock)
)

// Features is what the running kernel lets the BPF observer load, found by
// loading each program once (Probe). Each program that does not load,
// whatever the kernel's reason, has a fallback, and Fallbacks says which
// was taken and why; only sockops, and a Snapshot pass of either kind, are
// required.
type Features struct {
	// ConnIter is the program of Snapshot's pass over the job's sockets
	// (ProgConnIter or ProgConnIterSkc: the same records), or "": each
	// Snapshot walks the TCP table of every namespace with iter/tcp.
	ConnIter string
	// Adoption: iter/tcp loads. Without it the programs never see the
	// connections a process established before its cgroup was watched
	// (Open's observer adds them from sock_diag, uncounted: Complemented),
	// and the kernel keeps the entries of a cgroup let go until their
	// sockets close (Snapshot leaves them out itself).
	Adoption bool
	// State: the state tracepoint loads. Without it sockops notes the FINs
	// and closes of the connections it registered, and an adopted
	// connection's byte counts include its FINs.
	State bool
	// Signals: the signal clock loads (SignalClock, mpid's, not the
	// observer's). Without it a rank's SIGTSTP is ordered against its
	// SIGCONT by its handler's stamp and mpid's looks at its own thaws.
	Signals bool
	// Fallbacks lists each program that did not load, in probe order.
	Fallbacks []Fallback
	// Loads is each program the probe tried, in probe order, with the
	// kernel's reason where it refused it. Probe fills it even when it
	// fails (mpid check shows it); empty when the probe loaded nothing
	// (it could not make the maps).
	Loads []Load
}

// Load is one program as the probe found it.
type Load struct {
	Program string
	Refused string // the kernel's reason (one line), "" if it loaded
}

// Fallback is a program the kernel refused and what is used instead.
type Fallback struct {
	Program string `json:"program"`
	Reason  string `json:"reason"`  // the kernel's, as the loader got it (one line)
	Instead string `json:"instead"` // what takes its place, and what that weakens
}

// ModeFull and ModeDegraded are Features.Mode's values.
const (
	ModeFull     = "full"
	ModeDegraded = "degraded"
)

// Mode is ModeFull when every guarantee of docs/guarantees.md holds as
// stated there with these programs, else ModeDegraded (Weaker says what is
// weaker). ProgConnIterSkc is full: it reads the same records, at one more
// cache line a socket.
func (f Features) Mode() string {
	if len(f.Weaker()) == 0 {
		return ModeFull
	}
	return ModeDegraded
}

// Weaker lists, one line each, what holds less on this kernel than
// docs/guarantees.md states for the full mode.
func (f Features) Weaker() []string {
	var w []string
	if !f.Adoption {
		w = append(w, "a connection made before mpid watched its cgroup is checked through sock_diag, without byte counts: bytes sent on it through a closed gate are not detected (a rank's JOIN, before MPI_Init, comes before its connections)")
	}
	if f.Adoption && !f.State {
		w = append(w, "an adopted connection's byte counts include its FINs")
	}
	if !f.Signals {
		w = append(w, "a SIGTSTP whose handler a freeze that is not mpid's held (a resource manager's, its handler's frame built as it froze) can pause the job again after its resume: `mpipause resume JOBID` recovers")
	}
	if f.ConnIter == "" {
		w = append(w, "PREPARE's kernel read and the check after the freeze each read the job's connection list and look each connection up, and walk the whole TCP table of every namespace the job uses, whatever the job holds (slower on a busy node), where the list cannot stand for a walk (the first read of a namespace, a connection made before mpid started or closing, counters that move at every lookup, a list that overflowed); the drain checks between look the job's connections up one by one (where a lookup cannot count bytes, for a connection made before mpid started, a clean drain answer after an unclean one walks too)")
	}
	return w
}

// String is the features as one log value: the mode and the programs used.
func (f Features) String() string {
	progs := []string{ProgSockops}
	if f.State {
		progs = append(progs, ProgState)
	}
	if f.Adoption {
		progs = append(progs, ProgTCPIter)
	}
	if f.ConnIter != "" {
		progs = append(progs, f.ConnIter)
	}
	if f.Signals {
		progs = append(progs, ProgSignals)
	}
	return f.Mode() + " (" + strings.Join(progs, ", ") + ")"
}

// probeOrder is the order Probe loads the programs in.
var probeOrder = []string{ProgSockops, ProgState, ProgTCPIter, ProgConnIter, ProgConnIterSkc, ProgSignals}

// decide turns what loaded (each program's load error, nil if it loaded;
// a program missing from refused was not tried) into Features, or fails
// where the BPF observer cannot work: without sockops nothing registers
// the job's connections, and without both iterators nothing reads them.
func decide(refused map[string]error) (Features, error) {
	var f Features
	reason := func(p string) string { return oneLine(refused[p]) }
	for _, p := range probeOrder {
		if err, tried := refused[p]; tried {
			f.Loads = append(f.Loads, Load{p, oneLine(err)})
		}
	}
	if err := refused[ProgSockops]; err != nil {
		return f, fmt.Errorf("%w: load %s: %s; the BPF observer needs Linux 5.10 or later with BTF", ErrBPFUnavailable, ProgSockops, reason(ProgSockops))
	}
	f.State = refused[ProgState] == nil
	if !f.State {
		f.Fallbacks = append(f.Fallbacks, Fallback{ProgState, reason(ProgState), "sockops notes the FINs and closes of the connections it registered"})
	}
	f.Adoption = refused[ProgTCPIter] == nil
	if !f.Adoption {
		f.Fallbacks = append(f.Fallbacks, Fallback{ProgTCPIter, reason(ProgTCPIter), "sock_diag finds the connections made before their cgroup was watched, without byte counts"})
	}
	if _, tried := refused[ProgSignals]; tried {
		f.Signals = refused[ProgSignals] == nil
		if !f.Signals {
			f.Fallbacks = append(f.Fallbacks, Fallback{ProgSignals, reason(ProgSignals), "a rank's SIGTSTP is ordered by its handler's stamp and mpid's looks at its own thaws"})
		}
	}
	switch {
	case refused[ProgConnIter] == nil:
		f.ConnIter = ProgConnIter
	case refused[ProgConnIterSkc] == nil:
		f.ConnIter = ProgConnIterSkc
		f.Fallbacks = append(f.Fallbacks, Fallback{ProgConnIter, reason(ProgConnIter), ProgConnIterSkc + ": the same records, one more cache line a socket"})
	case f.Adoption:
		f.Fallbacks = append(f.Fallbacks,
			Fallback{ProgConnIter, reason(ProgConnIter), ProgConnIterSkc},
			Fallback{ProgConnIterSkc, reason(ProgConnIterSkc), "an iter/tcp pass a namespace: walks the whole TCP table"})
	default:
		return f, fmt.Errorf("%w: load %s: %s; and %s: %s: nothing can read the job's connections", ErrBPFUnavailable,
			ProgConnIterSkc, reason(ProgConnIterSkc), ProgTCPIter, reason(ProgTCPIter))
	}
	return f, nil
}

// oneLine is err's first line (a verifier error's reason; %+v on the
// error gives its whole log).
func oneLine(err error) string {
	if err == nil {
		return ""
	}
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}

// CheckBPF says whether the BPF observer can run here, and with what:
// the capabilities it needs (CAP_SYS_ADMIN too to enter other network
// namespaces: setns), the kernel's BTF, and the programs the kernel loads
// (Probe). mpid calls it at start, so that a node below the floor is
// refused in one line before it serves.
func CheckBPF(setns bool) (Features, error) {
	want := []caps.Cap{caps.BPF, caps.Perfmon, caps.NetAdmin}
	if setns {
		want = append(want, caps.SysAdmin)
	}
	missing, err := caps.Missing(want...)
	if err != nil {
		return Features{}, err
	}
	if len(missing) > 0 {
		return Features{}, fmt.Errorf("%w: missing %s; run as root or grant them", ErrNotPrivileged, strings.Join(missing, ", "))
	}
	if _, err := os.Stat(btfPath); err != nil {
		return Features{}, fmt.Errorf("%w: %v; the BPF observer needs a kernel built with CONFIG_DEBUG_INFO_BTF=y", ErrNoBTF, err)
	}
	// Before 5.11 the kernel charges BPF maps to RLIMIT_MEMLOCK (64 KiB
	// by default before 5.16): raise it, where that is needed and
	// allowed; a no-op on kernels that charge the cgroup.
	if err := rlimit.RemoveMemlock(); err != nil {
		return Features{}, fmt.Errorf("%w: %v; raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in a systemd unit, ulimit -l unlimited in a shell): this kernel charges BPF maps to it", ErrBPFUnavailable, err)
	}
	return Probe()
}

var probed struct {
	once sync.Once
	f    Features
	err  error
}

// Probe loads each of the observer's programs once in this process, over
// maps of its own that it then closes, and returns what the kernel allows
// (decide). The result is kept: the kernel does not change under a running
// process. mpid calls it at start to say, once, what this node's kernel
// weakens.
func Probe() (Features, error) {
	if refuseForTest != nil {
		return probe(refuseForTest)
	}
	probed.once.Do(func() {
		var refuse map[string]error
		if v := os.Getenv(RefuseEnv); v != "" {
			refuse = map[string]error{}
			for _, p := range strings.Split(v, ",") {
				refuse[strings.TrimSpace(p)] = errors.New("refused by " + RefuseEnv)
			}
		}
		probed.f, probed.err = probe(refuse)
	})
	return probed.f, probed.err
}

// RefuseEnv names programs (ProgState, ProgTCPIter, ProgConnIter, ...,
// comma-separated) that the probe of a process started with it treats as
// refused, as an older kernel would: the rig's tests run mpid in each
// kernel mode on any kernel with it. The process's own environment, set
// by whoever starts mpid.
const RefuseEnv = "MPIPAUSE_BPF_REFUSE"

// refuseForTest makes the probe treat these programs as refused with the
// error given, beside what the kernel refuses, so that the tests run each
// fallback on any kernel. Nil in the product.
var refuseForTest map[string]error

// probe loads each program, treating those in refuse as refused with
// the error given.
func probe(refuse map[string]error) (Features, error) {
	specs, err := loadSpecs()
	if err != nil {
		return Features{}, err
	}
	maps := map[string]*ebpf.Map{}
	defer func() {
		for _, m := range maps {
			m.Close()
		}
	}()
	for name, spec := range map[string]*ebpf.MapSpec{pinConns: specs.sockops.Maps[pinConns], pinWatched: specs.sockops.Maps[pinWatched], pinRecords: specs.conniter.Maps[pinRecords], pinList: specs.sockops.Maps[pinList], pinLost: specs.sockops.Maps[pinLost]} {
		m, err := ebpf.NewMap(spec)
		if err != nil {
			return Features{}, fmt.Errorf("%w: create map %s: %w", ErrBPFUnavailable, name, err)
		}
		maps[name] = m
	}
	refused := map[string]error{}
	for _, p := range []struct {
		name, prog string
		spec       *ebpf.CollectionSpec
	}{
		{ProgSockops, sockopsProgMpipauseSockops, specs.sockops},
		{ProgState, sockstatProgMpipauseState, specs.sockstat},
		{ProgTCPIter, tcpiterProgMpipauseTcpiter, specs.tcpiter},
		{ProgConnIter, conniterProgMpipauseConniter, specs.conniter},
		{ProgConnIterSkc, conniterProgMpipauseConniterSkc, specs.conniter},
		{ProgSignals, signalsProgMpipauseSignal, specs.signals},
	} {
		if err := refuse[p.name]; err != nil {
			refused[p.name] = err
			continue
		}
		prog, err := loadProgram(p.spec, p.prog, maps)
		if err == nil {
			prog.Close()
		}
		refused[p.name] = err
	}
	return decide(refused)
}

// loadProgram loads the one program prog of spec over maps (those of
// spec's maps that maps names; the others spec creates).
func loadProgram(spec *ebpf.CollectionSpec, prog string, maps map[string]*ebpf.Map) (*ebpf.Program, error) {
	cs := spec.Copy()
	for name := range cs.Programs {
		if name != prog {
			delete(cs.Programs, name)
		}
	}
	repl := map[string]*ebpf.Map{}
	for name, m := range maps {
		if _, ok := cs.Maps[name]; ok {
			repl[name] = m
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(cs, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return nil, err
	}
	defer coll.Close()
	p := coll.DetachProgram(prog)
	if p == nil {
		return nil, errors.New("no program " + prog)
	}
	return p, nil
}

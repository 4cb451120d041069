package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/mpipause/mpipause/internal/term"
	"github.com/mpipause/mpipause/loader"
)

func observe(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "observe", "[--cgroup PATH] [--netns PATH]... [--follow=false] [--observer KIND] [--json] [--watch INTERVAL [--count N]]")
	var cgroups stringList
	fs.Var(&cgroups, "cgroup", "job cgroup v2 `path`, absolute or relative to the v2 mount (default /, the whole hierarchy); repeatable: a job's ranks may live in several (mpipause status --json lists them)")
	var netns stringList
	fs.Var(&netns, "netns", "also look in this network namespace (`name` under /run/netns, or a path); repeatable")
	follow := fs.Bool("follow", true, "also look in every network namespace where a process of the cgroup lives")
	asJSON := fs.Bool("json", false, "print JSON (one object per snapshot) instead of a table")
	watch := fs.Duration("watch", 0, "take a snapshot every `interval` until interrupted (e.g. 1s)")
	count := fs.Int("count", 0, "with --watch, stop after `n` snapshots (0: until interrupted)")
	kind := fs.String("observer", "auto", "`kind` of observer: auto (BPF, else sock_diag), bpf, or sock_diag")
	usage := fs.Usage
	fs.Usage = func() { usage(); fmt.Fprint(e.stdout, observeColumns) }
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return usageError{fmt.Sprintf("unexpected argument %q; observe takes only options", fs.Arg(0))}
	}
	if *count < 0 || (*count > 0 && *watch == 0) {
		return usageError{"--count needs --watch and a positive number"}
	}
	if *watch < 0 {
		return usageError{"--watch takes a positive interval such as 1s"}
	}
	if len(cgroups) == 0 {
		cgroups = stringList{"/"}
	}
	// Unbounded: the person running observe named the trees and waits for
	// their walk (a Slurm or systemd parent has hundreds below it); mpid's
	// observers, whose walks a job's user could make long, keep the bounds.
	cfg := loader.Config{Cgroups: cgroups, Netns: netns, FollowJob: *follow, Unbounded: true}
	switch *kind {
	case "auto":
		cfg.OnFallback = func(reason error) {
			fmt.Fprintf(e.stderr, "mpipause observe: BPF observer unavailable (%v); using sock_diag\n", reason)
		}
	case "bpf":
		cfg.Require = loader.KindBPF
	case "sock_diag":
		cfg.Require = loader.KindSockDiag
	default:
		return usageError{fmt.Sprintf("--observer %q: want auto, bpf or sock_diag", *kind)}
	}

	obs, err := loader.Open(ctx, cfg)
	if err != nil {
		return err
	}
	defer obs.Close()

	for i := 1; ; i++ {
		conns, err := obs.Snapshot(ctx)
		if err != nil {
			return err
		}
		rep := newReport(obs.Kind(), cgroups, time.Now(), conns)
		if s, ok := obs.(interface{ Skipped() []string }); ok {
			rep.Skipped = append(rep.Skipped, s.Skipped()...)
		}
		if *asJSON {
			if err := writeJSON(e.stdout, rep, ""); err != nil {
				return err
			}
		} else {
			if *watch > 0 && e.isTTY {
				fmt.Fprint(e.stdout, "\033[H\033[2J") // redraw in place
			} else if i > 1 {
				fmt.Fprintln(e.stdout)
			}
			rep.writeTable(e.stdout)
		}
		if *watch == 0 || (*count > 0 && i >= *count) {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil // interrupted while watching: a normal way to end
		case <-time.After(*watch):
		}
	}
}

// report is what observe prints; its JSON field names are a contract for scripts.
type report struct {
	Observer    string     `json:"observer"`
	Cgroup      string     `json:"cgroup"` // the first of Cgroups, for scripts of one
	Cgroups     []string   `json:"cgroups"`
	Time        time.Time  `json:"time"`
	Connections []connJSON `json:"connections"`
	Summary     summary    `json:"summary"`
	// Skipped names what this observer could not look into, so a script
	// never takes "no connections" for "nothing there".
	Skipped []string `json:"skipped"`
}

type summary struct {
	Connections   int    `json:"connections"`
	NonEmpty      int    `json:"non_empty"`
	InflightBytes uint64 `json:"inflight_bytes"`
	Netns         int    `json:"netns"`
}

// observeColumns ends observe's --help. The counters are the kernel's own
// (tcp_sock), so they cover the socket's whole life, including what it did
// before mpipause attached.
const observeColumns = `
columns (JSON fields in parentheses):
  SEND-Q    bytes written, not yet acknowledged by the peer (send_queue_bytes)
  UNREAD    bytes arrived, not yet read by the application (unread_bytes)
            (a FIN counts 1 in either until acknowledged or read)
  SENT      bytes the application wrote since the socket was created (bytes_sent)
  RECEIVED  bytes the application read since the socket was created, peeks
            excluded (bytes_received)
  RETRANS   segments the kernel retransmitted since the socket was created
            (retransmits)
  SENT, RECEIVED and RETRANS come from the BPF observer; sock_diag shows -
  (counted: false).
Whatever the observer may not look into (a namespace it may not enter, another
user's process) is named after the table ("not seen") and in skipped.
`

type connJSON struct {
	Netns       string `json:"netns"`
	Local       string `json:"local"`
	Remote      string `json:"remote"`
	State       string `json:"state"`
	SendQueue   uint32 `json:"send_queue_bytes"`
	Unread      uint32 `json:"unread_bytes"`
	Counted     bool   `json:"counted"`
	BytesSent   uint64 `json:"bytes_sent"`
	BytesRecv   uint64 `json:"bytes_received"`
	Retransmits uint64 `json:"retransmits"`
	Cookie      uint64 `json:"cookie"`
	Cgroup      uint64 `json:"cgroup_id"`
}

func newReport(kind string, cgroups []string, now time.Time, conns []loader.Conn) report {
	sort.Slice(conns, func(i, j int) bool {
		a, b := conns[i], conns[j]
		if a.Netns != b.Netns {
			return a.Netns < b.Netns
		}
		if a.Local != b.Local {
			return a.Local.String() < b.Local.String()
		}
		return a.Remote.String() < b.Remote.String()
	})
	r := report{Observer: kind, Cgroup: cgroups[0], Cgroups: cgroups, Time: now, Connections: make([]connJSON, 0, len(conns)), Skipped: []string{}}
	ns := map[string]bool{}
	for _, c := range conns {
		ns[c.Netns] = true
		r.Connections = append(r.Connections, connJSON{
			Netns: nsLabel(c.Netns), Local: c.Local.String(), Remote: c.Remote.String(), State: c.State.String(),
			SendQueue: c.SendQueue, Unread: c.Unread, Counted: c.Counted,
			BytesSent: c.BytesSent, BytesRecv: c.BytesRecv, Retransmits: c.Retransmits,
			Cookie: c.Cookie, Cgroup: c.Cgroup,
		})
		if !c.Empty() {
			r.Summary.NonEmpty++
		}
		r.Summary.InflightBytes += uint64(c.SendQueue) + uint64(c.Unread)
	}
	r.Summary.Connections = len(conns)
	r.Summary.Netns = len(ns)
	return r
}

func nsLabel(ns string) string {
	if ns == "" {
		return "host"
	}
	return ns
}

func (r report) writeTable(w io.Writer) {
	fmt.Fprintf(w, "observer %s  cgroup %s  %s\n", r.Observer, term.Safe(r.Cgroup), r.Time.Format("15:04:05.000"))
	t := table{header: []string{"NETNS", "LOCAL", "REMOTE", "STATE", "SEND-Q", "UNREAD", "SENT", "RECEIVED", "RETRANS"}, right: 4}
	for _, c := range r.Connections {
		sent, recv, retr := "-", "-", "-"
		if c.Counted {
			sent, recv, retr = human(c.BytesSent), human(c.BytesRecv), fmt.Sprint(c.Retransmits)
		}
		t.add(c.Netns, c.Local, c.Remote, c.State, fmt.Sprint(c.SendQueue), fmt.Sprint(c.Unread), sent, recv, retr)
	}
	t.write(w)
	s := r.Summary
	verdict := "all empty"
	if s.NonEmpty > 0 {
		verdict = fmt.Sprintf("%d not empty, %s in flight", s.NonEmpty, human(s.InflightBytes))
	}
	fmt.Fprintf(w, "%d connection%s in %d netns: %s\n", s.Connections, plural(s.Connections), s.Netns, verdict)
	for _, sk := range r.Skipped {
		fmt.Fprintf(w, "not seen: %s; run as root to see it\n", term.Safe(sk))
	}
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

// human prints a byte count with a binary unit, exact below 1 KiB.
func human(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

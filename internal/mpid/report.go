package mpid

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/quiesce"
)

// What a pause or resume tells the CLI: its progress, its figures and, when
// it failed, why, where and which connections still held bytes.

func toProgress(p quiesce.Progress, nodes int, start time.Time) ctl.Progress {
	out := ctl.Progress{Phase: string(p.Phase), Round: p.Round, Done: p.Done, Nodes: nodes, Ms: ms(time.Since(start)), Err: p.Stat.Err}
	if !p.Done {
		out.NodesClean = p.Report.Nodes - len(p.Report.Pending)
		for _, n := range p.Report.Pending {
			out.Conns += len(n.Conns)
		}
		out.InflightBytes = p.Report.InflightBytes()
	}
	return out
}

// figures fills a job view with a result's measurements.
func figures(v ctl.Job, res quiesce.Result) ctl.Job {
	v.Connections = res.Report.Checked
	v.InflightBytes = res.Report.InflightBytes()
	v.TotalMs = ms(res.Total)
	v.Phases = nil
	for _, p := range res.Phases {
		v.Phases = append(v.Phases, ctl.Phase{Name: string(p.Phase), Rounds: p.Rounds, Ms: ms(p.Elapsed), Err: p.Err})
		if p.Phase == quiesce.KindDrain {
			v.DrainMs += ms(p.Elapsed) // a VERIFY that found bytes drains again
		}
	}
	v.Failure = nil
	return v
}

// stateAfter is the job's state for the CLI (ctl) after a pause that
// failed, from the protocol's outcome (quiesce.Result.State): the two
// vocabularies are each their layer's, whatever words they share.
func stateAfter(protocol string) string {
	switch protocol {
	case quiesce.StateRunning, "": // rolled back; or refused before its first round
		return ctl.StateRunning
	case quiesce.StatePaused:
		return ctl.StatePaused
	case quiesce.StateFailed: // some node did not confirm the rollback
		return ctl.StateFailed
	}
	// A state this mpid does not know is not one it can vouch for: failed
	// keeps the pause's record and goes on confirming the rollback.
	return ctl.StateFailed
}

// failure explains a failed pause or resume: where, why, and which
// connections still held bytes.
func failure(err error, res quiesce.Result, cause error) *ctl.Failure {
	f := &ctl.Failure{Rank: -1, Reason: why(err, cause).Error()}
	// The coordinator's own reason for cutting the pause short (a rank
	// missing from the first drain's count) is what the user is told: the
	// drain it cut short did not time out, and its report is no cause.
	own := cause != nil && !errors.Is(cause, context.Canceled)
	var ae *quiesce.AbortError
	if errors.As(err, &ae) {
		f.Phase = string(ae.Phase)
	}
	if fa := fault(err, cause); fa != nil {
		f.Rank = fa.Rank
	}
	// The peer of a connection is whoever owns its other end: another
	// node's pending connection with the addresses swapped, if listed.
	byEnds := map[[2]string]int{}
	for _, n := range res.Report.Pending {
		for _, c := range n.Conns {
			byEnds[[2]string{c.Local, c.Remote}] = c.Rank
		}
	}
	notReading := map[int]bool{}
	nodes := 0
	violNode := ""
	stopped := errors.Is(err, quiesce.ErrThroughGates)
	for _, n := range res.Report.Pending {
		if f.Node == "" {
			f.Node = n.Node
		}
		if len(n.Conns) > 0 {
			nodes++
		}
		// Late bytes too where the pause ended on them: it saw them again
		// after every rethaw, which a late call (one per thread) cannot
		// explain. A drain stopped by a violation may count late bytes of
		// its round beside it, which are no one's fault.
		through := n.Violations
		if !stopped {
			through += n.Late
		}
		f.Violations += through
		if through > 0 && violNode == "" {
			violNode = cmp.Or(n.Node, "a node that did not give its name")
		}
		for _, c := range n.Conns {
			peer, ok := byEnds[[2]string{c.Remote, c.Local}]
			if !ok {
				peer = -1
			}
			f.Conns = append(f.Conns, ctl.Conn{Node: c.Node, Local: c.Local, Remote: c.Remote,
				SendQueue: c.SendQueue, Unread: c.Unread, Rank: c.Rank, Peer: peer})
			if c.Unread > 0 && c.Rank >= 0 {
				notReading[c.Rank] = true
			}
		}
	}
	for r := range notReading {
		f.NotReading = append(f.NotReading, r)
	}
	slices.Sort(f.NotReading)
	if len(f.NotReading) == 1 {
		f.Rank = f.NotReading[0]
	}
	if !own && errors.Is(err, quiesce.ErrNotEmpty) && f.Phase == string(quiesce.KindDrain) {
		// The user's question is who does not read, not the protocol's
		// round count.
		f.Reason = "the drain timed out"
		if len(f.Conns) > 0 || f.Violations == 0 {
			f.Reason += fmt.Sprintf(": %s on %s still hold bytes", plural(len(f.Conns), "connection"), plural(nodes, "node"))
		}
		if len(f.NotReading) > 0 {
			f.Reason += fmt.Sprintf("; ranks not reading what was sent to them: %s (busy outside MPI?)", ctl.RankList(f.NotReading))
		}
	}
	if !own && stopped {
		f.Reason = "the drain stopped"
	}
	if !own && f.Violations > 0 {
		// Bytes that keep moving while every gate is closed are not the
		// library's: something sends past the shim (raw system calls,
		// io_uring, a helper process), and no pause can be consistent.
		sep := "; "
		if f.Reason == "the drain timed out" || f.Reason == "the drain stopped" {
			sep = ": "
		}
		if len(f.Conns) == 0 {
			f.Node = violNode
		}
		f.Reason += fmt.Sprintf("%s%s sent through closed gates on %s in the last round (a send the shim does not hold: raw system calls, io_uring, MSG_ZEROCOPY?)",
			sep, plural(int(f.Violations), "byte"), violNode)
	}
	for _, n := range res.Unconfirmed {
		f.Unconfirmed = append(f.Unconfirmed, n.Node)
	}
	if f.Phase == "" {
		f.Phase = string(quiesce.KindResume)
	}
	return f
}

// why is the reason a pause or resume failed, as the user is told it: the
// abort's cause, or the coordinator's own reason for cutting the pause
// short (cause), which beats "context canceled".
func why(err, cause error) error {
	if cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	var ae *quiesce.AbortError
	if errors.As(err, &ae) {
		return ae.Cause
	}
	return err
}

// fault is what the node whose failure is the reason (why) blamed on a
// rank, if anything.
func fault(err, cause error) *quiesce.Fault {
	var ne *quiesce.NodeError
	if errors.As(why(err, cause), &ne) {
		return ne.First.Fault
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// waitingOn says in one line what a pause's round still waits on: each
// pending node's gates not yet closed and its connections holding bytes,
// at most max connections in all (a job's thousands would flood the
// journal). A pause that a scheduler started has no CLI to show its
// progress, so the journal is where an operator learns why it was slow.
func waitingOn(rep quiesce.Report, max int) string {
	var b strings.Builder
	listed, conns := 0, 0
	for _, n := range rep.Pending {
		conns += len(n.Conns)
	}
	for i, n := range rep.Pending {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(cmp.Or(n.Node, "?"))
		b.WriteString(":")
		if n.Err != "" {
			fmt.Fprintf(&b, " error %q", n.Err)
		}
		if n.Ungated > 0 {
			fmt.Fprintf(&b, " %s still mid-send", plural(n.Ungated, "socket"))
		}
		if n.Violations+n.Late > 0 {
			fmt.Fprintf(&b, " %s past closed gates", plural(int(n.Violations+n.Late), "byte"))
		}
		for _, c := range n.Conns {
			if listed == max {
				break
			}
			listed++
			fmt.Fprintf(&b, " rank %d %s->%s", c.Rank, c.Local, c.Remote)
			if c.SendQueue > 0 {
				fmt.Fprintf(&b, " unacked %d", c.SendQueue)
			}
			if c.Unread > 0 {
				fmt.Fprintf(&b, " unread %d", c.Unread)
			}
			b.WriteString(",")
		}
	}
	s := strings.TrimSuffix(strings.ReplaceAll(b.String(), ",;", ";"), ",")
	if conns > listed {
		s += fmt.Sprintf(" (and %d more connections)", conns-listed)
	}
	return s
}

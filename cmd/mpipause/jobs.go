package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/term"
	"github.com/mpipause/mpipause/quiesce"
)

// Exit codes beyond 0 (done), 1 (the operation failed), 2 (bad usage):
// one per reason a script may want to tell apart.
var exitCodes = map[string]int{
	ctl.CodeFailed:      1,
	ctl.CodeBadRequest:  2,
	ctl.CodeUnknownJob:  3,
	ctl.CodePermission:  4,
	ctl.CodeState:       5,
	ctl.CodeUnavailable: 6,
	ctl.CodeUnpausable:  7,
	ctl.CodeElsewhere:   8,
	ctl.CodeRankGone:    9,
}

const exitCodeHelp = `exit status:
  0  done             1  failed (a pause is rolled back: the job runs on)
  2  bad usage        3  no such job of yours on this node (root: none at all)
  5  wrong state (already paused, not paused, busy)
  6  no mpid here (or the job's coordinator does not answer)
  7  the job cannot be paused cleanly
  8  the job's coordinator is not known on this node (the coordinator: the node
     where "mpipause run" ran, or under Slurm the step's first node)
  9  a rank exited during the pause (rolled back for the others)
`

type jobFlags struct {
	json    bool
	timeout time.Duration
}

func pauseCmd(ctx context.Context, e *env, args []string) error {
	return jobOp(ctx, e, ctl.OpPause, args)
}

func resumeCmd(ctx context.Context, e *env, args []string) error {
	return jobOp(ctx, e, ctl.OpResume, args)
}

func jobOp(ctx context.Context, e *env, op string, args []string) error {
	var f jobFlags
	synopsis := map[string]string{
		ctl.OpPause: `[--json] [--timeout D] JOBID

Pauses every rank of the job on every node at a point where no message is
half-sent and every TCP connection between ranks is empty, as the kernel
reports after the ranks are frozen; or rolls the pause back and says why.
'mpipause JOBID' is the same command.`,
		ctl.OpResume: `[--json] JOBID

Resumes a paused job on every node.`,
	}[op] + "\n\n" + slurmIDHelp
	fs := newFlags(e, op, synopsis+"\n\n"+exitCodeHelp)
	fs.BoolVar(&f.json, "json", false, "print the result as one JSON object")
	if op == ctl.OpPause {
		fs.DurationVar(&f.timeout, "timeout", 0, "give up draining after `D` (at most 10m) and roll back (default: mpid's, 10s)")
	}
	operands, err := parseMixed(fs, args)
	if err != nil {
		return err
	}
	if len(operands) != 1 {
		return usageError{fmt.Sprintf("want exactly one job id, got %d arguments; see --help", len(operands))}
	}
	if f.timeout < 0 || f.timeout > ctl.MaxTimeout {
		return usageError{fmt.Sprintf("--timeout %v: want a positive duration of at most %v", f.timeout, ctl.MaxTimeout)}
	}
	id := operands[0]
	if err := ctl.ValidJobID(id); err != nil {
		return usageError{err.Error()}
	}
	var pr *progressPrinter
	if !f.json {
		pr = &progressPrinter{w: e.stdout, tty: e.isTTY, op: op}
		fmt.Fprintf(e.stdout, "%s job %s\n", map[string]string{ctl.OpPause: "pausing", ctl.OpResume: "resuming"}[op], term.Safe(id))
	}
	do := func(id string) (*ctl.Reply, error) {
		return ctl.Do(ctx, ctl.Addr(), ctl.Request{Op: op, Job: id, Timeout: f.timeout}, func(p ctl.Progress) {
			if pr != nil {
				pr.show(p)
			}
		})
	}
	rep, err := do(id)
	if step, serr := slurmStep(ctx, id, err); step != "" {
		id = step
		rep, err = do(id)
	} else {
		err = serr
	}
	if pr != nil {
		pr.finish()
	}
	var ce *ctl.Error
	if op == ctl.OpPause && errors.As(err, &ce) && ce.Lost {
		// The coordinator went away mid-pause: what happens next is not a
		// mystery, and the user should not have to read the design to know.
		ce.Message += fmt.Sprintf("; if the pause was under way, every node rolls it back on its own once its step's deadline "+
			"and a grace of %v have passed, and a restarted mpid thaws what it finds frozen without a committed pause; "+
			"check with `mpipause status %s`", quiesce.DefaultLeaseGrace, id)
	}
	return printReply(e, f.json, rep, err)
}

// printReply prints the final answer and passes the error on for the exit code.
func printReply(e *env, asJSON bool, rep *ctl.Reply, err error) error {
	var ce *ctl.Error
	if err != nil && !errors.As(err, &ce) {
		return err
	}
	if asJSON {
		out := struct {
			*ctl.Job
			Jobs  []ctl.Job  `json:"jobs,omitempty"`
			Error *ctl.Error `json:"error,omitempty"`
		}{Error: ce}
		if rep != nil {
			out.Job, out.Jobs = rep.Job, rep.Jobs
		}
		writeJSON(e.stdout, out, "  ")
		if ce != nil {
			return silent{ce}
		}
		return nil
	}
	// A refusal changed nothing: its one line says all. A failed pause did
	// something, and the report says what.
	if rep != nil && rep.Job != nil && (ce == nil || ce.Code == ctl.CodeFailed) {
		printJob(e.stdout, *rep.Job)
	}
	return err
}

// silent is an error already reported on stdout (--json): only its exit
// code is left to give.
type silent struct{ err *ctl.Error }

func (s silent) Error() string { return s.err.Error() }
func (s silent) Unwrap() error { return s.err }

func statusCmd(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs := newFlags(e, "status", "[--json] [JOBID]\n\nShows a job's state and its last pause or resume; without JOBID, every job on this node you may see.\n\n"+slurmIDHelp+"\n\n"+exitCodeHelp)
	fs.BoolVar(&asJSON, "json", false, "print the result as JSON")
	operands, err := parseMixed(fs, args)
	if err != nil {
		return err
	}
	if len(operands) > 1 {
		return usageError{"want at most one job id; see --help"}
	}
	req := ctl.Request{Op: ctl.OpStatus}
	if len(operands) == 1 {
		req.Job = operands[0]
	}
	if req.Job != "" {
		if err := ctl.ValidJobID(req.Job); err != nil {
			return usageError{err.Error()}
		}
	}
	rep, err := ctl.Do(ctx, ctl.Addr(), req, nil)
	if req.Job != "" {
		if step, serr := slurmStep(ctx, req.Job, err); step != "" {
			req.Job = step
			rep, err = ctl.Do(ctx, ctl.Addr(), req, nil)
		} else {
			err = serr
		}
	}
	if req.Job == "" && err == nil && !asJSON {
		if len(rep.Jobs) == 0 {
			fmt.Fprintln(e.stdout, "no jobs on this node")
		}
		for i, j := range rep.Jobs {
			if i > 0 {
				fmt.Fprintln(e.stdout)
			}
			printJob(e.stdout, j)
		}
		return nil
	}
	return printReply(e, asJSON, rep, err)
}

func listCmd(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs := newFlags(e, "list", "[--json]\n\nLists the jobs on this node that you may see (all of them for root).")
	fs.BoolVar(&asJSON, "json", false, "print the jobs as a JSON array")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected argument %q; see --help", fs.Arg(0))}
	}
	rep, err := ctl.Do(ctx, ctl.Addr(), ctl.Request{Op: ctl.OpList}, nil)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, rep.Jobs, "  ")
	}
	if len(rep.Jobs) == 0 {
		fmt.Fprintln(e.stdout, "no jobs on this node")
		return nil
	}
	t := &table{header: []string{"JOB", "STATE", "SINCE", "COORDINATOR", "NODES", "RANKS", "HERE"}, right: 5}
	for _, j := range rep.Jobs {
		coord := j.Coordinator
		if coord == "" {
			coord = "?"
		}
		t.add(j.ID, j.State, j.Since.Local().Format(time.TimeOnly), coord, fmt.Sprint(len(j.Nodes)), fmt.Sprint(j.Ranks), fmt.Sprint(len(j.LocalRanks)))
	}
	t.write(e.stdout)
	return nil
}

// printJob is the human view of a job. Its names and reasons come from
// ranks and other nodes: every string is shown through term.Safe.
func printJob(w io.Writer, j ctl.Job) {
	q, qs := term.Safe, safeJoin
	where := "coordinated here"
	switch {
	case j.Coordinator == "":
		where = "its coordinator not known here"
	case j.Coordinator != j.Node:
		where = "coordinated by " + q(j.Coordinator)
	}
	fmt.Fprintf(w, "job %s: %s since %s (%s)\n", q(j.ID), q(j.State), j.Since.Local().Format(time.TimeOnly), where)
	fmt.Fprintf(w, "  ranks %d on %d nodes (%s); here: %s\n", j.Ranks, len(j.Nodes), qs(j.Nodes), ctl.RankList(j.LocalRanks))
	if j.Unpausable != "" {
		fmt.Fprintf(w, "  cannot be paused cleanly: %s\n", q(j.Unpausable))
	}
	for _, c := range j.Cgroups {
		fmt.Fprintf(w, "  cgroup on %s (%s): %s\n", q(c.Node), q(c.Placed), q(c.Dir))
	}
	if j.Observer != "" {
		fmt.Fprintf(w, "  kernel observer on %s: %s\n", q(j.Node), q(j.Observer))
	}
	if len(j.Phases) > 0 {
		var ph []string
		for _, p := range j.Phases {
			ph = append(ph, fmt.Sprintf("%s %s", strings.ToLower(q(p.Name)), msStr(p.Ms)))
		}
		fmt.Fprintf(w, "  last: %s in %s (%s)\n", lastOp(j), msStr(j.TotalMs), strings.Join(ph, ", "))
		if j.State == ctl.StatePaused {
			fmt.Fprintf(w, "  kernel check after the freeze: %d connections, %s queued; %s drained before the freeze\n",
				j.Connections, human(j.InflightBytes), human(j.DrainedBytes))
		}
	}
	if f := j.Failure; f != nil {
		fmt.Fprintf(w, "  failed in %s: %s\n", q(f.Phase), q(f.Reason))
		for i, c := range f.Conns {
			if i == 10 {
				fmt.Fprintf(w, "  ... %d more connections\n", len(f.Conns)-i)
				break
			}
			fmt.Fprintf(w, "  %s %s (rank %s) -> %s (rank %s): %s unacknowledged, %s unread\n",
				q(c.Node), q(c.Local), rankStr(c.Rank), q(c.Remote), rankStr(c.Peer), human(c.SendQueue), human(c.Unread))
		}
		if len(f.Unconfirmed) > 0 {
			fmt.Fprintf(w, "  not confirmed running again on: %s\n", qs(f.Unconfirmed))
		}
	}
}

// safeJoin is names, each through term.Safe, joined by commas.
func safeJoin(names []string) string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = term.Safe(n)
	}
	return strings.Join(out, ",")
}

// writeJSON is the --json output, indented or (indent "") one line:
// encoding/json escapes control characters, term.SafeJSON the rest a
// terminal may act on.
func writeJSON(w io.Writer, v any, indent string) error {
	b, err := json.Marshal(v)
	if indent != "" {
		b, err = json.MarshalIndent(v, "", indent)
	}
	if err != nil {
		return err
	}
	_, err = w.Write(append(term.SafeJSON(b), '\n'))
	return err
}

func rankStr(r int) string {
	if r < 0 {
		return "?"
	}
	return fmt.Sprint(r)
}

func lastOp(j ctl.Job) string {
	if len(j.Phases) > 0 && j.Phases[0].Name == "RESUME" {
		return "resume"
	}
	return "pause"
}

func msStr(ms float64) string {
	if ms >= 1000 {
		return fmt.Sprintf("%.2f s", ms/1000)
	}
	return fmt.Sprintf("%.1f ms", ms)
}

// progressPrinter shows the phases as they finish; on a terminal the drain
// rounds redraw one line in place.
type progressPrinter struct {
	w       io.Writer
	tty     bool
	op      string
	pending bool // a redrawn line is on screen
}

func (p *progressPrinter) show(pr ctl.Progress) {
	if !pr.Done {
		if p.tty && pr.Phase == "DRAIN" {
			fmt.Fprintf(p.w, "\r  %-8s round %d: %d/%d nodes empty, %d connections hold %s  (at %s)\x1b[K",
				term.Safe(pr.Phase), pr.Round, pr.NodesClean, pr.Nodes, pr.Conns, human(pr.InflightBytes), msStr(pr.Ms))
			p.pending = true
		}
		return
	}
	if p.pending {
		fmt.Fprint(p.w, "\r\x1b[K")
		p.pending = false
	}
	state := "ok"
	if pr.Err != "" {
		state = "failed" // the summary says why
	}
	rounds := ""
	if pr.Round > 1 {
		rounds = fmt.Sprintf(", %d rounds", pr.Round)
	}
	fmt.Fprintf(p.w, "  %-8s %d nodes%s  %s  (at %s)\n", term.Safe(pr.Phase), pr.Nodes, rounds, state, msStr(pr.Ms))
}

func (p *progressPrinter) finish() {
	if p.pending {
		fmt.Fprint(p.w, "\r\x1b[K")
	}
}

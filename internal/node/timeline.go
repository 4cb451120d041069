package node

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Timelines keep, per job, when each of this node's steps of the job's
// current operation ran and how long it took, and when each rank answered
// a DRAIN, and log them as one line ("step timeline") when the operation's
// last step here ends: COMMIT for a pause, OPEN for a resume or a rollback
// (a failed pause and its rollback make one line). A slow pause's time is
// spent between nodes and ranks, and the per-step metrics (histograms) do
// not say in which order; this does, at a cost of a clock read and an
// append per step. mpid keeps them only with --log-timeline.
//
// Each line carries the operation's start on CLOCK_MONOTONIC (mono_us):
// the nodes of one host (the rig's) share that clock, so their lines can be
// laid side by side; the clocks of different hosts are not comparable.
type Timelines struct {
	mu   sync.Mutex
	jobs map[string]*timeline
}

type timeline struct {
	start   time.Time
	mono    time.Duration
	events  []tlEvent
	dropped int
}

type tlEvent struct {
	what     string // a step, or "answer" (which has no length)
	at, took time.Duration
	note     string // a step's outcome, the rank that answered
}

// Bounds: a timeline keeps the first maxTimelineEvents events of an
// operation (a drain that checks for seconds counts the rest), and at most
// maxTimelines jobs have one open at once; a job beyond that goes
// unrecorded until one ends.
const (
	maxTimelineEvents = 200
	maxTimelines      = 256
)

func (t *Timelines) open(job string, now time.Time) *timeline {
	if t.jobs == nil {
		t.jobs = map[string]*timeline{}
	}
	tl := t.jobs[job]
	if tl == nil {
		if len(t.jobs) >= maxTimelines {
			return nil
		}
		var ts unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
		tl = &timeline{start: now, mono: time.Duration(ts.Nano()) - time.Since(now)}
		t.jobs[job] = tl
	}
	return tl
}

func (tl *timeline) add(e tlEvent) {
	if len(tl.events) >= maxTimelineEvents {
		tl.dropped++
		return
	}
	tl.events = append(tl.events, e)
}

// step records that step began at start and took took, with outcome note;
// PREPARE starts a new operation (what an earlier one left open is
// dropped: a pause whose node was cut off before its COMMIT). A nil
// Timelines records nothing.
func (t *Timelines) step(job, step string, start time.Time, took time.Duration, note string) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if step == "PREPARE" {
		delete(t.jobs, job)
	}
	if tl := t.open(job, start); tl != nil {
		tl.add(tlEvent{what: step, at: start.Sub(tl.start), took: took, note: note})
	}
}

// answer records that a rank answered a DRAIN of job.
func (t *Timelines) answer(job string, rank int) {
	if t == nil {
		return
	}
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if tl := t.jobs[job]; tl != nil {
		tl.add(tlEvent{what: "answer", at: now.Sub(tl.start), note: fmt.Sprintf("rank %d", rank)})
	}
}

// end logs job's timeline and forgets it.
func (t *Timelines) end(job, node string, log *slog.Logger) {
	if t == nil {
		return
	}
	t.mu.Lock()
	tl := t.jobs[job]
	delete(t.jobs, job)
	t.mu.Unlock()
	if tl == nil || log == nil {
		return
	}
	attrs := []any{"job", job, "node", node, "mono_us", tl.mono.Microseconds(), "ms", ms(time.Since(tl.start)), "events", tl.String()}
	if tl.dropped > 0 {
		attrs = append(attrs, "dropped", tl.dropped)
	}
	log.Info("step timeline", attrs...)
}

// String lists the events, each as WHAT@START+LENGTH NOTE in
// milliseconds from the operation's first step ("DRAIN@2.61+0.48
// unclean", "answer@3.90 rank 1"), separated by "; ".
func (tl *timeline) String() string {
	var b strings.Builder
	for i, e := range tl.events {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(e.what)
		b.WriteByte('@')
		b.WriteString(ms(e.at))
		if e.what != "answer" {
			b.WriteByte('+')
			b.WriteString(ms(e.took))
		}
		if e.note != "" {
			b.WriteByte(' ')
			b.WriteString(e.note)
		}
	}
	return b.String()
}

func ms(d time.Duration) string {
	return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond))
}

package node

import (
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/loader"
)

// logLines are the lines of a log's output whose message is msg.
func logLines(out *testutil.Buffer, msg string) []string {
	var lines []string
	for _, s := range strings.Split(out.String(), "\n") {
		if strings.Contains(s, "msg=\""+msg+"\"") {
			lines = append(lines, s)
		}
	}
	return lines
}

var tlEventRE = regexp.MustCompile(`^([A-Z]+|answer)@([0-9.]+)(\+[0-9.]+)?( .*)?$`)

// timelineEvents splits a "step timeline" line's events into what
// happened, in order, checking that each came no earlier than the one
// before it.
func timelineEvents(t *testing.T, line string) []string {
	t.Helper()
	m := regexp.MustCompile(`events="([^"]*)"`).FindStringSubmatch(line)
	if m == nil {
		t.Fatalf("no events in %q", line)
	}
	var out []string
	last := -1.0
	for _, e := range strings.Split(m[1], "; ") {
		f := tlEventRE.FindStringSubmatch(e)
		if f == nil {
			t.Fatalf("event %q of %q is not WHAT@MS[+MS][ NOTE]", e, line)
		}
		at, _ := strconv.ParseFloat(f[2], 64)
		if at < last {
			t.Errorf("event %q comes before the one ahead of it (%.2f ms) in %q", e, last, line)
		}
		last = at
		out = append(out, f[1]+f[4])
	}
	return out
}

// TestTimelineLogsEachOperation: with Timelines set, a node logs one line
// for a pause when its COMMIT ends, naming each step with its outcome and
// the rank's answer to the DRAIN in the order they came, and one more for
// the resume when its OPEN ends; without, it logs none.
func TestTimelineLogsEachOperation(t *testing.T) {
	for _, on := range []bool{true, false} {
		release := make(chan struct{})
		ctx, s, job, lines := oneRankWith(t, fmt.Sprintf("timeline-%v", on), new(atomic.Pointer[string]), nil, func() { <-release })
		go func() {
			for range lines {
			}
		}()
		obs := &fakeObserver{conns: []loader.Conn{
			conn(0x11, "10.0.0.1:5000", "10.0.0.1:6000"),
			conn(0x12, "10.0.0.1:6000", "10.0.0.1:5000"),
		}}
		out := &testutil.Buffer{}
		log := slog.New(slog.NewTextHandler(out, nil))
		role := &Role{Name: "n1", Ranks: s, Jobs: observed{obs}, Freezer: noFreezer{}, Log: log}
		if on {
			role.Timelines = &Timelines{}
		}
		st := NewSteps(role, log)
		st.Records = &dropCount{}
		must := func(what string, err error) {
			t.Helper()
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
		}
		must("prepare", st.Prepare(ctx, job))
		_, err := st.Drain(ctx, job)
		must("drain", err)
		wake := role.DrainWake(job)
		close(release)
		select {
		case <-wake:
		case <-time.After(5 * time.Second):
			t.Fatal("the rank's answer to the DRAIN did not come in 5 s")
		}
		_, err = st.Drain(ctx, job)
		must("drain", err)
		must("freeze", st.Freeze(ctx, job))
		_, err = st.Verify(ctx, job)
		must("verify", err)
		if l := logLines(out, "step timeline"); len(l) != 0 {
			t.Fatalf("timeline logged before the COMMIT: %q", l)
		}
		must("commit", st.Commit(ctx, job))
		must("thaw", st.Thaw(ctx, job))
		must("open", st.Open(ctx, job))
		got := logLines(out, "step timeline")
		if !on {
			if len(got) != 0 {
				t.Errorf("without Timelines a node logged %q", got)
			}
			continue
		}
		if len(got) != 2 {
			t.Fatalf("logged %d timelines, want 2 (the pause's, the resume's): %q", len(got), got)
		}
		pause := timelineEvents(t, got[0])
		want := []string{"PREPARE", "DRAIN clean", "answer rank 3", "DRAIN clean", "FREEZE", "VERIFY clean", "COMMIT"}
		if strings.Join(pause, ", ") != strings.Join(want, ", ") {
			t.Errorf("the pause's timeline is %q, want %q", pause, want)
		}
		if !strings.Contains(got[0], "job="+job) || !strings.Contains(got[0], "node=n1") || !strings.Contains(got[0], "mono_us=") {
			t.Errorf("the pause's timeline does not say its job, node and start: %q", got[0])
		}
		if resume := timelineEvents(t, got[1]); strings.Join(resume, ", ") != "THAW, OPEN" {
			t.Errorf("the resume's timeline is %q, want THAW then OPEN", resume)
		}
	}
}

// TestTimelineBounded: an operation keeps its first maxTimelineEvents
// events and counts the rest; at most maxTimelines jobs have a timeline
// open at once; a PREPARE drops what an operation cut short left open.
func TestTimelineBounded(t *testing.T) {
	tl := &Timelines{}
	now := time.Now()
	for range maxTimelineEvents + 7 {
		tl.step("j", "DRAIN", now, time.Millisecond, "unclean")
	}
	out := &testutil.Buffer{}
	tl.end("j", "n0", slog.New(slog.NewTextHandler(out, nil)))
	got := logLines(out, "step timeline")
	if len(got) != 1 || !strings.Contains(got[0], "dropped=7") || strings.Count(got[0], "DRAIN@") != maxTimelineEvents {
		t.Errorf("%d checks gave %q, want %d events and dropped=7", maxTimelineEvents+7, got, maxTimelineEvents)
	}
	for i := range maxTimelines + 5 {
		tl.step(fmt.Sprint("job", i), "THAW", now, 0, "")
	}
	if len(tl.jobs) != maxTimelines {
		t.Errorf("%d jobs' timelines open, want at most %d", len(tl.jobs), maxTimelines)
	}
	tl.step("job0", "PREPARE", now, 0, "")
	if e := tl.jobs["job0"].events; len(e) != 1 || e[0].what != "PREPARE" {
		t.Errorf("after a PREPARE the job's timeline holds %v, want the PREPARE alone", e)
	}
}

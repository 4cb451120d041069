package mpid

import (
	"fmt"
	"testing"
	"time"
)

func TestLogLimiter(t *testing.T) {
	clock := time.Unix(1000, 0)
	l := newLogLimiter(10 * time.Second)
	l.now = func() time.Time { return clock }
	type step struct {
		after time.Duration
		key   string
		ok    bool
		held  int
	}
	for i, s := range []step{
		{0, "a", true, 0},
		{50 * time.Millisecond, "a", false, 0},
		{50 * time.Millisecond, "a", false, 0},
		{0, "b", true, 0}, // another message is not held back by a's
		{10 * time.Second, "a", true, 2},
		{time.Second, "a", false, 0},
		{10 * time.Second, "a", true, 1},
		{10 * time.Second, "a", true, 0}, // quiet since: logged as new
	} {
		clock = clock.Add(s.after)
		ok, held := l.allow(s.key)
		if ok != s.ok || held != s.held {
			t.Errorf("step %d (%s after %v): allow = %v, %d; want %v, %d", i, s.key, s.after, ok, held, s.ok, s.held)
		}
	}
	if len(l.seen) > 2 {
		t.Errorf("%d keys kept, want at most 2", len(l.seen))
	}
}

// TestLogLimiterCountsCauses: refusals that differ only in what the refused
// party chose (its pid, a job id, a quoted field) are one cause, one line
// per quiet period; a user who makes every refusal's text new in
// unquoted words too gets at most maxCauses lines, and the limiter keeps
// at most that many keys.
func TestLogLimiterCountsCauses(t *testing.T) {
	l := newLogLimiter(10 * time.Second)
	lines := 0
	for pid := range 1000 {
		for _, msg := range []string{
			fmt.Sprintf("JOIN from pid %d (uid 1001) refused: JOIN version \"x%d\", this mpid speaks 2", pid, pid),
			fmt.Sprintf("uid %d has 16 rank connections waiting for their first line already", 1000+pid%7),
			fmt.Sprintf("HELLO field \"job=%d\\\"\" malformed", pid),
		} {
			if ok, _ := l.allow(msg); ok {
				lines++
			}
		}
	}
	if lines != 3 {
		t.Errorf("3,000 refusals of 3 causes with chosen pids, uids and text: %d lines, want 3", lines)
	}
	lines = 0
	for i := range 10000 {
		if ok, _ := l.allow(fmt.Sprintf("rank of job j%c%c refused", 'a'+i%26, 'a'+i/26%26)); ok {
			lines++
		}
	}
	if lines > maxCauses || len(l.seen) > maxCauses {
		t.Errorf("10,000 refusals naming 676 job ids: %d lines, %d keys kept; want at most %d of each", lines, len(l.seen), maxCauses)
	}
}

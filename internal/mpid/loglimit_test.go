package mpid

import (
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

package mpid

import (
	"regexp"
	"sync"
	"time"
)

// refusalQuiet is how long the same refusal is only counted after it was
// logged: a shim that mpid refuses retries every 50 ms or so, and each try
// would otherwise be a log line (a thousand a minute were seen under a
// container manager that refused bpf(2)).
const refusalQuiet = 10 * time.Second

// logLimiter says whether a message may be logged now: the first time, and
// then once every quiet period, with the number of repeats it held back
// meanwhile. It counts by cause (causeOf), not by the whole message, whose
// numbers and quoted text the refused party chooses: counted whole, a user
// who varies them (a pid, a job id, a field) gets a line for each. Causes
// are forgotten once quiet; at most maxCauses are counted apart, and the
// rest together.
type logLimiter struct {
	quiet time.Duration
	now   func() time.Time

	mu   sync.Mutex
	seen map[string]*limited
}

type limited struct {
	logged time.Time
	held   int
}

// maxCauses bounds the causes a limiter counts apart: mpid's refusals have
// a few dozen; more can only come from text the causeOf mask misses, and
// counting those together keeps both the map and the log bounded.
const maxCauses = 256

// otherCauses is the key the causes past maxCauses share (one of them).
const otherCauses = "(refusals of other causes)"

var (
	quotedText = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'[^']*'`)
	numbers    = regexp.MustCompile(`[0-9]+`)
)

// causeOf is msg with its quoted text and its numbers masked: the refusals
// that differ only in what the refused party chose count as one.
func causeOf(msg string) string {
	return numbers.ReplaceAllString(quotedText.ReplaceAllString(msg, `"…"`), "#")
}

func newLogLimiter(quiet time.Duration) *logLimiter {
	return &logLimiter{quiet: quiet, now: time.Now, seen: map[string]*limited{}}
}

// allow reports whether key may be logged now and, if so, how many repeats
// of it were held back since it last was.
func (l *logLimiter) allow(msg string) (ok bool, held int) {
	key := causeOf(msg)
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	for k, e := range l.seen {
		if now.Sub(e.logged) >= l.quiet && e.held == 0 {
			delete(l.seen, k)
		}
	}
	if _, ok := l.seen[key]; !ok && len(l.seen) >= maxCauses-1 {
		key = otherCauses
	}
	e := l.seen[key]
	if e == nil {
		l.seen[key] = &limited{logged: now}
		return true, 0
	}
	if now.Sub(e.logged) < l.quiet {
		e.held++
		return false, 0
	}
	held = e.held
	e.logged, e.held = now, 0
	return true, held
}

package mpid

import (
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
// meanwhile. Keys are whole messages; they are forgotten once quiet.
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

func newLogLimiter(quiet time.Duration) *logLimiter {
	return &logLimiter{quiet: quiet, now: time.Now, seen: map[string]*limited{}}
}

// allow reports whether key may be logged now and, if so, how many repeats
// of it were held back since it last was.
func (l *logLimiter) allow(key string) (ok bool, held int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	for k, e := range l.seen {
		if now.Sub(e.logged) >= l.quiet && e.held == 0 {
			delete(l.seen, k)
		}
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

package quiesce

import "sync"

// busy counts work in progress and lets a caller wait until there is none.
// Unlike sync.WaitGroup it may gain work while someone waits, which is the
// normal case here: a duplicate's handler can send messages that duplicate.
type busy struct {
	mu   sync.Mutex
	n    int
	cond *sync.Cond
}

func (b *busy) add() {
	b.mu.Lock()
	b.n++
	b.mu.Unlock()
}

func (b *busy) done() {
	b.mu.Lock()
	b.n--
	if b.n == 0 && b.cond != nil {
		b.cond.Broadcast()
	}
	b.mu.Unlock()
}

// wait blocks until no work is in progress.
func (b *busy) wait() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cond == nil {
		b.cond = sync.NewCond(&b.mu)
	}
	for b.n > 0 {
		b.cond.Wait()
	}
}

func (b *busy) idle() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n == 0
}

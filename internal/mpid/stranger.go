package mpid

import (
	"runtime"
)

// strangerNice is the niceness of the threads that do a stranger's work:
// a user's own processes' default, so that the work competes for the CPU
// as the stranger's own processes would, never ahead of any user's ranks.
const strangerNice = 0

// asStranger runs fn, work that anyone who reaches an endpoint can cause
// before mpid knows who they are (a TLS handshake on the peer port), on an
// OS thread of its own under SCHED_OTHER at strangerNice, not under mpid's
// real-time policy and niceness (sched.go), and returns when fn has.
// Linux keeps a policy per thread, and the Go runtime runs any goroutine
// on any thread: so the goroutine locks its thread, lowers it, and ends
// without unlocking, which ends the thread too (the runtime never hands a
// locked thread to another goroutine; the main thread, which it never
// exits, it parks for good), and no other goroutine ever runs on a
// lowered thread. Threads the runtime starts meanwhile come from its
// template thread, not from the locked one, and so keep mpid's policy;
// mpid's later passes over its threads leave the lowered one alone.
// What fn costs is bounded by the caller (the peer port's handshake rates
// and caps); the thread is one more per handshake under way.
// A kernel that refuses the change (lowering needs no privilege, so it
// should not) leaves fn at mpid's priority, still bounded by those rates.
func asStranger(fn func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer sched.lower()()
		fn()
	}()
	<-done
}

// strangerLoop is serve, an accept loop that runs for mpid's life, made to
// run through asStranger (for an errgroup's Go).
func strangerLoop(serve func() error) func() error {
	return func() (err error) {
		asStranger(func() { err = serve() })
		return err
	}
}

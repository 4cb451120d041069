package accept

import (
	"errors"
	"io"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

type logged struct {
	cause, key string
}

// recorder collects what a Listener logs.
type recorder struct {
	mu    sync.Mutex
	lines []logged
	seen  chan logged
}

func newRecorder() *recorder { return &recorder{seen: make(chan logged, 100)} }

func (r *recorder) log(cause, key string, _ net.Addr, _ error) {
	r.mu.Lock()
	r.lines = append(r.lines, logged{cause, key})
	r.mu.Unlock()
	r.seen <- logged{cause, key}
}

func listenTCP(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// recordSleeps makes l's back-offs instant, and records them.
func recordSleeps(l *Listener) *[]time.Duration {
	var slept []time.Duration
	l.sleep = func(d time.Duration, _ <-chan struct{}) bool { slept = append(slept, d); return true }
	return &slept
}

// TestBackoff: accept errors of every kind of exhaustion are waited out,
// 5 ms doubling, and the next connection is served; the back-off starts
// over after it.
func TestBackoff(t *testing.T) {
	fl := testutil.NewFlakyListener(listenTCP(t), syscall.EMFILE, syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM)
	rec := newRecorder()
	l := New(fl, Options{Log: rec.log})
	slept := recordSleeps(l)
	dialFrom(t, "127.0.0.1", fl.Addr().String())
	sc, done, err := l.Next()
	if err != nil {
		t.Fatalf("Next after 5 accept errors: %v", err)
	}
	sc.Close()
	done()
	ms := time.Millisecond
	if want := []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms}; !slices.Equal(*slept, want) {
		t.Errorf("backed off %v, want %v", *slept, want)
	}
	var causes []string
	for _, l := range rec.lines {
		causes = append(causes, l.cause)
	}
	want := []string{"accept: too many open files", "accept: too many open files", "accept: too many open files in system",
		"accept: no buffer space available", "accept: cannot allocate memory"}
	if !slices.Equal(causes, want) {
		t.Errorf("logged %q, want %q", causes, want)
	}

	fl.Fail(syscall.EMFILE)
	*slept = nil
	dialFrom(t, "127.0.0.1", fl.Addr().String())
	if _, _, err := l.Next(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(*slept, []time.Duration{5 * ms}) {
		t.Errorf("after a success, backed off %v, want [5ms]", *slept)
	}
}

// TestBackoffCapped: a lasting exhaustion is retried once a second, no
// slower.
func TestBackoffCapped(t *testing.T) {
	errs := make([]syscall.Errno, 12)
	for i := range errs {
		errs[i] = syscall.EMFILE
	}
	fl := testutil.NewFlakyListener(listenTCP(t), errs...)
	l := New(fl, Options{})
	slept := recordSleeps(l)
	dialFrom(t, "127.0.0.1", fl.Addr().String())
	if _, _, err := l.Next(); err != nil {
		t.Fatal(err)
	}
	if len(*slept) != 12 || slices.Max(*slept) != time.Second || (*slept)[11] != time.Second {
		t.Errorf("backed off %v, want 12 waits capped at 1s", *slept)
	}
}

// TestCloseEndsBackoff: closing the listener ends a back-off under way;
// that alone ends Next.
func TestCloseEndsBackoff(t *testing.T) {
	fl := testutil.NewFlakyListener(listenTCP(t), syscall.EMFILE, syscall.EMFILE, syscall.EMFILE, syscall.EMFILE,
		syscall.EMFILE, syscall.EMFILE, syscall.EMFILE, syscall.EMFILE, syscall.EMFILE)
	rec := newRecorder()
	l := New(fl, Options{Log: rec.log})
	ended := make(chan error, 1)
	go func() {
		_, _, err := l.Next()
		ended <- err
	}()
	for range 8 { // 5+10+...+640 ms in all: the 9th waits 1 s
		<-rec.seen
	}
	l.Close()
	select {
	case err := <-ended:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Next after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Next still backing off after Close")
	}
}

// serveAll admits connections on l until it is closed, sending each.
func serveAll(l *Listener) chan net.Conn {
	out := make(chan net.Conn, 100)
	go func() {
		for {
			c, done, err := l.Next()
			if err != nil {
				close(out)
				return
			}
			out <- &conn{Conn: c, done: done}
		}
	}()
	return out
}

// dialFrom connects from source address src (any of 127/8 is the
// loopback's).
func dialFrom(t *testing.T, src, to string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", to)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer: the server closed c at once (EOF, not a read timeout).
func closedByServer(t *testing.T, c net.Conn) bool {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := c.Read(make([]byte, 1))
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

// TestPerKey: a peer's connection past its bound is closed at once and
// logged; another peer's is still served; a slot freed is taken again.
func TestPerKey(t *testing.T) {
	ln := listenTCP(t)
	rec := newRecorder()
	l := New(ln, Options{Key: AddrKey, PerKey: 2, Total: 10, Log: rec.log})
	defer l.Close()
	admitted := serveAll(l)
	addr := ln.Addr().String()
	dialFrom(t, "127.0.0.1", addr)
	dialFrom(t, "127.0.0.1", addr)
	first, second := <-admitted, <-admitted
	_ = second
	third := dialFrom(t, "127.0.0.1", addr)
	if got := <-rec.seen; got != (logged{CausePerKey, "127.0.0.1"}) {
		t.Errorf("logged %+v, want %q of 127.0.0.1", got, CausePerKey)
	}
	if !closedByServer(t, third) {
		t.Error("the third connection of 127.0.0.1 was not closed")
	}
	dialFrom(t, "127.0.0.2", addr)
	if c := <-admitted; c.RemoteAddr().(*net.TCPAddr).IP.String() != "127.0.0.2" {
		t.Errorf("admitted %v, want 127.0.0.2's", c.RemoteAddr())
	}
	if total, of := l.Open("127.0.0.1"); total != 3 || of != 2 {
		t.Errorf("open %d, of 127.0.0.1 %d; want 3 and 2", total, of)
	}
	first.Close()
	dialFrom(t, "127.0.0.1", addr)
	if c := <-admitted; c.RemoteAddr().(*net.TCPAddr).IP.String() != "127.0.0.1" {
		t.Errorf("admitted %v, want 127.0.0.1's once one of its slots is free", c.RemoteAddr())
	}
}

// TestTotal: past the total, anyone's connection is closed; keyless ones
// (root's) count toward it too.
func TestTotal(t *testing.T) {
	ln := listenTCP(t)
	rec := newRecorder()
	l := New(ln, Options{Key: func(c net.Conn) (string, error) { return "", nil }, PerKey: 1, Total: 2, Log: rec.log})
	defer l.Close()
	admitted := serveAll(l)
	addr := ln.Addr().String()
	dialFrom(t, "127.0.0.1", addr)
	dialFrom(t, "127.0.0.1", addr) // keyless: PerKey does not apply
	<-admitted
	<-admitted
	c := dialFrom(t, "127.0.0.3", addr)
	if got := <-rec.seen; got.cause != CauseTotal {
		t.Errorf("logged %+v, want %q", got, CauseTotal)
	}
	if !closedByServer(t, c) {
		t.Error("the connection past the total was not closed")
	}
}

// TestBusy: while Busy says so, new connections are closed.
func TestBusy(t *testing.T) {
	ln := listenTCP(t)
	rec := newRecorder()
	var mu sync.Mutex
	busy := errors.New("heap near its limit")
	l := New(ln, Options{Busy: func() error { mu.Lock(); defer mu.Unlock(); return busy }, Log: rec.log})
	defer l.Close()
	admitted := serveAll(l)
	c := dialFrom(t, "127.0.0.1", ln.Addr().String())
	if got := <-rec.seen; got.cause != CauseBusy {
		t.Errorf("logged %+v, want %q", got, CauseBusy)
	}
	if !closedByServer(t, c) {
		t.Error("a connection while busy was not closed")
	}
	mu.Lock()
	busy = nil
	mu.Unlock()
	dialFrom(t, "127.0.0.1", ln.Addr().String())
	<-admitted
}

package ranks

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
)

// TestServerPerUID: past Limits.PerKey a uid's new connection is closed
// at accept, before its line is read, and the refusal is heard; one of
// its connections gone, the next is served.
func TestServerPerUID(t *testing.T) {
	addr := fmt.Sprintf("@mpipause-ranks-limit-test-%d", os.Getpid())
	s, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	refused := map[string]int{}
	heard := make(chan string, 10)
	s.Limits = accept.Options{PerKey: 2, Total: 10, Log: func(cause, key string, _ net.Addr, _ error) {
		mu.Lock()
		refused[cause+" "+key]++
		mu.Unlock()
		heard <- cause
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error)
	go func() { done <- s.Serve(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	dial := func() net.Conn {
		c, err := net.Dial("unix", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// Two silent ones: each waits for its first line, held.
	first := dial()
	dial()
	third := dial()
	if cause := <-heard; cause != accept.CausePerKey {
		t.Errorf("heard %q, want %q", cause, accept.CausePerKey)
	}
	third.SetReadDeadline(time.Now().Add(5 * time.Second)) // well under the 10 s a first line may take
	if _, err := third.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the third connection of one uid: %v, want it closed at once", err)
	}
	mu.Lock()
	if n := refused[fmt.Sprintf("%s uid %d", accept.CausePerKey, os.Getuid())]; n != 1 {
		t.Errorf("refusals %v, want one of uid %d", refused, os.Getuid())
	}
	mu.Unlock()
	first.Close()
	// Its slot frees once the server has read its EOF; then a rank of
	// the same uid registers.
	deadline := time.Now().Add(10 * time.Second)
	for {
		c := fakeShim(t, addr, fmt.Sprintf("HELLO 2 job=j rank=0 size=1 pid=%d host=h key=k\n", os.Getpid()))
		wctx, wcancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := s.Wait(wctx, func(all []*Rank) bool { return len(all) == 1 })
		wcancel()
		if err == nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("no rank registered with a slot free")
		}
	}
}

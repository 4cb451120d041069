package quiesce

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// tlsServer serves one fake node behind a loopback listener, over TLS
// under keys (in the clear when keys is nil), and collects its refusals.
type tlsServer struct {
	addr string
	fake *fakeNode
	id   *Identity
	mu   sync.Mutex
	logs []string
}

func (s *tlsServer) logged() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.logs, "\n")
}

// serveTLS serves a node named name (its address when empty) under keys;
// its agent dials other nodes through resolve, if set.
func serveTLS(t testing.TB, name string, keys *Keyring, o ServerOptions, resolve ...func(string) (string, error)) *tlsServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if name == "" {
		name = ln.Addr().String()
	}
	s := &tlsServer{addr: ln.Addr().String(), fake: newFake(name)}
	if keys != nil {
		s.id = mustIdentity(t, name, keys)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tr := &TCPTransport{Identity: s.id}
	if len(resolve) > 0 {
		tr.Resolve = resolve[0]
	}
	a := NewAgent(s.fake, tr, fastOpts().Retry)
	o.Identity = s.id
	o.Refused = func(cause string, peer net.Addr, err error) {
		s.mu.Lock()
		s.logs = append(s.logs, fmt.Sprintf("%s: %v", cause, err))
		s.mu.Unlock()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ServeTCPWith(ctx, ln, a.Handle, o)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func mustKey(t testing.TB) *Key {
	t.Helper()
	k, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func mustIdentity(t testing.TB, name string, keys *Keyring) *Identity {
	t.Helper()
	id, err := NewIdentity(name, keys)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func prepare(addr string) Message {
	return Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindPrepare, Nodes: []string{addr}}
}

// TestAuthenticatedTransport: under the same key a pause works; without
// TLS, under another key, or against a node in the clear, nothing is done,
// the error says why, and the server names the cause without the key.
func TestAuthenticatedTransport(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	srv := serveTLS(t, "", keys, ServerOptions{})
	tr := &TCPTransport{Identity: mustIdentity(t, "client", keys)}
	if _, err := NewCoordinator(tr, fastOpts()).Pause(context.Background(), "j", []string{srv.addr}); err != nil {
		t.Fatalf("pause under the cluster key: %v", err)
	}
	checkPaused(t, &cluster{fakes: []*fakeNode{srv.fake}})

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	fresh := serveTLS(t, "", keys, ServerOptions{})
	other := &TCPTransport{Identity: mustIdentity(t, "client", NewKeyring(mustKey(t)))}
	if _, err := other.Call(ctx, fresh.addr, prepare(fresh.addr)); !errors.Is(err, ErrAuth) || !permanent(err) ||
		!strings.Contains(err.Error(), "not from this cluster's key") {
		t.Errorf("another key: %v; want a permanent ErrAuth naming the key", err)
	}
	if _, err := (&TCPTransport{}).Call(ctx, fresh.addr, prepare(fresh.addr)); err == nil {
		t.Error("a client in the clear was answered")
	}
	if n := fresh.fake.calls["prepare"]; n != 0 {
		t.Errorf("unauthenticated calls ran %d PREPAREs", n)
	}
	// The server logs its side of a refused handshake after the client
	// has its error: each refusal is waited for, not read at once.
	for _, want := range []string{"does not speak TLS", "another cluster key"} {
		waitFor(t, "the server's refusal naming "+want, func() bool { return strings.Contains(fresh.logged(), want) })
	}
	open := serveTLS(t, "", nil, ServerOptions{})
	if _, err := tr.Call(ctx, open.addr, prepare(open.addr)); err == nil {
		t.Error("a node in the clear was trusted")
	}
	for _, l := range []string{srv.logged(), fresh.logged()} {
		if strings.Contains(l, hex.EncodeToString(keys.Current().b[:])) {
			t.Error("the key appears in a refusal")
		}
	}
}

// TestPauseWithAnotherKeyFailsAtOnce: a node that holds another cluster
// key fails the pause in PREPARE with the reason (not after PREPARE's
// deadline with the reason as a "last error"), and the node that did
// prepare is rolled back.
func TestPauseWithAnotherKeyFailsAtOnce(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	good, bad := serveTLS(t, "", keys, ServerOptions{}), serveTLS(t, "", NewKeyring(mustKey(t)), ServerOptions{})
	opts := fastOpts()
	opts.Prepare, opts.Abort = time.Minute, time.Minute
	tr := &TCPTransport{Identity: mustIdentity(t, "coordinator", keys)}
	res, err := NewCoordinator(tr, opts).Pause(context.Background(), "j", []string{good.addr, bad.addr})
	if err == nil || !strings.Contains(err.Error(), "same cluster key file") || strings.Contains(err.Error(), "deadline") {
		t.Fatalf("pause with a node of another key: %v; want the key named, no deadline", err)
	}
	// The rollback asks the refusing node no more than it must, either.
	for _, p := range res.Phases {
		if p.Phase == KindAbort && !strings.Contains(p.Err, "refused by "+bad.addr) {
			t.Errorf("rollback: %+v; want it ended by the refusal, not by its deadline", p)
		}
	}
	if len(res.Unconfirmed) != 1 || res.Unconfirmed[0].Node != bad.addr || !res.Unconfirmed[0].Refused {
		t.Errorf("unconfirmed %+v; want only the refusing node, marked refused", res.Unconfirmed)
	}
	checkRolledBack(t, &cluster{fakes: []*fakeNode{good.fake}})
	if n := bad.fake.calls["prepare"]; n != 0 {
		t.Errorf("the node of another key ran %d PREPAREs", n)
	}
}

// TestAnotherNodeAnswers is the redirected name (DNS, /etc/hosts, ARP):
// node1's name leads to node2, a real member holding the key. The pause
// fails at once naming both, and node2 ran nothing.
func TestAnotherNodeAnswers(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	addrs := map[string]string{}
	resolve := func(n string) (string, error) { return addrs[n], nil }
	node0 := serveTLS(t, "node0", keys, ServerOptions{}, resolve)
	node2 := serveTLS(t, "node2", keys, ServerOptions{}, resolve)
	addrs["node0"], addrs["node1"], addrs["node2"] = node0.addr, node2.addr, node2.addr
	tr := &TCPTransport{Identity: mustIdentity(t, "node0", keys), Resolve: resolve}
	opts := fastOpts()
	opts.Prepare, opts.Abort = time.Minute, time.Minute
	t0 := time.Now()
	_, err := NewCoordinator(tr, opts).Pause(context.Background(), "j", []string{"node0", "node1", "node2"})
	if !errors.Is(err, ErrWrongNode) && (err == nil || !strings.Contains(err.Error(), "answered as node2")) {
		t.Fatalf("pause with node1's name at node2: %v; want node1's address named as answered by node2", err)
	}
	if !strings.Contains(err.Error(), "node1's address") || !strings.Contains(err.Error(), "answered as node2") {
		t.Errorf("error %q does not name both nodes", err)
	}
	if d := time.Since(t0); d > 30*time.Second {
		t.Errorf("the pause took %v to fail: not at once", d)
	}
	checkRolledBack(t, &cluster{fakes: []*fakeNode{node0.fake, node2.fake}})

	// A client whose hello names another node (its certificate check
	// skipped, as a buggy or hostile member might) is refused by the
	// server too, and the agent refuses a step addressed to another node.
	conn, err := tls.Dial("tcp", node2.addr, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13,
		Certificates: []tls.Certificate{mustIdentity(t, "node0", keys).cert}, NextProtos: []string{peerALPN}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion, Node: "node1"})
	var h Hello
	if err := readFrame(conn, &h); err != nil || !strings.Contains(h.Err, "this is node2, not node1") {
		t.Errorf("hello for node1 at node2: %v %+v", err, h)
	}
	a := NewAgent(newFake("node2"), NewMemNetwork(1, Faults{}), fastOpts().Retry)
	a.Self = "node2"
	rep, _ := a.Handle(context.Background(), prepare("node1"))
	if !strings.Contains(rep.Err, "addressed to node1 reached node2") {
		t.Errorf("agent of node2 given node1's PREPARE: %+v", rep)
	}
}

// TestKeyRotation: the steps of a move to a new key (docs/install.md)
// interoperate with the step before and after; two nodes with no key in
// common do not.
func TestKeyRotation(t *testing.T) {
	k1, k2 := mustKey(t), mustKey(t)
	steps := []*Keyring{NewKeyring(k1), NewKeyring(k1, k2), NewKeyring(k2, k1), NewKeyring(k2)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range steps {
		for j := range steps {
			srv := serveTLS(t, "", steps[j], ServerOptions{})
			tr := &TCPTransport{Identity: mustIdentity(t, "n", steps[i])}
			_, err := tr.Call(ctx, srv.addr, prepare(srv.addr))
			if near := i-j <= 1 && j-i <= 1; near != (err == nil) {
				t.Errorf("step %d calling step %d: %v", i, j, err)
			}
		}
	}
}

// TestInjectedBytesAreNotAuthFailures: bytes altered on the way (the old
// handshake's hello could carry a forged "err") break the connection, and
// the error is transient, not a permanent "wrong key".
func TestInjectedBytesAreNotAuthFailures(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	srv := serveTLS(t, "", keys, ServerOptions{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		s, err := net.Dial("tcp", srv.addr)
		if err != nil {
			return
		}
		defer s.Close()
		go io.Copy(s, c)
		// Past the server's first flight, flip a byte of each chunk.
		buf := make([]byte, 64<<10)
		for n := 0; ; n++ {
			r, err := s.Read(buf)
			if err != nil {
				return
			}
			if n > 0 {
				buf[r-1] ^= 1
			}
			c.Write(buf[:r])
		}
	}()
	tr := &TCPTransport{Identity: mustIdentity(t, srv.addr, keys), Resolve: func(string) (string, error) { return ln.Addr().String(), nil }}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = tr.Call(ctx, srv.addr, prepare(srv.addr))
	if err == nil || permanent(err) || errors.Is(err, ErrAuth) {
		t.Errorf("altered bytes: %v; want a transient failure", err)
	}
}

// TestUnauthenticatedFlood: strangers announcing 64 MiB frames, silent
// ones and a flood beyond the connection caps cost the server no memory
// of consequence, are cut off within the handshake timeout, and are
// reported once per cause.
func TestUnauthenticatedFlood(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	const timeout = 300 * time.Millisecond
	srv := serveTLS(t, "", keys, ServerOptions{HandshakeTimeout: timeout})
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.HeapInuse
	big := make([]byte, 1<<20)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var peak uint64
	for range 20 {
		wg.Go(func() {
			c, err := net.Dial("tcp", srv.addr)
			if err != nil {
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			c.Write([]byte{0x04, 0, 0, 0}) // 64 MiB
			for range 60 {
				if _, err := c.Write(big); err != nil {
					break
				}
				var m runtime.MemStats
				runtime.ReadMemStats(&m)
				mu.Lock()
				peak = max(peak, m.HeapInuse)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if grew := int64(peak) - int64(before); grew > 16<<20 {
		t.Errorf("20 strangers announcing 64 MiB frames grew the heap by %d MiB", grew>>20)
	}

	// Silent: closed by the server within the handshake timeout.
	c, err := net.Dial("tcp", srv.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t0 := time.Now()
	c.SetReadDeadline(t0.Add(10 * timeout))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Errorf("a silent client: %v after %v; want the server to close it", err, time.Since(t0))
	}

	// Beyond the per-address cap: closed at once, without a handshake
	// (the connections within it wait for their handshake's timeout).
	srv = serveTLS(t, "", keys, ServerOptions{HandshakeTimeout: time.Minute})
	var held []net.Conn
	for range DefaultMaxPendingPerAddr {
		c, err := net.Dial("tcp", srv.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		held = append(held, c)
	}
	waitFor(t, "the held connections to be accepted", func() bool {
		c, err := net.Dial("tcp", srv.addr)
		if err != nil {
			return false
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(time.Second))
		_, err = c.Read(make([]byte, 1))
		return errors.Is(err, io.EOF)
	})
	l := srv.logged()
	if n := strings.Count(l, "too many connections"); n == 0 {
		t.Errorf("the cap's refusals were not reported:\n%s", l)
	}
	for _, c := range held {
		c.Close()
	}
}

// TestKeyFile: a written key loads back; a key file open to others, in the
// wrong format, with too many keys, or already there is refused with what
// to do, and no error or formatting of a key shows its bytes.
func TestKeyFile(t *testing.T) {
	dir := t.TempDir()
	k := mustKey(t)
	path := filepath.Join(dir, "cluster.key")
	if err := WriteKeyFile(path, k); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %v %v, want 0600", st.Mode(), err)
	}
	got, err := LoadKeys(path)
	if err != nil || len(got.All()) != 1 || got.Current().b != k.b {
		t.Fatalf("load: %v", err)
	}
	if err := WriteKeyFile(path, mustKey(t)); err == nil || !strings.Contains(err.Error(), "never overwritten") {
		t.Errorf("overwrite: %v", err)
	}
	k2 := mustKey(t)
	if err := ReplaceKeyFile(path, k2, k); err != nil {
		t.Fatal(err)
	}
	if got, err := LoadKeys(path); err != nil || len(got.All()) != 2 || got.Current().b != k2.b || got.All()[1].b != k.b {
		t.Fatalf("two keys: %v", err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("replaced key file mode %v %v, want 0600", st.Mode(), err)
	}
	secret := hex.EncodeToString(k.b[:])
	for _, s := range []string{fmt.Sprint(k), fmt.Sprintf("%v %+v %#v %s", *k, k, k, k), fmt.Sprint(got)} {
		if strings.Contains(s, secret) || strings.Contains(s, fmt.Sprint(k.b[0:4])) {
			t.Errorf("a key formats as %q", s)
		}
	}
	loose := filepath.Join(dir, "loose.key")
	os.WriteFile(loose, []byte(secret+"\n"), 0o644)
	os.Chmod(loose, 0o644)
	if _, err := LoadKeys(loose); err == nil || !strings.Contains(err.Error(), "chmod 600") || strings.Contains(err.Error(), secret) {
		t.Errorf("loose mode: %v", err)
	}
	bad := filepath.Join(dir, "bad.key")
	os.WriteFile(bad, []byte("not a key "+secret[:10]+"\n"), 0o600)
	if _, err := LoadKeys(bad); err == nil || !strings.Contains(err.Error(), "mpid keygen") || strings.Contains(err.Error(), secret[:10]) {
		t.Errorf("malformed: %v", err)
	}
	many := filepath.Join(dir, "many.key")
	os.WriteFile(many, []byte(strings.Repeat(secret+"\n", MaxKeys+1)), 0o600)
	if _, err := LoadKeys(many); err == nil {
		t.Errorf("%d keys loaded", MaxKeys+1)
	}
	if _, err := LoadKeys(filepath.Join(dir, "none")); err == nil {
		t.Error("a missing key file loaded")
	}
}

// waitFor polls cond until it holds, failing the test after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// BenchmarkConnect is what a new peer connection costs (a connection per
// call: MaxIdle -1), with TLS and, as the baseline of the same run, in the
// clear; pooled connections pay it once per peer every 30 s at most.
func BenchmarkConnect(b *testing.B) {
	keys := NewKeyring(mustKey(b))
	for _, c := range []struct {
		name string
		keys *Keyring
	}{{"clear", nil}, {"tls", keys}} {
		b.Run(c.name, func(b *testing.B) {
			srv := serveTLS(b, "", c.keys, ServerOptions{})
			tr := &TCPTransport{MaxIdle: -1}
			if c.keys != nil {
				tr.Identity = mustIdentity(b, "client", c.keys)
			}
			ctx := context.Background()
			for b.Loop() {
				if _, err := tr.Call(ctx, srv.addr, prepare(srv.addr)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestPoolKeepsNamesApart: a connection proved to be node2's is not used
// for node1 when node1's name leads to node2's address; the call to node1
// dials and finds the wrong node (TestAnotherNodeAnswers met this only when
// the tree happened to call node2 first).
func TestPoolKeepsNamesApart(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	addrs := map[string]string{}
	resolve := func(n string) (string, error) { return addrs[n], nil }
	node2 := serveTLS(t, "node2", keys, ServerOptions{}, resolve)
	addrs["node1"], addrs["node2"] = node2.addr, node2.addr
	tr := &TCPTransport{Identity: mustIdentity(t, "node0", keys), Resolve: resolve}
	defer tr.CloseIdle()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := Message{Version: ProtocolVersion, Job: "j", Kind: KindThaw, Nodes: []string{"node2"}}
	if _, err := tr.Call(ctx, "node2", req); err != nil {
		t.Fatalf("call to node2: %v", err)
	}
	req.Nodes = []string{"node1"}
	if _, err := tr.Call(ctx, "node1", req); !errors.Is(err, ErrWrongNode) {
		t.Fatalf("call to node1, whose name leads to node2's address, after a call to node2: %v; want ErrWrongNode", err)
	}
}

// TestHandshakeRate: a stranger's loop of handshakes from one address is
// cut to that address's rate before any handshake starts, another
// address still gets its own, the total rate holds across addresses, and
// every handshake that did start ran through Unauthenticated (where mpid
// drops its real-time priority).
func TestHandshakeRate(t *testing.T) {
	keys := NewKeyring(mustKey(t))
	// try reports whether the server took part in a handshake from local
	// (the stranger has no certificate: TLS 1.3 lets the client finish
	// before the server refuses that), not whether it authenticated.
	try := func(addr, local string) bool {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13})
		return tc.Handshake() == nil
	}
	count := func(addr, local string, n int) (ok int) {
		for range n {
			if try(addr, local) {
				ok++
			}
		}
		return ok
	}
	var ran atomic.Int64
	through := func(fn func()) { ran.Add(1); fn() }
	srv := serveTLS(t, "", keys, ServerOptions{HandshakeRatePerAddr: 1, HandshakeRate: 1000, Unauthenticated: through})
	// A burst of two, then one a second: twenty tries in well under a
	// second get two, three if the machine stalls for a second.
	one := count(srv.addr, "127.0.0.1", 20)
	if one < 1 || one > 3 {
		t.Errorf("20 handshakes from one address at a rate of 1/s: %d started, want 2", one)
	}
	if ok := count(srv.addr, "127.0.0.2", 1); ok != 1 {
		t.Errorf("another address's first handshake refused while the first address was over its rate")
	}
	if l := srv.logged(); !strings.Contains(l, "too many handshakes a second") || !strings.Contains(l, "from 127.0.0.1") {
		t.Errorf("the rate's refusals were not reported with their address:\n%s", l)
	}

	all := serveTLS(t, "", keys, ServerOptions{HandshakeRatePerAddr: 1000, HandshakeRate: 1, Unauthenticated: through})
	ok := 0
	for i := range 8 {
		ok += count(all.addr, fmt.Sprintf("127.0.0.%d", 1+i%4), 1)
	}
	if ok < 1 || ok > 3 {
		t.Errorf("8 handshakes from 4 addresses at a total rate of 1/s: %d started, want 2", ok)
	}
	if l := all.logged(); !strings.Contains(l, "in all") {
		t.Errorf("the total rate's refusals were not reported:\n%s", l)
	}
	// Through Unauthenticated: each server's accept loop, and every
	// handshake that started (those the clients saw), and nothing more.
	want := int64(2 + one + 1 + ok)
	waitFor(t, "the handshakes that started to be counted", func() bool { return ran.Load() >= want })
	if n := ran.Load(); n != want {
		t.Errorf("%d calls of Unauthenticated; want %d (2 accept loops, %d handshakes)", n, want, want-2)
	}
}

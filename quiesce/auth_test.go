package quiesce

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// authServer serves one fake node with key behind a loopback listener and
// collects what it logs.
type authServer struct {
	addr string
	fake *fakeNode
	mu   sync.Mutex
	logs []string
}

func (s *authServer) logged() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.logs, "\n")
}

func serveAuth(t *testing.T, key *Key) *authServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &authServer{addr: ln.Addr().String(), fake: newFake(ln.Addr().String())}
	a := NewAgent(s.fake, &TCPTransport{Key: key}, fastOpts().Retry)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ServeTCPWith(ctx, ln, a.Handle, ServerOptions{Key: key, Log: func(msg string, args ...any) {
			s.mu.Lock()
			s.logs = append(s.logs, fmt.Sprint(append([]any{msg}, args...)...))
			s.mu.Unlock()
		}})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func mustKey(t *testing.T) *Key {
	t.Helper()
	k, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func prepare(addr string) Message {
	return Message{Version: ProtocolVersion, Job: "j", Epoch: 1, Seq: 1, Kind: KindPrepare, Nodes: []string{addr}}
}

// TestAuthenticatedTransport: with the same key a pause works; without the
// key, with another key, or against a node without one, nothing is done and
// the error says why; the server logs the refusal without the key.
func TestAuthenticatedTransport(t *testing.T) {
	key := mustKey(t)
	srv := serveAuth(t, key)
	tr := &TCPTransport{Key: key}
	if _, err := NewCoordinator(tr, fastOpts()).Pause(context.Background(), "j", []string{srv.addr}); err != nil {
		t.Fatalf("pause with the cluster key: %v", err)
	}
	checkPaused(t, &cluster{fakes: []*fakeNode{srv.fake}})

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	fresh := serveAuth(t, key)
	for name, c := range map[string]struct {
		tr   *TCPTransport
		want string
	}{
		"no key":      {&TCPTransport{}, "requires the cluster key"},
		"another key": {&TCPTransport{Key: mustKey(t)}, "does not hold this node's cluster key"},
	} {
		_, err := c.tr.Call(ctx, fresh.addr, prepare(fresh.addr))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, c.want)
		}
	}
	if n := fresh.fake.calls["prepare"]; n != 0 {
		t.Errorf("unauthenticated calls ran %d PREPAREs", n)
	}
	if l := fresh.logged(); !strings.Contains(l, "does not authenticate") {
		t.Errorf("server log lacks the refusal: %q", l)
	}
	open := serveAuth(t, nil)
	if _, err := tr.Call(ctx, open.addr, prepare(open.addr)); !errors.Is(err, ErrAuth) {
		t.Errorf("a node without a key: %v; want ErrAuth", err)
	}
	for _, l := range []string{srv.logged(), fresh.logged()} {
		if strings.Contains(l, hex.EncodeToString(key.b[:])) {
			t.Error("the key appears in a log line")
		}
	}
}

// TestPauseWithAnotherKeyFailsAtOnce: a node that holds another cluster
// key fails the pause in PREPARE with the reason (not after PREPARE's
// deadline with the reason as a "last error"), and the node that did
// prepare is rolled back.
func TestPauseWithAnotherKeyFailsAtOnce(t *testing.T) {
	key := mustKey(t)
	good, bad := serveAuth(t, key), serveAuth(t, mustKey(t))
	opts := fastOpts()
	opts.Prepare, opts.Abort = time.Minute, time.Minute
	res, err := NewCoordinator(&TCPTransport{Key: key}, opts).Pause(context.Background(), "j", []string{good.addr, bad.addr})
	if err == nil || !strings.Contains(err.Error(), "does not hold this node's cluster key") || strings.Contains(err.Error(), "deadline") {
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

// rawClient does the client's handshake by hand and returns the
// connection, its reader and its session, so a test can send what it likes.
func rawClient(t *testing.T, addr string, key *Key) (net.Conn, *bufio.Reader, *session) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	nonce, _ := newNonce()
	if err := writeFrame(conn, Hello{Magic: HelloMagic, Version: ProtocolVersion, Nonce: nonce}); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(conn)
	var h Hello
	if err := readFrame(br, &h); err != nil {
		t.Fatal(err)
	}
	return conn, br, newSession(key, nonce, h.Nonce, true)
}

// TestForgedAndReplayedFrames: a frame with a bad MAC, a valid frame sent
// again on its connection, and a valid frame replayed on another connection
// are all rejected, logged, and never reach the node.
func TestForgedAndReplayedFrames(t *testing.T) {
	key := mustKey(t)
	srv := serveAuth(t, key)
	f := frame{TimeoutNanos: int64(5 * time.Second), Msg: prepare(srv.addr)}

	// A valid frame is answered; the same bytes again are refused.
	conn, br, s := rawClient(t, srv.addr, key)
	body, _ := jsonFrame(f)
	sealed := s.seal(body)
	if err := writeRaw(conn, sealed); err != nil {
		t.Fatal(err)
	}
	var rep frame
	if err := readSealed(br, s, &rep); err != nil || rep.Msg.Err != "" {
		t.Fatalf("valid frame: %v %+v", err, rep.Msg)
	}
	writeRaw(conn, sealed)
	if err := readSealed(br, s, &rep); err == nil {
		t.Error("a frame sent twice on one connection was answered")
	}

	// Replayed on a fresh connection: another session key.
	conn2, br2, _ := rawClient(t, srv.addr, key)
	writeRaw(conn2, sealed)
	if err := readFrame(br2, &rep); err == nil {
		t.Error("a frame replayed on another connection was answered")
	}

	// Forged: right length, wrong MAC; and a body altered after sealing.
	conn3, br3, s3 := rawClient(t, srv.addr, key)
	bad := s3.seal(body)
	bad[len(bad)-1] ^= 1
	writeRaw(conn3, bad)
	if err := readFrame(br3, &rep); err == nil {
		t.Error("a frame with a forged MAC was answered")
	}
	conn4, br4, s4 := rawClient(t, srv.addr, key)
	altered := s4.seal(body)
	altered[10] ^= 1
	writeRaw(conn4, altered)
	if err := readFrame(br4, &rep); err == nil {
		t.Error("an altered frame was answered")
	}

	if n := srv.fake.calls["prepare"]; n != 1 {
		t.Errorf("the node ran %d PREPAREs, want only the valid one", n)
	}
	if l := srv.logged(); strings.Count(l, "frame rejected") != 4 {
		t.Errorf("want 4 rejections logged, got:\n%s", l)
	}
}

func jsonFrame(f frame) ([]byte, error) {
	var b strings.Builder
	if err := writeFrame(&b, f); err != nil {
		return nil, err
	}
	return []byte(b.String()[4:]), nil
}

// writeRaw writes b as a frame body as it is (with whatever MAC it has).
func writeRaw(conn net.Conn, b []byte) error {
	hdr := []byte{byte(len(b) >> 24), byte(len(b) >> 16), byte(len(b) >> 8), byte(len(b))}
	_, err := conn.Write(append(hdr, b...))
	return err
}

// TestKeyFile: a written key loads back; a key file open to others, in
// the wrong format, or already there is refused with what to do, and no
// error or formatting of a key shows its bytes.
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
	got, err := LoadKey(path)
	if err != nil || got.b != k.b {
		t.Fatalf("load: %v", err)
	}
	if err := WriteKeyFile(path, mustKey(t)); err == nil || !strings.Contains(err.Error(), "never overwritten") {
		t.Errorf("overwrite: %v", err)
	}
	secret := hex.EncodeToString(k.b[:])
	for _, s := range []string{fmt.Sprint(k), fmt.Sprintf("%v %+v %#v %s", *k, k, k, k)} {
		if strings.Contains(s, secret) || strings.Contains(s, fmt.Sprint(k.b[0:4])) {
			t.Errorf("a key formats as %q", s)
		}
	}
	loose := filepath.Join(dir, "loose.key")
	os.WriteFile(loose, []byte(secret+"\n"), 0o644)
	os.Chmod(loose, 0o644)
	if _, err := LoadKey(loose); err == nil || !strings.Contains(err.Error(), "chmod 600") || strings.Contains(err.Error(), secret) {
		t.Errorf("loose mode: %v", err)
	}
	bad := filepath.Join(dir, "bad.key")
	os.WriteFile(bad, []byte("not a key "+secret[:10]+"\n"), 0o600)
	if _, err := LoadKey(bad); err == nil || !strings.Contains(err.Error(), "mpid keygen") || strings.Contains(err.Error(), secret[:10]) {
		t.Errorf("malformed: %v", err)
	}
	if _, err := LoadKey(filepath.Join(dir, "none")); err == nil {
		t.Error("a missing key file loaded")
	}
}

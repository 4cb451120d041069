package quiesce

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"strings"
	"syscall"
)

// Authentication of the TCP transport (DESIGN.md, security model): every
// node of a cluster holds the same 32-byte cluster key. A connection opens
// with a nonce from each side in the hellos; both derive a session key from
// the cluster key and the two nonces; the server proves it holds the key in
// its hello, and from then on every frame in either direction carries an
// HMAC-SHA256 over its direction, its number on the connection and its
// bytes. A node without the key cannot produce a frame the other accepts;
// a frame replayed (on the same connection: its number is past; on another:
// the session key differs), reordered, reflected back to its sender or
// altered fails its MAC, and the receiver drops the connection.

// KeySize is the cluster key's length in bytes.
const KeySize = 32

// Key is a cluster key. It prints as a placeholder, so that no log line,
// error or status output can carry it by accident.
type Key struct{ b [KeySize]byte }

func (Key) String() string   { return "(cluster key)" }
func (Key) GoString() string { return "(cluster key)" }

// GenerateKey returns a fresh random key.
func GenerateKey() (*Key, error) {
	var k Key
	if _, err := io.ReadFull(rand.Reader, k.b[:]); err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	return &k, nil
}

// WriteKeyFile writes a new key to path, mode 0600, refusing to replace an
// existing file (a key in use on other nodes must not change under them).
func WriteKeyFile(path string, k *Key) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%s exists; a cluster key is never overwritten (remove it first if you mean to replace it on every node)", path)
		}
		return err
	}
	if _, err := fmt.Fprintln(f, hex.EncodeToString(k.b[:])); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	return f.Close()
}

// LoadKey reads a key file written by WriteKeyFile. The file must be a
// regular file owned by root or by this process's user, and neither group
// nor others may have any access to it; errors say what to fix and never
// quote the file's content.
func LoadKey(path string) (*Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("cluster key %s is not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("cluster key %s has mode %04o, open to group or others; run: chmod 600 %s", path, perm, path)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && sys.Uid != 0 && int(sys.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("cluster key %s is owned by uid %d, not by root or this user", path, sys.Uid)
	}
	b, err := io.ReadAll(io.LimitReader(f, 4*KeySize))
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	raw, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(raw) != KeySize {
		return nil, fmt.Errorf("cluster key %s is not %d hex-encoded bytes (make one with: mpid keygen)", path, KeySize)
	}
	var k Key
	copy(k.b[:], raw)
	return &k, nil
}

const nonceSize = 32

func newNonce() ([]byte, error) {
	n := make([]byte, nonceSize)
	if _, err := io.ReadFull(rand.Reader, n); err != nil {
		return nil, err
	}
	return n, nil
}

// session is one authenticated connection's state: its key and the number
// of the next frame in each direction. A connection uses it for one frame
// at a time, so it keeps one keyed HMAC and resets it for each frame,
// rather than deriving the HMAC's pads from the key again every time.
type session struct {
	key        []byte
	out, in    byte // direction labels: 'c' client to server, 's' server to client
	sent, recv uint64

	h   hash.Hash // HMAC-SHA256 keyed with key, made on first use
	hdr [9]byte
	tag [sha256.Size]byte
}

func newSession(k *Key, clientNonce, serverNonce []byte, client bool) *session {
	m := hmac.New(sha256.New, k.b[:])
	m.Write([]byte("mpipause-quiesce session v1"))
	m.Write(clientNonce)
	m.Write(serverNonce)
	s := &session{key: m.Sum(nil), out: 's', in: 'c'}
	if client {
		s.out, s.in = 'c', 's'
	}
	return s
}

// proof is what the server's hello carries: only a holder of the cluster
// key can compute it for these nonces.
func (s *session) proof() []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte("server hello"))
	return m.Sum(nil)
}

// mac appends to dst the MAC of the frame numbered seq in direction dir.
func (s *session) mac(dst []byte, dir byte, seq uint64, body []byte) []byte {
	if s.h == nil {
		s.h = hmac.New(sha256.New, s.key)
	} else {
		s.h.Reset()
	}
	s.hdr[0] = dir
	binary.BigEndian.PutUint64(s.hdr[1:], seq)
	s.h.Write(s.hdr[:])
	s.h.Write(body)
	return s.h.Sum(dst)
}

// ErrAuth: a peer failed authentication (no key, another key, a forged,
// replayed or altered frame).
var ErrAuth = errors.New("authentication failed")

// seal appends the MAC of the next outgoing frame to body.
func (s *session) seal(body []byte) []byte {
	out := s.mac(body, s.out, s.sent, body)
	s.sent++
	return out
}

// open checks and strips the MAC of the next incoming frame.
func (s *session) open(b []byte) ([]byte, error) {
	if len(b) < sha256.Size {
		return nil, fmt.Errorf("%w: frame %d too short for its MAC", ErrAuth, s.recv)
	}
	body, tag := b[:len(b)-sha256.Size], b[len(b)-sha256.Size:]
	if !hmac.Equal(tag, s.mac(s.tag[:0], s.in, s.recv, body)) {
		return nil, fmt.Errorf("%w: frame %d: bad MAC (forged, replayed, reordered or not from a holder of the cluster key)", ErrAuth, s.recv)
	}
	s.recv++
	return body, nil
}

// Derive returns a secret that only holders of the cluster key can compute
// for these parts: HMAC-SHA256(key, label, then each part), each
// length-prefixed so that no two lists of parts give the same input. mpid
// derives the per-job keys it hands to launchers this way
// (docs/security.md), so any node of the cluster can check one without
// state, and one job's key says nothing about another's.
func (k *Key) Derive(label string, parts ...string) []byte {
	m := hmac.New(sha256.New, k.b[:])
	var n [8]byte
	for _, p := range append([]string{label}, parts...) {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		m.Write(n[:])
		m.Write([]byte(p))
	}
	return m.Sum(nil)
}

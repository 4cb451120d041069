package quiesce

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// The cluster key (docs/security.md): every node of a cluster holds the
// same secret, from which the peer port's TLS certificates (tls.go) and the
// job keys mpid hands to launchers are derived. A key file may list a few
// keys, one per line, so that a cluster can move to a new key without a
// flag day (docs/install.md): the first is the one this node uses, every
// one listed is accepted from others.

// KeySize is the cluster key's length in bytes.
const KeySize = 32

// MaxKeys bounds the keys of one file: the current one and the next, with
// room for a previous one still being retired.
const MaxKeys = 3

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

// Derive returns a secret that only holders of the key can compute for
// these parts: HMAC-SHA256(key, label, then each part), each
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

// Keyring is the keys of a key file: Current is this node's, and every key
// of All is accepted from other nodes.
type Keyring struct{ keys []*Key }

// NewKeyring makes a keyring of current and the other keys accepted.
func NewKeyring(current *Key, accepted ...*Key) *Keyring {
	return &Keyring{keys: append([]*Key{current}, accepted...)}
}

// Current is the key this node certifies itself with and derives new job
// keys from.
func (r *Keyring) Current() *Key { return r.keys[0] }

// All is every key accepted, Current first.
func (r *Keyring) All() []*Key { return r.keys }

func (*Keyring) String() string { return "(cluster keys)" }

// WriteKeyFile writes a new file of keys to path, mode 0600, refusing to
// replace an existing file (a key in use on other nodes must not change
// under them).
func WriteKeyFile(path string, keys ...*Key) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%s exists; a cluster key is never overwritten (remove it first if you mean to replace it on every node)", path)
		}
		return err
	}
	if err := writeKeys(f, keys); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	return f.Close()
}

// ReplaceKeyFile replaces the keys of path with keys, atomically: a reader
// sees the old file or the new one, never a part.
func ReplaceKeyFile(path string, keys ...*Key) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".cluster-key-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	err = f.Chmod(0o600)
	if err == nil {
		err = writeKeys(f, keys)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

func writeKeys(f *os.File, keys []*Key) error {
	if len(keys) == 0 || len(keys) > MaxKeys {
		return fmt.Errorf("a key file holds 1 to %d keys, not %d", MaxKeys, len(keys))
	}
	var b bytes.Buffer
	for _, k := range keys {
		fmt.Fprintln(&b, hex.EncodeToString(k.b[:]))
	}
	if _, err := f.Write(b.Bytes()); err != nil {
		return err
	}
	return f.Sync()
}

// LoadKeys reads a key file written by WriteKeyFile or ReplaceKeyFile. The
// file must be a regular file owned by root or by this process's user, and
// neither group nor others may have any access to it; errors say what to
// fix and never quote the file's content.
func LoadKeys(path string) (*Keyring, error) {
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
	b, err := io.ReadAll(io.LimitReader(f, MaxKeys*(2*KeySize+2)+1))
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	r, ok := parseKeys(b)
	if !ok {
		return nil, fmt.Errorf("cluster key %s is not 1 to %d lines of %d hex-encoded bytes (make one with: mpid keygen)", path, MaxKeys, KeySize)
	}
	return r, nil
}

// parseKeys reads a key file's content.
func parseKeys(b []byte) (*Keyring, bool) {
	lines := strings.Fields(string(b))
	if len(lines) == 0 || len(lines) > MaxKeys {
		return nil, false
	}
	r := &Keyring{}
	for _, l := range lines {
		raw, err := hex.DecodeString(l)
		if err != nil || len(raw) != KeySize {
			return nil, false
		}
		k := &Key{}
		copy(k.b[:], raw)
		r.keys = append(r.keys, k)
	}
	return r, true
}

package ranks

import (
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

// makePage builds a state page as the shim does, with fds entries; fd 3 is
// gated and holds 77 bytes, fd 5 was short.
func makePage(t *testing.T, fds int, seal bool, mutate func([]byte)) []byte {
	t.Helper()
	fd, err := unix.MemfdCreate("test-page", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	held := (pageHeader + 2*fds + 7) &^ 7
	size := held + 8*fds
	b := make([]byte, size)
	copy(b, pageMagic)
	le := binary.LittleEndian
	le.PutUint32(b[8:], pageVersion)
	le.PutUint32(b[12:], uint32(fds))
	le.PutUint64(b[16:], uint64(size))
	le.PutUint64(b[24:], uint64(held))
	b[pageHeader+5] = 1     // fd 5 short
	b[pageHeader+fds+3] = 1 // fd 3 gated
	le.PutUint64(b[held+8*3:], 77)
	if mutate != nil {
		mutate(b)
	}
	if _, err := unix.Pwrite(fd, b, 0); err != nil {
		t.Fatal(err)
	}
	if seal {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
			t.Fatal(err)
		}
	}
	return unix.UnixRights(fd)
}

func TestReceivePage(t *testing.T) {
	p, err := receivePage(makePage(t, 64, true, nil))
	if err != nil {
		t.Fatal(err)
	}
	r := &Rank{page: p}
	got := r.Sockets()
	if len(got) != 2 || got[0] != (Socket{FD: 3, Gated: true, Held: 77}) || got[1] != (Socket{FD: 5, Short: true}) {
		t.Errorf("Sockets() = %+v", got)
	}
	p.close()
	if s := r.Sockets(); s != nil {
		t.Errorf("Sockets() after close = %+v", s)
	}

	for name, oob := range map[string][]byte{
		"unsealed":      makePage(t, 64, false, nil),
		"bad magic":     makePage(t, 64, true, func(b []byte) { b[0] = 'X' }),
		"bad version":   makePage(t, 64, true, func(b []byte) { b[8] = 9 }),
		"too many fds":  makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint32(b[12:], 1<<20) }),
		"size mismatch": makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[16:], 1) }),
		"held offset":   makePage(t, 64, true, func(b []byte) { binary.LittleEndian.PutUint64(b[24:], 1<<40) }),
	} {
		if p, err := receivePage(oob); err == nil {
			p.close()
			t.Errorf("%s: accepted", name)
		}
	}
	if p, err := receivePage(nil); p != nil || err != nil {
		t.Errorf("no fd: %v, %v; want nil, nil", p, err)
	}
}

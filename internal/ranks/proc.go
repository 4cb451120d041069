package ranks

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/peercred"
	"golang.org/x/sys/unix"
)

// soPeerPIDFD is SO_PEERPIDFD (Linux 6.5), which golang.org/x/sys/unix does
// not name yet: 77 in asm-generic/socket.h, which every architecture Go
// supports on Linux uses for it.
const soPeerPIDFD = 77

// ErrExited: the process that connected is gone, so its pid number may be
// another process's by now, and mpid does not act on it.
var ErrExited = errors.New("the process that connected has exited")

// Proc is the process at the other end of a rank-socket connection, held
// by a pidfd taken at accept, before anything was read from it: a pid
// number names whoever holds it when it is used, the pidfd only that
// process. mpid acts on a rank's pid (a cgroup move, a boost) only through
// its Proc, and only while the pidfd says the process is alive (see
// docs/mpid.md, "Pids").
type Proc struct {
	Pid int    // from SO_PEERCRED
	UID uint32 // from SO_PEERCRED: the effective uid at connect()

	mu sync.RWMutex // held for reading around every use of fd; Close takes it to write
	fd int          // the pidfd; -1 once closed
}

// peerProc takes the credentials and a pidfd of c's peer: SO_PEERPIDFD
// where the kernel has it (the very process that connected, even if it has
// exited since), else pidfd_open of SO_PEERCRED's pid, checked against
// SO_PEERCRED's uid: the number may have passed to another process between
// connect() and now, and the check refuses one of another user (the
// remaining window, a reuse by the same user between connect and accept,
// only lets a user act on their own process).
func peerProc(c *net.UnixConn) (*Proc, error) {
	cred, err := peercred.Of(c)
	if err != nil {
		return nil, err
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var serr error
	if err := raw.Control(func(s uintptr) { fd, serr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, soPeerPIDFD) }); err != nil {
		return nil, err
	}
	p := &Proc{Pid: int(cred.Pid), UID: cred.Uid, fd: fd}
	switch {
	case serr == nil:
		return p, nil
	case errors.Is(serr, unix.ENOPROTOOPT):
		return openProc(int(cred.Pid), cred.Uid)
	case errors.Is(serr, unix.ESRCH), errors.Is(serr, unix.EINVAL):
		// Kernels that cannot make a pidfd for a reaped peer say so.
		return nil, ErrExited
	default:
		return nil, fmt.Errorf("pidfd of pid %d: %w", cred.Pid, serr)
	}
}

// openProc is peerProc without SO_PEERPIDFD: pidfd_open(pid), then the
// process's effective uid read from /proc while the pidfd says it is alive
// (a number held by a live process is not reused, so the /proc entry read
// in between is the pidfd's process).
func openProc(pid int, uid uint32) (*Proc, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil, ErrExited
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd of pid %d: %w", pid, err)
	}
	p := &Proc{Pid: pid, UID: uid, fd: fd}
	euid, uerr := procEUID(pid)
	if err := p.Alive(); err != nil {
		p.Close()
		return nil, err
	}
	if uerr != nil || euid != uid {
		p.Close()
		return nil, fmt.Errorf("pid %d now runs as uid %d (%v), not as the uid %d that connected: %w", pid, euid, uerr, uid, ErrExited)
	}
	return p, nil
}

// procEUID is the effective uid in /proc/PID/status.
func procEUID(pid int) (uint32, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Uid:"); ok {
			f := strings.Fields(v)
			if len(f) >= 2 {
				n, err := strconv.ParseUint(f[1], 10, 32)
				return uint32(n), err
			}
		}
	}
	return 0, errors.New("no Uid line")
}

// Alive is nil while the process is alive (or a zombie not yet reaped: its
// number is still its own), ErrExited once it is gone. Signal 0 checks
// without sending: EPERM (mpid under its unit has no CAP_KILL, and the
// process is another user's) says alive as surely as success.
func (p *Proc) Alive() error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.aliveLocked()
}

func (p *Proc) aliveLocked() error {
	if p.fd < 0 {
		return ErrExited
	}
	err := unix.PidfdSendSignal(p.fd, 0, nil, 0)
	switch {
	case err == nil, errors.Is(err, unix.EPERM):
		return nil
	case errors.Is(err, unix.ESRCH):
		return ErrExited
	}
	return fmt.Errorf("pid %d: %w", p.Pid, err)
}

// Close releases the pidfd; the Proc then counts as exited.
func (p *Proc) Close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd >= 0 {
		unix.Close(p.fd)
		p.fd = -1
	}
}

// MoveTo moves the process into the cgroup v2 directory dir. cgroup.procs
// takes a number, so the pidfd vouches for it around the write: alive
// before, and alive after (then the number was still its own at the
// write). Gone after: the write may have moved whoever got the number; if
// that process is in dir now, it goes back where the number's holder was
// just before, and the error says what was undone.
func (p *Proc) MoveTo(dir string) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if err := p.aliveLocked(); err != nil {
		return fmt.Errorf("pid %d: %w", p.Pid, err)
	}
	from, ferr := cgroupv2.Of(p.Pid)
	werr := cgroupv2.AddProc(dir, p.Pid)
	err := p.aliveLocked()
	switch {
	case err == nil && werr == nil:
		return nil
	case err == nil:
		return werr
	case !errors.Is(err, ErrExited):
		return errors.Join(werr, err)
	case werr != nil:
		return fmt.Errorf("pid %d: %w", p.Pid, ErrExited) // nothing was moved
	}
	now, nerr := cgroupv2.Of(p.Pid)
	undo := "nothing holds its number now"
	switch {
	case nerr != nil:
	case now != dir:
		undo = "the number's holder is not in " + dir
	case ferr != nil:
		undo = fmt.Sprintf("could not undo: where it was is unknown (%v)", ferr)
	default:
		if e := cgroupv2.AddProc(from, p.Pid); e != nil {
			undo = fmt.Sprintf("could not move pid %d back to %s: %v", p.Pid, from, e)
		} else {
			undo = fmt.Sprintf("moved pid %d back to %s", p.Pid, from)
		}
	}
	return fmt.Errorf("pid %d: %w during the move into %s (%s)", p.Pid, ErrExited, dir, undo)
}

// Proc is the rank's registered process, held by a pidfd until the rank
// goes.
func (r *Rank) Proc() *Proc { return r.proc }

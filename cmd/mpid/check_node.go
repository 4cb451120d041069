package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"github.com/mpipause/mpipause/internal/caps"
	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/mountinfo"
	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/internal/peercred"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
	"golang.org/x/sys/unix"
)

// kernelNode is nodeFacts from the running kernel and file system.
type kernelNode struct{}

var _ nodeFacts = kernelNode{}

func (kernelNode) Release() (string, error) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "", err
	}
	return unix.ByteSliceToString(u.Release[:]), nil
}

func (kernelNode) Stat(path string) (fileStat, error) {
	var st unix.Stat_t
	err := unix.Lstat(path, &st)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return fileStat{}, nil
	}
	if err != nil {
		return fileStat{}, err
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return fileStat{}, err
	}
	return fileStat{Exists: true, Mode: fi.Mode(), UID: st.Uid}, nil
}

func (kernelNode) ReadFile(path string) ([]byte, error) { return os.ReadFile(path) }

func (kernelNode) Glob(pattern string) ([]string, error) { return filepath.Glob(pattern) }

func (kernelNode) SubDirs(dir string) ([]string, error) {
	es, err := os.ReadDir(dir)
	var out []string
	for _, e := range es {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out, err
}

func (kernelNode) Writable(path string) error { return unix.Access(path, unix.W_OK) }

func (kernelNode) MissingCaps(want ...caps.Cap) ([]string, error) { return caps.Missing(want...) }

func (kernelNode) Rlimit(resource int) (unix.Rlimit, error) {
	var l unix.Rlimit
	err := unix.Getrlimit(resource, &l)
	return l, err
}

func (kernelNode) RaiseMemlock() (before, after unix.Rlimit, err error) {
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &before); err != nil {
		return before, before, err
	}
	err = rlimit.RemoveMemlock()
	if gerr := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &after); gerr != nil && err == nil {
		err = gerr
	}
	return before, after, err
}

func (kernelNode) Probe() (loader.Features, error) { return loader.Probe() }

func (kernelNode) BPFFS() (string, error) { return loader.BPFFS() }

func (kernelNode) Mounts() ([]mountinfo.Mount, error) { return mountinfo.Read(mountinfo.Self) }

func (kernelNode) SelfCgroup() (string, error) { return cgroupv2.Of(os.Getpid()) }

func (kernelNode) LoadKeys(path string) (int, error) {
	r, err := quiesce.LoadKeys(path)
	if err != nil {
		return 0, err
	}
	return len(r.All()), nil
}

func (kernelNode) ListenTCP(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return l.Close()
}

// PortHolder finds the listening socket of port in /proc/net/tcp and tcp6,
// then the process that has it open.
func (kernelNode) PortHolder(port int) (int, string, error) {
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
			if len(fs) < 10 || fs[3] != "0A" {
				continue
			}
			_, hexPort, ok := strings.Cut(fs[1], ":")
			if p, err := strconv.ParseUint(hexPort, 16, 16); ok && err == nil && int(p) == port {
				inodes["socket:["+fs[9]+"]"] = true
			}
		}
	}
	if len(inodes) == 0 {
		return 0, "", errors.New("no listening socket found")
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return 0, "", err
	}
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(filepath.Join("/proc", p.Name(), "fd"))
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join("/proc", p.Name(), "fd", fd.Name())); err == nil && inodes[l] {
				return pid, comm(pid), nil
			}
		}
	}
	return 0, "", errors.New("no process found with the listening socket")
}

func comm(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

func (kernelNode) DialUnix(addr string) (bool, int, string, error) {
	c, err := net.DialTimeout("unix", addr, time.Second)
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return false, 0, "", nil
	}
	if err != nil {
		return false, 0, "", err
	}
	defer c.Close()
	cred, err := peercred.Of(c.(*net.UnixConn))
	if err != nil {
		return true, 0, "?", nil
	}
	return true, int(cred.Pid), comm(int(cred.Pid)), nil
}

func (kernelNode) SocketDir(dir string) error { return mpid.CheckSocketDir(dir) }

func (kernelNode) Executable() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(exe)
}

// preloadProgram is what the shim is preloaded into: it runs nothing of
// its own, and the shim's constructor does nothing outside a rank.
const preloadProgram = "/bin/true"

func (kernelNode) Preload(lib string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, preloadProgram)
	cmd.Env = []string{"LD_PRELOAD=" + lib}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	// ld.so says why it did not preload the library, and goes on.
	if line, _, _ := strings.Cut(strings.TrimSpace(stderr.String()), "\n"); line != "" {
		return errors.New(line)
	}
	if err != nil {
		return fmt.Errorf("%s with it preloaded: %w", preloadProgram, err)
	}
	return nil
}

func (kernelNode) LookPath(file string) (string, error) { return exec.LookPath(file) }

func (kernelNode) Hostname() (string, error) { return os.Hostname() }

func (kernelNode) LookupHost(name string) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return net.DefaultResolver.LookupHost(ctx, name)
}

func (kernelNode) LocalAddrs() ([]net.IP, error) {
	as, err := net.InterfaceAddrs()
	var ips []net.IP
	for _, a := range as {
		if n, ok := a.(*net.IPNet); ok {
			ips = append(ips, n.IP)
		}
	}
	return ips, err
}

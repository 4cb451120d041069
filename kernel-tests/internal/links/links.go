package links

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NetnsDir is where named network namespaces are bound, as iproute2's
// `ip netns add` does (ip-netns(8)), so that `ip netns exec` finds ours.
const NetnsDir = "/run/netns"

// ErrNoNetnsName says a named network namespace does not exist.
var ErrNoNetnsName = errors.New("no such named network namespace")

// NetnsPath returns the file a named network namespace is bound to.
func NetnsPath(name string) string { return filepath.Join(NetnsDir, name) }

// NetnsExists reports whether name is a bound network namespace (a file in
// NetnsDir on which an nsfs is mounted, not a leftover empty file).
func NetnsExists(name string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(NetnsPath(name), &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC
}

// ListNetns returns the names of the bound network namespaces, sorted.
func ListNetns() ([]string, error) {
	ents, err := os.ReadDir(NetnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", NetnsDir, err)
	}
	var names []string
	for _, e := range ents {
		if NetnsExists(e.Name()) {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names, nil
}

// AddNetns creates a network namespace and binds it to NetnsDir/name, the
// way `ip netns add` does. A namespace of that name that already exists is
// left alone and is not an error.
func AddNetns(name string) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return fmt.Errorf("add netns %q: invalid name", name)
	}
	if NetnsExists(name) {
		return nil
	}
	if err := os.MkdirAll(NetnsDir, 0o755); err != nil {
		return fmt.Errorf("add netns %s: %w", name, err)
	}
	if err := shareNetnsDir(); err != nil {
		return fmt.Errorf("add netns %s: %w", name, err)
	}
	path := NetnsPath(name)
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE, 0o444)
	if err != nil {
		return fmt.Errorf("add netns %s: %w", name, err)
	}
	f.Close()

	// unshare(CLONE_NEWNET) moves only the calling thread: do it on a locked
	// thread, bind that thread's namespace, and come back. If coming back
	// fails the thread stays locked, so the runtime kills it instead of
	// reusing a thread in the wrong namespace.
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("add netns %s: current netns: %w", name, err)
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("add netns %s: unshare: %w", name, err)
			return
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		bindErr := unix.Mount(self, path, "", unix.MS_BIND, "")
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(bindErr, fmt.Errorf("add netns %s: return to original netns: %w", name, err))
			return
		}
		runtime.UnlockOSThread()
		if bindErr != nil {
			bindErr = fmt.Errorf("add netns %s: bind %s: %w", name, path, bindErr)
		}
		errc <- bindErr
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// shareNetnsDir makes NetnsDir a shared mount point, binding it onto
// itself first if it is not a mount point, exactly as `ip netns add` does.
// Otherwise the first `ip netns add` after ours binds NetnsDir onto itself
// and our namespace files, underneath, can no longer be opened or removed
// by name (seen here: a rig that `down` could not remove).
func shareNetnsDir() error {
	for bound := false; ; bound = true {
		err := unix.Mount("", NetnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) || bound {
			return fmt.Errorf("make %s a shared mount: %w", NetnsDir, err)
		}
		if err := unix.Mount(NetnsDir, NetnsDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s onto itself: %w", NetnsDir, err)
		}
	}
}

// DelNetns unbinds and removes a named network namespace, as `ip netns del`
// does. The namespace itself lives on while a process is still in it.
// Deleting a namespace that does not exist is not an error.
func DelNetns(name string) error {
	path := NetnsPath(name)
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete netns %s: unmount: %w", name, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("delete netns %s: %w", name, err)
	}
	return nil
}

// NetnsInode returns the inode number of a named network namespace, which
// is what /proc/PID/ns/net links to ("net:[INODE]").
func NetnsInode(name string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(NetnsPath(name), &st); err != nil {
		return 0, fmt.Errorf("stat netns %s: %w", name, err)
	}
	return st.Ino, nil
}

// Netns is a netlink connection into one named network namespace.
type Netns struct {
	name string
	ns   netns.NsHandle
	h    *netlink.Handle
}

// OpenNetns opens a netlink connection into the named network namespace;
// "" means the caller's own.
func OpenNetns(name string) (*Netns, error) {
	var ns netns.NsHandle
	var err error
	if name == "" {
		ns, err = netns.Get()
	} else {
		if !NetnsExists(name) {
			return nil, fmt.Errorf("open netns %s: %w", name, ErrNoNetnsName)
		}
		ns, err = netns.GetFromName(name)
	}
	if err != nil {
		return nil, fmt.Errorf("open netns %q: %w", name, err)
	}
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		ns.Close()
		return nil, fmt.Errorf("netlink in netns %q: %w", name, err)
	}
	return &Netns{name: name, ns: ns, h: h}, nil
}

// Close releases the connection and the namespace handle.
func (n *Netns) Close() error {
	n.h.Close()
	return n.ns.Close()
}

// Name returns the namespace's name ("" for the caller's own).
func (n *Netns) Name() string { return n.name }

// Link is what the rig needs to know of a network interface.
type Link struct {
	Name   string
	Index  int
	Type   string // "veth", "bridge", "device" (loopback), ...
	Up     bool   // administratively up (IFF_UP)
	Master int    // ifindex of the bridge it is enslaved to, 0 if none
	Addrs  []netip.Prefix
}

// Links lists the namespace's interfaces with their IPv4 and IPv6
// addresses, sorted by index.
func (n *Netns) Links() ([]Link, error) {
	ls, err := n.h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links in netns %q: %w", n.name, err)
	}
	out := make([]Link, 0, len(ls))
	for _, l := range ls {
		a := l.Attrs()
		lk := Link{Name: a.Name, Index: a.Index, Type: l.Type(), Up: a.Flags&unix.IFF_UP != 0, Master: a.MasterIndex}
		addrs, err := n.h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("list addresses of %s in netns %q: %w", a.Name, n.name, err)
		}
		for _, ad := range addrs {
			ip, ok := netip.AddrFromSlice(ad.IP)
			if !ok {
				continue
			}
			ones, _ := ad.Mask.Size()
			lk.Addrs = append(lk.Addrs, netip.PrefixFrom(ip.Unmap(), ones))
		}
		out = append(out, lk)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

// HasLink reports whether an interface of that name exists in the namespace.
func (n *Netns) HasLink(name string) bool {
	_, err := n.h.LinkByName(name)
	return err == nil
}

// AddBridge creates a bridge and sets it up; an existing bridge of that name
// is kept.
func (n *Netns) AddBridge(name string) error {
	if l, err := n.h.LinkByName(name); err == nil {
		if l.Type() != "bridge" {
			return fmt.Errorf("add bridge %s in netns %q: a %s of that name exists", name, n.name, l.Type())
		}
		return n.SetUp(name)
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
	if err := n.h.LinkAdd(br); err != nil {
		return fmt.Errorf("add bridge %s in netns %q: %w", name, n.name, err)
	}
	return n.SetUp(name)
}

// AddVeth creates a veth pair: name in this namespace, enslaved to the
// bridge master (if not ""), and peer named peerName created directly in the
// namespace peerNS, so that no interface ever appears anywhere else. Both
// ends are set up. An existing pair is kept.
func (n *Netns) AddVeth(name, master string, peerNS *Netns, peerName string) error {
	if n.HasLink(name) && peerNS.HasLink(peerName) {
		return n.SetUp(name)
	}
	if n.HasLink(name) { // half a pair from an interrupted run
		if err := n.DelLink(name); err != nil {
			return err
		}
	}
	attrs := netlink.LinkAttrs{Name: name}
	if master != "" {
		br, err := n.h.LinkByName(master)
		if err != nil {
			return fmt.Errorf("add veth %s: bridge %s in netns %q: %w", name, master, n.name, err)
		}
		attrs.MasterIndex = br.Attrs().Index
	}
	v := &netlink.Veth{LinkAttrs: attrs, PeerName: peerName, PeerNamespace: netlink.NsFd(peerNS.ns)}
	if err := n.h.LinkAdd(v); err != nil {
		return fmt.Errorf("add veth %s (peer %s in netns %q) in netns %q: %w", name, peerName, peerNS.name, n.name, err)
	}
	if err := n.SetUp(name); err != nil {
		return err
	}
	return peerNS.SetUp(peerName)
}

// DelLink deletes an interface; a missing one is not an error.
func (n *Netns) DelLink(name string) error {
	l, err := n.h.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("delete %s in netns %q: %w", name, n.name, err)
	}
	if err := n.h.LinkDel(l); err != nil {
		return fmt.Errorf("delete %s in netns %q: %w", name, n.name, err)
	}
	return nil
}

// SetUp sets an interface administratively up.
func (n *Netns) SetUp(name string) error {
	l, err := n.h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("set %s up in netns %q: %w", name, n.name, err)
	}
	if err := n.h.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up in netns %q: %w", name, n.name, err)
	}
	return nil
}

// AddAddr puts the address p (with its prefix length) on the interface;
// an address already there is not an error.
func (n *Netns) AddAddr(name string, p netip.Prefix) error {
	l, err := n.h.LinkByName(name)
	if err != nil {
		return fmt.Errorf("add %s to %s in netns %q: %w", p, name, n.name, err)
	}
	a := &netlink.Addr{IPNet: prefixToIPNet(p)}
	if err := n.h.AddrReplace(l, a); err != nil {
		return fmt.Errorf("add %s to %s in netns %q: %w", p, name, n.name, err)
	}
	return nil
}

// WriteSysctl writes value to /proc/sys/KEY (KEY with dots or slashes) as
// seen from inside the namespace: the net.* sysctls are per namespace and
// /proc/sys resolves them for the network namespace of the calling thread.
func (n *Netns) WriteSysctl(key, value string) error {
	path := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
	return n.do(func() error {
		if err := os.WriteFile(path, []byte(value), 0); err != nil {
			return fmt.Errorf("sysctl %s=%s in netns %q: %w", key, value, n.name, err)
		}
		return nil
	})
}

// do runs fn on an OS thread that is inside the namespace.
func (n *Netns) do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(n.ns); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns %q: %w", n.name, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leave netns %q: %w", n.name, err))
			return // thread stays locked: the runtime discards it
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

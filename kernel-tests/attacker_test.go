package kerneltests

// The stand-in attacker of the security tier (security_test.go): the test
// binary itself, run in a rig node as an unprivileged user with
// MPIPAUSE_KT_ATTACK naming what to do. It speaks the rank and control
// channels the way any local process can, without the shim and without
// anything a launcher hands its ranks (no job key), so it shows what mpid
// accepts from a stranger. It talks on every rank-channel address the node
// may serve (MPIPAUSE_KT_ATTACK_SOCK, a comma list; default the fixed
// design's path and the abstract name of today's mpid): whichever mpid
// listens on gets the attack.

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mpipause/mpipause/internal/ctl"
	"golang.org/x/sys/unix"
)

// attackEnv selects the stand-in's mode; TestMain runs attackMain instead
// of the tests when it is set.
const attackEnv = "MPIPAUSE_KT_ATTACK"

// Where a node's mpid may serve ranks and the CLI: the root-owned paths of
// the fixed design, then the abstract names any user can also bind.
var (
	rankAddrs = []string{"/run/mpipause/rank.sock", "@mpipause-mpid"}
	ctlAddrs  = []string{"/run/mpipause/ctl.sock", "@mpipause-ctl"}
)

// forgedMarker is in every answer the squatter (M3) forges, so that a test
// can tell it from mpid's.
const forgedMarker = "FORGED-BY-SQUATTER"

func attackRankAddrs() []string {
	if s := os.Getenv("MPIPAUSE_KT_ATTACK_SOCK"); s != "" {
		return strings.Split(s, ",")
	}
	return rankAddrs
}

// attackMain runs one mode and returns the exit status. Progress goes to
// stdout as lines the test waits for; stdin closing (or a "quit" line)
// ends the modes that hold their connections.
func attackMain(mode string, args []string) int {
	var err error
	switch mode {
	case "rank":
		err = attackRank(args)
	case "connect":
		err = attackConnectChild(args)
	case "reuse":
		err = attackReuse(args)
	case "endless":
		err = attackEndless(args)
	case "flood":
		err = attackFlood(args)
	case "squat":
		err = attackSquat(args)
	case "peerflood":
		err = attackPeerFlood(args)
	case "peerspam":
		err = attackPeerSpam(args)
	case "handshakes":
		err = attackHandshakes(args) // security_sched_test.go
	case "costs":
		err = attackCosts(args) // security_costs_test.go
	case "connflood":
		err = attackConnFlood(args) // security_exhaust_test.go
	case "scrapes":
		err = attackScrapes(args) // security_flood_test.go
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "attacker %s: %v\n", mode, err)
		return 1
	}
	return 0
}

// say prints one progress line for the test.
func say(format string, a ...any) { fmt.Printf(format+"\n", a...) }

// dialRanks connects to every rank-channel address that accepts.
func dialRanks() []*net.UnixConn {
	var out []*net.UnixConn
	for _, a := range attackRankAddrs() {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: a, Net: "unix"})
		if err != nil {
			say("dial %s: %v", a, err)
			continue
		}
		say("connected %s", a)
		out = append(out, c)
	}
	return out
}

// join sends "JOIN 1 job=ID pid=PID" on a connection of its own to every
// address and returns the answers.
func join(job string, pid int) []string {
	var out []string
	for _, c := range dialRanks() {
		fmt.Fprintf(c, "JOIN 1 job=%s pid=%d\n", job, pid)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		c.Close()
		if err != nil {
			line = "no answer: " + err.Error()
		}
		out = append(out, strings.TrimSpace(line))
	}
	return out
}

// kv reads "k=v" arguments.
func kv(args []string) map[string]string {
	m := map[string]string{}
	for _, a := range args {
		k, v, _ := strings.Cut(a, "=")
		m[k] = v
	}
	return m
}

// attackRank registers a crafted rank: args job=, rank=, size=, host=,
// root=, hosts= (as the HELLO fields), join=1 to JOIN the job first,
// thread=NAME to name a thread so before the HELLO. It then answers mpid's
// gate requests as a shim would (so a pause it is part of can commit) and
// writes every stdin line to mpid as it is (e.g. "EVENT pause").
func attackRank(args []string) error {
	m := kv(args)
	pid := os.Getpid()
	if m["join"] == "1" {
		for _, a := range join(m["job"], pid) {
			say("join: %s", a)
		}
	}
	if name := m["thread"]; name != "" {
		tid := make(chan int)
		go func() {
			runtime.LockOSThread() // never unlocked: the thread keeps its name
			b, _ := unix.BytePtrFromString(name)
			unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(b)), 0, 0, 0)
			tid <- unix.Gettid()
			select {}
		}()
		say("thread %d", <-tid)
	}
	hello := fmt.Sprintf("HELLO 1 job=%s rank=%s size=%s pid=%d host=%s", m["job"], m["rank"], m["size"], pid, m["host"])
	if m["root"] != "" {
		hello += " root=" + m["root"]
	}
	if m["hosts"] != "" {
		hello += " hosts=" + m["hosts"]
	}
	conns := dialRanks()
	for _, c := range conns {
		if _, err := c.Write([]byte(hello + "\n")); err != nil {
			say("hello: %v", err)
		}
		go shimReplies(c)
	}
	say("hello sent")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "quit" {
			break
		}
		for _, c := range conns {
			c.Write([]byte(sc.Text() + "\n"))
		}
		say("wrote %s", sc.Text())
	}
	return nil
}

// shimReplies answers mpid's gate requests on c with a shim's replies, the
// gate empty.
func shimReplies(c *net.UnixConn) {
	br := bufio.NewReader(c)
	gate := "open"
	var mu sync.Mutex
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			say("mpid closed the connection: %v", err)
			return
		}
		verb, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		mu.Lock()
		var reply string
		switch verb {
		case "CLOSE":
			gate = "closed"
			reply = "CLOSED gate=closed gated=0 closing=0 held=0"
		case "STATE":
			reply = "STATE gate=" + gate + " gated=0 closing=0 held=0"
		case "OPEN":
			gate = "open"
			reply = "OPENED flushed=0 errors=0 errno=0"
		case "REOPEN":
			gate = "open"
			reply = "REOPENED"
		case "DRAIN":
			reply = "DRAINING sockets=0 stashed=0"
		}
		mu.Unlock()
		if reply != "" {
			c.Write([]byte(reply + "\n"))
		}
	}
}

// attackConnectChild is H1's child: connect the sockets it inherited (fd
// 3 on) to the rank-channel addresses, in order, and exit. The parent
// keeps them: the kernel's credentials of each connection stay this
// process's, whose pid is free again once it is reaped.
func attackConnectChild(args []string) error {
	for i, a := range args {
		sa := &unix.SockaddrUnix{Name: a}
		if strings.HasPrefix(a, "@") {
			sa.Name = "\x00" + a[1:]
		}
		if err := unix.Connect(3+i, sa); err != nil {
			fmt.Fprintf(os.Stderr, "connect %s: %v\n", a, err)
		}
	}
	return nil
}

// attackReuse is H1's parent: args job= (the attacker's job id). A child
// connects a socket per address and exits; "child PID" tells the test,
// which makes a victim's process reuse that pid and writes a line on
// stdin; then each socket sends "JOIN 1 job=JOB pid=PID", PID the child's.
func attackReuse(args []string) error {
	m := kv(args)
	addrs := attackRankAddrs()
	var files []*os.File
	for range addrs {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		files = append(files, os.NewFile(uintptr(fd), "rank"))
	}
	child := exec.Command("/proc/self/exe", addrs...)
	child.Env = append(os.Environ(), attackEnv+"=connect")
	child.ExtraFiles = files
	child.Stderr = os.Stderr
	if err := child.Run(); err != nil {
		return fmt.Errorf("child: %v", err)
	}
	pid := child.ProcessState.Pid()
	say("child %d", pid)
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return fmt.Errorf("waiting for the go: %v", err)
	}
	for i, f := range files {
		c, err := net.FileConn(f)
		if err != nil {
			say("join via %s: %v", addrs[i], err)
			continue
		}
		fmt.Fprintf(c, "JOIN 1 job=%s pid=%d\n", m["job"], pid)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			line = "no answer: " + err.Error()
		}
		say("join via %s: %s", addrs[i], strings.TrimSpace(line))
		c.Close()
	}
	return nil
}

// attackEndless sends one line that never ends, bytes= long (MiB), twice
// per address: as the first line of a connection, and after a HELLO of its
// own job job=. "sent N" tells the test how many bytes mpid took; the
// connections stay open until stdin closes.
func attackEndless(args []string) error {
	m := kv(args)
	mib, _ := strconv.Atoi(m["mib"])
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	send := func(c *net.UnixConn, prefix string) int64 {
		var n int64
		c.Write([]byte(prefix))
		for i := 0; i < mib; i++ {
			// mpid not reading for this long is a refusal too.
			c.SetWriteDeadline(time.Now().Add(20 * time.Second))
			k, err := c.Write(chunk)
			n += int64(k)
			if err != nil {
				break
			}
		}
		return n
	}
	var total int64
	var hold []*net.UnixConn
	for _, c := range dialRanks() {
		total += send(c, "")
		hold = append(hold, c)
	}
	hello := fmt.Sprintf("HELLO 1 job=%s rank=0 size=1 pid=%d host=%s\n", m["job"], os.Getpid(), m["host"])
	for _, c := range dialRanks() {
		total += send(c, hello)
		hold = append(hold, c)
	}
	say("sent %d", total)
	bufio.NewReader(os.Stdin).ReadString('\n')
	for _, c := range hold {
		c.Close()
	}
	return nil
}

// attackFlood floods the node's mpid, as M2 of docs/security.md does: JOINs of new
// job ids (each one a cgroup and a BPF observer in today's mpid) one after
// the other, up to joins=; hellos= connections that send half a HELLO and
// hold; and events= "EVENT pause" lines from a rank of its own job job=.
// "flooding" once all three are under way; it stops at a line on stdin.
func attackFlood(args []string) error {
	m := kv(args)
	joins, _ := strconv.Atoi(m["joins"])
	hellos, _ := strconv.Atoi(m["hellos"])
	events, _ := strconv.Atoi(m["events"])
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var held []*net.UnixConn
	for i := 0; i < hellos; i++ {
		for _, c := range dialRanks() {
			c.Write([]byte("HELLO 1 job=" + m["job"]))
			held = append(held, c)
		}
	}
	var sentJoins int
	wg.Go(func() {
		for i := 0; i < joins; i++ {
			select {
			case <-stop:
				return
			default:
			}
			join(fmt.Sprintf("%s-j%d", m["job"], i), os.Getpid())
			sentJoins++
		}
	})
	var sentEvents int
	wg.Go(func() {
		hello := fmt.Sprintf("HELLO 1 job=%s rank=0 size=1 pid=%d host=%s\n", m["job"], os.Getpid(), m["host"])
		for _, c := range dialRanks() {
			c.Write([]byte(hello))
			go shimReplies(c)
			for i := 0; i < events; i++ {
				c.SetWriteDeadline(time.Now().Add(5 * time.Second))
				if _, err := c.Write([]byte("EVENT pause\n")); err != nil {
					break
				}
				sentEvents++
			}
		}
	})
	say("flooding")
	bufio.NewReader(os.Stdin).ReadString('\n')
	close(stop)
	wg.Wait()
	for _, c := range held {
		c.Close()
	}
	say("flooded joins=%d events=%d", sentJoins, sentEvents)
	return nil
}

// attackSquat binds the rank and control endpoints while no mpid holds
// them (M3) and answers every control request with a forged "paused" job.
// "bound A,B" names what it got; it serves until stdin closes.
func attackSquat(args []string) error {
	var bound []string
	var lns []*net.UnixListener
	for _, a := range append(append([]string{}, rankAddrs...), ctlAddrs...) {
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: a, Net: "unix"})
		if err != nil {
			continue
		}
		bound = append(bound, a)
		lns = append(lns, ln)
	}
	for _, ln := range lns {
		go func() {
			for {
				c, err := ln.AcceptUnix()
				if err != nil {
					return
				}
				go func() {
					defer c.Close()
					c.SetReadDeadline(time.Now().Add(5 * time.Second))
					req, err := ctl.ReadRequest(bufio.NewReader(c))
					if err != nil {
						return
					}
					j := ctl.Job{ID: req.Job, State: ctl.StatePaused, Node: forgedMarker, Coordinator: forgedMarker, Nodes: []string{forgedMarker}}
					if req.Job == "" {
						ctl.Write(c, ctl.Reply{Jobs: []ctl.Job{j}, Final: true})
					} else {
						ctl.Write(c, ctl.Reply{Job: &j, Final: true})
					}
				}()
			}
		}()
	}
	say("bound %s", strings.Join(bound, ","))
	bufio.NewReader(os.Stdin).ReadString('\n')
	for _, ln := range lns {
		ln.Close()
	}
	return nil
}

// The peer port's attacks (H2 and L3) come from the network:
// the stand-in runs in another node, as a user without the cluster key.
// Its plain connections open with the hello of the hand-written
// handshake the peer port spoke before TLS (then in quiesce/tcp.go):
// there, a hello with a nonce is answered without any proof from the
// client, so the stand-in gets as far as a stranger can. To a TLS server
// the same bytes are a malformed record.

// withBody is a length prefix and its body in one buffer.
func withBody(prefix, body []byte) []byte { return append(prefix, body...) }

// helloFrame is that hello, length-prefixed: magic, version 2 and a
// fresh 32-byte nonce, as JSON.
func helloFrame() []byte {
	nonce := make([]byte, 32)
	rand.Read(nonce)
	body, _ := json.Marshal(map[string]any{"magic": "mpipause-quiesce", "version": 2, "nonce": nonce})
	return withBody(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body)
}

// garbageFrame is a length-prefixed frame of n random bytes: no MAC, no
// record a TLS peer could take.
func garbageFrame(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return withBody(binary.BigEndian.AppendUint32(nil, uint32(n)), b)
}

// attackPeerFlood is H2: args addr= (a node's peer port), then big=
// connections that each announce a frame of frame= MiB and send mib= MiB
// of it, silent= connections that send nothing, and hellos= connections
// that send a plain hello and then nothing. Each connection reads until
// mpid closes it or wait= seconds from its connect have passed. It says
// "group NAME dialled=D closed=C max_ms=M" per group (C: closed by mpid
// within wait; M: the longest a closed one stayed open), "sent N" (bytes
// of the big frames written) and "flooded".
func attackPeerFlood(args []string) error {
	m := kv(args)
	num := func(k string) int { v, _ := strconv.Atoi(m[k]); return v }
	wait := time.Duration(num("wait")) * time.Second
	type group struct {
		name            string
		dialled, closed atomic.Int64
		maxOpen         atomic.Int64 // ms
	}
	groups := []*group{{name: "big"}, {name: "silent"}, {name: "hellos"}}
	var sent atomic.Int64
	chunk := make([]byte, 1<<20)
	rand.Read(chunk)
	var wg sync.WaitGroup
	open := func(g *group, send func(c net.Conn, until time.Time)) {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", m["addr"], 5*time.Second)
			if err != nil {
				say("dial %s: %v", m["addr"], err)
				return
			}
			defer c.Close()
			g.dialled.Add(1)
			t0 := time.Now()
			until := t0.Add(wait)
			c.SetReadDeadline(until)
			gone := make(chan struct{})
			go func() {
				defer close(gone)
				// EOF (nil) or a reset: mpid closed it; the deadline: still open.
				_, err := io.Copy(io.Discard, c)
				if errors.Is(err, os.ErrDeadlineExceeded) {
					return
				}
				g.closed.Add(1)
				ms := time.Since(t0).Milliseconds()
				for {
					old := g.maxOpen.Load()
					if ms <= old || g.maxOpen.CompareAndSwap(old, ms) {
						break
					}
				}
			}()
			if send != nil {
				send(c, until)
			}
			<-gone
		})
	}
	for range num("big") {
		open(groups[0], func(c net.Conn, until time.Time) {
			c.SetWriteDeadline(until)
			if _, err := c.Write(binary.BigEndian.AppendUint32(nil, uint32(num("frame")<<20))); err != nil {
				return
			}
			for range num("mib") {
				k, err := c.Write(chunk)
				sent.Add(int64(k))
				if err != nil {
					return
				}
			}
		})
	}
	for range num("silent") {
		open(groups[1], nil)
	}
	for range num("hellos") {
		open(groups[2], func(c net.Conn, until time.Time) {
			c.SetWriteDeadline(until)
			c.Write(helloFrame())
		})
	}
	say("flooding")
	wg.Wait()
	for _, g := range groups {
		say("group %s dialled=%d closed=%d max_ms=%d", g.name, g.dialled.Load(), g.closed.Load(), g.maxOpen.Load())
	}
	say("sent %d", sent.Load())
	say("flooded")
	return nil
}

// attackPeerSpam is L3: args addr= (a node's peer port), n= connections,
// par= at a time. Even ones send a plain hello, wait for the answer and
// send a garbage frame; odd ones make a TLS handshake (no client
// certificate, the server's unchecked) and send garbage in it. Each then
// closes. It says "spammed n=N connected=C answered=A tls=T ms=M".
func attackPeerSpam(args []string) error {
	m := kv(args)
	n, _ := strconv.Atoi(m["n"])
	par, _ := strconv.Atoi(m["par"])
	var connected, answered, handshakes atomic.Int64
	next := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	for range max(par, 1) {
		wg.Go(func() {
			for i := range next {
				c, err := net.DialTimeout("tcp", m["addr"], 2*time.Second)
				if err != nil {
					continue
				}
				connected.Add(1)
				c.SetDeadline(time.Now().Add(2 * time.Second))
				if i%2 == 0 {
					if _, err := c.Write(helloFrame()); err == nil {
						var hdr [4]byte
						if _, err := io.ReadFull(c, hdr[:]); err == nil {
							answered.Add(1)
						}
						c.Write(garbageFrame(64))
					}
				} else {
					tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, ServerName: "node0", MinVersion: tls.VersionTLS12})
					if tc.Handshake() == nil {
						handshakes.Add(1)
						tc.Write(garbageFrame(64))
					} else {
						c.Write(garbageFrame(64))
					}
				}
				c.Close()
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	say("spammed n=%d connected=%d answered=%d tls=%d ms=%d", n, connected.Load(), answered.Load(), handshakes.Load(), time.Since(start).Milliseconds())
	return nil
}

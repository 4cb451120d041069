package kerneltests

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// N3: one user opens as many connections as it can to node0's control and
// rank sockets (a stand-in per socket, each with its own descriptor limit)
// and holds them. Judged on the victim: mpid is the same process, the
// victim's status and a pause and resume of its job work while the flood
// is held.
func secN3(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const conns = 20000
	v := e.startUserJob(ctx, t, victimUID, "node0", name("n3v"))
	a := e.startUserJob(ctx, t, attackerUID, "node0", name("n3a"))
	pid := statusOf(t, jobRig).Nodes[0].MPIDPid
	alive := func() bool {
		n := statusOf(t, jobRig).Nodes[0]
		return n.MPIDAlive && n.MPIDPid == pid
	}
	t.Cleanup(func() {
		// An mpid the flood ended is started again for the rows after.
		if !alive() {
			if _, err := startRigMPIDs(t); err != nil {
				t.Errorf("restarting node0's mpid: %v", err)
			}
		}
	})
	rss0, lines0 := statusKB(pid, "VmRSS"), logLines(t, 0)
	var held []string
	var floods []*standIn
	for _, sock := range []string{"ctl", "rank"} {
		s := e.attacker(ctx, t, "node0", "connflood", "sock="+sock, fmt.Sprintf("n=%d", conns))
		held = append(held, strings.TrimPrefix(s.wait(t, "holding ", 3*time.Minute), "holding "))
		floods = append(floods, s)
	}
	rss1 := statusKB(pid, "VmRSS")
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	up := alive()
	st := e.userCLI(ctx, t, victimUID, "node0", "status", v.id)
	paused, how := e.pauseResume(ctx, t, victimUID, "node0", v)
	up = up && alive()
	lines := logLines(t, 0) - lines0
	t.Logf("mpid's log during the flood:\n%s", lastLines(t, 0, lines))
	row.refused = up && st.code == 0 && paused && lines < 100
	row.outcome = fmt.Sprintf("attacker held %s; mpid pid %d alive: %v, RSS %d -> %d MiB, %d descriptors open, %d log lines; victim's status exit %d; %s",
		strings.Join(held, "; "), pid, up, rss0/1024, rss1/1024, len(fds), lines, st.code, how)
	if !up {
		row.outcome += "; mpid's last words: " + oneLineOf(lastLines(t, 0, 2))
	}
	// Control: the attacker's own connections are served once its flood
	// ends (during it, its own requests are past its bound too).
	for _, s := range floods {
		s.stop()
	}
	row.controlOK, row.control = e.pauseResume(ctx, t, attackerUID, "node0", a)
}

// lastLines is node k's mpid log's last n lines.
func lastLines(t *testing.T, k, n int) string {
	b, err := os.ReadFile(mpidLog(k))
	if err != nil {
		return err.Error()
	}
	l := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(l[max(len(l)-n, 0):], "\n")
}

// attackConnFlood opens n= connections to the node's sock= socket ("ctl"
// or "rank": the first of its addresses that accepts) as fast as the
// kernel takes them, sending nothing, and holds them until stdin closes.
// It stops early at its own descriptor limit (raised to the hard limit
// first) or when the socket refuses (its server gone). "holding ..." says
// how many it holds and why it stopped.
func attackConnFlood(args []string) error {
	m := kv(args)
	n, _ := strconv.Atoi(m["n"])
	addrs := ctlAddrs
	if m["sock"] == "rank" {
		addrs = attackRankAddrs()
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil {
		lim.Cur = lim.Max
		unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	}
	var addr *net.UnixAddr
	var conns []*net.UnixConn
	var stop error
	for _, a := range addrs {
		ua := &net.UnixAddr{Name: a, Net: "unix"}
		c, err := net.DialUnix("unix", nil, ua)
		if err == nil {
			addr, conns = ua, append(conns, c)
			break
		}
		stop = err
	}
	if addr == nil {
		// Its server is gone (the other flood ended it): that is the
		// test's finding, not the stand-in's failure.
		addr = &net.UnixAddr{Name: strings.Join(addrs, " or ")}
	} else {
		stop = nil
	}
	start := time.Now()
	deadline := start.Add(2 * time.Minute)
	busy := 0
	for len(conns) < n && stop == nil && addr.Net != "" {
		c, err := net.DialUnix("unix", nil, addr)
		switch {
		case err == nil:
			conns = append(conns, c)
		case errors.Is(err, syscall.EAGAIN) && time.Now().Before(deadline):
			// The listen backlog is full: the server has not caught up.
			busy++
			time.Sleep(time.Millisecond)
		default:
			stop = err
		}
	}
	why := "all connected"
	if stop != nil {
		why = "stopped: " + stop.Error()
	}
	say("holding %d connections to %s after %v (limit %d; %d backlog-full retries; %s)",
		len(conns), addr.Name, time.Since(start).Round(time.Millisecond), lim.Cur, busy, why)
	bufio.NewReader(os.Stdin).ReadString('\n')
	return nil
}

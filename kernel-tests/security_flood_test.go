package kerneltests

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/metrics"
)

// secondAttackerUID is the second user of the ALL row.
const secondAttackerUID = 1003

// ALL: every endpoint of node0's mpid flooded at once, by two local users
// (idle connections held to the control and rank sockets; JOINs, half
// HELLOs and EVENT lines; metrics scrapes in a loop) and a stranger on
// node1 (TLS handshakes to the peer port), while the victim pauses and
// resumes its job 20 times. Refused: every pause committed (the CLI's exit
// 0, the job frozen) and every resume ran it again, mpid is the same
// process throughout, its RSS stays under the unit's GOMEMLIMIT (512 MiB),
// and its log has at most one warning per cause per 10 s (plus one).
func secAll(ctx context.Context, t *testing.T, e *secEnv, row *secRow) {
	const rounds = 20
	v := e.startUserJob(ctx, t, victimUID, "node0", name("allv"))
	row.controlOK, row.control = e.pauseResume(ctx, t, victimUID, "node0", v)
	if !row.controlOK {
		return
	}
	row.control = "the victim's pause and resume before the flood: " + row.control
	pid := statusOf(t, jobRig).Nodes[0].MPIDPid
	log := mpidLog(0)
	off := fileSize(log)
	start := time.Now()
	var floods []*standIn
	flood := func(s *standIn, ready string) {
		s.wait(t, ready, 3*time.Minute)
		floods = append(floods, s)
	}
	for _, uid := range []int{attackerUID, secondAttackerUID} {
		flood(e.attackerAs(ctx, t, uid, "node0", "connflood", "sock=ctl", "n=3000"), "holding ")
		flood(e.attackerAs(ctx, t, uid, "node0", "connflood", "sock=rank", "n=3000"), "holding ")
		flood(e.attackerAs(ctx, t, uid, "node0", "flood", fmt.Sprintf("job=%s-%d", name("allf"), uid), "host=node0",
			"joins=300", "hellos=100", "events=20000"), "flooding")
	}
	flood(e.attackerAs(ctx, t, attackerUID, "node0", "scrapes", "addr="+rigMetricsAddr, "secs=600", "par=4"), "scraping")
	flood(e.attackerAs(ctx, t, secondAttackerUID, "node1", "handshakes", node0Peer, "secs=600", "par=4"), "handshaking")
	defer func() {
		for _, s := range floods {
			s.stop()
		}
	}()
	var failed []string
	var took []time.Duration
	rss := statusKB(pid, "VmRSS")
	for i := range rounds {
		t0 := time.Now()
		r := e.userCLI(ctx, t, victimUID, "node0", "pause", v.id)
		d, fr := time.Since(t0), v.frozen()
		rr := e.userCLI(ctx, t, victimUID, "node0", "resume", v.id)
		if r.code != 0 || !fr || rr.code != 0 || v.frozen() {
			failed = append(failed, fmt.Sprintf("round %d: pause exit %d frozen %v, resume exit %d (%s)", i, r.code, fr, rr.code, oneLineOf(r.stderr+rr.stderr)))
		}
		took = append(took, d)
		rss = max(rss, statusKB(pid, "VmRSS"))
	}
	n := statusOf(t, jobRig).Nodes[0]
	alive := n.MPIDAlive && n.MPIDPid == pid
	for _, s := range floods {
		s.stop()
	}
	floods = nil
	elapsed := time.Since(start)
	warns, samples := warnCauses(t, log, off)
	allowed := int(elapsed/(10*time.Second)) + 2
	var loud []string
	for cause, k := range warns {
		if k > allowed {
			loud = append(loud, fmt.Sprintf("%q %d times, e.g. %s", cause, k, strings.Join(samples[cause], " | ")))
		}
	}
	sort.Strings(loud)
	sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
	row.refused = len(failed) == 0 && alive && rss < 512*1024 && len(loud) == 0
	row.outcome = fmt.Sprintf("%d of %d pauses committed and resumed (p50 %v, max %v); mpid pid %d alive: %v; RSS at most %d MiB; %d causes of warnings in %v, the most repeated %s",
		rounds-len(failed), rounds, took[len(took)/2].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond),
		pid, alive, rss/1024, len(warns), elapsed.Round(time.Second), mostRepeated(warns))
	if len(failed) > 0 {
		row.outcome += "; FAILED " + strings.Join(failed, "; ")
	}
	if len(loud) > 0 {
		row.outcome += fmt.Sprintf("; more than %d lines: %s", allowed, strings.Join(loud, ", "))
	}
}

// warnCause is a log line's level and message; errorAttr its error, which
// for refusals says the cause. mpid's log limiter counts by the message's
// error with its numbers and quoted text masked: so does the test.
var (
	warnCause  = regexp.MustCompile(`level=(WARN|ERROR) msg="((?:[^"\\]|\\.)*)"`)
	errorAttr  = regexp.MustCompile(` error="((?:[^"\\]|\\.)*)"`)
	quotedText = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'[^']*'`)
	numbers    = regexp.MustCompile(`[0-9]+`)
)

// lineCause is the cause a warning line counts under: level, message and
// its error, numbers and quoted text masked.
func lineCause(line string) (string, bool) {
	m := warnCause.FindStringSubmatch(line)
	if m == nil {
		return "", false
	}
	cause := m[1] + " " + m[2]
	if e := errorAttr.FindStringSubmatch(line); e != nil {
		msg := strings.ReplaceAll(e[1], `\"`, `"`)
		cause += ": " + numbers.ReplaceAllString(quotedText.ReplaceAllString(msg, `"…"`), "#")
	}
	return cause, true
}

// warnCauses counts the warning and error lines of path written after off,
// by cause (lineCause), with the first three lines of each.
func warnCauses(t *testing.T, path string, off int64) (map[string]int, map[string][]string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	out, samples := map[string]int{}, map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if c, ok := lineCause(sc.Text()); ok {
			out[c]++
			if len(samples[c]) < 3 {
				samples[c] = append(samples[c], sc.Text())
			}
		}
	}
	return out, samples
}

// mostRepeated names the cause counted most often, with its count.
func mostRepeated(causes map[string]int) string {
	best, k := "(none)", 0
	for c, n := range causes {
		if n > k || (n == k && c < best) {
			best, k = c, n
		}
	}
	return fmt.Sprintf("%q (%d)", best, k)
}

// attackScrapes scrapes the metrics at addr= (inside the stand-in's node)
// with par= workers in a loop for secs= seconds or until stdin closes:
// "scraping" once the first answer is in, "scraped ok=N refused=M" at the
// end (refused: 429, mpid's scrape rate).
func attackScrapes(args []string) error {
	m := kv(args)
	var secs, par int
	fmt.Sscan(m["secs"], &secs)
	fmt.Sscan(m["par"], &par)
	stop := stopAfter(time.Duration(secs) * time.Second)
	var ok, refused atomic.Int64
	var once sync.Once
	var wg sync.WaitGroup
	c := &http.Client{Timeout: 5 * time.Second}
	for range max(par, 1) {
		wg.Go(func() {
			for !stop() {
				resp, err := c.Get("http://" + m["addr"] + metrics.Path)
				if err != nil {
					refused.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					ok.Add(1)
				} else {
					refused.Add(1)
				}
				once.Do(func() { say("scraping") })
			}
		})
	}
	wg.Wait()
	say("scraped ok=%d refused=%d", ok.Load(), refused.Load())
	return nil
}

// stopAfter reports true once d has passed or stdin has closed (or said
// anything): the stand-ins that run in loops stop as the test tells them.
func stopAfter(d time.Duration) func() bool {
	var done atomic.Bool
	go func() {
		bufio.NewReader(os.Stdin).ReadString('\n')
		done.Store(true)
	}()
	end := time.Now().Add(d)
	return func() bool { return done.Load() || time.Now().After(end) }
}

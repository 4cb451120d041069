package ranks

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/jobid"
)

// The rank channel's lines: their versions and bounds, and the parsers of
// what a shim sends (JOIN, HELLO, its answers and its unasked EVENT lines).
// Each parser takes one line and refuses anything else with a reason.

// isJoin: the first line is a JOIN (well formed or not), not a HELLO.
func isJoin(line string) bool {
	verb, _, _ := strings.Cut(line, " ")
	return verb == "JOIN"
}

// oneLine makes s fit an ERR line: printable ASCII, at most 200 bytes,
// never empty.
func oneLine(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c < ' ' || c > '~' {
			b[i] = ' '
		}
	}
	s = strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200]
	}
	if s == "" {
		s = "refused"
	}
	return s
}

// JoinVersion and HelloVersion are the line formats mpid speaks; a shim of
// another release is refused with a reason that says so.
const (
	JoinVersion  = "2"
	HelloVersion = "2"
)

// MaxKey bounds a job key: a node name (253) and ':' and 64 hex digits.
const MaxKey = 320

// validKey: what a key= field may hold (checked for real by mpid, with the
// cluster key): printable ASCII without spaces or '='.
func validKey(v string) bool {
	if len(v) == 0 || len(v) > MaxKey {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= ' ' || c > '~' || c == '=' {
			return false
		}
	}
	return true
}

// ParseJoin parses "JOIN 2 job=<id> pid=<pid> key=<job key>" (one trailing
// newline allowed): exactly these fields, each once, single spaces. A job
// id is 1 to jobid.MaxLen printable ASCII characters other than '=' (so no
// spaces and no control characters); pid is a positive decimal without
// sign or leading zeros; the key is what the launcher gave the rank.
func ParseJoin(line string) (job string, pid int, key string, err error) {
	f := strings.Split(strings.TrimSuffix(line, "\n"), " ")
	if len(f) < 2 || f[0] != "JOIN" {
		return "", 0, "", fmt.Errorf("not a JOIN: %q", line)
	}
	if f[1] != JoinVersion {
		return "", 0, "", fmt.Errorf("JOIN version %q, this mpid speaks %s: the rank's shim is of another mpipause release; relaunch the job with this one", f[1], JoinVersion)
	}
	if len(f) != 5 {
		return "", 0, "", fmt.Errorf("JOIN wants job=, pid= and key=, got %q (launch the job with `mpipause run`, which gives its ranks their job key)", line)
	}
	var haveJob, havePid, haveKey bool
	for _, kv := range f[2:] {
		k, v, _ := strings.Cut(kv, "=")
		switch {
		case k == "job" && !haveJob:
			if !jobid.Valid(v) {
				return "", 0, "", fmt.Errorf("JOIN job id %q: %s", v, jobid.Rule)
			}
			job, haveJob = v, true
		case k == "pid" && !havePid:
			n, perr := strconv.ParseInt(v, 10, 32)
			if perr != nil || n <= 0 || v[0] == '0' || v[0] == '+' {
				return "", 0, "", fmt.Errorf("JOIN pid %q", v)
			}
			pid, havePid = int(n), true
		case k == "key" && !haveKey:
			if !validKey(v) {
				return "", 0, "", errors.New("JOIN key malformed")
			}
			key, haveKey = v, true
		default:
			return "", 0, "", fmt.Errorf("JOIN field %q", kv)
		}
	}
	return job, pid, key, nil
}

// ParseHello parses "HELLO 2 job=... rank=... size=... pid=... host=...
// key=... [root=h] [hosts=a,b]".
func ParseHello(line string) (*Rank, error) {
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "HELLO" {
		return nil, fmt.Errorf("not a HELLO: %q", line)
	}
	if f[1] != HelloVersion {
		return nil, fmt.Errorf("HELLO version %q, this mpid speaks %s: the rank's shim is of another mpipause release; relaunch the job with this one", f[1], HelloVersion)
	}
	r := &Rank{Rank: -1}
	seen := map[string]bool{}
	var hosts string
	for _, kv := range f[2:] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || seen[k] {
			return nil, fmt.Errorf("HELLO field %q", kv)
		}
		seen[k] = true
		var err error
		switch k {
		case "job":
			r.Job = v
		case "rank":
			r.Rank, err = strconv.Atoi(v)
		case "size":
			r.Size, err = strconv.Atoi(v)
		case "pid":
			r.Pid, err = strconv.Atoi(v)
		case "host":
			r.Host = v
		case "tstp":
			r.Tstp, err = strconv.ParseUint(v, 16, 64)
		case "hosts":
			hosts = v
		case "root":
			r.Root = v
		case "key":
			if !validKey(v) {
				return nil, errors.New("HELLO key malformed")
			}
			r.Key = v
		}
		if err != nil {
			return nil, fmt.Errorf("HELLO field %q: %w", kv, err)
		}
	}
	if r.Job == "" || r.Pid <= 0 {
		return nil, fmt.Errorf("HELLO without job or pid: %q", line)
	}
	// Copies: a substring would keep the whole line (up to maxFirstLine)
	// for as long as the rank is registered.
	r.Job, r.Host, r.Root, r.Key = strings.Clone(r.Job), strings.Clone(r.Host), strings.Clone(r.Root), strings.Clone(r.Key)
	if r.Key == "" {
		return nil, errors.New("HELLO without a job key: launch the job with `mpipause run`, which gives its ranks their job key")
	}
	// The same rules as everywhere a job id or rank comes in: what mpid
	// builds paths and reports from must hold whatever a process sends.
	if !jobid.Valid(r.Job) {
		return nil, fmt.Errorf("HELLO job id %q: %s", r.Job, jobid.Rule)
	}
	if r.Size <= 0 || r.Rank < 0 || r.Rank >= r.Size {
		return nil, fmt.Errorf("HELLO rank %d of size %d", r.Rank, r.Size)
	}
	// Only rank 0's list is read (coordinator's cross-check); any other
	// rank's is neither checked nor kept.
	if seen["hosts"] && r.Rank == 0 {
		if len(hosts) > MaxHostsBytes {
			return nil, fmt.Errorf("HELLO hosts= of %d bytes: mpid keeps at most %d bytes of a job's host list", len(hosts), MaxHostsBytes)
		}
		if n := strings.Count(hosts, ",") + 1; n > MaxHosts {
			return nil, fmt.Errorf("HELLO hosts= of %d names: mpid keeps at most %d hosts of a job", n, MaxHosts)
		}
		// A copy of its own: the line it came in goes.
		r.Hosts = strings.Split(strings.Clone(hosts), ",")
	}
	// Host names become node names, peers' addresses and lines in root's
	// terminal: only what a host name may be.
	names := map[string][]string{"host": {r.Host}, "root": {r.Root}, "hosts": r.Hosts}
	for _, k := range []string{"host", "root", "hosts"} {
		for _, h := range names[k] {
			if seen[k] && !jobid.ValidHostName(h) {
				return nil, fmt.Errorf("HELLO %s %q: %s", k, h, jobid.HostNameRule)
			}
		}
	}
	return r, nil
}

// MaxRankLine bounds a line from a registered rank (replies and events,
// some tens of bytes): a longer one cuts the rank off.
const MaxRankLine = 4096

// Opened is what a rank reports when its gate has reopened.
type Opened struct {
	Flushed uint64 `json:"flushed"` // held bytes sent
	// Errors counts held chunks the kernel refused, and Errno says why: a
	// connection the peer closed during the pause (EPIPE, ECONNRESET), on
	// which the kernel would have dropped those bytes just the same.
	Errors int `json:"errors"`
	Errno  int `json:"errno,omitempty"`
}

// Request is what a rank asks for unasked: the event "pause" (it got
// SIGTSTP) or "resume" (SIGCONT), "at=<ns>" after it since shims stamp it.
type Request struct {
	Op string // "pause" or "resume"
	// At is CLOCK_MONOTONIC, in nanoseconds, when the rank's handler ran:
	// the user's action, which the rank may send much later (frozen in
	// between by a pause another rank asked for). 0: not stamped (a shim
	// of an older release).
	At int64
	// Overtaken: a pause whose SIGTSTP a SIGCONT overtook on the rank's
	// thread (its handler ran after the continue's): the shim reports it
	// for mpid to count against what it saw while the rank was frozen,
	// never to act on.
	Overtaken bool
}

// ParseRequest parses the event "pause[ at=<ns>]" or "resume[ at=<ns>]",
// ns a positive decimal without sign.
func ParseRequest(ev string) (Request, error) {
	body, overtaken := strings.CutSuffix(ev, " overtaken")
	op, at, stamped := strings.Cut(body, " ")
	if op != "pause" && op != "resume" {
		return Request{}, fmt.Errorf("not a pause or resume request: %q", ev)
	}
	if overtaken && op != "pause" {
		return Request{}, fmt.Errorf("malformed request %q", ev)
	}
	if !stamped {
		return Request{Op: op, Overtaken: overtaken}, nil
	}
	v, ok := strings.CutPrefix(at, "at=")
	if !ok || v == "" || strings.Trim(v, "0123456789") != "" {
		return Request{}, fmt.Errorf("malformed request %q", ev)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return Request{}, fmt.Errorf("malformed request %q", ev)
	}
	return Request{Op: op, At: n, Overtaken: overtaken}, nil
}

// ParseFlushed parses the event "flushed bytes=<n> errors=<n> errno=<e>".
func ParseFlushed(ev string) (Opened, error) {
	rest, ok := strings.CutPrefix(ev, "flushed ")
	if !ok {
		return Opened{}, fmt.Errorf("not a flush report: %q", ev)
	}
	return ParseOpened("OPENED " + strings.ReplaceAll(rest, "bytes=", "flushed="))
}

// ParseOpened parses "OPENED flushed=<n> errors=<n> errno=<e>".
func ParseOpened(line string) (Opened, error) {
	kv, err := fields(line, "OPENED")
	if err != nil {
		return Opened{}, err
	}
	var o Opened
	var e1, e2, e3 error
	o.Flushed, e1 = strconv.ParseUint(kv["flushed"], 10, 64)
	o.Errors, e2 = strconv.Atoi(kv["errors"])
	if v, ok := kv["errno"]; ok {
		o.Errno, e3 = strconv.Atoi(v)
	}
	if errors.Join(e1, e2, e3) != nil || o.Errors < 0 {
		return Opened{}, fmt.Errorf("malformed reply %q", line)
	}
	return o, nil
}

// ParseGate parses "<verb> gate=closed gated=1 closing=0 held=123".
func ParseGate(line, verb string) (Gate, error) {
	kv, err := fields(line, verb)
	if err != nil {
		return Gate{}, err
	}
	var g Gate
	g.State = kv["gate"]
	var e1, e2, e3 error
	g.Gated, e1 = strconv.Atoi(kv["gated"])
	g.Closing, e2 = strconv.Atoi(kv["closing"])
	g.Held, e3 = strconv.ParseUint(kv["held"], 10, 64)
	okState := g.State == "open" || g.State == "closed" || g.State == "flushing"
	if !okState || errors.Join(e1, e2, e3) != nil || g.Gated < 0 || g.Closing < 0 {
		return Gate{}, fmt.Errorf("malformed reply %q", line)
	}
	return g, nil
}

func fields(line, verb string) (map[string]string, error) {
	f := strings.Fields(line)
	if len(f) == 0 || f[0] != verb {
		return nil, fmt.Errorf("want %s, got %q", verb, line)
	}
	kv := map[string]string{}
	for _, x := range f[1:] {
		k, v, _ := strings.Cut(x, "=")
		kv[k] = v
	}
	return kv, nil
}

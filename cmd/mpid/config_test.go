package main

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ranks"
)

func init() {
	// A settings file installed on the test machine must not change what
	// the tests parse.
	defaultConfig = "/nonexistent/mpipause-test/mpid.conf"
}

// distConf is the settings file the packages install.
const distConf = "../../dist/mpid.conf"

// parse is what mpid does with args: the options, the file, the checks.
func parse(t *testing.T, args ...string) (config, error) {
	t.Helper()
	var out bytes.Buffer
	return parseArgs(args, &out)
}

func writeConf(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "mpid.conf")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDistConfUpToDate: dist/mpid.conf is what --print-config prints, so it
// lists every option of mpid, with its default and help, today's.
func TestDistConfUpToDate(t *testing.T) {
	var out bytes.Buffer
	if _, err := parseArgs([]string{"--print-config"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--print-config: %v, want flag.ErrHelp (exit 0)", err)
	}
	want, err := os.ReadFile(distConf)
	if err != nil {
		t.Fatal(err)
	}
	if out.String() != string(want) {
		t.Errorf("%s is stale: regenerate it with\n  go run ./cmd/mpid --print-config > dist/mpid.conf\n--- got:\n%s", distConf, out.String())
	}
}

// TestDistConfDefaults: every option line of dist/mpid.conf, uncommented,
// gives mpid exactly its defaults, and every option is there.
func TestDistConfDefaults(t *testing.T) {
	b, err := os.ReadFile(distConf)
	if err != nil {
		t.Fatal(err)
	}
	opt := regexp.MustCompile(`(?m)^#([a-z][a-z0-9-]* = .*)$`)
	lines := opt.FindAllStringSubmatch(string(b), -1)
	var text strings.Builder
	for _, l := range lines {
		text.WriteString(l[1] + "\n")
	}
	got, err := parse(t, "--config", writeConf(t, text.String()))
	if err != nil {
		t.Fatalf("dist/mpid.conf uncommented: %v", err)
	}
	if len(got.origin) != len(lines) {
		t.Errorf("%d option lines, %d options set", len(lines), len(got.origin))
	}
	want, err := parse(t, "--config", writeConf(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	got.origin, want.origin = nil, nil
	got.configFile, want.configFile = "", ""
	if !reflect.DeepEqual(got, want) {
		t.Errorf("dist/mpid.conf's values are not the defaults:\n got %+v\nwant %+v", got, want)
	}
	// Counted apart from --print-config, which wrote the file.
	n := 0
	eachOption(t, func(name string) {
		if !notInFile[name] {
			n++
		}
	})
	if n != len(lines) {
		t.Errorf("mpid has %d options a file can set, dist/mpid.conf lists %d", n, len(lines))
	}
}

// eachOption calls each with the name of every option --help lists.
func eachOption(t *testing.T, each func(name string)) {
	t.Helper()
	var out bytes.Buffer
	if _, err := parseArgs([]string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(out.String(), -1) {
		each(m[1])
	}
}

func TestConfigFile(t *testing.T) {
	conf := writeConf(t, `# a comment
node = n7

  peer-port=7171
drain-timeout = 3s
unpin-on-exit = true
state-dir = "/var/lib/mpipause state"
log-format = json
`)
	cfg, err := parse(t, "--config", conf, "--peer-port", "7200")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Node != "n7" || cfg.Drain != 3*time.Second || !cfg.Unpin || cfg.StateDir != "/var/lib/mpipause state" || cfg.logFormat != "json" {
		t.Errorf("the file's values not taken: %+v", cfg)
	}
	if cfg.PeerPort != 7200 {
		t.Errorf("peer-port %d: the command line's 7200 must win over the file's 7171", cfg.PeerPort)
	}
	if cfg.RankSocket != ranks.DefaultAddr || cfg.Nice != -10 {
		t.Errorf("options the file leaves out must keep their defaults: %+v", cfg)
	}
}

func TestConfigFileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		want       string // with FILE for the file's name
	}{
		{"unknown option", "node = a\n\nnodes = b\n", `FILE:3: unknown option "nodes"`},
		{"bad integer", "peer-port = seventy\n", `FILE:1: invalid value "seventy" for peer-port`},
		{"bad duration", "# x\ndrain-timeout = 10\n", `FILE:2: invalid value "10" for drain-timeout`},
		{"bad bool", "unpin-on-exit = sure\n", `FILE:1: invalid value "sure" for unpin-on-exit`},
		{"out of range, checked after", "node = a\npeer-port = 0\n", "FILE:2: --peer-port 0: want 1-65535"},
		{"bad log format", "log-format = xml\n", `FILE:1: --log-format "xml": want text or json`},
		{"set twice", "nice = 1\nnice = 2\n", "FILE:2: nice set again (first at FILE:1)"},
		{"no equals sign", "node a\n", `FILE:1: "node a" is not`},
		{"config in the file", "config = /etc/other.conf\n", `FILE:1: unknown option "config"`},
		{"bad quoting", `node = "a"b"` + "\n", "FILE:1: node = \"a\"b\": bad quoting"},
		{"node not a host name", "node = node_1\n", `FILE:1: --node "node_1": want a host name (RFC 1123)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conf := writeConf(t, tc.text)
			_, err := parse(t, "--config", conf)
			want := strings.ReplaceAll(tc.want, "FILE", conf)
			if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
				t.Errorf("got error %v, want one line containing %q", err, want)
			}
		})
	}
}

func TestConfigFileMissing(t *testing.T) {
	// The default file is optional: a node without one runs on defaults.
	if _, err := parse(t); err != nil {
		t.Errorf("no %s: %v, want the defaults", defaultConfig, err)
	}
	// One named on the command line is not.
	missing := filepath.Join(t.TempDir(), "none.conf")
	_, err := parse(t, "--config", missing)
	if err == nil || !strings.Contains(err.Error(), "--config: open "+missing+": no such file") {
		t.Errorf("--config %s: %v, want an error naming the file", missing, err)
	}
	// A flag's own check keeps its message when the command line set it.
	_, err = parse(t, "--config", writeConf(t, "nice = 3\n"), "--peer-port", "0")
	if err == nil || err.Error() != "--peer-port 0: want 1-65535" {
		t.Errorf("--peer-port 0 on the command line: %v", err)
	}
}

// TestNodeName: --node must be a host name (what the ranks' HELLOs carry,
// jobid.ValidHostName); anything else stops mpid with one line that shows
// the name escaped.
func TestNodeName(t *testing.T) {
	for _, good := range []string{"node0", "n1.cluster.example"} {
		if cfg, err := parse(t, "--config", os.DevNull, "--node", good); err != nil || cfg.Node != good {
			t.Errorf("--node %s: %v", good, err)
		}
	}
	for _, bad := range []string{"node\x1b[2J", "-n", "a..b", strings.Repeat("a", 64)} {
		_, err := parse(t, "--config", os.DevNull, "--node", bad)
		if err == nil || !strings.HasPrefix(err.Error(), "--node ") || !strings.Contains(err.Error(), "RFC 1123") ||
			strings.ContainsAny(err.Error(), "\n\x1b") {
			t.Errorf("--node %q: %v; want one printable line naming --node and the rule", bad, err)
		}
	}
}

package main

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestLogJournal(t *testing.T) {
	var b bytes.Buffer
	log := slog.New(newLogHandler(&b, "text", true))
	log.Info("serving", "node", "node0")
	log.Warn("rank refused", "error", "bad hello")
	log.With("job", "j1").WithGroup("pause").Error("rolled back", "phase", "drain")
	want := []string{
		`<6>level=INFO msg=serving node=node0`,
		`<4>level=WARN msg="rank refused" error="bad hello"`,
		`<3>level=ERROR msg="rolled back" job=j1 pause.phase=drain`,
	}
	if got := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n"); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("journal lines (-want +got):\n-%s\n+%s", strings.Join(want, "\n-"), strings.Join(got, "\n+"))
	}
}

func TestLogJournalJSON(t *testing.T) {
	var b bytes.Buffer
	slog.New(newLogHandler(&b, "json", true)).Warn("x", "n", 1)
	if got, want := b.String(), `<4>{"level":"WARN","msg":"x","n":1}`+"\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestLogText: off the journal, the lines are today's, time stamp first.
func TestLogText(t *testing.T) {
	var b bytes.Buffer
	slog.New(newLogHandler(&b, "text", false)).Info("serving", "node", "node0")
	if got := b.String(); !strings.HasPrefix(got, "time=") || !strings.HasSuffix(got, " level=INFO msg=serving node=node0\n") {
		t.Errorf("text line %q", got)
	}
	b.Reset()
	slog.New(newLogHandler(&b, "json", false)).Info("serving")
	if got := b.String(); !strings.HasPrefix(got, `{"time":`) {
		t.Errorf("json line %q", got)
	}
}

func TestSyslogPriority(t *testing.T) {
	for _, tc := range []struct {
		l    slog.Level
		want int
	}{
		{slog.LevelDebug, 7}, {slog.LevelInfo - 1, 7}, {slog.LevelInfo, 6}, {slog.LevelInfo + 2, 6},
		{slog.LevelWarn, 4}, {slog.LevelError - 1, 4}, {slog.LevelError, 3}, {slog.LevelError + 4, 3},
	} {
		if got := syslogPriority(tc.l); got != tc.want {
			t.Errorf("syslogPriority(%v) = %d, want %d", tc.l, got, tc.want)
		}
	}
}

func TestJournalStream(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "stream"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, env string
		want      bool
	}{
		{"unset", "", false},
		{"this file", fmt.Sprintf("%d:%d", st.Dev, st.Ino), true},
		{"another inode (stderr redirected since)", fmt.Sprintf("%d:%d", st.Dev, st.Ino+1), false},
		{"malformed", "journal", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("JOURNAL_STREAM", tc.env)
			if got := journalStream(f); got != tc.want {
				t.Errorf("JOURNAL_STREAM=%q: %v, want %v", tc.env, got, tc.want)
			}
		})
	}
}

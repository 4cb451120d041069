package mpid

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/node"
)

// G5 (durable, docs/guarantees.md): a paused job stays paused across a
// restart of mpid. The ranks' cgroups stay frozen without mpid; what a new
// mpid needs is which jobs they are, their owners, and, on the coordinator,
// the job's nodes, to resume it everywhere. The coordinator writes a record
// before a pause's first step (pausing: a successor rolls it back) and again
// once it holds (paused); every other node writes one at COMMIT, before it
// acknowledges. A node's record goes when it thaws the job; the
// coordinator's when its operation ends with the job running everywhere
// (operation.go); any record goes with its job. Every node, at start,
// adopts the job cgroups it finds under its cgroup parent.
//
// A record is written whole or not at all (a temporary file, then a rename
// over the old one) and carries a SHA-256 of its content: a torn or altered
// file is reported, set aside (*.corrupt) and never trusted. Nothing is
// synced to disk: what the record is for is a restart of mpid, which finds
// the page cache as the last mpid left it; a crash of the host, the only
// thing a sync would outlast, ends the ranks the record describes, and a
// pause a crashed coordinator left half done is rolled back by the other
// nodes' leases. A sync would cost each pause up to three disk flushes on
// a state directory that is not a tmpfs.

const recordVersion = 1

type record struct {
	Version     int       `json:"version"`
	Job         string    `json:"job"`
	Owner       uint32    `json:"owner_uid"`
	State       string    `json:"state"`
	Since       time.Time `json:"since"`
	Nodes       []string  `json:"nodes"`
	Coordinator string    `json:"coordinator"`
	Ranks       int       `json:"ranks"`
	LocalRanks  []int     `json:"local_ranks,omitempty"`
	Last        ctl.Job   `json:"last"`
	// Cgroups are where the job's ranks here are frozen: a restarted mpid
	// finds the job there (registry.adopt), wherever its launcher put them.
	Cgroups []string `json:"cgroups,omitempty"`
}

type recordFile struct {
	Record json.RawMessage `json:"record"`
	SHA256 string          `json:"sha256"`
}

// store keeps the records of paused jobs in dir (Config.StateDir).
type store struct {
	dir string
	log *slog.Logger
}

func (s *store) write(r record) error { return writeRecord(s.dir, r) }

func (s *store) read(id string) (record, error) { return readRecord(recordPath(s.dir, id)) }

func (s *store) drop(id string) {
	if err := os.Remove(recordPath(s.dir, id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.log.Warn("remove state record", "job", id, "error", err)
	}
}

// commitRecords are the store's records as internal/node's steps write
// them: a node's record of a pause committed here.
type commitRecords struct{ st *store }

var _ node.Records = commitRecords{}

func (c commitRecords) Pausing(id string) bool {
	r, err := c.st.read(id)
	return err == nil && r.State == ctl.StatePausing
}

func (c commitRecords) WriteCommit(m node.Commit) error {
	return c.st.write(record{Version: recordVersion, Job: m.Job, Owner: m.Owner, State: ctl.StatePaused, Since: m.Since,
		Nodes: []string{m.Node}, Coordinator: m.Coordinator, Ranks: m.Ranks, LocalRanks: m.LocalRanks, Cgroups: m.Cgroups})
}

func (c commitRecords) Drop(id string) { c.st.drop(id) }

// load reads every record; one that fails its check is reported and set
// aside (*.corrupt), never trusted.
func (s *store) load() map[string]record {
	recs := map[string]record{}
	files, _ := filepath.Glob(filepath.Join(s.dir, "*.json"))
	for _, f := range files {
		r, err := readRecord(f)
		if err != nil {
			s.log.Error("state record not trusted; set aside", "file", f+".corrupt", "error", err)
			os.Rename(f, f+".corrupt")
			continue
		}
		recs[r.Job] = r
	}
	return recs
}

func recordPath(dir, job string) string { return filepath.Join(dir, job+".json") }

// writeRecord stores r atomically.
func writeRecord(dir string, r record) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	body, err := json.Marshal(r)
	if err != nil {
		return err
	}
	sum := sha256.Sum256(body)
	// Not indented: the checksum is over the record's bytes as they are.
	b, err := json.Marshal(recordFile{Record: body, SHA256: hex.EncodeToString(sum[:])})
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, ".tmp-"+r.Job+"-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), recordPath(dir, r.Job))
}

// errCorrupt: a record file that fails its checksum or does not parse.
var errCorrupt = errors.New("corrupt state file")

// readRecord reads and checks one record file.
func readRecord(path string) (record, error) {
	var r record
	b, err := os.ReadFile(path)
	if err != nil {
		return r, err
	}
	var f recordFile
	if err := json.Unmarshal(b, &f); err != nil {
		return r, fmt.Errorf("%w %s: %v", errCorrupt, path, err)
	}
	sum := sha256.Sum256(f.Record)
	if f.SHA256 != hex.EncodeToString(sum[:]) {
		return r, fmt.Errorf("%w %s: checksum mismatch (torn or altered)", errCorrupt, path)
	}
	if err := json.Unmarshal(f.Record, &r); err != nil {
		return r, fmt.Errorf("%w %s: %v", errCorrupt, path, err)
	}
	if r.Version != recordVersion || !jobid.Valid(r.Job) || filepath.Base(path) != r.Job+".json" {
		return r, fmt.Errorf("%w %s: version %d, job %q", errCorrupt, path, r.Version, r.Job)
	}
	return r, nil
}

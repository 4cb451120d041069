package mpid

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/ranks"
)

// G5 (durable): a paused job stays paused across a restart of mpid. The
// ranks' cgroups stay frozen without mpid; what a new mpid needs is which
// jobs they are, their owners, and, on the coordinator, the job's nodes, to
// resume it everywhere. The coordinator writes a record when a pause
// commits and removes it when the job resumes or ends; every node, at
// start, adopts the job cgroups it finds under its cgroup parent.
//
// A record is written whole or not at all (a temporary file, fsync, rename,
// fsync of the directory) and carries a SHA-256 of its content: a torn or
// altered file is reported, set aside (*.corrupt) and never trusted.

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
}

type recordFile struct {
	Record json.RawMessage `json:"record"`
	SHA256 string          `json:"sha256"`
}

func (d *Daemon) stateDir() string {
	if d.cfg.StateDir != "" {
		return d.cfg.StateDir
	}
	return filepath.Join("/run/mpipause", "mpid-"+d.cfg.Node)
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
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), recordPath(dir, r.Job)); err != nil {
		return err
	}
	df, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer df.Close()
	return df.Sync()
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
	if r.Version != recordVersion || ctl.ValidJobID(r.Job) != nil || filepath.Base(path) != r.Job+".json" {
		return r, fmt.Errorf("%w %s: version %d, job %q", errCorrupt, path, r.Version, r.Job)
	}
	return r, nil
}

// saveLocked records j on the coordinator: its pause under way (state
// pausing, written before the first step) or committed (state paused).
func (d *Daemon) saveLocked(j *job, v ctl.Job) {
	r := record{Version: recordVersion, Job: j.id, Owner: j.owner, State: j.state, Since: j.since,
		Nodes: v.Nodes, Coordinator: v.Coordinator, Ranks: v.Ranks, LocalRanks: v.LocalRanks, Last: j.last}
	if err := writeRecord(d.stateDir(), r); err != nil {
		// The pause holds either way; only a restart of mpid would lose
		// track of it, so say so loudly.
		d.log.Error("cannot record the paused job; a restart of mpid would forget it", "job", j.id, "error", err)
	}
}

func (d *Daemon) dropRecord(id string) {
	if err := os.Remove(recordPath(d.stateDir(), id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("remove state record", "job", id, "error", err)
	}
}

// adopt brings back, at start, the jobs whose cgroups outlived the previous
// mpid: paused if the cgroup is frozen and a committed pause is recorded,
// thawed if it is frozen without one (the pause never committed), running
// otherwise; a pause the previous mpid was coordinating is rolled back on
// every node (the returned work, to run once mpid serves). Their ranks
// registered with the old mpid; the job can be paused again once all of
// them have registered with this one.
func (d *Daemon) adopt() (interrupted []func()) {
	if d.cfg.FixedCgroup != "" {
		return nil
	}
	dir := d.stateDir()
	recs := map[string]record{}
	files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	for _, f := range files {
		r, err := readRecord(f)
		if err != nil {
			d.log.Error("state record not trusted; set aside", "file", f+".corrupt", "error", err)
			os.Rename(f, f+".corrupt")
			continue
		}
		recs[r.Job] = r
	}
	entries, _ := os.ReadDir(d.cgroupParent())
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range entries {
		id := e.Name()
		if !e.IsDir() || d.jobs[id] != nil {
			continue
		}
		owner, name, ok := ranks.SplitJobKey(id)
		if !ok {
			// Not a job of this release's layout (<uid>:<id>): left alone.
			continue
		}
		cg := filepath.Join(d.cgroupParent(), id)
		procs, err := cgroupv2.Procs(cg)
		if err != nil || len(procs) == 0 {
			continue
		}
		frozen, _ := cgroupv2.Frozen(cg)
		if _, committed := recs[id]; frozen && !committed {
			// Frozen, but no pause committed here: the previous mpid died
			// inside a pause (after FREEZE, before COMMIT), which the
			// coordinator has rolled back, or will, on the other nodes.
			// The ranks' gates reopen as their shims lose the old mpid.
			if err := cgroupv2.Thaw(context.Background(), cg); err != nil {
				d.log.Error("job frozen by a pause that never committed here; thaw failed", "job", id, "error", err)
			} else {
				frozen = false
				d.log.Warn("job frozen by a pause that never committed here (mpid died inside it): thawed", "job", id)
			}
		}
		j := &job{id: id, name: name, owner: owner, dir: cg, state: ctl.StateRunning, since: time.Now(), adopted: true, missing: map[int]bool{}}
		for _, pid := range procs {
			// A registered rank runs the shim's control thread; the
			// launcher's daemons and the ranks' own children do not.
			if ranks.CtlThread(pid) != 0 {
				j.missing[pid] = true
			}
		}
		if frozen {
			j.state = ctl.StatePaused
		}
		if r, ok := recs[id]; ok && r.Owner == owner {
			j.since, j.last = r.Since, r.Last
			j.nodes, j.coordinator, j.size, j.localRanks = r.Nodes, r.Coordinator, r.Ranks, r.LocalRanks
			if r.Coordinator == d.cfg.Node {
				// The nodes the record names had registered ranks of the
				// job here; they will again (sweep), but the job's pauses
				// and resumes need them from now on.
				j.remotes = map[string]bool{}
				for _, n := range r.Nodes {
					if n != d.cfg.Node {
						j.remotes[n] = true
					}
				}
			}
			delete(recs, id)
			if r.State == ctl.StatePausing {
				// This node coordinated a pause and died inside it: some
				// nodes may hold it (COMMIT reached them), others not.
				// Nobody was told it held, so it is rolled back everywhere.
				j.state = ctl.StateFailed
				nodes := r.Nodes
				interrupted = append(interrupted, func() { d.confirmRollback(id, nodes) })
				d.log.Warn("found a pause this node was coordinating when its mpid died: rolling it back on every node", "job", id, "nodes", strings.Join(nodes, ","))
			}
		}
		d.jobs[id] = j
		d.log.Warn("adopted a job left by the previous mpid", "job", id, "state", j.state, "cgroup", cg, "ranks", len(j.missing),
			"coordinator", j.coordinator, "nodes", strings.Join(j.nodes, ","))
	}
	for id := range recs {
		// Its ranks are gone: the job ended while mpid was down.
		d.log.Info("the recorded job ended while mpid was down", "job", id)
		d.dropRecord(id)
	}
	return interrupted
}

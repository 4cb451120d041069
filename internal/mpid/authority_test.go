package mpid

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/quiesce"
)

// TestJobToken: a job key opens exactly one job: its owner's id, with the
// coordinator it names, under this cluster's key.
func TestJobToken(t *testing.T) {
	k, _ := quiesce.GenerateKey()
	other, _ := quiesce.GenerateKey()
	tok := JobToken(k, 1002, "4243.0", "node0")
	if coord, err := checkToken(quiesce.NewKeyring(k), 1002, "4243.0", tok); err != nil || coord != "node0" {
		t.Fatalf("the job's own key: %q, %v", coord, err)
	}
	// While the cluster moves to a new key, a key made under either is
	// accepted by a node holding both, in either order.
	for _, ring := range []*quiesce.Keyring{quiesce.NewKeyring(other, k), quiesce.NewKeyring(k, other)} {
		if _, err := checkToken(ring, 1002, "4243.0", tok); err != nil {
			t.Errorf("during a key rotation: %v", err)
		}
	}
	hexPart := tok[len("node0:"):]
	for name, c := range map[string]struct {
		uid       uint32
		id, token string
		key       *quiesce.Key
	}{
		"another user":        {1001, "4243.0", tok, k},
		"another id":          {1002, "4243.1", tok, k},
		"another coordinator": {1002, "4243.0", "node1:" + hexPart, k},
		"another cluster":     {1002, "4243.0", tok, other},
		"no coordinator":      {1002, "4243.0", ":" + hexPart, k},
		"no mac":              {1002, "4243.0", "node0:", k},
		"no colon":            {1002, "4243.0", hexPart, k},
		"escape in the name":  {1002, "4243.0", "no\x1bde:" + hexPart, k},
		"truncated":           {1002, "4243.0", tok[:len(tok)-2], k},
	} {
		if _, err := checkToken(quiesce.NewKeyring(c.key), c.uid, c.id, c.token); err == nil {
			t.Errorf("%s: accepted", name)
		} else if err != errBadToken {
			t.Errorf("%s: %v, want the one refusal that tells a guesser nothing", name, err)
		}
	}
	if JobToken(k, 1, "a", "b:c") == JobToken(k, 1, "a:b", "c") {
		t.Error("the key's parts run into each other")
	}
}

func TestFirstHost(t *testing.T) {
	for list, want := range map[string]string{
		"node0": "node0", "node[0-2]": "node0", "n[01-04],login": "n01", "a,b": "a",
		"rack[3,5-7]-n[2-4]": "rack3-n2", "[1-2]x": "1x", "x[7]": "x7", "c1.cluster,c2.cluster": "c1.cluster",
	} {
		if got, err := firstHost(list); err != nil || got != want {
			t.Errorf("firstHost(%q) = %q, %v; want %q", list, got, err, want)
		}
	}
	for _, bad := range []string{"", "n[0-2", "a\x1b[31m", "-x", "a b"} {
		if got, err := firstHost(bad); err == nil {
			t.Errorf("firstHost(%q) = %q, want an error", bad, got)
		}
	}
}

// TestJobAuthority: what a local user can do with the rank channel and the
// control socket, against another user's job (issue findings C1, C2, M1).
func TestJobAuthority(t *testing.T) {
	d := newTestDaemon(t, "node0", nil, nil)
	const victim, attacker = 1002, 1001
	vtok := JobToken(d.cfg.ClusterKey.Current(), victim, "4243.0", "node0")
	d.reg.mu.Lock()
	vj, err := d.reg.authorizeLocked(victim, "4243.0", vtok)
	d.reg.mu.Unlock()
	if err != nil || vj.owner != victim || vj.coordinator != "node0" {
		t.Fatalf("the victim's own rank: %+v, %v", vj, err)
	}
	// C1: the victim's key is the victim's: not the attacker's, whatever
	// the attacker calls the job, and no key of the attacker's own opens it.
	atok := JobToken(d.cfg.ClusterKey.Current(), attacker, "4243.0", "node0")
	d.reg.mu.Lock()
	_, stolen := d.reg.authorizeLocked(attacker, "4243.0", vtok)
	aj, own := d.reg.authorizeLocked(attacker, "4243.0", atok)
	d.reg.mu.Unlock()
	if stolen == nil {
		t.Error("the attacker joined with the victim's job key")
	}
	// M1: the attacker's "4243.0" is the attacker's own job; the victim's
	// is untouched and still joins.
	if own != nil || aj == vj || aj.owner != attacker {
		t.Errorf("the attacker's own job of the same id: %+v, %v", aj, own)
	}
	d.reg.mu.Lock()
	again, err := d.reg.authorizeLocked(victim, "4243.0", vtok)
	d.reg.mu.Unlock()
	if err != nil || again != vj {
		t.Errorf("the victim's next rank: %v", err)
	}
	// A stranger's request names a job in their own namespace: they learn
	// nothing of the victim's, not even that it exists.
	for _, op := range []string{ctl.OpStatus, ctl.OpPause, ctl.OpResume} {
		_, err := d.coord.doAt(context.Background(), ctl.Request{Op: op, Job: vj.id}, attacker, nil, true)
		var ce *ctl.Error
		if !asCtl(err, &ce) || ce.Code != ctl.CodeUnknownJob || strings.Contains(ce.Message, "1002") {
			t.Errorf("%s of the victim's job by the attacker: %v", op, err)
		}
	}
	if key, _ := d.reg.lookup("4243.0", attacker); key != aj.id {
		t.Errorf("the attacker's 4243.0 is %s, want their own %s", key, aj.id)
	}
	// Root names either: ambiguous by id alone, exact as UID:ID.
	if _, err := d.reg.lookup("4243.0", 0); err == nil || !strings.Contains(err.Error(), "UID:ID") {
		t.Errorf("root's ambiguous 4243.0: %v", err)
	}
	if key, err := d.reg.lookup("1002:4243.0", 0); err != nil || key != vj.id {
		t.Errorf("root's 1002:4243.0: %q, %v", key, err)
	}
	// Two launches under one id from two coordinators are refused, not
	// merged.
	d.reg.mu.Lock()
	_, err = d.reg.authorizeLocked(victim, "4243.0", JobToken(d.cfg.ClusterKey.Current(), victim, "4243.0", "node1"))
	d.reg.mu.Unlock()
	if err == nil {
		t.Error("a second coordinator for the victim's job was accepted")
	}
}

// TestForeignStep (C2): a protocol step of a job this node knows runs only
// if it comes from the job's coordinator.
func TestForeignStep(t *testing.T) {
	net := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer net.Close()
	coord := newTestDaemon(t, "node0", net, nil)
	d := newTestDaemon(t, "node1", net, coord.cfg.ClusterKey)
	tok := JobToken(d.cfg.ClusterKey.Current(), 1002, "j", "node0")
	d.reg.mu.Lock()
	j, err := d.reg.authorizeLocked(1002, "j", tok)
	d.reg.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	// The node registered itself with the job's coordinator, which lists
	// it now.
	for deadline := time.Now().Add(5 * time.Second); ; {
		v, err := coord.coord.view(j.id)
		if err == nil && strings.Join(v.Nodes, ",") == "node0,node1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the coordinator's view after node1's registration: %+v, %v", v, err)
		}
		net.Drain()
	}
	step := quiesce.Message{Version: quiesce.ProtocolVersion, Job: j.id, Kind: quiesce.KindPrepare, Nodes: []string{"node1"}}
	for coord, ok := range map[string]bool{"node0": true, "node2": false, "": false} {
		step.Coordinator = coord
		if why := d.peer.foreignStep(step); (why == "") != ok {
			t.Errorf("a step from %q: %q", coord, why)
		}
	}
	step.Job, step.Coordinator = "j", "node0"
	if why := d.peer.foreignStep(step); why == "" {
		t.Error("a step naming no owner was accepted")
	}
}

// TestRegistration: the coordinator's node list holds the nodes that
// showed the job's key for the job's owner, and loses them when the job
// ends there.
func TestRegistration(t *testing.T) {
	d := newTestDaemon(t, "node0", nil, nil)
	tok := JobToken(d.cfg.ClusterKey.Current(), 1002, "j", "node0")
	key := jobid.Key(1002, "j")
	reg := func(op string, uid uint32, token, node string) *peerControl {
		return d.peer.registered(key, &peerControl{Op: op, UID: uid, Token: token, Node: node, Size: 6})
	}
	for name, c := range map[string]*peerControl{
		"another uid":         reg(opRegister, 1001, tok, "node1"),
		"a forged key":        reg(opRegister, 1002, "node0:00", "node1"),
		"another coordinator": reg(opRegister, 1002, JobToken(d.cfg.ClusterKey.Current(), 1002, "j", "node2"), "node1"),
		"a bad node name":     reg(opRegister, 1002, tok, "node1\x1b[2J"),
	} {
		if c.Code == "" {
			t.Errorf("%s: registered", name)
		}
	}
	if len(d.reg.jobs) != 0 {
		t.Fatalf("refused registrations made jobs: %v", d.reg.jobs)
	}
	if c := reg(opRegister, 1002, tok, "node1"); c.Code != "" {
		t.Fatalf("a good registration: %s", c.Message)
	}
	reg(opRegister, 1002, tok, "node2")
	v, err := d.coord.view(key)
	if err != nil || strings.Join(v.Nodes, ",") != "node0,node1,node2" || v.Ranks != 6 || v.Coordinator != "node0" || v.ID != "j" {
		t.Fatalf("view %+v, %v", v, err)
	}
	reg(opUnregister, 1002, tok, "node1")
	reg(opUnregister, 1002, tok, "node2")
	if d.reg.jobs[key] != nil {
		t.Error("the job outlived its last node")
	}
}

func asCtl(err error, ce **ctl.Error) bool {
	e, ok := err.(*ctl.Error)
	*ce = e
	return ok
}

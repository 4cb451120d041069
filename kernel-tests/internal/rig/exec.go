package rig

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/kernel-tests/internal/links"
)

// Exec says how to run a command in a node: Path and Argv for execve(2),
// with Env as its environment.
type Exec struct {
	Path string
	Argv []string
	Env  []string
}

// Command prepares cmd to run in node (nodeK, K or its netns name) from
// the working directory cwd, with env (the caller's environment) plus the
// node's: PATH with BinDir first, NameEnv, NodeEnv and LauncherEnv's
// defaults for what env does not set.
//
// The command runs in the node's network, mount and UTS namespaces and
// nothing else changes: same PID namespace, same cgroup (so a launcher
// started in a job's cgroup keeps all its ranks in it, on every node), same
// credentials. nsenter(1) is exec'd, not forked, so signals sent to the
// command's process reach it.
func (r *Rig) Command(node string, cmd []string, env []string, cwd string) (*Exec, error) {
	if len(cmd) == 0 {
		return nil, fmt.Errorf("rig exec: no command")
	}
	st, err := r.Load()
	if err != nil {
		return nil, err
	}
	i, err := r.NodeIndex(st, node)
	if err != nil {
		return nil, err
	}
	return r.nodeCommand(st, i, cmd, r.nodeEnv(env, i, st), cwd)
}

// nodeCommand is Command for node i of st, with env already the node's.
func (r *Rig) nodeCommand(st *State, i int, cmd []string, env []string, cwd string) (*Exec, error) {
	nsenter, err := lookPath("nsenter")
	if err != nil {
		return nil, err
	}
	root, err := r.hostRoot(st, i)
	if err != nil {
		return nil, err
	}
	argv := []string{nsenter,
		"--net=" + root + links.NetnsPath(r.NodeNetns(i)),
		"--mount=" + root + r.mntFile(i),
		"--uts=" + root + r.utsFile(i),
		"--wd=" + cwd, "--"}
	return &Exec{Path: nsenter, Argv: append(argv, cmd...), Env: env}, nil
}

// hostRoot returns "" if node i's namespace files are visible from here,
// which they are in the host's mount namespace, and otherwise the
// /proc/PID/root of a process in the host's mount namespace, through which
// they are. A node's mount namespace is a copy made before some of those
// files were bound (and binds of mount namespaces never propagate), so a
// launcher's agent in node0 cannot open node1's directly. PID 1 may not do
// (its ns links can be out of reach: it may hold capabilities this process
// lacks), so the search starts with this process's ancestors (the `rig exec`
// that started the launcher came from the host) and then tries every
// process.
func (r *Rig) hostRoot(st *State, i int) (string, error) {
	if isNsfs(r.mntFile(i)) {
		return "", nil
	}
	if st.HostMountNS == "" {
		return "", fmt.Errorf("rig exec: %s is not visible from this mount namespace", r.mntFile(i))
	}
	try := func(pid int) (string, bool) {
		l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
		if err != nil || l != st.HostMountNS {
			return "", false
		}
		root := fmt.Sprintf("/proc/%d/root", pid)
		return root, isNsfs(root + r.mntFile(i))
	}
	for p := ppid(os.Getpid()); p > 1; p = ppid(p) {
		if root, ok := try(p); ok {
			return root, nil
		}
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			if root, ok := try(pid); ok {
				return root, nil
			}
		}
	}
	return "", fmt.Errorf("rig exec: %s is not visible from this mount namespace, and no process of the host's (%s) is reachable to see it through", r.mntFile(i), st.HostMountNS)
}

// nodeEnv returns env with the node's variables set.
func (r *Rig) nodeEnv(env []string, i int, st *State) []string {
	return r.buildNodeEnv(env, i, st, true)
}

// buildNodeEnv is nodeEnv; without preload, it drops LD_PRELOAD altogether
// instead of adding the finalize fix to it.
func (r *Rig) buildNodeEnv(env []string, i int, st *State, preloads bool) []string {
	out := make([]string, 0, len(env)+16)
	set := map[string]bool{}
	path, preload := "", ""
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "PATH":
			path = v
			continue
		case NameEnv, NodeEnv, "HOSTNAME":
			continue // replaced below (HOSTNAME would name the caller's node)
		case "LD_PRELOAD":
			preload = v
			continue
		}
		set[k] = true
		out = append(out, kv)
	}
	if path == "" {
		path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	if r.cfg.BinDir != "" && !strings.HasPrefix(path, r.cfg.BinDir+":") {
		path = r.cfg.BinDir + ":" + path
	}
	out = append(out, "PATH="+path, NameEnv+"="+r.cfg.Name, NodeEnv+"="+NodeName(i))
	// The finalize fix goes first and the user's preloads (the mpipause
	// shim, say) still load: LD_PRELOAD is a list, not a choice.
	if !preloads {
		preload = ""
	} else if fix := r.finalizeFix(); fix != "" && !strings.Contains(preload, fix) {
		preload = strings.TrimSuffix(fix+":"+preload, ":")
	}
	if preload != "" {
		out = append(out, "LD_PRELOAD="+preload)
	}
	for _, kv := range LauncherEnv(st.Agent, nodeIf) {
		if k, _, _ := strings.Cut(kv, "="); !set[k] {
			out = append(out, kv)
		}
	}
	return out
}

// FinalizeFixLib is the library, next to the rig binary in BinDir, that
// keeps MPICH ch4:ucx from hanging in MPI_Finalize over TCP
// (kernel-tests/ucx-finalize; docs/rig.md has the cause and the numbers).
const FinalizeFixLib = "libucxfinalize.so"

// finalizeFix returns the path of FinalizeFixLib if it was built.
func (r *Rig) finalizeFix() string {
	if r.cfg.BinDir == "" {
		return ""
	}
	p := r.cfg.BinDir + "/" + FinalizeFixLib
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// LauncherEnv returns the environment under which plain
// `mpirun.openmpi -H node0:2,node1:2 -np 4 ./app` and
// `mpiexec.mpich -hosts node0,node1 -n 4 ./app` start their ranks on the
// rig's nodes, over TCP on iface. A variable the user already set wins.
// docs/rig.md explains each choice.
func LauncherEnv(agent, iface string) []string {
	return []string{
		// Open MPI 4.1: remote start through the agent; ob1 + TCP for all
		// rank-to-rank traffic (also between ranks of one node, which would
		// otherwise use shared memory), on the node interface only.
		"OMPI_MCA_plm_rsh_agent=" + agent,
		"OMPI_MCA_pml=ob1",
		"OMPI_MCA_btl=tcp,self",
		"OMPI_MCA_btl_tcp_if_include=" + iface,
		"OMPI_MCA_oob_tcp_if_include=" + iface,
		"OMPI_MCA_rmaps_base_oversubscribe=1",
		// mpirun maps each node as if it had cores of its own, and with
		// two ranks or fewer binds each to its node's first core: on the
		// rig every node's first core is this machine's core 0, so a
		// 2 x 1 job's ranks took turns on one core, a tick a message.
		"OMPI_MCA_hwloc_base_binding_policy=none",
		"OMPI_ALLOW_RUN_AS_ROOT=1",
		"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
		// MPICH 4.0 (Hydra, ch4:ucx): remote start through the agent, the
		// control connections on iface; UCX over TCP on iface.
		"HYDRA_LAUNCHER=ssh",
		"HYDRA_LAUNCHER_EXEC=" + agent,
		"HYDRA_IFACE=" + iface,
		// tcp,self is the only UCX_TLS that keeps every rank-to-rank byte
		// on TCP here. With it, Debian's MPICH 4.0.2 + UCX 1.13.1 can hang
		// in MPI_Finalize: flushing a UCX TCP endpoint that has sent
		// anything sends an empty PUT and waits for the peer's PUT ACK,
		// but a peer that has finished its own disconnects blocks in the
		// PMI barrier without progressing UCX, so the ACK never comes.
		// Adding posix or sm does not fix that without leaving TCP: the
		// nodes share boot_id and IPC namespace, so UCX takes them for one
		// host and sends eager messages (posix; it still hangs with
		// rendezvous over TCP) or everything (sm) through shared memory.
		// nodeEnv preloads FinalizeFixLib, which keeps UCX progressing in
		// that barrier. docs/rig.md has the evidence and the numbers.
		"UCX_TLS=tcp,self",
		"UCX_NET_DEVICES=" + iface,
	}
}

// ParseSSH takes the arguments a launcher gives its ssh agent,
// `[options] host command...`, and returns the host and the remote command
// as one shell string, as ssh(1) joins it for the remote shell.
func ParseSSH(args []string) (host, command string, err error) {
	// ssh(1) options that take a value.
	const withArg = "BbcDEeFIiJLlmOoPpQRSWw"
	i := 0
	for ; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			i++
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			break
		}
		// -x, -q, -oFoo=bar, -p 22, -xq ...: the first letter taking a value
		// takes the rest of the word or, if none, the next argument.
		for j := 1; j < len(a); j++ {
			if strings.IndexByte(withArg, a[j]) >= 0 {
				if j == len(a)-1 {
					i++
				}
				break
			}
		}
	}
	if i >= len(args) {
		return "", "", fmt.Errorf("ssh agent: no host in %q", args)
	}
	host = args[i]
	if at := strings.LastIndexByte(host, '@'); at >= 0 {
		host = host[at+1:]
	}
	if i+1 >= len(args) {
		return "", "", fmt.Errorf("ssh agent: no command for host %s (interactive logins are not supported)", host)
	}
	return host, strings.Join(args[i+1:], " "), nil
}

func lookPath(name string) (string, error) {
	for _, dir := range []string{"/usr/bin", "/bin", "/usr/sbin", "/sbin"} {
		p := dir + "/" + name
		if unix.Access(p, unix.X_OK) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found (install util-linux)", name)
}

// SPDX-License-Identifier: Apache-2.0
//
// mpipause_spank: a SPANK plugin that makes every Slurm job step pausable by
// mpipause, and makes `scontrol suspend` / `scontrol resume` pause and resume
// it consistently.
//
// Enabled by one line in plugstack.conf:
//
//	optional /usr/lib/mpipause/mpipause_spank.so [shim=PATH] [ctl=ADDR] [default=on|off]
//
// For every step (not the extern or the interactive step; the batch script
// and an MPI launcher's daemons: docs/slurm.md, "Launching MPI under Slurm")
// it puts the shim (libmpipause.so) into the tasks' LD_PRELOAD and sets
// MPIPAUSE_JOBID=<SLURM_JOB_ID>.<SLURM_STEP_ID>, as `mpipause run` does with
// the launcher's options: each rank then joins its job's cgroup on its node
// before it opens a socket, registers with the node's mpid, and turns a
// SIGTSTP into a pause of the whole job.
//
// Why a watcher. slurmstepd suspends a step with SIGTSTP to every process of
// the step, then 2 s later (22.05: a fixed sleep(2); PreemptParameters=
// suspend_grace_time=N in later releases) SIGSTOP; `scontrol resume` sends
// SIGCONT. The ranks' SIGTSTP pauses the job, which mpid commits by freezing
// the ranks' cgroups well inside those 2 s. But a frozen rank runs no
// handler, so no rank can act on the SIGCONT. mpid reads a SIGCONT pending
// on a frozen rank as its request (all proctrack plugins; the only way under
// proctrack/cgroup, which signals the tasks alone). Besides, local task 0 of
// the step on each node forks a small watcher before it execs the program:
// it is part of the step (a child of a task, in its process group), so it
// gets the signals of proctrack linuxproc and pgid, but it is no rank (no
// shim). Where the ranks share the step's cgroup, mpid freezes them in one
// inside it and the watcher stays unfrozen: after a SIGTSTP it waits;
// Slurm's SIGSTOP stops it like everything else; the SIGCONT of `scontrol
// resume` wakes it and it asks the node's mpid to resume the job (the
// control socket's JSON request, as `mpipause resume` sends it). Every node
// asks; the first request resumes the job and mpid refuses the others as
// not paused. docs/slurm.md, "scontrol suspend and resume".
//
// srun --mpipause=no leaves a step alone (--mpipause=yes asks for it where
// plugstack.conf says default=off).

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

// Debian 11's glibc 2.31 has no SYS_close_range; 436 on every architecture
// (a kernel before 5.9 refuses it, and the loop below closes instead).
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

SPANK_PLUGIN(mpipause, 1);

#define DEFAULT_SHIM "/usr/lib/mpipause/libmpipause.so"
#define DEFAULT_CTL "/run/mpipause/ctl.sock"
// The longest job id: two 10-digit numbers and a dot.
#define IDLEN 32

static char shim[4096] = DEFAULT_SHIM;
static char ctl_addr[108] = DEFAULT_CTL;
static int enabled = 1; // plugstack.conf default=, then srun --mpipause=
// A wrong plugstack.conf argument fails init; an "optional" plugin's other
// hooks may still be called, and must then do nothing.
static int broken;

static int opt_cb(int val, const char *arg, int remote);

struct spank_option spank_options[] = {
	{"mpipause", "yes|no",
	 "Make this step pausable by mpipause (shim in LD_PRELOAD, job id JOBID.STEPID), and scontrol suspend/resume "
	 "pause and resume it consistently (default: yes, unless plugstack.conf says default=off).",
	 1, 0, opt_cb},
	SPANK_OPTIONS_TABLE_END,
};

static int yesno(const char *s)
{
	if (!s)
		return -1;
	if (!strcmp(s, "yes") || !strcmp(s, "on") || !strcmp(s, "1"))
		return 1;
	if (!strcmp(s, "no") || !strcmp(s, "off") || !strcmp(s, "0"))
		return 0;
	return -1;
}

static int opt_cb(int val, const char *arg, int remote)
{
	(void)val;
	(void)remote;
	int v = yesno(arg);
	if (v < 0) {
		slurm_error("mpipause: --mpipause=%s: want yes or no", arg ? arg : "");
		return -1;
	}
	enabled = v;
	return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	(void)sp;
	for (int i = 0; i < ac; i++) {
		const char *a = av[i];
		if (!strncmp(a, "shim=", 5) && a[5] == '/' && strlen(a + 5) < sizeof(shim)) {
			snprintf(shim, sizeof(shim), "%s", a + 5);
		} else if (!strncmp(a, "ctl=", 4) && a[4] && strlen(a + 4) < sizeof(ctl_addr)) {
			snprintf(ctl_addr, sizeof(ctl_addr), "%s", a + 4);
		} else if (!strncmp(a, "default=", 8) && yesno(a + 8) >= 0) {
			enabled = yesno(a + 8);
		} else {
			slurm_error("mpipause: plugstack.conf argument %s: want shim=/ABSOLUTE/PATH, ctl=ADDR or "
				    "default=on|off",
				    a);
			broken = 1;
			return -1;
		}
	}
	return 0;
}

// What a step is to mpipause (step_kind).
enum {
	STEP_NONE = -1,	  // extern, interactive: left alone
	STEP_PLAIN = 0,	  // an srun step: its tasks are the ranks, job JOBID.STEPID
	STEP_BATCH = 1,	  // the batch script: job JOBID.batch, for what mpirun or mpiexec starts in it
	STEP_DAEMONS = 2, // an MPI launcher's daemons, started by srun from the batch script: its job
};

// launcher_daemons: the step runs an MPI launcher's daemons (Open MPI's
// orted or prted, MPICH's hydra_pmi_proxy), as mpirun and mpiexec start
// them with srun inside an sbatch script. Their ranks are their children.
static int launcher_daemons(spank_t sp)
{
	int argc = 0;
	char **argv = NULL;
	static const char *const names[] = {"orted", "prted", "hydra_pmi_proxy"};

	if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS || argc < 1 || !argv || !argv[0])
		return 0;
	const char *b = strrchr(argv[0], '/');
	b = b ? b + 1 : argv[0];
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcmp(b, names[i]))
			return 1;
	return 0;
}

// step_kind gives the step's mpipause job id in id: "JOBID.STEPID" for an
// srun step (STEP_PLAIN); "JOBID.batch" for the batch script (STEP_BATCH),
// and for a step of an MPI launcher's daemons that the batch script started
// (STEP_DAEMONS: the batch script's id and job key are in its environment,
// and the ranks under mpirun or mpiexec on the batch script's node are of
// that job too); STEP_NONE for the extern and the interactive step.
static int step_kind(spank_t sp, char *id, size_t n)
{
	uint32_t job, step;
	char have[IDLEN], key[8];
	if (spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS)
		return STEP_NONE;
	if (step == SLURM_EXTERN_CONT || step == SLURM_INTERACTIVE_STEP)
		return STEP_NONE;
	snprintf(id, n, "%u.batch", job);
	if (step == SLURM_BATCH_SCRIPT)
		return STEP_BATCH;
	if (launcher_daemons(sp) && spank_getenv(sp, "MPIPAUSE_JOBID", have, sizeof(have)) == ESPANK_SUCCESS &&
	    !strcmp(have, id) && spank_getenv(sp, "MPIPAUSE_JOBKEY", key, sizeof(key)) != ESPANK_ENV_NOEXIST)
		return STEP_DAEMONS;
	snprintf(id, n, "%u.%u", job, step);
	return STEP_PLAIN;
}

// wanted: the step asked for it (or did not say no), and is one to pause:
// its kind (step_kind), or STEP_NONE.
static int wanted(spank_t sp, char *id, size_t n)
{
	char *arg = NULL;
	if (broken)
		return STEP_NONE;
	if (spank_option_getopt(sp, &spank_options[0], &arg) == ESPANK_SUCCESS && opt_cb(0, arg, 1) < 0)
		return STEP_NONE;
	return enabled ? step_kind(sp, id, n) : STEP_NONE;
}

// preload_with appends the shim to a colon- or space-separated list, once.
static int preload_with(const char *have, char *out, size_t n)
{
	size_t sl = strlen(shim);
	for (const char *p = have; p && *p;) {
		size_t l = strcspn(p, ": ");
		if (l == sl && !strncmp(p, shim, l))
			return snprintf(out, n, "%s", have) < (int)n ? 0 : -1;
		p += l;
		p += strspn(p, ": ");
	}
	int r = have && *have ? snprintf(out, n, "%s:%s", have, shim) : snprintf(out, n, "%s", shim);
	return r > 0 && (size_t)r < n ? 0 : -1;
}

static int job_key(spank_t sp, const char *id, char *key, size_t n);

// step_key is the step's job key (step_key_ok 1), or why there is none
// (-1); asked of mpid in slurm_spank_init_post_opt, which slurmstepd runs
// as root. slurm_spank_user_init runs with the step's user's privileges,
// and mpid gives a job key for another user's step to root alone: asked
// from there, every step of a user but root ran without mpipause.
static char step_key[512];
static int step_key_ok;

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	char id[IDLEN];

	if (!spank_remote(sp) || access(shim, R_OK) != 0)
		return 0;
	switch (wanted(sp, id, sizeof(id))) {
	case STEP_NONE:
		return 0;
	case STEP_DAEMONS:
		// The batch script's job key, in the step's environment.
		if (spank_getenv(sp, "MPIPAUSE_JOBKEY", step_key, sizeof(step_key)) == ESPANK_SUCCESS && step_key[0])
			step_key_ok = 1;
		else
			step_key_ok = -1, snprintf(step_key, sizeof(step_key), "no MPIPAUSE_JOBKEY from the batch script");
		return 0;
	}
	step_key_ok = job_key(sp, id, step_key, sizeof(step_key)) < 0 ? -1 : 1;
	return 0;
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	char id[IDLEN], have[8192] = "", pre[8192 + 4096 + 2];

	if (!spank_remote(sp))
		return 0;
	int kind = wanted(sp, id, sizeof(id));
	if (kind == STEP_NONE)
		return 0;
	if (access(shim, R_OK) != 0) {
		slurm_error("mpipause: no shim at %s (%s): step %s runs without it and cannot be paused cleanly; "
			    "install mpipause or set shim= in plugstack.conf",
			    shim, strerror(errno), id);
		return 0;
	}
	if (spank_getenv(sp, "LD_PRELOAD", have, sizeof(have)) != ESPANK_SUCCESS)
		have[0] = 0;
	if (preload_with(have, pre, sizeof(pre)) < 0) {
		slurm_error("mpipause: LD_PRELOAD of step %s is too long to add the shim to", id);
		return 0;
	}
	if (step_key_ok != 1) {
		slurm_error("mpipause: step %s runs without mpipause and cannot be paused cleanly: %s", id,
			    step_key_ok ? step_key : "no job key (slurm_spank_init_post_opt did not ask mpid)");
		return 0;
	}
	const char *key = step_key;
	if (spank_setenv(sp, "LD_PRELOAD", pre, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MPIPAUSE_JOBID", id, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MPIPAUSE_JOBKEY", key, 1) != ESPANK_SUCCESS) {
		slurm_error("mpipause: cannot set the environment of step %s", id);
		return 0;
	}
	// In the batch script and the steps of the launcher's daemons only
	// the MPI processes are ranks (SLURM_PROCID is the script's and the
	// daemons'); an srun step's tasks are ranks, whatever the script had.
	if (kind == STEP_PLAIN)
		spank_unsetenv(sp, "MPIPAUSE_JOIN");
	else if (spank_setenv(sp, "MPIPAUSE_JOIN", "ranks", 1) != ESPANK_SUCCESS) {
		slurm_error("mpipause: cannot set the environment of step %s", id);
		return 0;
	}
	if (strcmp(ctl_addr, DEFAULT_CTL))
		spank_setenv(sp, "MPIPAUSE_CTL_SOCKET", ctl_addr, 1);
	slurm_verbose("mpipause: step %s: shim %s, job id %s", id, shim, id);
	return 0;
}

// say writes one line to the task's stderr (which srun shows), prefixed.
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	char b[1024], host[64] = "?";
	va_list ap;
	gethostname(host, sizeof(host) - 1);
	int n = snprintf(b, sizeof(b), "mpipause (slurm, %s): ", host);
	va_start(ap, fmt);
	n += vsnprintf(b + n, sizeof(b) - n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(b) - 2)
		n = sizeof(b) - 2;
	b[n++] = '\n';
	if (write(2, b, n) < 0) {
	}
}

// ctl_send sends one control request line (req, rlen bytes) to mpid and
// returns its final line in out (with its newline cut): 0, or -1 with why
// in out.
static int ctl_send(const char *req, int rlen, char *out, size_t n)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	size_t l = strlen(ctl_addr);
	socklen_t al;
	int fd;

	if (ctl_addr[0] == '@') {
		memcpy(a.sun_path + 1, ctl_addr + 1, l - 1);
		al = offsetof(struct sockaddr_un, sun_path) + l;
	} else {
		memcpy(a.sun_path, ctl_addr, l);
		al = offsetof(struct sockaddr_un, sun_path) + l + 1;
	}
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&a, al) < 0) {
		snprintf(out, n, "no mpid at %s: %s", ctl_addr, strerror(errno));
		if (fd >= 0)
			close(fd);
		return -1;
	}
	// Only root's word counts (SO_PEERCRED, before a byte is sent): an
	// abstract ctl= name can be bound by any user while mpid is down.
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0) {
		snprintf(out, n, "cannot tell who serves %s: %s", ctl_addr, strerror(errno));
		close(fd);
		return -1;
	}
	if (cr.uid != 0) {
		snprintf(out, n, "%s is served by uid %u, not by root: not mpid, not trusted", ctl_addr, (unsigned)cr.uid);
		close(fd);
		return -1;
	}
	struct timeval tv = {.tv_sec = 60};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	if (write(fd, req, rlen) != rlen) {
		snprintf(out, n, "mpid at %s: %s", ctl_addr, strerror(errno));
		close(fd);
		return -1;
	}
	// Progress lines come first; the final one is the last line before
	// mpid closes. Keep the current line's head, enough to tell them apart.
	char line[2048];
	size_t have = 0;
	int final = 0;
	out[0] = 0;
	for (;;) {
		char c;
		ssize_t r = read(fd, &c, 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		if (c != '\n') {
			if (have < sizeof(line) - 1)
				line[have++] = c;
			continue;
		}
		line[have] = 0;
		if (strncmp(line, "{\"progress\"", 11)) {
			snprintf(out, n, "%s", line);
			final = 1;
		}
		have = 0;
	}
	close(fd);
	if (!final) {
		snprintf(out, n, "mpid at %s closed the connection without an answer", ctl_addr);
		return -1;
	}
	return 0;
}

// ctl_do sends one control request for job id to mpid and returns its final
// line in out (with its newline cut): 0, or -1 with why in out.
static int ctl_do(const char *op, const char *id, char *out, size_t n)
{
	char req[256];
	int rlen = snprintf(req, sizeof(req), "{\"version\":1,\"op\":\"%s\",\"job\":\"%s\"}\n", op, id);
	return ctl_send(req, rlen, out, n);
}

// job_key asks mpid (as root, in slurmstepd) for the job key of step id of
// user uid, whose coordinator is the first node of the step's node list:
// the secret the tasks present to their nodes' mpids (docs/security.md).
// 0 with the key in key, or -1 with why in key.
static int job_key(spank_t sp, const char *id, char *key, size_t n)
{
	uid_t uid;
	char nodes[4096] = "", req[4096 + 512], rep[2048];
	static const char *const vars[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};

	if (spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS) {
		snprintf(key, n, "the step's user is not known");
		return -1;
	}
	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]) && !nodes[0]; i++)
		if (spank_getenv(sp, vars[i], nodes, sizeof(nodes)) != ESPANK_SUCCESS)
			nodes[0] = 0;
	// The batch script's node coordinates what mpirun or mpiexec starts
	// from it (the first of the job's nodes, where Slurm runs the script).
	if (!nodes[0] && gethostname(nodes, sizeof(nodes) - 1) == 0)
		nodes[strcspn(nodes, ".")] = 0;
	// A host list is names, brackets, ranges and commas: nothing to escape.
	if (!nodes[0] || strspn(nodes, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.,[]") != strlen(nodes)) {
		snprintf(key, n, "the step's node list (SLURM_STEP_NODELIST) is missing or not a host list");
		return -1;
	}
	int rlen = snprintf(req, sizeof(req), "{\"version\":1,\"op\":\"token\",\"job\":\"%s\",\"owner_uid\":%u,\"nodelist\":\"%s\"}\n",
			    id, (unsigned)uid, nodes);
	if (ctl_send(req, rlen, rep, sizeof(rep)) < 0) {
		snprintf(key, n, "%.300s", rep);
		return -1;
	}
	const char *t = strstr(rep, "\"token\":\"");
	const char *e = t ? strchr(t + 9, '"') : NULL;
	if (!t || !e || (size_t)(e - (t + 9)) >= n) {
		snprintf(key, n, "mpid did not give the job key: %.200s", rep);
		return -1;
	}
	snprintf(key, n, "%.*s", (int)(e - (t + 9)), t + 9);
	return 0;
}

// resume asks mpid to resume job id. A pause still under way (a resume at
// once after a suspend, on a slow machine) is waited for.
static void resume(const char *id)
{
	char rep[2048];
	struct timespec t0, now;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		if (ctl_do("resume", id, rep, sizeof(rep)) < 0) {
			say("Slurm resumed step %s, but the job could not be resumed: %s", id, rep);
			return;
		}
		if (!strstr(rep, "\"error\"")) {
			return;
		}
		// Refused: maybe another node's watcher resumed it first (it
		// runs), or a pause or resume is under way (wait for it).
		char st[2048];
		if (ctl_do("status", id, st, sizeof(st)) < 0 || strstr(st, "\"error\"") ||
		    strstr(st, "\"state\":\"running\"") || strstr(st, "\"state\":\"failed\""))
			return;
		if (strstr(st, "\"state\":\"paused\"") && !strstr(rep, "\"code\":\"state\"")) {
			say("Slurm resumed step %s, but mpid refused to resume the job: %s", id, rep);
			return;
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec - t0.tv_sec > 60) {
			say("Slurm resumed step %s, but the job did not resume within 60 s: %s", id, rep);
			return;
		}
		poll(NULL, 0, 100);
	}
}

// task_stopped: 1 if process pid is stopped by a signal (state T in
// /proc/PID/stat), 0 if not, -1 if it cannot be read.
static int task_stopped(pid_t pid)
{
	char path[64], b[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t r = read(fd, b, sizeof(b) - 1);
	close(fd);
	if (r <= 0)
		return -1;
	b[r] = 0;
	// "PID (COMM) STATE ...": COMM may hold anything, up to the last ')'.
	const char *p = strrchr(b, ')');
	return p && p[1] == ' ' && p[2] == 'T' ? 1 : 0;
}

// watch is the watcher's life: see the comment at the top.
//
// A task that is an MPI launcher's daemon (Open MPI's orted, MPICH's
// hydra_pmi_proxy: mpirun or mpiexec inside sbatch starts them with srun)
// is stopped by the SIGTSTP of scontrol suspend, which under
// proctrack/cgroup reaches the step's tasks alone, not their children, the
// ranks. The watcher sees its task stopped (state T, on two ticks in a row)
// and asks the node's mpid to pause the job itself; it asks to resume it
// when the task runs again (Slurm's SIGCONT). A rank that is a task handles
// its SIGTSTP (the shim) and is never stopped by it.
static void watch(const char *id, pid_t task)
{
	sigset_t set;
	int suspended = 0, stops = 0, asked = 0;

	prctl(PR_SET_NAME, "mpipause-watch");
	// Gone with the task: the kernel's signal at its death, and a check of
	// the parent for the case the task died before prctl.
	prctl(PR_SET_PDEATHSIG, SIGTERM);
	if (getppid() != task)
		_exit(0);
	// Hold nothing of the task's: the PMI channel, the step's sockets and
	// its stdout must close when the task does, whatever the watcher does.
	int null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null >= 0) {
		dup2(null, 0);
		dup2(null, 1);
	}
	if (syscall(SYS_close_range, 3, ~0U, 0) < 0)
		for (int fd = 3; fd < 1024; fd++)
			close(fd);

	sigemptyset(&set);
	sigaddset(&set, SIGTSTP);
	sigaddset(&set, SIGCONT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGHUP);
	sigprocmask(SIG_SETMASK, &set, NULL);
	for (;;) {
		struct timespec tick = {.tv_nsec = 100 * 1000 * 1000};
		int s = sigtimedwait(&set, NULL, &tick);
		if (s < 0) {
			if (getppid() != task)
				_exit(0);
			int st = task_stopped(task);
			if (st == 1 && !asked && ++stops >= 2) {
				char rep[2048];
				asked = 1;
				if (ctl_do("pause", id, rep, sizeof(rep)) < 0)
					say("step %s: its task %d was stopped, but the job could not be paused: %s", id,
					    (int)task, rep);
			} else if (st == 0) {
				stops = 0;
				if (asked)
					resume(id);
				asked = 0;
			}
			continue;
		}
		switch (s) {
		case SIGTSTP:
			// The ranks got it too: their shims ask mpid to pause.
			suspended = 1;
			break;
		case SIGCONT:
			if (suspended)
				resume(id);
			suspended = 0;
			break;
		default:
			_exit(0);
		}
	}
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	char id[IDLEN];
	int task;

	if (wanted(sp, id, sizeof(id)) == STEP_NONE || access(shim, R_OK) != 0)
		return 0;
	if (spank_get_item(sp, S_TASK_ID, &task) != ESPANK_SUCCESS || task != 0)
		return 0;
	pid_t me = getpid();
	pid_t w = fork();
	if (w < 0) {
		slurm_error("mpipause: step %s: no watcher (fork: %s): scontrol resume will not resume the job; "
			    "mpipause resume %s will",
			    id, strerror(errno), id);
		return 0;
	}
	if (w == 0) {
		watch(id, me);
		_exit(0);
	}
	return 0;
}

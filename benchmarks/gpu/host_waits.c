// LD_PRELOAD shim: times every untimed pthread_cond_wait (MLX's scheduler::wait_for_one, its CPU array waits).
// Build: cc -O2 -shared -fPIC -o host_waits.so host_waits.c -ldl -lpthread
// Read from Python with benchmarks/gpu/host_waits.py (ctypes); times are CLOCK_MONOTONIC ns, tid the kernel's.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define CAPACITY (1L << 20)  // records kept; later waits are counted in `dropped`

typedef struct {
  int64_t start_ns, end_ns;
  int32_t tid;
} record_t;

typedef int (*cond_wait_fn)(pthread_cond_t*, pthread_mutex_t*);

static record_t records[CAPACITY];
static atomic_long next_index;  // records claimed (may pass CAPACITY: the excess was dropped)
static atomic_long dropped;
static _Atomic(cond_wait_fn) real_wait;
static atomic_long min_ns = -1;  // -1: HOST_WAITS_MIN_US not read yet

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static cond_wait_fn resolve(void) {
  // the new-ABI symbol (libstdc++ and libmlx bind @GLIBC_2.3.2); plain dlsym may give the 2.2.5 compat one
  cond_wait_fn fn = (cond_wait_fn)dlvsym(RTLD_NEXT, "pthread_cond_wait", "GLIBC_2.3.2");
  if (fn == NULL) fn = (cond_wait_fn)dlsym(RTLD_NEXT, "pthread_cond_wait");
  atomic_store(&real_wait, fn);
  return fn;
}

static long threshold_ns(void) {
  long ns = atomic_load(&min_ns);
  if (ns >= 0) return ns;
  const char* env = getenv("HOST_WAITS_MIN_US");
  ns = (env != NULL && *env != '\0') ? atol(env) * 1000L : 50000L;  // default 50 us
  atomic_store(&min_ns, ns);
  return ns;
}

int pthread_cond_wait(pthread_cond_t* cond, pthread_mutex_t* mutex) {
  cond_wait_fn fn = atomic_load(&real_wait);
  if (fn == NULL) fn = resolve();
  int64_t start = now_ns();
  int rc = fn(cond, mutex);
  int64_t end = now_ns();
  if (end - start < threshold_ns()) return rc;
  long i = atomic_fetch_add(&next_index, 1);
  if (i >= CAPACITY) {
    atomic_fetch_add(&dropped, 1);
    return rc;
  }
  records[i] = (record_t){start, end, (int32_t)syscall(SYS_gettid)};  // not cached: a forked child's differs
  return rc;
}

// Records kept so far (a record being written as this runs may still read as zeros).
long host_waits_count(void) {
  long n = atomic_load(&next_index);
  return n < CAPACITY ? n : CAPACITY;
}

// Copies up to `max` records into `out` as (start_ns, end_ns, tid) triples; returns how many.
long host_waits_read(long long* out, long max) {
  long n = host_waits_count();
  if (n > max) n = max;
  for (long i = 0; i < n; i++) {
    out[3 * i] = records[i].start_ns;
    out[3 * i + 1] = records[i].end_ns;
    out[3 * i + 2] = records[i].tid;
  }
  return n;
}

// Forgets every record and the dropped count (waits in progress may land after it).
void host_waits_clear(void) {
  atomic_store(&next_index, 0);
  atomic_store(&dropped, 0);
}

// Waits over the threshold that found the array full.
long host_waits_dropped(void) { return atomic_load(&dropped); }

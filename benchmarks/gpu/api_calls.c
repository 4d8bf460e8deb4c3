// CUPTI callback shim: times every CUDA driver and runtime API call of this process, MLX's included (libmlx links
// the CUDA runtime statically, so an LD_PRELOAD shim sees none of its runtime calls; CUPTI sees them at the driver).
// Build: cc -O2 -shared -fPIC -o api_calls.so api_calls.c -L$CUPTI/lib -l:libcupti.so.13
// Read from Python with benchmarks/gpu/api_calls.py (ctypes); times are CLOCK_MONOTONIC ns, tid the kernel's.
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// The few declarations of CUPTI's callback API this uses (cupti_callbacks.h, CUDA 13), written out because its
// headers need the CUDA runtime's, which the lent machine's `nvidia/cu13` wheels lack (thirty-sixth run).
typedef int CUptiResult;  // CUPTI_SUCCESS is 0
typedef enum { CUPTI_CB_DOMAIN_DRIVER_API = 1, CUPTI_CB_DOMAIN_RUNTIME_API = 2 } CUpti_CallbackDomain;
typedef enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 } CUpti_ApiCallbackSite;
typedef uint32_t CUpti_CallbackId;
typedef struct CUpti_Subscriber_st* CUpti_SubscriberHandle;
typedef void (*CUpti_CallbackFunc)(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                                   const void* data);
typedef struct {
  CUpti_ApiCallbackSite callbackSite;
  const char* functionName;
  const void* functionParams;
  void* functionReturnValue;
  const char* symbolName;
  void* context;  // CUcontext
  uint32_t contextUid;
  uint64_t* correlationData;
  uint32_t correlationId;
} CUpti_CallbackData;
CUptiResult cuptiSubscribe(CUpti_SubscriberHandle* subscriber, CUpti_CallbackFunc callback, void* userdata);
CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle subscriber, CUpti_CallbackDomain domain);
CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber);
#define CUPTI_SUCCESS 0

#define CAPACITY (1L << 20)  // records kept; later calls are counted in `dropped`

typedef struct {
  const char* name;  // CUPTI's: a global constant
  int64_t start_ns, end_ns;
  int32_t tid, domain;  // CUpti_CallbackDomain: driver or runtime
} record_t;

static record_t records[CAPACITY];
static atomic_long next_index;  // records claimed (may pass CAPACITY: the excess was dropped)
static atomic_long dropped;
static atomic_long min_ns;
static CUpti_SubscriberHandle subscriber;
static int subscribed;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void on_call(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  (void)userdata;
  (void)cbid;
  const CUpti_CallbackData* call = (const CUpti_CallbackData*)data;
  if (call->callbackSite == CUPTI_API_ENTER) {  // the entry's time rides to the exit in the call's own slot
    *call->correlationData = (uint64_t)now_ns();
    return;
  }
  int64_t start = (int64_t)*call->correlationData, end = now_ns();
  if (end - start < atomic_load(&min_ns)) return;
  long i = atomic_fetch_add(&next_index, 1);
  if (i >= CAPACITY) {
    atomic_fetch_add(&dropped, 1);
    return;
  }
  records[i] = (record_t){call->functionName, start, end, (int32_t)syscall(SYS_gettid), (int32_t)domain};
}

// Times calls of at least `min_duration_ns` from now on; returns CUPTI's result (0: subscribed).
int api_calls_start(long long min_duration_ns) {
  atomic_store(&min_ns, (long)min_duration_ns);
  if (subscribed) return 0;
  CUptiResult result = cuptiSubscribe(&subscriber, (CUpti_CallbackFunc)on_call, NULL);
  if (result != CUPTI_SUCCESS) return (int)result;
  subscribed = 1;
  result = cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API);
  if (result == CUPTI_SUCCESS) result = cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API);
  return (int)result;
}

// Stops timing (the records stay).
void api_calls_stop(void) {
  if (subscribed) cuptiUnsubscribe(subscriber);
  subscribed = 0;
}

// Records kept so far (a record being written as this runs may still read as zeros).
long api_calls_count(void) {
  long n = atomic_load(&next_index);
  return n < CAPACITY ? n : CAPACITY;
}

// Copies up to `max` records: (start_ns, end_ns, tid, domain) into `times`, the call's name into `names`.
long api_calls_read(long long* times, const char** names, long max) {
  long n = api_calls_count();
  if (n > max) n = max;
  for (long i = 0; i < n; i++) {
    times[4 * i] = records[i].start_ns;
    times[4 * i + 1] = records[i].end_ns;
    times[4 * i + 2] = records[i].tid;
    times[4 * i + 3] = records[i].domain;
    names[i] = records[i].name;
  }
  return n;
}

// Forgets every record and the dropped count.
void api_calls_clear(void) {
  atomic_store(&next_index, 0);
  atomic_store(&dropped, 0);
}

long api_calls_dropped(void) { return atomic_load(&dropped); }

/* MSL simulator runtime: runs one compiled Metal kernel over a dispatchThreads grid.
 *
 * Every thread of a threadgroup is a coroutine with its own small stack. The scheduler runs each
 * runnable thread until it blocks (threadgroup barrier, SIMD-group operation) or returns, in the
 * order chosen by the caller (forward or reverse: a missing barrier shows up in one of them).
 * When every thread is blocked it releases whatever can proceed:
 *   - a SIMD group whose live lanes all wait at the same SIMD operation (same kind, same source
 *     line) is released together; each lane then reads all lanes' deposited values (lockstep);
 *   - when every live thread waits at threadgroup_barrier, all are released.
 * Anything else is a divergence/deadlock and is reported as an error instead of hanging.
 * Threadgroups run one after another on this OS thread, so function-local `threadgroup` arrays
 * (emitted as statics in the section msl_tgmem) are shared by exactly one threadgroup; the section
 * is poisoned with 0xFF bytes (NaN / -1) before each threadgroup.
 *
 * The process running this is a child of the Python driver (runner.c, or a fork): a fault (guard page hit,
 * stack overflow) is reported through the shared error record and the child exits.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* AddressSanitizer keeps a shadow of each stack: every switch between the scheduler's stack
 * and a coroutine's is announced to it (its fiber interface), or it would take the coroutine's
 * frames for a stack overflow or report stale redzones of a finished coroutine's stack. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSL_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MSL_ASAN 1
#endif
#if defined(MSL_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define MSL_FIBER_LEAVE(save, bottom, size) __sanitizer_start_switch_fiber((save), (bottom), (size))
#define MSL_FIBER_ENTER(save) \
  __sanitizer_finish_switch_fiber((save), &scheduler_stack_bottom, &scheduler_stack_size)
#else
#define MSL_FIBER_LEAVE(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define MSL_FIBER_ENTER(save) ((void)(save))
#endif

static const void *scheduler_stack_bottom; /* learnt at a coroutine's first entry (ASan) */
static size_t scheduler_stack_size;

#if defined(__x86_64__) && !defined(MSL_USE_UCONTEXT)
#define MSL_X86_SWITCH 1
#else
#include <ucontext.h>
#endif

#define MSL_SIMD_WIDTH 32
#define MSL_SLOT_BYTES 64
#define MSL_MAX_THREADS 1024
#ifndef MSL_STACK_BYTES /* the sanitizer build passes a larger one: ASan's redzones grow frames */
#define MSL_STACK_BYTES (64 * 1024)
#endif
#define MSL_MAX_BUFFERS 64

enum { ST_RUNNABLE = 0, ST_BARRIER = 1, ST_SIMD = 2, ST_DONE = 3 };

/* Thread info read by the shim (layout mirrored in metal_shim.h). */
typedef struct {
  uint32_t tpig[3], tptg[3], tgpig[3];
  uint32_t index_in_tg, simd_lane, simd_group;
} msl_thread_info;

typedef struct {
  uint32_t grid[3], tg[3], tgs_per_grid[3], tg_actual[3];
  uint32_t threads_in_tg, simdgroups_in_tg;
} msl_dispatch_info;

/* Error record shared with the parent process (it lives in a MAP_SHARED page). */
typedef struct {
  int32_t code; /* 0 ok, 1 scheduler error, 2 fault, 3 stack overflow */
  int32_t buffer; /* buffer index for faults, -1 otherwise */
  int64_t offset; /* byte offset of the fault relative to the buffer start */
  char message[2048];
} msl_error;

typedef struct {
  void *sp; /* x86-64: saved stack pointer */
#if !defined(MSL_X86_SWITCH)
  ucontext_t uc;
#endif
  char *stack; /* usable stack base (above the guard page) */
  int state;
  int simd_kind, simd_site;
  msl_thread_info info;
} msl_thread;

typedef struct {
  int generation; /* counts completed exchanges; selects the slot buffer */
  uint32_t active_mask;
  unsigned char slots[2][MSL_SIMD_WIDTH][MSL_SLOT_BYTES];
} msl_simdgroup;

extern void msl_kernel_entry(void **buffers);

msl_dispatch_info msl_dispatch;
static msl_thread *threads;
static msl_simdgroup simdgroups[MSL_MAX_THREADS / MSL_SIMD_WIDTH];
static msl_thread *current;
#if defined(MSL_X86_SWITCH)
static void *scheduler_sp;
#else
static ucontext_t scheduler_uc;
#endif
static void **kernel_buffers;
static msl_error *error_out;
static char *stack_region;
static size_t stack_region_bytes;
static uintptr_t buf_lo[MSL_MAX_BUFFERS], buf_hi[MSL_MAX_BUFFERS];
static int n_buffers;

extern char __start_msl_tgmem[] __attribute__((weak));
extern char __stop_msl_tgmem[] __attribute__((weak));

/* ---- context switching ------------------------------------------------------------------- */
#if defined(MSL_X86_SWITCH)
/* Saves callee-saved registers + MXCSR/x87 CW on the current stack, stores rsp in *from, switches
 * to `to`. No signal-mask syscall (unlike swapcontext), so a switch costs a few nanoseconds. */
void msl_switch(void **from, void *to);
__asm__(".text\n.globl msl_switch\n.type msl_switch,@function\nmsl_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size msl_switch, .-msl_switch\n"
        ".globl msl_trampoline\n.type msl_trampoline,@function\nmsl_trampoline:\n"
        "  movq %r12, %rdi\n  callq *%r13\n  ud2\n"
        ".size msl_trampoline, .-msl_trampoline\n");
void msl_trampoline(void);
#endif

static void thread_main(void *arg);

static void to_scheduler(void) {
  /* A finished thread's stack is abandoned (NULL save): it is never resumed. */
  void *fake = NULL;
  MSL_FIBER_LEAVE(current->state == ST_DONE ? NULL : &fake, scheduler_stack_bottom,
                  scheduler_stack_size);
#if defined(MSL_X86_SWITCH)
  msl_switch(&current->sp, scheduler_sp);
#else
  swapcontext(&current->uc, &scheduler_uc);
#endif
  MSL_FIBER_ENTER(fake);
}

static void resume(msl_thread *t) {
  current = t;
  void *fake = NULL;
  MSL_FIBER_LEAVE(&fake, t->stack, MSL_STACK_BYTES);
#if defined(MSL_X86_SWITCH)
  msl_switch(&scheduler_sp, t->sp);
#else
  swapcontext(&scheduler_uc, &t->uc);
#endif
  /* back on the scheduler's stack */
#if defined(MSL_ASAN)
  __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
  current = NULL;
}

static void start_thread(msl_thread *t) {
#if defined(MSL_ASAN)
  /* the stack of the last threadgroup's thread: its frames' redzones are gone with it */
  ASAN_UNPOISON_MEMORY_REGION(t->stack, MSL_STACK_BYTES);
#endif
#if defined(MSL_X86_SWITCH)
  uintptr_t top = ((uintptr_t)t->stack + MSL_STACK_BYTES) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)top;
  /* msl_switch's `ret` pops this, leaving rsp == top (16-byte aligned) for the trampoline's call */
  *--sp = (uint64_t)(uintptr_t)msl_trampoline;
  *--sp = 0;                             /* rbp */
  *--sp = 0;                             /* rbx */
  *--sp = (uint64_t)(uintptr_t)t;        /* r12: argument */
  *--sp = (uint64_t)(uintptr_t)thread_main; /* r13: function */
  *--sp = 0;                             /* r14 */
  *--sp = 0;                             /* r15 */
  uint32_t csr[2];
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(*(uint16_t *)&csr[1]));
  *--sp = (uint64_t)csr[0] | ((uint64_t)(csr[1] & 0xffff) << 32);
  t->sp = sp;
#else
  getcontext(&t->uc);
  t->uc.uc_stack.ss_sp = t->stack;
  t->uc.uc_stack.ss_size = MSL_STACK_BYTES;
  t->uc.uc_link = NULL;
  makecontext(&t->uc, (void (*)(void))thread_main, 1, t);
#endif
  t->state = ST_RUNNABLE;
}

static void thread_main(void *arg) {
  msl_thread *t = (msl_thread *)arg;
  (void)t;
  MSL_FIBER_ENTER(NULL); /* first entry: learns the scheduler's stack */
  msl_kernel_entry(kernel_buffers);
  current->state = ST_DONE;
  to_scheduler();
  abort(); /* a finished thread is never resumed */
}

/* ---- API used by the shim ---------------------------------------------------------------- */
const msl_thread_info *msl_current_info(void) { return &current->info; }

void msl_threadgroup_barrier(int site) {
  current->state = ST_BARRIER;
  current->simd_site = site;
  to_scheduler();
}

/* A misuse the shim detects (e.g. a SIMD-group matrix op with inactive lanes): report and stop. */
void msl_fatal(const char *message) {
  const msl_thread_info *w = &current->info;
  error_out->code = 1;
  snprintf(error_out->message, sizeof(error_out->message),
           "%s: lane %u of simdgroup %u in threadgroup (%u,%u,%u)", message, w->simd_lane,
           w->simd_group, w->tgpig[0], w->tgpig[1], w->tgpig[2]);
  _exit(71);
}

/* Deposit `size` bytes for this lane, wait until the SIMD group exchanges, return the slot buffer
 * (MSL_SIMD_WIDTH slots of MSL_SLOT_BYTES) and the mask of lanes that took part. */
const void *msl_simd_exchange(const void *value, int size, int kind, int site, uint32_t *active) {
  msl_thread *t = current;
  msl_simdgroup *g = &simdgroups[t->info.simd_group];
  if (size > MSL_SLOT_BYTES) size = MSL_SLOT_BYTES;
  memcpy(g->slots[g->generation & 1][t->info.simd_lane], value, (size_t)size);
  t->state = ST_SIMD;
  t->simd_kind = kind;
  t->simd_site = site;
  to_scheduler();
  /* The scheduler bumped the generation when releasing the group. */
  *active = g->active_mask;
  return g->slots[(g->generation - 1) & 1];
}

/* ---- scheduler --------------------------------------------------------------------------- */
static const char *kind_name(int kind) {
  static const char *names[] = {"simdgroup_barrier", "simd_sum", "simd_max", "simd_min",
                                "simd_prefix_inclusive_sum", "simd_prefix_exclusive_sum",
                                "simd_shuffle", "simd_shuffle_down", "simd_shuffle_up",
                                "simd_shuffle_xor", "simd_broadcast", "simd_broadcast_first",
                                "simd_product", "simd_and", "simd_or", "simd_xor", "simd_all",
                                "simd_any", "simd_ballot", "simd_is_first", "simdgroup_load",
                                "simdgroup_store", "simdgroup_multiply"};
  if (kind >= 0 && kind < (int)(sizeof(names) / sizeof(names[0]))) return names[kind];
  return "simd op";
}

static int fail(const char *fmt_tg, const msl_thread_info *where, const char *detail) {
  error_out->code = 1;
  snprintf(error_out->message, sizeof(error_out->message), "%s in threadgroup (%u,%u,%u): %s",
           fmt_tg, where->tgpig[0], where->tgpig[1], where->tgpig[2], detail);
  return -1;
}

/* Releases the SIMD group of threads [base, end) if its live lanes all wait at one SIMD op.
 * Returns how many threads were released (0: none waits at a SIMD op), or -1 on a divergence. */
static int release_group(int base, int end) {
  int at_simd = 0, live = 0, first = -1;
  for (int i = base; i < end; i++) {
    if (threads[i].state == ST_DONE) continue;
    live++;
    if (threads[i].state == ST_SIMD) {
      at_simd++;
      if (first < 0) first = i;
    }
  }
  if (at_simd == 0) return 0;
  char detail[512];
  for (int i = base; i < end; i++) {
    msl_thread *t = &threads[i];
    if (t->state == ST_DONE) continue;
    if (t->state != ST_SIMD || t->simd_kind != threads[first].simd_kind ||
        t->simd_site != threads[first].simd_site) {
      if (t->state == ST_SIMD)
        snprintf(detail, sizeof detail,
                 "SIMD divergence in simdgroup %d: lane %d waits at %s (line %d) while lane %d "
                 "waits at %s (line %d)",
                 base / MSL_SIMD_WIDTH, first - base, kind_name(threads[first].simd_kind),
                 threads[first].simd_site >> 12, i - base, kind_name(t->simd_kind),
                 t->simd_site >> 12);
      else
        snprintf(detail, sizeof detail,
                 "SIMD divergence in simdgroup %d: lane %d waits at %s (line %d) while lane %d "
                 "waits at threadgroup_barrier",
                 base / MSL_SIMD_WIDTH, first - base, kind_name(threads[first].simd_kind),
                 threads[first].simd_site >> 12, i - base);
      return fail("deadlock", &threads[i].info, detail);
    }
  }
  msl_simdgroup *g = &simdgroups[base / MSL_SIMD_WIDTH];
  g->active_mask = 0;
  for (int i = base; i < end; i++)
    if (threads[i].state == ST_SIMD) {
      g->active_mask |= 1u << (i - base);
      threads[i].state = ST_RUNNABLE;
    }
  g->generation++;
  return live;
}

static int run_threadgroup(const uint32_t tgid[3], int reverse) {
  msl_dispatch_info *d = &msl_dispatch;
  uint32_t ext[3];
  for (int k = 0; k < 3; k++) {
    uint32_t start = tgid[k] * d->tg[k];
    ext[k] = d->grid[k] - start < d->tg[k] ? d->grid[k] - start : d->tg[k];
  }
  int n = (int)(ext[0] * ext[1] * ext[2]);
  memcpy(d->tg_actual, ext, sizeof ext);
  d->threads_in_tg = (uint32_t)n;
  d->simdgroups_in_tg = (uint32_t)((n + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH);
  if (__start_msl_tgmem && __stop_msl_tgmem > __start_msl_tgmem)
    memset(__start_msl_tgmem, 0xFF, (size_t)(__stop_msl_tgmem - __start_msl_tgmem));
  for (int i = 0; i < n; i++) {
    msl_thread *t = &threads[i];
    uint32_t lx = (uint32_t)i % ext[0], ly = ((uint32_t)i / ext[0]) % ext[1],
             lz = (uint32_t)i / (ext[0] * ext[1]);
    t->info.tptg[0] = lx, t->info.tptg[1] = ly, t->info.tptg[2] = lz;
    for (int k = 0; k < 3; k++) {
      t->info.tgpig[k] = tgid[k];
      t->info.tpig[k] = tgid[k] * d->tg[k] + t->info.tptg[k];
    }
    t->info.index_in_tg = (uint32_t)i;
    t->info.simd_lane = (uint32_t)i % MSL_SIMD_WIDTH;
    t->info.simd_group = (uint32_t)i / MSL_SIMD_WIDTH;
    start_thread(t);
  }
  for (int g = 0; g < (n + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH; g++) simdgroups[g].generation = 0;
  /* One SIMD group at a time runs as far as it can (its SIMD ops released as soon as all its
   * lanes arrive) before the next starts: a SIMD group reaches the code after a missing
   * threadgroup_barrier before the others have done their part (their writes are missing in one
   * schedule and present in the other). */
  const int ngroups = (n + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH;
  for (;;) {
    for (int gi = 0; gi < ngroups; gi++) {
      const int base = (reverse ? ngroups - 1 - gi : gi) * MSL_SIMD_WIDTH;
      const int end = base + MSL_SIMD_WIDTH < n ? base + MSL_SIMD_WIDTH : n;
      for (;;) {
        for (int j = 0; j < end - base; j++) {
          msl_thread *t = &threads[reverse ? end - 1 - j : base + j];
          if (t->state == ST_RUNNABLE) resume(t);
        }
        int released = release_group(base, end);
        if (released < 0) return -1;
        if (released == 0) break;
      }
    }
    int done = 0, at_barrier = 0, first_done = -1, first_barrier = -1;
    for (int i = 0; i < n; i++) {
      if (threads[i].state == ST_DONE) {
        done++;
        if (first_done < 0) first_done = i;
      } else if (threads[i].state == ST_BARRIER) {
        at_barrier++;
        if (first_barrier < 0) first_barrier = i;
      }
    }
    if (done == n) return 0;
    if (at_barrier == n) {
      for (int i = 0; i < n; i++) {
        if (threads[i].simd_site == threads[0].simd_site) continue;
        char d2[512];
        snprintf(d2, sizeof d2,
                 "threads wait at different threadgroup_barrier calls: thread 0 at line %d, "
                 "thread %d at line %d",
                 threads[0].simd_site >> 12, i, threads[i].simd_site >> 12);
        return fail("deadlock", &threads[i].info, d2);
      }
      for (int i = 0; i < n; i++) threads[i].state = ST_RUNNABLE;
      continue;
    }
    char detail[512];
    snprintf(detail, sizeof detail,
             "divergent threadgroup_barrier: %d of %d threads wait at the barrier (first: thread "
             "%d) but %d threads already returned (first: thread %d)",
             at_barrier, n, first_barrier, done, first_done);
    return fail("deadlock", &threads[first_barrier >= 0 ? first_barrier : 0].info, detail);
  }
}

/* ---- fault reporting --------------------------------------------------------------------- */
static void on_fault(int sig, siginfo_t *si, void *ctx) {
  (void)ctx;
  uintptr_t a = (uintptr_t)si->si_addr;
  error_out->code = 2;
  error_out->buffer = -1;
  for (int i = 0; i < n_buffers; i++) {
    if (a >= buf_lo[i] - 4096 && a < buf_hi[i] + 4096 && !(a >= buf_lo[i] && a < buf_hi[i])) {
      error_out->buffer = i;
      error_out->offset = (int64_t)(a - buf_lo[i]);
    }
  }
  if (error_out->buffer < 0 && stack_region && a >= (uintptr_t)stack_region &&
      a < (uintptr_t)stack_region + stack_region_bytes)
    error_out->code = 3;
  snprintf(error_out->message, sizeof(error_out->message), "signal %d at address %p", sig,
           si->si_addr);
  if (current) {
    const msl_thread_info *w = &current->info;
    size_t len = strlen(error_out->message);
    snprintf(error_out->message + len, sizeof(error_out->message) - len,
             " in thread (%u,%u,%u) of threadgroup (%u,%u,%u)", w->tptg[0], w->tptg[1],
             w->tptg[2], w->tgpig[0], w->tgpig[1], w->tgpig[2]);
  }
  _exit(70);
}

static void install_fault_handler(void) {
  static char altstack[64 * 1024];
  stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
  sigaction(SIGILL, &sa, NULL);
}

/* ---- entry point ------------------------------------------------------------------------- */
/* buffers[i] spans [buffers[i], buffers[i] + sizes[i]) and is followed by a guard page.
 * reverse: 1 runs threads and threadgroups in reverse order. */
/* err_record is an msl_error; its type is void * so that the runner's declaration (runner.c),
 * which does not know the struct, names the same function type (calling through a pointer of
 * another function type is undefined behaviour, and UBSan reports it). */
int msl_run(void **buffers, const int64_t *sizes, int nbuf, const uint32_t *grid,
            const uint32_t *tg, int reverse, void *err_record) {
  msl_error *err = (msl_error *)err_record;
  error_out = err;
  memset(err, 0, sizeof *err);
  err->buffer = -1;
  kernel_buffers = buffers;
  n_buffers = nbuf < MSL_MAX_BUFFERS ? nbuf : MSL_MAX_BUFFERS;
  for (int i = 0; i < n_buffers; i++) {
    buf_lo[i] = (uintptr_t)buffers[i];
    buf_hi[i] = (uintptr_t)buffers[i] + (uintptr_t)sizes[i];
  }
  msl_dispatch_info *d = &msl_dispatch;
  uint32_t total = 1;
  for (int k = 0; k < 3; k++) {
    d->grid[k] = grid[k];
    d->tg[k] = tg[k] < grid[k] ? tg[k] : grid[k]; /* MLX clamps the threadgroup to the grid */
    if (d->tg[k] == 0) d->tg[k] = 1;
    d->tgs_per_grid[k] = (grid[k] + d->tg[k] - 1) / d->tg[k];
    total *= d->tg[k];
  }
  if (total > MSL_MAX_THREADS) {
    err->code = 1;
    snprintf(err->message, sizeof err->message, "threadgroup of %u threads exceeds %d", total,
             MSL_MAX_THREADS);
    return -1;
  }
  long page = sysconf(_SC_PAGESIZE);
  size_t per = MSL_STACK_BYTES + (size_t)page; /* guard page below each stack */
  stack_region_bytes = per * total;
  stack_region = mmap(NULL, stack_region_bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (stack_region == MAP_FAILED) {
    err->code = 1;
    snprintf(err->message, sizeof err->message, "cannot allocate coroutine stacks");
    return -1;
  }
  threads = calloc(total, sizeof(msl_thread));
  for (uint32_t i = 0; i < total; i++) {
    mprotect(stack_region + per * i, (size_t)page, PROT_NONE);
    threads[i].stack = stack_region + per * i + page;
  }
  install_fault_handler();
  if (d->grid[0] == 0 || d->grid[1] == 0 || d->grid[2] == 0) return 0;
  uint32_t ntg[3] = {d->tgs_per_grid[0], d->tgs_per_grid[1], d->tgs_per_grid[2]};
  uint64_t count = (uint64_t)ntg[0] * ntg[1] * ntg[2];
  for (uint64_t j = 0; j < count; j++) {
    uint64_t i = reverse ? count - 1 - j : j;
    uint32_t id[3] = {(uint32_t)(i % ntg[0]), (uint32_t)((i / ntg[0]) % ntg[1]),
                      (uint32_t)(i / ((uint64_t)ntg[0] * ntg[1]))};
    if (run_threadgroup(id, reverse) != 0) return -1;
  }
  return 0;
}

/* ---- half-precision conversion libcalls ------------------------------------------------- */
/* On x86-64 without F16C, LLVM lowers every half <-> float conversion to a library call, and
 * which call, and how the half travels, depends on the compiler:
 *   - LLVM <= 14: __gnu_h2f_ieee / __gnu_f2h_ieee, the half as a 16-bit integer (edi / ax);
 *   - LLVM >= 15: __extendhfsf2 / __truncsfhf2 / __truncdfhf2, the half in xmm0 (the _Float16
 *     ABI of the x86-64 psABI).
 * A definition with the wrong parameter type reads whatever the register holds, so the
 * __extendhfsf2 family is declared with _Float16 wherever the compiler has that type (it then
 * has the xmm0 convention) and with uint16_t only where it has not (where no caller would use
 * the xmm0 convention either). runtime.c is always compiled by the compiler that compiles the
 * kernels (simulator.py). */
#if defined(__FLT16_MANT_DIG__)
typedef _Float16 msl_abi_half;
#else
typedef uint16_t msl_abi_half;
#endif

static float half_bits_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      int e = -1;
      do { man <<= 1; e++; } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* Round-to-nearest-even of a double to half, from the bits (no double rounding through float). */
static uint16_t double_to_half_bits(double d) {
  uint64_t x;
  memcpy(&x, &d, 8);
  uint16_t sign = (uint16_t)((x >> 48) & 0x8000);
  uint64_t absx = x & 0x7fffffffffffffffull;
  int exp = (int)(absx >> 52);
  uint64_t man = absx & 0xfffffffffffffull;
  if (exp == 0x7ff) /* inf or nan (keep nan quiet, keep the top payload bits) */
    return (uint16_t)(sign | 0x7c00 | (man ? 0x200 | (uint16_t)(man >> 42) : 0));
  int e = exp - 1023; /* unbiased */
  if (e > 15) return (uint16_t)(sign | 0x7c00);
  if (exp == 0 || e < -26) return sign; /* zero, double subnormals and < half(min_sub) / 2 */
  uint64_t m = man | (1ull << 52); /* 53 significant bits */
  /* half normal: 11 bits kept (shift 42); half subnormal (e < -14): fewer, value m * 2^(e-52) */
  int shift = e >= -14 ? 42 : 42 + (-14 - e);
  uint64_t r = m >> shift, rem = m & ((1ull << shift) - 1), halfway = 1ull << (shift - 1);
  if (rem > halfway || (rem == halfway && (r & 1))) r++;
  /* normal: r is 1.m in 11 bits (may carry to 2^11, which the exponent add absorbs) */
  uint32_t bits = e >= -14 ? (uint32_t)((e + 14) << 10) + (uint32_t)r : (uint32_t)r;
  if (bits >= 0x7c00) return (uint16_t)(sign | 0x7c00);
  return (uint16_t)(sign | bits);
}

static uint16_t float_to_half_bits(float f) { return double_to_half_bits((double)f); }

static uint16_t abi_to_bits(msl_abi_half h) {
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}

static msl_abi_half bits_to_abi(uint16_t b) {
  msl_abi_half h;
  memcpy(&h, &b, 2);
  return h;
}

/* Hidden: the kernel library binds to these, never to a same-named definition elsewhere in the
 * process (libgcc_s has the __extendhfsf2 family too), so what runs is what this file says. */
#define MSL_LIBCALL __attribute__((visibility("hidden")))
MSL_LIBCALL float __gnu_h2f_ieee(uint16_t h) { return half_bits_to_float(h); }
MSL_LIBCALL uint16_t __gnu_f2h_ieee(float f) { return float_to_half_bits(f); }
MSL_LIBCALL float __extendhfsf2(msl_abi_half h) { return half_bits_to_float(abi_to_bits(h)); }
MSL_LIBCALL msl_abi_half __truncsfhf2(float f) { return bits_to_abi(float_to_half_bits(f)); }
MSL_LIBCALL msl_abi_half __truncdfhf2(double d) { return bits_to_abi(double_to_half_bits(d)); }

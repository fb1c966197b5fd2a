/* msl_runner: runs one simulated launch in a process of its own, spawned (posix_spawn / vfork)
 * rather than forked from the test process. Forking pytest after torch and transformers are
 * imported copies ~640 MB of page tables (9-18 ms a fork, most of the simulator tests' time
 * as system time); spawning this program costs ~2 ms.
 *
 *   msl_runner LIB REVERSE GX GY GZ TX TY TZ ERRFD ERRBYTES [FD MAPBYTES OFFSET NBYTES]...
 *
 * Each buffer is a memfd the Python driver filled (simulator._GuardedBuffer): it is mapped
 * shared here with its first and last pages PROT_NONE, so the data ends right before a guard
 * page as in the driver's own mapping, and the kernel's writes land in the driver's memory.
 * ERRFD holds the msl_error the runtime reports through (runtime.c). Exit status: 0 the launch
 * ran, 1 it reported an error, 70 a fault (runtime.c's handler), 64-66 a bad invocation. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int (*msl_run_fn)(void **, const int64_t *, int, const uint32_t *, const uint32_t *, int, void *);

static void *map_fd(const char *fd, long long bytes) {
  void *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, atoi(fd), 0);
  return p == MAP_FAILED ? NULL : p;
}

int main(int argc, char **argv) {
  if (argc < 11 || (argc - 11) % 4 != 0) {
    fprintf(stderr, "usage: msl_runner LIB REVERSE GX GY GZ TX TY TZ ERRFD ERRBYTES [FD MAPBYTES OFFSET NBYTES]...\n");
    return 64;
  }
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  msl_run_fn run = lib ? (msl_run_fn)dlsym(lib, "msl_run") : NULL;
  if (!run) {
    fprintf(stderr, "msl_runner: %s\n", dlerror());
    return 65;
  }
  int reverse = atoi(argv[2]);
  uint32_t grid[3], tg[3];
  for (int k = 0; k < 3; k++) {
    grid[k] = (uint32_t)strtoul(argv[3 + k], NULL, 10);
    tg[k] = (uint32_t)strtoul(argv[6 + k], NULL, 10);
  }
  void *err = map_fd(argv[9], atoll(argv[10]));
  if (!err) {
    perror("msl_runner: mapping the error record");
    return 66;
  }
  int nbuf = (argc - 11) / 4;
  void **ptrs = calloc((size_t)(nbuf > 0 ? nbuf : 1), sizeof(void *));
  int64_t *sizes = calloc((size_t)(nbuf > 0 ? nbuf : 1), sizeof(int64_t));
  long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < nbuf; i++) {
    char **a = argv + 11 + 4 * i;
    long long map_bytes = atoll(a[1]);
    char *base = map_fd(a[0], map_bytes);
    if (!base || mprotect(base, (size_t)page, PROT_NONE) != 0 ||
        mprotect(base + map_bytes - page, (size_t)page, PROT_NONE) != 0) {
      perror("msl_runner: mapping a buffer");
      return 66;
    }
    ptrs[i] = base + atoll(a[2]);
    sizes[i] = atoll(a[3]);
  }
  return run(ptrs, sizes, nbuf, grid, tg, reverse, err) == 0 ? 0 : 1;
}

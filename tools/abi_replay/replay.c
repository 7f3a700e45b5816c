/* replay: runs recorded mojolearn ops against a kernel binary, without
 * Python, and compares the bytes with the recorded ones.
 *
 *   replay [-v] LIB.so RECORD.mlrec...
 *
 * The records come from the host layer's test recorder
 * (python/native/record.h; _native.set_record_dir, tools/arm64_check.py).
 * For each record: allocate every buffer, fill it with its recorded input
 * bytes, point the argument slots at the copies, run all phases of the op
 * through the binary's C ABI (ml_plan / ml_task, mojo/entry_cpu.mojo) on one
 * thread, then compare every buffer with its recorded output bytes and check
 * a guard after each copy. Tasks of a phase are independent, so running them
 * in order on one thread gives the bits of any schedule.
 *
 * Scratch buffers (flags 0: an op's workspace that it writes before reading)
 * are not compared: what an op leaves there is no result, and it may differ
 * between machines without any output doing so (for instance the sign of a
 * NaN made from stale padding: x86 makes 0xffc00000, ARM 0x7fc00000). They
 * are counted, and listed with -v.
 *
 * Plain C99 + POSIX (dlopen), so the same file builds natively and with a
 * cross compiler (aarch64-linux-gnu-gcc) to run under qemu-user.
 *
 * Prints one line per differing record (every record with -v) and a
 * summary. Exit status: 0 all identical, 1 some bytes differ, 2 an error
 * (unreadable record, failing op, unloadable binary).
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t (*plan_fn)(int64_t, int64_t *, int64_t);
typedef int64_t (*task_fn)(int64_t, int64_t *, int64_t, int64_t);
typedef int64_t (*int_fn)(void);

enum { GUARD = 4096, GUARD_BYTE = 0x5A, PHASE_END = -1, MAX_PHASES = 1 << 20 };

static plan_fn g_plan;
static task_fn g_task;
static int64_t g_abi;
static int g_verbose;
static int g_scratch_differed; /* records whose scratch differed (not compared) */

/* A record file read into memory, with a read cursor. */
typedef struct {
  unsigned char *data;
  size_t size, pos;
  int bad;
} reader;

static int64_t rd_i64(reader *r) {
  int64_t v = 0;
  if (r->pos + 8 > r->size) {
    r->bad = 1;
    return 0;
  }
  memcpy(&v, r->data + r->pos, 8); /* little-endian on both ends */
  r->pos += 8;
  return v;
}

/* The next n bytes (and their padding to 8); NULL past the end. */
static const unsigned char *rd_bytes(reader *r, int64_t n) {
  size_t padded = ((size_t)n + 7) / 8 * 8;
  const unsigned char *p;
  if (n < 0 || r->pos + padded > r->size) {
    r->bad = 1;
    return NULL;
  }
  p = r->data + r->pos;
  r->pos += padded;
  return p;
}

static int read_file(const char *path, reader *r) {
  FILE *f = fopen(path, "rb");
  long n;
  memset(r, 0, sizeof *r);
  if (!f) return -1;
  if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fclose(f);
    return -1;
  }
  r->data = malloc(n > 0 ? (size_t)n : 1);
  r->size = (size_t)n;
  if (!r->data || fread(r->data, 1, r->size, f) != r->size) {
    fclose(f);
    free(r->data);
    r->data = NULL;
    return -1;
  }
  fclose(f);
  return 0;
}

typedef struct {
  int64_t bytes, flags, nslots;
  const int64_t *slots; /* nslots x (slot, offset), unaligned: read with memcpy */
  unsigned char *mem;
} buffer;

static int64_t slot_field(const buffer *b, int64_t i, int k) {
  int64_t v;
  memcpy(&v, (const unsigned char *)b->slots + (size_t)(2 * i + k) * 8, 8);
  return v;
}

/* Replays one record: 0 identical, 1 differs, 2 error. */
static int replay(const char *path) {
  reader r;
  int64_t abi, op, nargs, nbufs, i, j, phase, total = 0;
  int64_t *args = NULL;
  buffer *bufs = NULL;
  int status = 2, scratch_differed = 0;
  if (read_file(path, &r) != 0) {
    fprintf(stderr, "ERROR %s: cannot read\n", path);
    return 2;
  }
  if (r.size < 8 || memcmp(r.data, "MLREC001", 8) != 0) {
    fprintf(stderr, "ERROR %s: not an op record (MLREC001)\n", path);
    goto done;
  }
  r.pos = 8;
  abi = rd_i64(&r);
  op = rd_i64(&r);
  nargs = rd_i64(&r);
  nbufs = rd_i64(&r);
  if (r.bad || nargs < 0 || nargs > 4096 || nbufs < 0 || nbufs > 4096) {
    fprintf(stderr, "ERROR %s: bad header\n", path);
    goto done;
  }
  if (abi != g_abi) {
    fprintf(stderr, "ERROR %s: recorded with ABI %lld, the binary has %lld\n", path, (long long)abi,
            (long long)g_abi);
    goto done;
  }
  args = calloc((size_t)nargs + 1, 8);
  bufs = calloc((size_t)nbufs + 1, sizeof *bufs);
  if (!args || !bufs) goto done;
  for (i = 0; i < nargs; ++i) args[i] = rd_i64(&r);
  for (i = 0; i < nbufs; ++i) {
    buffer *b = &bufs[i];
    b->bytes = rd_i64(&r);
    b->flags = rd_i64(&r);
    b->nslots = rd_i64(&r);
    if (r.bad || b->bytes < 0 || b->nslots < 0 || b->nslots > nargs) break;
    b->slots = (const int64_t *)rd_bytes(&r, 16 * b->nslots);
  }
  if (r.bad || i < nbufs) {
    fprintf(stderr, "ERROR %s: bad buffer table\n", path);
    goto done;
  }
  /* Copies with the input bytes; the slots point into them. */
  for (i = 0; i < nbufs; ++i) {
    buffer *b = &bufs[i];
    const unsigned char *in = rd_bytes(&r, b->bytes);
    void *mem = NULL;
    if (!in || posix_memalign(&mem, 64, (size_t)b->bytes + GUARD) != 0) {
      fprintf(stderr, "ERROR %s: buffer %lld: truncated or out of memory\n", path, (long long)i);
      goto done;
    }
    b->mem = mem;
    memcpy(b->mem, in, (size_t)b->bytes);
    memset(b->mem + b->bytes, GUARD_BYTE, GUARD);
    for (j = 0; j < b->nslots; ++j) {
      int64_t slot = slot_field(b, j, 0), off = slot_field(b, j, 1);
      if (slot < 0 || slot >= nargs || off < 0 || off > b->bytes) {
        fprintf(stderr, "ERROR %s: buffer %lld: bad slot %lld\n", path, (long long)i, (long long)slot);
        goto done;
      }
      args[slot] = (int64_t)(intptr_t)(b->mem + off);
    }
  }
  /* All phases, every task in order, on this thread. */
  for (phase = 0; phase < MAX_PHASES; ++phase) {
    int64_t n = g_plan(op, args, phase), t;
    if (n == PHASE_END) break;
    if (n < 0) {
      fprintf(stderr, "ERROR %s: ml_plan(op %lld, phase %lld) = %lld\n", path, (long long)op,
              (long long)phase, (long long)n);
      goto done;
    }
    for (t = 0; t < n; ++t) {
      int64_t s = g_task(op, args, phase, t);
      if (s != 0) {
        fprintf(stderr, "ERROR %s: ml_task(op %lld, phase %lld, task %lld) = %lld\n", path,
                (long long)op, (long long)phase, (long long)t, (long long)s);
        goto done;
      }
    }
  }
  /* Every buffer against its recorded bytes after the run. */
  status = 0;
  for (i = 0; i < nbufs; ++i) {
    buffer *b = &bufs[i];
    const unsigned char *want = rd_bytes(&r, b->bytes);
    int64_t k, diff = 0, first = -1;
    if (!want) {
      fprintf(stderr, "ERROR %s: truncated output bytes\n", path);
      status = 2;
      goto done;
    }
    for (k = 0; k < b->bytes; ++k)
      if (b->mem[k] != want[k]) {
        if (first < 0) first = k;
        ++diff;
      }
    for (k = 0; k < GUARD; ++k)
      if (b->mem[b->bytes + k] != GUARD_BYTE) {
        fprintf(stderr, "ERROR %s: op %lld wrote past buffer %lld (slot %lld, %lld bytes)\n", path,
                (long long)op, (long long)i, (long long)slot_field(b, 0, 0), (long long)b->bytes);
        status = 2;
        goto done;
      }
    if (diff && b->flags == 0) {
      if (g_verbose)
        printf("note %s: scratch buffer %lld (slot %lld) differs in %lld bytes (not compared)\n",
               path, (long long)i, (long long)(b->nslots ? slot_field(b, 0, 0) : -1),
               (long long)diff);
      scratch_differed = 1;
      continue;
    }
    if (b->flags != 0) total += b->bytes;
    if (diff) {
      int64_t shown = 0, w;
      printf("DIFF %s: op %lld buffer %lld (slot %lld, flags %lld): %lld of %lld bytes differ, "
             "first at byte %lld\n", path, (long long)op, (long long)i,
             (long long)(b->nslots ? slot_field(b, 0, 0) : -1), (long long)b->flags,
             (long long)diff, (long long)b->bytes, (long long)first);
      /* the first few differing 32-bit words (float32 bits), got vs recorded */
      for (w = first / 4 * 4; w + 4 <= b->bytes && shown < 4; w += 4) {
        uint32_t got, rec;
        memcpy(&got, b->mem + w, 4);
        memcpy(&rec, want + w, 4);
        if (got != rec) {
          printf("     byte %lld: 0x%08lx, recorded 0x%08lx\n", (long long)w, (unsigned long)got,
                 (unsigned long)rec);
          ++shown;
        }
      }
      status = 1;
    }
  }
  g_scratch_differed += scratch_differed;
  if (status == 0 && g_verbose)
    printf("ok   %s: op %lld, %lld buffers, %lld bytes of results and inputs identical\n", path,
           (long long)op, (long long)nbufs, (long long)total);
done:
  if (bufs)
    for (i = 0; i < nbufs; ++i) free(bufs[i].mem);
  free(bufs);
  free(args);
  free(r.data);
  return status;
}

int main(int argc, char **argv) {
  int a = 1, n = 0, same = 0, differ = 0, errors = 0;
  void *h;
  if (a < argc && strcmp(argv[a], "-v") == 0) g_verbose = 1, ++a;
  if (argc - a < 2) {
    fprintf(stderr, "usage: replay [-v] LIB.so RECORD.mlrec...\n");
    return 2;
  }
  h = dlopen(argv[a], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "ERROR cannot load %s: %s\n", argv[a], dlerror());
    return 2;
  }
  {
    /* (memcpy: ISO C has no cast from an object to a function pointer) */
    void *p = dlsym(h, "ml_plan"), *t = dlsym(h, "ml_task"), *v = dlsym(h, "ml_abi_version");
    int_fn abi;
    memcpy(&g_plan, &p, sizeof p);
    memcpy(&g_task, &t, sizeof t);
    memcpy(&abi, &v, sizeof v);
    if (!p || !t || !v) {
      fprintf(stderr, "ERROR %s: not a mojolearn kernel binary (ml_plan/ml_task/ml_abi_version)\n",
              argv[a]);
      return 2;
    }
    g_abi = abi();
  }
  for (++a; a < argc; ++a, ++n) {
    int s = replay(argv[a]);
    same += s == 0;
    differ += s == 1;
    errors += s == 2;
  }
  printf("replay: %d records, %d identical, %d differ, %d errors", n, same, differ, errors);
  if (g_scratch_differed)
    printf(" (scratch, not compared, differed in %d)", g_scratch_differed);
  printf("\n");
  return errors ? 2 : differ ? 1 : 0;
}

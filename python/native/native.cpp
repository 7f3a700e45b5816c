// _native: the thin host layer between Python and the Mojo binaries.
//
// * loads a Mojo kernel binary (dlopen, RTLD_LOCAL) and reads back what it is;
// * runs its operations: an op is a sequence of phases, each a set of
//   independent tasks (see mojo/mojolearn_kernels/abi.mojo), spread over a
//   persistent thread pool with cheap wake-ups; the GIL is released;
// * Storage: aligned memory exporting the buffer protocol, the base of
//   mojolearn.Array;
// * address(): the data address of any contiguous buffer;
// * set_record_dir(): test-only records of every op run (record.h), which
//   tools/abi_replay/replay.c replays without Python (the arm64 check).
//
// Thread safety: run() may be called from several Python threads; only one
// uses the pool at a time, the others run their tasks on their own thread
// (same bits, since tasks are independent).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "device.h"
#include "record.h"

#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define ML_HAVE_MMAP 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <iterator>
#include <map>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace nb = nanobind;

namespace {

using PlanFn = int64_t (*)(int64_t, int64_t *, int64_t);
using TaskFn = int64_t (*)(int64_t, int64_t *, int64_t, int64_t);
using IntFn = int64_t (*)();
using DescribeFn = int64_t (*)(uint8_t *, int64_t);
using NonFiniteFn = int64_t (*)(float *, int64_t);
using IntArgFn = int64_t (*)(int64_t);

constexpr int64_t kPhaseEnd = -1;
constexpr int64_t kPlanWorkspace = -1;
// More threads than this is a mistake (a pool that size cannot be started
// reliably, and no machine this runs on has that many cores).
constexpr int64_t kMaxThreads = 1024;

// One spin-wait pause, on any architecture.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Test hook (MOJOLEARN_TEST_POOL_DELAY_US, read when a pool starts): the
// caller pauses between publishing a job's fields and opening its tickets,
// and each worker pauses after every task it runs. This widens the windows
// in which a worker that is late for one job meets the next job's fields,
// so tests/test_pool_stress.py can show the ticket protocol holding.
int pool_test_delay_us() {
  const char *s = std::getenv("MOJOLEARN_TEST_POOL_DELAY_US");
  return s ? std::max(0, std::atoi(s)) : 0;
}

// ------------------------------------------------------------------ pool

struct Job {
  TaskFn task;
  int64_t op;
  int64_t *args;
  int64_t phase;
  int64_t ntasks;
};

// Persistent workers. A job's tasks are split into one contiguous range per
// thread; each range is claimed through its own 64-bit ticket, (epoch << 32)
// | next task, so a worker that wakes late can never claim a task of a newer
// job with an older job's fields. A thread takes its own range first, then
// helps with the others: repeated calls (decode steps) give each thread the
// same tasks, so each core keeps the same weight panels in its own cache.
// The caller waits for the tasks to be done, not for the workers to wake: on
// a loaded machine a descheduled worker just does nothing while the others
// run its range. Which thread runs a task never changes a bit.
class Pool {
 public:
  explicit Pool(int nthreads)
      : nthreads_(nthreads < 1 ? 1 : nthreads), tickets_(new Ticket[nthreads_]),
        delay_us_(pool_test_delay_us()) {
    try {
      for (int i = 1; i < nthreads_; ++i) workers_.emplace_back([this, i] { loop(i); });
    } catch (...) {  // the system refused a thread: stop the ones started
      shutdown();
      throw std::runtime_error("cannot start " + std::to_string(nthreads_) +
                               " kernel threads; use fewer (mojolearn.set_num_threads)");
    }
  }
  ~Pool() { shutdown(); }
  int threads() const { return nthreads_; }

  // Runs job.ntasks tasks; returns the first nonzero task status (or 0).
  int64_t run(const Job &job) {
    if (job.ntasks <= 0) return 0;
    if (workers_.empty() || job.ntasks == 1) return run_inline(job);
    job_ = job;
    status_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // (3x a worker's pause: a worker late for the last job wakes inside it)
    if (delay_us_) std::this_thread::sleep_for(std::chrono::microseconds(3 * delay_us_));
    uint64_t e = epoch_.load(std::memory_order_relaxed) + 1;
    for (int r = 0; r < nthreads_; ++r)
      tickets_[r].v.store((e << 32) | static_cast<uint64_t>(lo(r, job.ntasks)),
                          std::memory_order_release);
    epoch_.store(e, std::memory_order_release);
    epoch_.notify_all();
    work(e, 0);
    while (done_.load(std::memory_order_acquire) != job.ntasks) cpu_relax();
    // Close the tickets before the next job's fields are written: a worker
    // still holding this job's last ticket value would otherwise compare it
    // with the next job's ranges and claim one of its tasks.
    for (int r = 0; r < nthreads_; ++r)
      tickets_[r].v.store(((e & 0xffffffffu) << 32) | kClosed, std::memory_order_release);
    return status_.load(std::memory_order_relaxed);
  }

  static int64_t run_inline(const Job &job) {
    for (int64_t t = 0; t < job.ntasks; ++t) {
      int64_t s = job.task(job.op, job.args, job.phase, t);
      if (s != 0) return s;
    }
    return 0;
  }

 private:
  struct alignas(64) Ticket {  // one cache line each: no false sharing
    std::atomic<uint64_t> v{0};
  };

  int64_t lo(int r, int64_t n) const { return n * r / nthreads_; }

  void work(uint64_t e, int self) {
    for (int k = 0; k < nthreads_; ++k) {
      int r = (self + k) % nthreads_;
      std::atomic<uint64_t> &ticket = tickets_[r].v;
      for (;;) {
        uint64_t t = ticket.load(std::memory_order_acquire);
        bool claimed = false;
        for (;;) {
          if ((t >> 32) != (e & 0xffffffffu)) return;  // that job is over
          if ((t & 0xffffffffu) == kClosed) return;     // all done, tickets closed
          if (static_cast<int64_t>(t & 0xffffffffu) >= lo(r + 1, job_.ntasks)) break;
          if (ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
            claimed = true;
            break;
          }
        }
        if (!claimed) break;  // this range is taken: help with the next one
        // The claimed task keeps its job alive: the caller cannot start the
        // next job before this task is counted done.
        int64_t s = job_.task(job_.op, job_.args, job_.phase, static_cast<int64_t>(t & 0xffffffffu));
        if (s != 0) status_.store(s, std::memory_order_relaxed);
        done_.fetch_add(1, std::memory_order_acq_rel);
        if (delay_us_ && self != 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
      }
    }
  }
  void loop(int self) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t e;
      auto spin_start = std::chrono::steady_clock::now();
      int spins = 0;
      // Spin briefly (decode issues phases microseconds apart), then sleep.
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        cpu_relax();
        if ((++spins & 63) == 0 &&
            std::chrono::steady_clock::now() - spin_start > std::chrono::microseconds(kSpinMicros)) {
          epoch_.wait(seen, std::memory_order_acquire);
        }
      }
      seen = e;
      if (stop_.load()) return;
      work(e, self);
    }
  }

  void shutdown() {
    stop_.store(true);
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
    for (auto &t : workers_) t.join();
    workers_.clear();
  }

  static constexpr int kSpinMicros = 50;
  static constexpr uint64_t kClosed = 0xffffffffu;  // task index of a closed ticket
  int nthreads_;
  std::unique_ptr<Ticket[]> tickets_;
  std::vector<std::thread> workers_;
  Job job_{};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> status_{0};
  std::atomic<bool> stop_{false};
  int delay_us_;
};

std::mutex g_pool_mutex;  // guards g_pool replacement and use
std::unique_ptr<Pool> g_pool;
int g_threads = 0;  // 0: not chosen yet

// MOJOLEARN_NUM_THREADS, when set, must be a whole number in 1..kMaxThreads
// (surrounding spaces allowed); anything else is refused by name.
int default_threads() {
  const char *s = std::getenv("MOJOLEARN_NUM_THREADS");
  if (s != nullptr && *s != '\0') {  // (set but empty: as if unset)
    std::string v(s);
    auto a = v.find_first_not_of(" \t"), b = v.find_last_not_of(" \t");
    std::string t = a == std::string::npos ? "" : v.substr(a, b - a + 1);
    bool digits = !t.empty() && t.size() <= 9 &&
                  std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
    long n = digits ? std::strtol(t.c_str(), nullptr, 10) : -1;
    if (n < 1 || n > kMaxThreads)
      throw std::invalid_argument("MOJOLEARN_NUM_THREADS must be a whole number from 1 to " +
                                  std::to_string(kMaxThreads) + ", got '" + v + "'");
    return static_cast<int>(n);
  }
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(std::min<unsigned>(n, kMaxThreads));
}

// ------------------------------------------------------------------ regions

// Caller memory the emulation knows of: every live Storage (Arrays, states,
// workspaces, weight blobs) and the buffers whose address was taken lately
// (address(), the decode fast path). Under emulate_device an op argument that
// points into one of them but is not in the op's buffer table is refused: a
// device binary would hand the kernel a host pointer there.
std::mutex g_regions_mutex;
std::map<uintptr_t, size_t> g_storage_regions;        // start -> bytes
std::deque<std::pair<uintptr_t, size_t>> g_recent_regions;  // bounded
std::atomic<int> g_emulating{0};  // Libraries with emulate_device set
std::atomic<bool> g_recording{false};  // set_record_dir (op records, record.h)
constexpr size_t kRecentRegions = 256;

void note_recent_region(const void *p, size_t n) {
  if ((g_emulating.load(std::memory_order_relaxed) == 0 && !g_recording.load()) || n == 0) return;
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  g_recent_regions.emplace_back(reinterpret_cast<uintptr_t>(p), n);
  if (g_recent_regions.size() > kRecentRegions) g_recent_regions.pop_front();
}

// Whether address a lies inside a known caller buffer of at least one byte.
bool in_known_region(uintptr_t a) {
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  auto it = g_storage_regions.upper_bound(a);
  if (it != g_storage_regions.begin()) {
    --it;
    if (a < it->first + it->second) return true;
  }
  for (const auto &r : g_recent_regions)
    if (a >= r.first && a < r.first + r.second) return true;
  return false;
}

// The known caller buffer holding address a (a live Storage first, else the
// latest buffer whose address was taken); false if none does.
bool find_region(uintptr_t a, uintptr_t &lo, size_t &n) {
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  auto it = g_storage_regions.upper_bound(a);
  if (it != g_storage_regions.begin() && a < std::prev(it)->first + std::prev(it)->second) {
    lo = std::prev(it)->first;
    n = std::prev(it)->second;
    return true;
  }
  for (auto r = g_recent_regions.rbegin(); r != g_recent_regions.rend(); ++r)
    if (a >= r->first && a < r->first + r->second) {
      lo = r->first;
      n = r->second;
      return true;
    }
  return false;
}

// Op records (test only; record.h, tools/abi_replay): while a directory is
// set, every op run writes <dir>/<prefix>-<nnnnn>-op<op>.mlrec. An op with a
// slot that looks like an address (above 2^32) but lies in no buffer the
// host layer knows of cannot be replayed; it is run but not recorded, and
// counted with its reason (record_status()). A buffer known only by a taken
// address is as large as it was then; if its memory was freed and reused
// since, a record can be short, which a replay on the recording machine
// shows (tools/arm64_check.py replays every record on x86-64 too).
std::mutex g_record_mutex;
std::string g_record_dir, g_record_prefix;
int64_t g_record_count = 0, g_record_skipped = 0;
std::string g_record_last_skip;
constexpr uint64_t kAddressLike = uint64_t{1} << 32;

// Per-phase wall time of every op run (MOJOLEARN_PHASE_TIMES=1 or
// mojolearn.debug.timing_phases): a debug switch for the RESULTS tables.
struct PhaseStat {
  int64_t calls = 0;
  double seconds = 0;
};
std::mutex g_phase_mutex;
std::map<std::pair<int64_t, int64_t>, PhaseStat> g_phase_stats;
std::atomic<bool> g_phase_timing{[] {
  const char *s = std::getenv("MOJOLEARN_PHASE_TIMES");
  return s != nullptr && std::strcmp(s, "1") == 0;
}()};

// ------------------------------------------------------------------ library

struct Library {
  std::string path;
  void *handle = nullptr;
  PlanFn plan = nullptr;
  TaskFn task = nullptr;
  NonFiniteFn nonfinite = nullptr;
  int64_t abi_version = 0, vendor = -1, numeric_mode = -1;
  std::string description;
  // Device binaries (vendor != cpu) export these; the CPU binary exports
  // ml_buffers and ml_host_op only (for emulate_device).
  mlstage::BuffersFn buffers = nullptr;
  mlstage::GpuRunFn gpu_run = nullptr;
  IntFn device_count_fn = nullptr;
  DescribeFn device_arch_fn = nullptr;
  IntArgFn host_op_fn = nullptr;  // ml_host_op: ops a device binary runs on the host
  bool emulate_device = false;  // stage buffers on the host like a device (tests)
  // Test hook: drop row `drop_row` of op `drop_op`'s buffer table when
  // staging, as a binary with that row missing would (-1: none).
  int64_t drop_op = -1, drop_row = -1;
  // Most rows a staged table of each op has had (tests read and clear it).
  mutable std::map<int64_t, int64_t> staged_rows;

  void set_emulate(bool on) {
    if (on != emulate_device) g_emulating.fetch_add(on ? 1 : -1);
    emulate_device = on;
  }

  explicit Library(const std::string &p) : path(p) {
    handle = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) throw std::runtime_error(std::string("cannot load ") + p + ": " + dlerror());
    auto need = [&](const char *name) {
      void *s = dlsym(handle, name);
      if (!s) throw std::runtime_error(p + " does not export " + name + ": not a mojolearn binary");
      return s;
    };
    plan = reinterpret_cast<PlanFn>(need("ml_plan"));
    task = reinterpret_cast<TaskFn>(need("ml_task"));
    nonfinite = reinterpret_cast<NonFiniteFn>(need("ml_first_nonfinite"));
    abi_version = reinterpret_cast<IntFn>(need("ml_abi_version"))();
    vendor = reinterpret_cast<IntFn>(need("ml_vendor"))();
    numeric_mode = reinterpret_cast<IntFn>(need("ml_numeric_mode"))();
    auto describe = reinterpret_cast<DescribeFn>(need("ml_describe"));
    std::vector<uint8_t> buf(512);
    int64_t n = describe(buf.data(), static_cast<int64_t>(buf.size()));
    if (n > static_cast<int64_t>(buf.size())) {
      buf.resize(static_cast<size_t>(n));
      describe(buf.data(), n);
    }
    description.assign(reinterpret_cast<char *>(buf.data()), static_cast<size_t>(n));
    buffers = reinterpret_cast<mlstage::BuffersFn>(dlsym(handle, "ml_buffers"));
    gpu_run = reinterpret_cast<mlstage::GpuRunFn>(dlsym(handle, "ml_gpu_run"));
    device_count_fn = reinterpret_cast<IntFn>(dlsym(handle, "ml_device_count"));
    device_arch_fn = reinterpret_cast<DescribeFn>(dlsym(handle, "ml_device_arch"));
    host_op_fn = reinterpret_cast<IntArgFn>(dlsym(handle, "ml_host_op"));
    const char *emu = std::getenv("MOJOLEARN_EMULATE_DEVICE");
    set_emulate(emu != nullptr && std::strcmp(emu, "1") == 0);
    if (vendor != 0 && (!buffers || !gpu_run || !device_count_fn || !host_op_fn))
      throw std::runtime_error(p + " is a device binary without ml_buffers/ml_gpu_run/"
                               "ml_device_count/ml_host_op");
  }

  // Devices the binary can use (0 for the CPU binary; never raises).
  int64_t device_count() const { return device_count_fn ? device_count_fn() : 0; }

  // The first device's architecture ('' without a device or when unknown).
  std::string device_arch() const {
    if (!device_arch_fn || device_count() <= 0) return "";
    std::vector<uint8_t> buf(256);
    int64_t n = device_arch_fn(buf.data(), static_cast<int64_t>(buf.size()));
    n = std::max<int64_t>(0, std::min<int64_t>(n, static_cast<int64_t>(buf.size())));
    return std::string(reinterpret_cast<char *>(buf.data()), static_cast<size_t>(n));
  }
  // The handle is never closed: kernels may be running on pool threads of
  // other libraries' users, and unloading a Mojo binary is not supported.

  uintptr_t symbol(const std::string &name) const {
    void *s = dlsym(handle, name.c_str());
    if (!s) throw std::runtime_error(path + " does not export " + name);
    return reinterpret_cast<uintptr_t>(s);
  }

  // First flat index of a NaN/inf among n floats at address, or -1.
  int64_t first_nonfinite(uintptr_t address, int64_t n) const {
    if (n <= 0) return -1;
    return nonfinite(reinterpret_cast<float *>(address), n);
  }

  // Decode fast path: if x is a C-contiguous float32 buffer of shape (b, d)
  // or (b, 1, d) holding only finite values, put its address in args[slot]
  // and run op with x's buffer held; returns false (and runs nothing) for
  // anything else, so the caller's full checks raise the precise error.
  bool run_step(int64_t op, std::vector<int64_t> &args, nb::handle x, int64_t b, int64_t d,
                size_t slot) const {
    Py_buffer view;
    if (PyObject_GetBuffer(x.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      return false;
    }
    bool ok = view.itemsize == 4 && view.format != nullptr &&
              (std::strcmp(view.format, "f") == 0 || std::strcmp(view.format, "<f") == 0 ||
               std::strcmp(view.format, "=f") == 0) &&
              ((view.ndim == 2 && view.shape[0] == b && view.shape[1] == d) ||
               (view.ndim == 3 && view.shape[0] == b && view.shape[1] == 1 && view.shape[2] == d)) &&
              slot < args.size() && nonfinite(static_cast<float *>(view.buf), b * d) < 0;
    if (ok) {
      args[slot] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(view.buf));
      note_recent_region(view.buf, static_cast<size_t>(view.len));
      try {
        run(op, args);
      } catch (...) {
        PyBuffer_Release(&view);
        throw;
      }
    }
    PyBuffer_Release(&view);
    return ok;
  }

  int64_t workspace_bytes(int64_t op, std::vector<int64_t> args) const {
    int64_t n = plan(op, args.data(), kPlanWorkspace);
    // -2: the binary has no such op; -3: the op's plan refused this
    // combination of arguments (e.g. packed weights given to a backward).
    if (n == -3)
      throw std::runtime_error("op " + std::to_string(op) +
                               " refused its arguments (a combination its kernel does not take)");
    if (n < 0) throw std::runtime_error("unknown op " + std::to_string(op));
    return n;
  }

  void run(int64_t op, std::vector<int64_t> &args) const {
    if (g_recording.load()) {
      run_recorded(op, args);
      return;
    }
    run_unrecorded(op, args);
  }

  // The op's pointer slots as spans (record.h): its buffer table for a
  // device op, then any other slot pointing into known caller memory.
  // Returns "" or why the op cannot be recorded.
  std::string record_spans(int64_t op, std::vector<int64_t> &args,
                           std::vector<mlrecord::Span> &spans) const {
    std::vector<bool> listed(args.size(), false);
    bool on_host = host_op_fn != nullptr && host_op_fn(op) != 0;
    if (!on_host && buffers) {
      for (const auto &b : mlstage::table(buffers, op, args)) {
        spans.push_back({b.slot, b.host, b.host, b.host + static_cast<uintptr_t>(b.bytes), b.flags});
        listed[static_cast<size_t>(b.slot)] = true;
      }
    }
    for (size_t i = 0; i < args.size(); ++i) {
      if (listed[i] || args[i] == 0) continue;
      auto a = static_cast<uintptr_t>(args[i]);
      uintptr_t lo = 0;
      size_t n = 0;
      if (find_region(a, lo, n))
        spans.push_back({static_cast<int64_t>(i), a, lo, lo + n, mlstage::kIn | mlstage::kOut});
      else if (static_cast<uint64_t>(args[i]) >= kAddressLike)
        return "op " + std::to_string(op) + " slot " + std::to_string(i) +
               " holds an address outside every known buffer";
    }
    return "";
  }

  void run_recorded(int64_t op, std::vector<int64_t> &args) const {
    std::vector<mlrecord::Span> spans;
    std::string why;
    try {
      why = record_spans(op, args, spans);
    } catch (const std::exception &e) {  // a table the staging would refuse
      why = e.what();
    }
    if (!why.empty()) {
      {
        std::lock_guard<std::mutex> lock(g_record_mutex);
        ++g_record_skipped;
        g_record_last_skip = why;
      }
      run_unrecorded(op, args);
      return;
    }
    mlrecord::Recording rec(op, args, spans);
    run_unrecorded(op, args);
    std::string path;
    {
      std::lock_guard<std::mutex> lock(g_record_mutex);
      if (g_record_dir.empty()) return;  // switched off meanwhile
      char num[32];
      std::snprintf(num, sizeof num, "-%05lld-op%lld.mlrec", static_cast<long long>(g_record_count++),
                    static_cast<long long>(op));
      path = g_record_dir + "/" + g_record_prefix + num;
    }
    rec.write(path, abi_version);
  }

  void run_unrecorded(int64_t op, std::vector<int64_t> &args) const {
    bool on_host = host_op_fn != nullptr && host_op_fn(op) != 0;
    if (!on_host && (gpu_run || emulate_device)) {
      run_staged(op, args);
      return;
    }
    run_host(op, args, args);
  }

  // Stages the op's buffers (device.h): on the device for a GPU binary, in
  // host copies for emulate_device.
  void run_staged(int64_t op, std::vector<int64_t> &args) const {
    if (!buffers) throw std::runtime_error(path + " does not export ml_buffers");
    auto bufs = mlstage::table(buffers, op, args, op == drop_op ? drop_row : -1);
    if (gpu_run) {
      nb::gil_scoped_release release;
      mlstage::run_gpu(gpu_run, op, args, bufs);
      return;
    }
    int64_t &most = staged_rows[op];
    most = std::max(most, static_cast<int64_t>(bufs.size()));
    check_unlisted_addresses(op, args, bufs);
    std::vector<int64_t> dargs(args);
    mlstage::HostStage stage(bufs, dargs);
    run_host(op, args, dargs);
    stage.finish(op, bufs);
  }

  // Emulation: no argument outside the table may point into caller memory
  // (a known buffer, or one the table lists under another slot).
  static void check_unlisted_addresses(int64_t op, const std::vector<int64_t> &args,
                                       const std::vector<mlstage::Buffer> &bufs) {
    std::vector<bool> listed(args.size(), false);
    for (const auto &b : bufs) listed[static_cast<size_t>(b.slot)] = true;
    for (size_t i = 0; i < args.size(); ++i) {
      if (listed[i] || args[i] == 0) continue;
      auto a = static_cast<uintptr_t>(args[i]);
      bool inside = in_known_region(a);
      for (const auto &b : bufs)
        inside = inside || (a >= b.host && a < b.host + static_cast<uintptr_t>(b.bytes));
      if (inside)
        throw std::runtime_error("op " + std::to_string(op) + ": argument slot " + std::to_string(i) +
                                 " holds the address of a buffer that is not in the op's buffer "
                                 "table (ml_buffers); a device binary would pass it a host pointer");
    }
  }

  // Phases planned on `args`, tasks run on `targs` (the same, or staged copies).
  void run_host(int64_t op, std::vector<int64_t> &args, std::vector<int64_t> &targs) const {
    int64_t status = 0;
    {
      nb::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(g_pool_mutex, std::try_to_lock);
      Pool *pool = nullptr;
      if (lock.owns_lock()) {
        if (!g_pool) g_pool = std::make_unique<Pool>(g_threads > 0 ? g_threads : default_threads());
        pool = g_pool.get();
      }
      for (int64_t phase = 0;; ++phase) {
        int64_t n = plan(op, args.data(), phase);
        if (n == kPhaseEnd) break;
        if (n < 0) {
          status = n;
          break;
        }
        Job job{task, op, targs.data(), phase, n};
        bool timed = g_phase_timing.load(std::memory_order_relaxed);
        auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
        status = pool ? pool->run(job) : Pool::run_inline(job);
        if (timed) {
          std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
          std::lock_guard<std::mutex> plock(g_phase_mutex);
          PhaseStat &st = g_phase_stats[{op, phase}];
          st.calls += 1;
          st.seconds += dt.count();
        }
        if (status != 0) break;
      }
    }
    if (status != 0)
      throw std::runtime_error("kernel op " + std::to_string(op) + " failed with status " +
                               std::to_string(status) + " (internal error)");
  }
};

// ------------------------------------------------------------------ storage

// Aligned memory with a shape and a format, exporting the buffer protocol.
// A view shares the memory of its base and keeps it alive.
// Arrays of at least this many bytes get their own anonymous mapping: it
// comes zeroed (no memset for zero=True) and goes back to the system when
// the array is freed. From malloc, a big freed block can stay in the
// process (glibc raises its mmap threshold after such a free), so a model
// loaded piece by piece would keep its transient pieces' pages.
constexpr size_t kMapBytes = size_t(1) << 20;

struct Storage {
  void *data = nullptr;
  size_t nbytes = 0;
  size_t mapped = 0;  // bytes of data's own mapping (0: from aligned_alloc)
  bool owns = false;
  std::string format;
  Py_ssize_t itemsize = 4;
  std::vector<Py_ssize_t> shape, strides;
  nb::object base;  // for views

  void set_shape(const std::vector<int64_t> &s) {
    shape.assign(s.begin(), s.end());
    strides.assign(s.size(), 0);
    Py_ssize_t st = itemsize;
    for (size_t i = s.size(); i-- > 0;) {
      strides[i] = st;
      st *= static_cast<Py_ssize_t>(s[i]);
    }
  }
  ~Storage() {
    if (owns) {
      {
        std::lock_guard<std::mutex> lock(g_regions_mutex);
        g_storage_regions.erase(reinterpret_cast<uintptr_t>(data));
      }
#ifdef ML_HAVE_MMAP
      if (mapped) {
        munmap(data, mapped);
        return;
      }
#endif
      std::free(data);
    }
  }
};

// Items in shape; refuses a shape whose byte count (at itemsize) does not
// fit in a signed 64-bit size, so no size can wrap around to a small one.
size_t count_of(const std::vector<int64_t> &shape, size_t itemsize = 1) {
  size_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) throw std::invalid_argument("negative dimension in shape");
    if (__builtin_mul_overflow(n, static_cast<size_t>(s), &n))
      throw std::overflow_error("shape has too many items to address");
  }
  size_t bytes = 0;
  if (__builtin_mul_overflow(n, itemsize, &bytes) || bytes > static_cast<size_t>(PTRDIFF_MAX) - 64)
    throw std::overflow_error("shape needs more bytes than can be addressed");
  return n;
}

// Storage(shape, format, itemsize, zero, base): new aligned memory, or, with
// base, a view sharing base's memory under another shape (same size).
void storage_init(Storage *self, const std::vector<int64_t> &shape, const std::string &format,
                  int64_t itemsize, bool zero, nb::handle base_obj) {
  new (self) Storage();
  if (base_obj.is_valid() && !base_obj.is_none()) {
    Storage &base = nb::cast<Storage &>(base_obj);
    self->itemsize = base.itemsize;
    self->format = base.format;
    self->set_shape(shape);
    if (count_of(shape, static_cast<size_t>(base.itemsize)) * static_cast<size_t>(base.itemsize) != base.nbytes)
      throw std::invalid_argument("cannot view " + std::to_string(base.nbytes) + " bytes as shape of " +
                                  std::to_string(count_of(shape)) + " items");
    self->data = base.data;
    self->nbytes = base.nbytes;
    self->base = nb::borrow(base_obj);
    return;
  }
  if (itemsize < 1 || itemsize > 64) throw std::invalid_argument("itemsize must be 1 to 64");
  self->format = format;
  self->itemsize = static_cast<Py_ssize_t>(itemsize);
  self->nbytes = count_of(shape, static_cast<size_t>(itemsize)) * static_cast<size_t>(itemsize);
  self->set_shape(shape);
  size_t alloc = (self->nbytes + 63) / 64 * 64;
  if (alloc == 0) alloc = 64;
#ifdef ML_HAVE_MMAP
  if (alloc >= kMapBytes) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_t len = (alloc + page - 1) / page * page;
    void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    self->data = p;  // page aligned, zero filled
    self->mapped = len;
    zero = false;
  }
#endif
  if (!self->data) {
    self->data = std::aligned_alloc(64, alloc);
    if (!self->data) throw std::bad_alloc();
  }
  self->owns = true;
  if (zero) std::memset(self->data, 0, alloc);
  std::lock_guard<std::mutex> lock(g_regions_mutex);
  g_storage_regions[reinterpret_cast<uintptr_t>(self->data)] = self->nbytes;
}

int storage_getbuffer(PyObject *exporter, Py_buffer *view, int flags) {
  Storage *s = nb::inst_ptr<Storage>(exporter);
  view->obj = exporter;
  Py_INCREF(exporter);
  view->buf = s->data;
  view->len = static_cast<Py_ssize_t>(s->nbytes);
  view->readonly = 0;
  view->itemsize = s->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? const_cast<char *>(s->format.c_str()) : nullptr;
  view->ndim = static_cast<int>(s->shape.size());
  view->shape = (flags & PyBUF_ND) ? s->shape.data() : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? s->strides.data() : nullptr;
  view->suboffsets = nullptr;
  view->internal = nullptr;
  return 0;
}

void storage_releasebuffer(PyObject *, Py_buffer *) {}

PyType_Slot storage_slots[] = {{Py_bf_getbuffer, reinterpret_cast<void *>(storage_getbuffer)},
                               {Py_bf_releasebuffer, reinterpret_cast<void *>(storage_releasebuffer)},
                               {0, nullptr}};

uintptr_t address_of(nb::handle obj, bool writable) {
  Py_buffer view;
  int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw nb::python_error();
  uintptr_t a = reinterpret_cast<uintptr_t>(view.buf);
  note_recent_region(view.buf, static_cast<size_t>(view.len));
  PyBuffer_Release(&view);
  return a;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "mojolearn host layer: binary loader, task runner, aligned storage.";

  nb::class_<Library>(m, "Library")
      .def(nb::init<const std::string &>(), nb::arg("path"))
      .def_ro("path", &Library::path)
      .def_ro("abi_version", &Library::abi_version)
      .def_ro("vendor", &Library::vendor)
      .def_ro("numeric_mode", &Library::numeric_mode)
      .def_ro("description", &Library::description)
      .def_prop_rw(
          "emulate_device", [](const Library &l) { return l.emulate_device; },
          [](Library &l, bool on) { l.set_emulate(on); },
          "Stage every op's buffers in host copies, as a device binary does (tests).")
      .def_rw("drop_op", &Library::drop_op, "Test hook: the op whose table loses a row when staged.")
      .def_rw("drop_row", &Library::drop_row, "Test hook: which row it loses (-1: none).")
      .def_rw("staged_rows", &Library::staged_rows,
              "Most rows a staged buffer table of each op has had (tests).")
      .def_prop_ro("device_count", &Library::device_count)
      .def_prop_ro("device_arch", &Library::device_arch)
      .def("symbol", &Library::symbol, nb::arg("name"))
      .def("first_nonfinite", &Library::first_nonfinite, nb::arg("address"), nb::arg("n"))
      .def(
          "run_step",
          [](const Library &lib, int64_t op, std::vector<int64_t> args, nb::handle x, int64_t b,
             int64_t d, size_t slot) { return lib.run_step(op, args, x, b, d, slot); },
          nb::arg("op"), nb::arg("args"), nb::arg("x"), nb::arg("b"), nb::arg("d"), nb::arg("slot"),
          "Decode fast path: run op with x (float32, C-contiguous, (b, d) or (b, 1, d), "
          "finite) in args[slot]; False (nothing run) for any other x.")
      .def("workspace_bytes", &Library::workspace_bytes, nb::arg("op"), nb::arg("args"))
      .def("run", [](const Library &lib, int64_t op, std::vector<int64_t> args) { lib.run(op, args); },
           nb::arg("op"), nb::arg("args"),
           "Run op over the int64 argument slots, all phases, GIL released.");

  nb::class_<Storage>(m, "Storage", nb::type_slots(storage_slots))
      .def("__init__", &storage_init, nb::arg("shape"), nb::arg("format") = "f",
           nb::arg("itemsize") = 4, nb::arg("zero") = true, nb::arg("base") = nb::none())
      .def_prop_ro("address", [](const Storage &s) { return reinterpret_cast<uintptr_t>(s.data); })
      .def_prop_ro("nbytes", [](const Storage &s) { return s.nbytes; })
      .def_prop_ro("_shape", [](const Storage &s) {
        nb::list l;
        for (auto v : s.shape) l.append(v);
        return nb::tuple(l);
      })
      .def_prop_ro("_format", [](const Storage &s) { return s.format; })
      .def_prop_ro("_itemsize", [](const Storage &s) { return s.itemsize; });

  m.def("address", &address_of, nb::arg("obj"), nb::arg("writable") = false,
        "Data address of a contiguous buffer (the caller keeps it alive).");
  m.def(
      "set_num_threads",
      [](int64_t n) {
        if (n < 1 || n > kMaxThreads)
          throw std::invalid_argument("number of threads must be from 1 to " +
                                      std::to_string(kMaxThreads) + ", got " + std::to_string(n));
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(g_pool_mutex);
        g_threads = static_cast<int>(n);
        g_pool.reset();
      },
      nb::arg("n"));
  m.attr("MAX_THREADS") = kMaxThreads;
  m.def("get_num_threads", [] { return g_threads > 0 ? g_threads : default_threads(); });
  m.def("release_free_memory", [] {
#if defined(__GLIBC__)
    // glibc keeps freed heap memory (its mmap threshold grows after a big
    // free, so later big arrays come from the heap): give it back, so a
    // model loaded piece by piece does not keep its transient pieces' pages.
    return malloc_trim(0) != 0;
#else
    return false;
#endif
  }, "Return freed heap memory to the system (glibc); True if some was.");
  m.def("_live_storages", [] {
    std::lock_guard<std::mutex> lock(g_regions_mutex);
    return g_storage_regions.size();
  }, "Storages alive now (tests: no leak).");
  m.def("set_phase_timing", [](bool on) { g_phase_timing.store(on); }, nb::arg("on"),
        "Record the wall time of every op phase (a debug switch; see phase_times).");
  m.def("phase_times", [] {
    std::lock_guard<std::mutex> lock(g_phase_mutex);
    nb::list out;
    for (const auto &kv : g_phase_stats)
      out.append(nb::make_tuple(kv.first.first, kv.first.second, kv.second.calls, kv.second.seconds));
    return out;
  }, "(op, phase, calls, seconds) of every phase run since the last reset.");
  m.def(
      "set_record_dir",
      [](const std::string &dir, const std::string &prefix) {
        std::lock_guard<std::mutex> lock(g_record_mutex);
        if (dir != g_record_dir) {
          g_record_count = g_record_skipped = 0;
          g_record_last_skip.clear();
          // Addresses taken before are forgotten (their buffers may be gone
          // and the memory reused), unless the emulation still needs them.
          std::lock_guard<std::mutex> rlock(g_regions_mutex);
          if (g_emulating.load() == 0) g_recent_regions.clear();
        }
        g_record_dir = dir;
        g_record_prefix = prefix;
        g_recording.store(!dir.empty());
      },
      nb::arg("dir"), nb::arg("prefix") = "op",
      "Test only: write a record of every op run into dir (an existing folder; '' stops), "
      "named <prefix>-<n>-op<op>.mlrec, for tools/abi_replay (python/native/record.h).");
  m.def("record_status", [] {
    std::lock_guard<std::mutex> lock(g_record_mutex);
    return nb::make_tuple(g_record_count, g_record_skipped, g_record_last_skip);
  }, "(records written, ops run but not recorded, why the last one was not) since the record "
     "directory last changed.");
  m.def("reset_phase_times", [] {
    std::lock_guard<std::mutex> lock(g_phase_mutex);
    g_phase_stats.clear();
  });
}

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
// The pool is in pool.h, Storage and the known caller regions in memory.h,
// device staging in device.h, the op records in record.h.
//
// Thread safety: run() may be called from several Python threads; only one
// uses the pool at a time, the others run their tasks on their own thread
// (same bits, since tasks are independent).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlfcn.h>

#include "device.h"
#include "memory.h"
#include "pool.h"
#include "record.h"

#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
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
using IntFn = int64_t (*)();
using DescribeFn = int64_t (*)(uint8_t *, int64_t);
using NonFiniteFn = int64_t (*)(float *, int64_t);
using IntArgFn = int64_t (*)(int64_t);

constexpr int64_t kPhaseEnd = -1;
constexpr int64_t kPlanWorkspace = -1;

using namespace mlpool;
using namespace mlmem;

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
  mlstage::Shared shared;  // ml_constants: the buffer table's row width and direction bits
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

  // The text a `fn(buf, cap) -> full length` export writes.
  static std::string read_text(DescribeFn fn) {
    std::vector<uint8_t> buf(512);
    int64_t n = fn(buf.data(), static_cast<int64_t>(buf.size()));
    if (n > static_cast<int64_t>(buf.size())) {
      buf.resize(static_cast<size_t>(n));
      fn(buf.data(), n);
    }
    return std::string(reinterpret_cast<char *>(buf.data()), static_cast<size_t>(std::max<int64_t>(n, 0)));
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
    description = read_text(describe);
    // Absent from a binary of an older ABI, which the loader refuses by its
    // version; the staging below then has no table to read.
    if (auto consts = reinterpret_cast<DescribeFn>(dlsym(handle, "ml_constants"))) {
      std::string text = read_text(consts);
      shared = {mlstage::constant(text, "BUF_ROW"), mlstage::constant(text, "BUF_IN"),
                mlstage::constant(text, "BUF_OUT")};
    }
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
      for (const auto &b : mlstage::table(buffers, shared, op, args)) {
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
        spans.push_back({static_cast<int64_t>(i), a, lo, lo + n, shared.in | shared.out});
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
    auto bufs = mlstage::table(buffers, shared, op, args, op == drop_op ? drop_row : -1);
    if (gpu_run) {
      nb::gil_scoped_release release;
      mlstage::run_gpu(gpu_run, op, args, bufs);
      return;
    }
    int64_t &most = staged_rows[op];
    most = std::max(most, static_cast<int64_t>(bufs.size()));
    check_unlisted_addresses(op, args, bufs);
    std::vector<int64_t> dargs(args);
    mlstage::HostStage stage(shared, bufs, dargs);
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

// Caller memory: Storage (the aligned, buffer-protocol memory behind
// mojolearn.Array) and the registry of known caller regions that device
// emulation and the op records consult.
#pragma once

#include <nanobind/nanobind.h>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define ML_HAVE_MMAP 1
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlmem {

namespace nb = nanobind;

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

// Aligned memory with a shape and a format, exporting the buffer protocol.
// A view shares the memory of its base and keeps it alive.
// Arrays of at least this many bytes get their own anonymous mapping: it
// comes zeroed (no memset for zero=True) and goes back to the system when
// the array is freed. From malloc, a big freed block can stay in the
// process (glibc raises its mmap threshold after such a free), so a model
// loaded piece by piece would keep its transient pieces' pages.
constexpr size_t kMapBytes = size_t(1) << 20;

#ifdef ML_HAVE_MMAP
// A zeroed anonymous mapping of len bytes (a page multiple). From 2 MB up it
// starts on a 2 MB boundary and asks for transparent huge pages (Linux; a
// hint the system may ignore): a batch-8 decode step reads ~30 MB of
// weights and state, ~7000 4 KB pages, more than the TLB holds, so every
// step walked the page tables again (d = 768 batch-8 steps 0.78-0.94x the
// time with huge pages). Only whole 2 MB pieces inside the array become
// huge pages, so an array costs at most what it touches, rounded to 2 MB.
void *map_zeroed(size_t len) {
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MADV_HUGEPAGE
  constexpr size_t kHuge = size_t(2) << 20;
  if (len >= kHuge) {
    void *q = mmap(nullptr, len + kHuge, prot, flags, -1, 0);
    if (q == MAP_FAILED) return q;
    uintptr_t a = (reinterpret_cast<uintptr_t>(q) + kHuge - 1) / kHuge * kHuge;
    size_t head = a - reinterpret_cast<uintptr_t>(q);
    if (head) munmap(q, head);
    munmap(reinterpret_cast<void *>(a + len), kHuge - head);  // the tail past len
    madvise(reinterpret_cast<void *>(a), len, MADV_HUGEPAGE);
    return reinterpret_cast<void *>(a);
  }
#endif
  return mmap(nullptr, len, prot, flags, -1, 0);
}
#endif

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
    void *p = map_zeroed(len);
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

}  // namespace mlmem

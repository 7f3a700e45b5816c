// The persistent thread pool that runs an op's tasks (native.cpp's run()).
// Tasks of one phase are independent; which thread runs a task never
// changes a bit.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace mlpool {

using TaskFn = int64_t (*)(int64_t, int64_t *, int64_t, int64_t);

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

}  // namespace mlpool

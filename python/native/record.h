// Test-only op recorder: one file per op run, replayed without Python by
// tools/abi_replay/replay.c (for instance an aarch64 build under qemu-user,
// tools/arm64_check.sh), which compares the bytes it computes with the ones
// recorded here.
//
// A record holds the op id, the argument slots and every buffer the op may
// touch, with its bytes before and after the run. Which slots are buffers
// comes from the binary's own table (ml_buffers, device ops) and, for the
// other slots, from the caller memory the host layer knows of (Storage
// allocations and buffers whose address was taken): a slot pointing into one
// of them records that whole allocation. Overlapping spans are merged into
// one buffer; each slot keeps its offset into it, so aliases stay aliases.
//
// File layout (little-endian; all fields int64 unless said):
//   magic "MLREC001" (8 bytes), abi_version, op, nargs, nbufs,
//   args[nargs] (as the caller passed them: host addresses in pointer slots),
//   per buffer: bytes, flags (1 in, 2 out, 0 scratch), nslots,
//               nslots x (slot, byte offset),
//   per buffer: its bytes before the run, zero-padded to a multiple of 8,
//   per buffer: its bytes after the run, likewise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mlrecord {

// One pointer slot and the memory it may reach: [lo, hi) (not empty) around addr.
struct Span {
  int64_t slot;
  uintptr_t addr, lo, hi;
  int64_t flags;
};

struct Buf {
  uintptr_t lo, hi;
  int64_t flags;
  std::vector<std::pair<int64_t, int64_t>> slots;  // (slot, offset)
  std::vector<unsigned char> before;
};

class Recording {
 public:
  // Merges the spans into buffers and copies their bytes as they are now.
  Recording(int64_t op, const std::vector<int64_t> &args, std::vector<Span> spans)
      : op_(op), args_(args) {
    std::sort(spans.begin(), spans.end(), [](const Span &a, const Span &b) { return a.lo < b.lo; });
    for (const Span &s : spans) {
      if (bufs_.empty() || s.lo >= bufs_.back().hi) bufs_.push_back(Buf{s.lo, s.hi, 0, {}, {}});
      Buf &b = bufs_.back();
      b.hi = std::max(b.hi, s.hi);
      b.flags |= s.flags;
    }
    for (const Span &s : spans)
      for (Buf &b : bufs_)
        if (s.lo >= b.lo && s.lo < b.hi)
          b.slots.emplace_back(s.slot, static_cast<int64_t>(s.addr - b.lo));
    for (Buf &b : bufs_) {
      auto *p = reinterpret_cast<const unsigned char *>(b.lo);
      b.before.assign(p, p + (b.hi - b.lo));
    }
  }

  // Writes the record, reading each buffer's bytes as they are after the run.
  void write(const std::string &path, int64_t abi_version) const {
    std::FILE *f = std::fopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write op record " + path);
    auto i64 = [&](int64_t v) { std::fwrite(&v, 8, 1, f); };
    auto bytes = [&](const unsigned char *p, size_t n) {
      static const unsigned char zero[8] = {0};
      std::fwrite(p, 1, n, f);
      std::fwrite(zero, 1, (8 - n % 8) % 8, f);
    };
    std::fwrite("MLREC001", 1, 8, f);
    i64(abi_version);
    i64(op_);
    i64(static_cast<int64_t>(args_.size()));
    i64(static_cast<int64_t>(bufs_.size()));
    for (int64_t a : args_) i64(a);
    for (const Buf &b : bufs_) {
      i64(static_cast<int64_t>(b.hi - b.lo));
      i64(b.flags);
      i64(static_cast<int64_t>(b.slots.size()));
      for (const auto &s : b.slots) {
        i64(s.first);
        i64(s.second);
      }
    }
    for (const Buf &b : bufs_) bytes(b.before.data(), b.before.size());
    for (const Buf &b : bufs_) bytes(reinterpret_cast<const unsigned char *>(b.lo), b.hi - b.lo);
    bool ok = std::ferror(f) == 0;
    ok = std::fclose(f) == 0 && ok;
    if (!ok) throw std::runtime_error("cannot write op record " + path);
  }

 private:
  int64_t op_;
  std::vector<int64_t> args_;
  std::vector<Buf> bufs_;
};

}  // namespace mlrecord

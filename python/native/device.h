// Device staging: how an op runs on a binary whose tasks cannot see host
// memory (a GPU binary), and the same staging on the CPU for tests.
//
// The binary lists an op's buffer slots (ml_buffers: slot, bytes, flags; see
// mojo/mojolearn_kernels/buffers.mojo). Here the list is checked and turned
// into a table with aliases (one buffer in two slots is staged once); then
// either the GPU binary's ml_gpu_run copies the buffers to the device and
// runs the phases there, or `emulate` stages them in fresh host memory and
// runs the ordinary host tasks on an args copy that points at the copies.
// Emulation makes a wrong table visible without a GPU: input copies are
// checked unchanged, output-only and scratch copies start as NaN bytes, and
// a guard after each copy catches writes past its end.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlstage {

using BuffersFn = int64_t (*)(int64_t, int64_t *, int64_t *, int64_t);
// ml_gpu_run(op, args, nargs, rows (slot, bytes, flags, alias), nrows, err, errcap)
using GpuRunFn = int64_t (*)(int64_t, int64_t *, int64_t, int64_t *, int64_t, uint8_t *, int64_t);

// The binary's own numbers (its ml_constants text, constants.mojo): the
// ml_buffers row width and direction bits. Read at load, never copied here.
struct Shared {
  int64_t row = 0, in = 0, out = 0;
};

// Value of NAME in ml_constants' `NAME=value;...` text (throws if absent).
inline int64_t constant(const std::string &text, const std::string &name) {
  std::string key = name + "=";
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(';', at);
    if (end == std::string::npos) end = text.size();
    if (text.compare(at, key.size(), key) == 0)
      return std::stoll(text.substr(at + key.size(), end - at - key.size()));
    at = end + 1;
  }
  throw std::runtime_error("the binary's ml_constants lacks " + name);
}

constexpr size_t kGuard = 4096;        // guard bytes after each emulated copy
constexpr unsigned char kGuardByte = 0x5A;
constexpr unsigned char kPoisonByte = 0xFF;  // float32 NaN

struct Buffer {
  int64_t slot, bytes, flags;
  int64_t alias;  // index of the row staging the same address, or -1
  uintptr_t host;
};

// The checked buffer table of op over args (without raw row drop_row, a
// test hook that plays a binary whose table misses that row).
inline std::vector<Buffer> table(BuffersFn fn, const Shared &k, int64_t op,
                                 std::vector<int64_t> &args, int64_t drop_row = -1) {
  const int64_t kRow = k.row;
  if (kRow < 3) throw std::runtime_error("the binary exports no buffer table width (ml_constants)");
  std::vector<int64_t> rows(kRow * 32);
  int64_t n = fn(op, args.data(), rows.data(), 32);
  if (n > 32) {
    rows.resize(static_cast<size_t>(kRow * n));
    n = fn(op, args.data(), rows.data(), n);
  }
  if (n < 0) throw std::runtime_error("op " + std::to_string(op) + " has no buffer table");
  std::vector<Buffer> out;
  for (int64_t i = 0; i < n; ++i) {
    if (i == drop_row) continue;
    Buffer b{rows[kRow * i], rows[kRow * i + 1], rows[kRow * i + 2], -1, 0};
    if (b.slot < 0 || b.slot >= static_cast<int64_t>(args.size()))
      throw std::runtime_error("buffer slot " + std::to_string(b.slot) + " of op " +
                               std::to_string(op) + " is outside its arguments");
    b.host = static_cast<uintptr_t>(args[static_cast<size_t>(b.slot)]);
    for (size_t j = 0; j < out.size(); ++j) {
      if (out[j].host == b.host && out[j].alias < 0) {
        b.alias = static_cast<int64_t>(j);
        out[j].flags |= b.flags;
        out[j].bytes = std::max(out[j].bytes, b.bytes);
        break;
      }
    }
    out.push_back(b);
  }
  // Distinct buffers must not overlap: they are staged as separate copies.
  for (size_t i = 0; i < out.size(); ++i)
    for (size_t j = 0; j < out.size(); ++j)
      if (i != j && out[i].alias < 0 && out[j].alias < 0 && out[i].host < out[j].host &&
          out[i].host + static_cast<uintptr_t>(out[i].bytes) > out[j].host)
        throw std::runtime_error("op " + std::to_string(op) + ": buffers in slots " +
                                 std::to_string(out[i].slot) + " and " + std::to_string(out[j].slot) +
                                 " overlap; a device binary needs separate buffers");
  return out;
}

// Rows for ml_gpu_run: (slot, bytes, flags, alias) per buffer.
inline std::vector<int64_t> gpu_rows(const std::vector<Buffer> &bufs) {
  std::vector<int64_t> r;
  for (const auto &b : bufs) r.insert(r.end(), {b.slot, b.bytes, b.flags, b.alias});
  return r;
}

inline void run_gpu(GpuRunFn fn, int64_t op, std::vector<int64_t> &args, const std::vector<Buffer> &bufs) {
  auto rows = gpu_rows(bufs);
  std::vector<uint8_t> err(1024, 0);
  int64_t s = fn(op, args.data(), static_cast<int64_t>(args.size()), rows.data(),
                 static_cast<int64_t>(bufs.size()), err.data(), static_cast<int64_t>(err.size() - 1));
  if (s != 0)
    throw std::runtime_error("GPU run of op " + std::to_string(op) + " failed (status " +
                             std::to_string(s) + "): " + reinterpret_cast<char *>(err.data()));
}

struct FreeDeleter {
  void operator()(void *p) const { std::free(p); }
};

// Host copies of the buffers (emulation); `dargs` gets their addresses.
struct HostStage {
  std::vector<std::unique_ptr<unsigned char, FreeDeleter>> mem;

  int64_t kIn, kOut;

  HostStage(const Shared &k, const std::vector<Buffer> &bufs, std::vector<int64_t> &dargs)
      : kIn(k.in), kOut(k.out) {
    for (const auto &b : bufs) {
      if (b.alias >= 0) {
        mem.emplace_back(nullptr);
        dargs[static_cast<size_t>(b.slot)] = dargs[static_cast<size_t>(bufs[static_cast<size_t>(b.alias)].slot)];
        continue;
      }
      size_t n = static_cast<size_t>(b.bytes);
      auto *p = static_cast<unsigned char *>(std::aligned_alloc(64, (n + kGuard + 63) / 64 * 64));
      if (!p) throw std::bad_alloc();
      mem.emplace_back(p);
      if (b.flags & kIn)
        std::memcpy(p, reinterpret_cast<void *>(b.host), n);
      else
        std::memset(p, kPoisonByte, n);
      std::memset(p + n, kGuardByte, kGuard);
      dargs[static_cast<size_t>(b.slot)] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    }
  }

  // Checks the guards and inputs, copies outputs back; throws on a misuse.
  void finish(int64_t op, const std::vector<Buffer> &bufs) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      const Buffer &b = bufs[i];
      if (b.alias >= 0) continue;
      unsigned char *p = mem[i].get();
      size_t n = static_cast<size_t>(b.bytes);
      std::string where = "op " + std::to_string(op) + " slot " + std::to_string(b.slot);
      for (size_t k = 0; k < kGuard; ++k)
        if (p[n + k] != kGuardByte)
          throw std::runtime_error(where + " wrote past its " + std::to_string(n) + " bytes");
      if (b.flags & kOut)
        std::memcpy(reinterpret_cast<void *>(b.host), p, n);
      else if ((b.flags & kIn) && std::memcmp(p, reinterpret_cast<void *>(b.host), n) != 0)
        throw std::runtime_error(where + " is an input but was written");
    }
  }
};

}  // namespace mlstage

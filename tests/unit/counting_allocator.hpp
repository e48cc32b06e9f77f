#pragma once
// The CPU allocator, counted: the bytes held now and at their peak, and optionally a budget past
// which an allocation fails with torch's out-of-memory error (a device's memory, on the CPU, for
// a model that does not fit). Shared by the distributed checks' worker and the benchmarks.

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace difftrain::test {

class CountingAllocator final : public c10::Allocator {
 public:
  /// Counts every CPU allocation of this process from now on; `budget` bytes at most (0: none).
  static CountingAllocator& install(std::size_t budget = 0) {
    static CountingAllocator* a = [budget] {
      auto* c = new CountingAllocator(c10::GetCPUAllocator(), budget);
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *a;
  }
  /// The installed one, or null.
  static CountingAllocator* instance() { return instance_; }

  c10::DataPtr allocate(std::size_t n) override {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (budget_ > 0 && current_ + n > budget_)
        TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory: ", n, " bytes asked with ",
                         current_, " of ", budget_, " held");
    }
    void* d = inner_->raw_allocate(n);
    std::lock_guard<std::mutex> lock(m_);
    sizes_[d] = n;
    current_ += n;
    peak_ = std::max(peak_, current_);
    return {d, d, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    std::memcpy(dst, src, n);
  }
  /// The peak starts again from what is held now.
  void reset_peak() {
    std::lock_guard<std::mutex> lock(m_);
    peak_ = current_;
  }
  [[nodiscard]] std::size_t peak() {
    std::lock_guard<std::mutex> lock(m_);
    return peak_;
  }

 private:
  CountingAllocator(c10::Allocator* inner, std::size_t budget)
      : inner_(inner), inner_delete_(inner->raw_deleter()), budget_(budget) {
    instance_ = this;
  }
  static void release(void* d) {
    if (d == nullptr) return;
    CountingAllocator* self = instance_;
    {
      std::lock_guard<std::mutex> lock(self->m_);
      if (auto it = self->sizes_.find(d); it != self->sizes_.end()) {
        self->current_ -= it->second;
        self->sizes_.erase(it);
      }
    }
    self->inner_delete_(d);
  }
  static inline CountingAllocator* instance_ = nullptr;
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_delete_;
  std::size_t budget_;
  std::mutex m_;
  std::unordered_map<void*, std::size_t> sizes_;
  std::size_t current_ = 0, peak_ = 0;
};

}  // namespace difftrain::test

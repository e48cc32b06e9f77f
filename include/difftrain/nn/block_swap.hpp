#pragma once
// Block swapping: the frozen tensors of chosen blocks (a transformer's last N blocks, as kohya's
// --blocks_to_swap, an idea from OneTrainer) live in host memory, and come to the device only
// while their block runs: copied in ahead of use on a side stream, dropped after, in forward and
// again in backward. A LoRA step of a model larger than the device then holds the resident blocks'
// weights plus two swapped blocks' at any time.
//
// How: each swapped tensor keeps its storage object (so the autograd graph's saved tensors and
// the model's parameters stay the same objects) while its memory is freed; bringing the block in
// allocates the memory again and copies the host copy into it. A model tells its blocks through
// nn::in_unit (unit_scope.hpp): entering a block brings it in (and starts copying the next one);
// leaving it drops it, and a hook on its outputs brings it back when backward reaches it (and
// starts on the block before). The recompute of gradient checkpointing inside backward finds the
// block in place. Trained tensors (LoRA's) stay on the device: the optimizer owns them.
//
// The arithmetic is untouched: a swapped run's outputs and gradients equal an unswapped run's to
// the bit. One listener per process: stage-3 sharding (which moves parameters the same way across
// ranks) and block swapping exclude each other.

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/nn/unit_scope.hpp"

namespace difftrain::nn {

struct BlockSwapOptions {
  /// Copy the next block (the one before, in backward) while this one runs; on the CPU the copy
  /// is made when the block is entered instead.
  bool prefetch = true;
  /// Page-locked host copies (CUDA devices), which asynchronous copies need.
  bool pin_memory = true;
  /// Where the blocks compute; default: where their tensors are. Tensors elsewhere (a model
  /// read into host memory) move there without ever being whole on it: place the rest of the
  /// model after constructing the swap.
  std::optional<at::Device> device;
};

/// Bytes and copies of a BlockSwap, for benchmarks and tests.
struct BlockSwapStats {
  std::int64_t blocks = 0;               ///< blocks swapped
  std::int64_t host_bytes = 0;           ///< their frozen tensors' bytes, held on the host
  std::int64_t resident_bytes = 0;       ///< of those, on the device now
  std::int64_t peak_resident_bytes = 0;  ///< the most at once since construction
  std::int64_t largest_block_bytes = 0;
  std::int64_t copies = 0;      ///< blocks copied in
  std::int64_t prefetched = 0;  ///< of which ahead of use
  std::int64_t releases = 0;    ///< blocks dropped
};

class BlockSwap;

namespace block_swap_detail {
inline std::atomic<BlockSwap*>& active() {
  static std::atomic<BlockSwap*> current{nullptr};
  return current;
}
}  // namespace block_swap_detail

class BlockSwap : UnitListener {
 public:
  /// Swaps `blocks` (in the order the model runs them; `names` for messages): every frozen
  /// parameter and buffer of each block is copied to the host, and its memory on the device
  /// (options.device, or where the tensors are) freed; the tensor objects stay the model's.
  BlockSwap(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
            std::vector<std::string> names, BlockSwapOptions o = {})
      : o_(o) {
    const std::string where = "BlockSwap";
    if (names.size() != blocks.size())
      throw ConfigError("takes one name per block (" + std::to_string(blocks.size()) + " blocks, " +
                            std::to_string(names.size()) + " names)",
                        where);
    std::optional<at::Device> device;
    at::NoGradGuard no_grad;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      if (!blocks[b]) throw ConfigError("block " + names[b] + " is null", where);
      Block block;
      block.module = blocks[b].get();
      block.name = std::move(names[b]);
      std::vector<at::Tensor> frozen;
      for (const at::Tensor& p : blocks[b]->parameters(/*recurse=*/true))
        if (!p.requires_grad()) frozen.push_back(p);
      for (const at::Tensor& t : blocks[b]->buffers(/*recurse=*/true))
        if (t.defined()) frozen.push_back(t);
      if (frozen.empty())
        throw ConfigError("has no frozen tensors to keep on the host (every parameter trains)",
                          where + ": " + block.name);
      for (const at::Tensor& t : frozen) {
        if (!device) device = o_.device.value_or(t.device());
        const auto bytes = static_cast<std::size_t>(t.numel() * t.element_size());
        if (t.storage_offset() != 0 || !t.is_contiguous() || t.storage().nbytes() != bytes)
          throw ConfigError(
              "holds a view into a larger tensor; a swapped tensor must own its memory",
              where + ": " + block.name);
        Slot s;
        slot_of_.emplace(t.unsafeGetTensorImpl(), std::pair{blocks_.size(), block.slots.size()});
        s.host = t.device().is_cpu() ? t.clone() : t.to(at::kCPU);
        if (o_.pin_memory && device->is_cuda()) s.host = s.host.pin_memory();
        // The same tensor object, its memory on the device (freed below).
        if (t.device() != *device)
          at::Tensor(t).set_data(at::empty_like(t, t.options().device(*device)));
        s.device = t;
        block.bytes += static_cast<std::int64_t>(bytes);
        block.slots.push_back(std::move(s));
      }
      stats_.host_bytes += block.bytes;
      stats_.largest_block_bytes = std::max(stats_.largest_block_bytes, block.bytes);
      index_.emplace(block.module, blocks_.size());
      blocks_.push_back(std::move(block));
    }
    stats_.blocks = static_cast<std::int64_t>(blocks_.size());
    device_ = device.value_or(at::Device(at::kCPU));
    if (!device_.is_cpu())
      side_ = c10::impl::VirtualGuardImpl(device_.type()).getStreamFromGlobalPool(device_);
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      blocks_[b].resident = true;
      stats_.resident_bytes += blocks_[b].bytes;
      release(b);
    }
    if (!listen_to_units(this)) {
      for (std::size_t b = 0; b < blocks_.size(); ++b) bring(b, false);
      throw ConfigError(
          "another listener (stage-3 sharding or another BlockSwap) follows the model's blocks in "
          "this process already; one per process",
          where);
    }
    block_swap_detail::active().store(this);
  }
  BlockSwap(const BlockSwap&) = delete;
  BlockSwap& operator=(const BlockSwap&) = delete;

  /// Every block back on the device for good.
  ~BlockSwap() override {
    BlockSwap* self = this;
    block_swap_detail::active().compare_exchange_strong(self, nullptr);
    stop_listening_to_units(this);
    const std::lock_guard<std::mutex> lock(mutex_);
    *alive_ = false;
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      bring(b, false);
      wait(b);
    }
  }

  [[nodiscard]] const BlockSwapStats& stats() const { return stats_; }
  [[nodiscard]] at::Device device() const { return device_; }

  /// Every swapped block on the device while the scope lives (saving the model, or running it
  /// outside its forward); dropped again after.
  class Whole {
   public:
    explicit Whole(BlockSwap& s) : s_(&s) {
      const std::lock_guard<std::mutex> lock(s_->mutex_);
      ++s_->whole_;
      for (std::size_t b = 0; b < s_->blocks_.size(); ++b) {
        s_->bring(b, false);
        s_->wait(b);
      }
    }
    Whole(const Whole&) = delete;
    Whole& operator=(const Whole&) = delete;
    ~Whole() {
      const std::lock_guard<std::mutex> lock(s_->mutex_);
      if (--s_->whole_ == 0)
        for (std::size_t b = 0; b < s_->blocks_.size(); ++b) s_->release(b);
    }

   private:
    BlockSwap* s_;
  };
  [[nodiscard]] Whole whole() { return Whole(*this); }

  /// `t`, or while it is swapped out its host copy (what a checkpoint reads, without bringing
  /// the block in).
  [[nodiscard]] at::Tensor readable(const at::Tensor& t) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = slot_of_.find(t.unsafeGetTensorImpl());
    if (it == slot_of_.end()) return t;
    Block& block = blocks_[it->second.first];
    if (!block.resident) return block.slots[it->second.second].host;
    wait(it->second.first);
    return t;
  }

  /// Sets `t` to `value`: its host copy, and the device tensor while resident (a resumed
  /// checkpoint).
  void assign(const at::Tensor& t, const at::Tensor& value) {
    const std::lock_guard<std::mutex> lock(mutex_);
    at::NoGradGuard no_grad;
    const auto it = slot_of_.find(t.unsafeGetTensorImpl());
    if (it == slot_of_.end()) {
      at::Tensor(t).copy_(value);
      return;
    }
    Block& block = blocks_[it->second.first];
    block.slots[it->second.second].host.copy_(value);
    if (block.resident) {
      wait(it->second.first);
      at::Tensor(t).copy_(value);
    }
  }

 private:
  struct Slot {
    at::Tensor device;  // the model's tensor; its memory is freed while swapped out
    at::Tensor host;
  };
  struct Block {
    const torch::nn::Module* module = nullptr;
    std::string name;
    std::vector<Slot> slots;
    std::int64_t bytes = 0;
    bool resident = false;
    std::optional<c10::Event> arrived;  // the side stream's copy, when one is in flight
  };

  void enter(const torch::nn::Module& m) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(&m);
    if (it == index_.end()) return;
    const std::size_t b = it->second;
    bring(b, false);
    wait(b);
    if (o_.prefetch && torch::autograd::get_current_graph_task_id() < 0 && b + 1 < blocks_.size())
      bring(b + 1, true);
  }

  void leave(const torch::nn::Module& m, const std::vector<at::Tensor>& outputs) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(&m);
    if (it == index_.end()) return;
    const std::size_t b = it->second;
    // A recompute inside backward: the block's backward comes right after; the hook that
    // brought it in drops it later.
    if (torch::autograd::get_current_graph_task_id() >= 0) return;
    for (const at::Tensor& t : outputs)
      if (t.requires_grad())
        at::Tensor(t).register_hook([this, b, alive = alive_](const at::Tensor& /*grad*/) {
          if (*alive) before_backward(b);
        });
    release(b);
  }

  /// Backward reached block b: the blocks after it are done; b comes in, the one before it
  /// starts coming.
  void before_backward(std::size_t b) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (std::size_t k = b + 1; k < blocks_.size(); ++k) release(k);
    bring(b, false);
    wait(b);
    if (o_.prefetch && b > 0) bring(b - 1, true);
  }

  /// Allocates block b's memory and starts (on the CPU: makes) the copy from the host.
  void bring(std::size_t b, bool ahead) {
    Block& block = blocks_[b];
    if (block.resident) return;
    at::NoGradGuard no_grad;
    for (Slot& s : block.slots) {
      c10::StorageImpl* storage = s.device.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
      const auto n = static_cast<std::size_t>(s.host.numel() * s.host.element_size());
      storage->set_data_ptr_noswap(storage->allocator()->allocate(n));
      storage->set_nbytes(n);
    }
    if (device_.is_cpu()) {
      for (Slot& s : block.slots) s.device.variable_data().copy_(s.host);
    } else {
      // The memory was allocated on the compute stream: the side stream starts after what that
      // stream has queued (the memory's last users), and the compute stream waits for the copy
      // before the block runs (wait()).
      const c10::impl::VirtualGuardImpl impl(device_.type());
      const c10::Stream compute = impl.getStream(device_);
      c10::Event allocated(device_.type());
      allocated.record(compute);
      allocated.block(*side_);
      {
        const c10::StreamGuard on_side(*side_);
        for (Slot& s : block.slots) s.device.variable_data().copy_(s.host, /*non_blocking=*/true);
      }
      block.arrived.emplace(device_.type());
      block.arrived->record(*side_);
    }
    block.resident = true;
    ++stats_.copies;
    if (ahead) ++stats_.prefetched;
    stats_.resident_bytes += block.bytes;
    stats_.peak_resident_bytes = std::max(stats_.peak_resident_bytes, stats_.resident_bytes);
  }

  /// The compute stream waits for block b's copy.
  void wait(std::size_t b) {
    Block& block = blocks_[b];
    if (!block.arrived) return;
    const c10::impl::VirtualGuardImpl impl(device_.type());
    block.arrived->block(impl.getStream(device_));
    block.arrived.reset();
  }

  /// Frees block b's device memory (its storage objects stay). Frees follow the compute stream's
  /// order, so kernels queued on it finish reading first.
  void release(std::size_t b) {
    Block& block = blocks_[b];
    if (!block.resident || whole_ > 0) return;
    wait(b);  // never free what is arriving
    for (Slot& s : block.slots) {
      c10::StorageImpl* storage = s.device.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
      storage->set_data_ptr_noswap(at::DataPtr(nullptr, s.device.device()));
      storage->set_nbytes(0);
    }
    block.resident = false;
    ++stats_.releases;
    stats_.resident_bytes -= block.bytes;
  }

  BlockSwapOptions o_;
  std::vector<Block> blocks_;
  std::map<const torch::nn::Module*, std::size_t> index_;
  std::map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> slot_of_;
  at::Device device_{at::kCPU};
  std::optional<c10::Stream> side_;
  std::mutex mutex_;
  int whole_ = 0;
  // Hooks left on a graph that outlives this object do nothing.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  BlockSwapStats stats_;
};

/// `t`, or its host copy while a living BlockSwap holds it swapped out: what reads every tensor of
/// a model (a checkpoint) reads, without bringing blocks in.
inline at::Tensor readable(const at::Tensor& t) {
  BlockSwap* s = block_swap_detail::active().load();
  return s != nullptr ? s->readable(t) : t;
}

/// t ← value, for a tensor a living BlockSwap may hold on the host (resuming a checkpoint).
inline void assign_tensor(const at::Tensor& t, const at::Tensor& value) {
  if (BlockSwap* s = block_swap_detail::active().load()) {
    s->assign(t, value);
    return;
  }
  at::NoGradGuard no_grad;
  at::Tensor(t).copy_(value);
}

/// kohya's split of --blocks_to_swap N for a model of double- and single-stream blocks (Flux):
/// N / 2 double blocks and twice the rest in single blocks (a single block is about half a double
/// one), the last ones of each list; each list keeps two blocks on the device.
struct DoubleSingleSwap {
  std::int64_t double_blocks = 0, single_blocks = 0;
};

inline DoubleSingleSwap split_blocks_to_swap(std::int64_t n, std::int64_t double_count,
                                             std::int64_t single_count, const std::string& where) {
  auto split = [](std::int64_t k) { return DoubleSingleSwap{k / 2, (k - k / 2) * 2}; };
  auto fits = [&](const DoubleSingleSwap& s) {
    return s.double_blocks <= double_count - 2 && s.single_blocks <= single_count - 2;
  };
  if (n < 0) throw ConfigError("must not be negative", where);
  if (n == 0) return {};
  if (!fits(split(n))) {
    std::int64_t most = 0;
    while (fits(split(most + 1))) ++most;
    throw ConfigError("is " + std::to_string(n) + ": " + std::to_string(split(n).double_blocks) +
                          " double and " + std::to_string(split(n).single_blocks) +
                          " single blocks, but the model's " + std::to_string(double_count) +
                          " and " + std::to_string(single_count) +
                          " keep two of each on the device: at most " + std::to_string(most),
                      where);
  }
  return split(n);
}

}  // namespace difftrain::nn

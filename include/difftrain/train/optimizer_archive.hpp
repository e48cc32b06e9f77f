#pragma once
// An optimizer's whole state as LibTorch's archive bytes, the same bytes for the same state.
//
// LibTorch's `Optimizer::save` keys each parameter's state by the address of its TensorImpl and
// writes the states in the order of a hash map over those addresses, so two runs that reach the
// same state (one of them resumed from a checkpoint) write different bytes. This writer keeps
// LibTorch's layout (torch/optim/serialize.h) and keys the parameters 1, 2, ... in the order of
// the groups instead, writing their states in that order. LibTorch's `Optimizer::load` reads it
// unchanged: it matches states to parameters through the groups' key lists, whatever the keys
// are. Adam, AdamW, SGD, RMSprop and Adagrad (and every optimizer derived from them, such as
// difftrain's fused and multi-tensor ones) are written this way; any other optimizer through its
// own `save`.

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "difftrain/train/adafactor.hpp"
#include "difftrain/train/adamw_8bit.hpp"
#include "difftrain/train/came.hpp"
#include "difftrain/train/lion.hpp"
#include "difftrain/train/prodigy.hpp"
#include "difftrain/train/schedule_free.hpp"

namespace difftrain::train {

namespace optimizer_archive_detail {
template <class State, class Options>
void save_by_position(torch::serialize::OutputArchive& archive,
                      const torch::optim::Optimizer& optimizer) {
  const auto unit = archive.compilation_unit();
  archive.write("pytorch_version", c10::IValue("1.5.0"));  // what LibTorch's reader expects
  torch::serialize::OutputArchive states(unit), groups(unit);
  const auto& param_groups = optimizer.param_groups();
  groups.write("param_groups/size",
               at::scalar_tensor(static_cast<std::int64_t>(param_groups.size()), at::kLong));
  std::size_t key = 0;
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    torch::serialize::OutputArchive group(unit);
    const auto& params = param_groups[g].params();
    group.write("params/size",
                at::scalar_tensor(static_cast<std::int64_t>(params.size()), at::kLong));
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::string name = std::to_string(++key);  // never 0: LibTorch reads it as a pointer
      group.write("params/" + std::to_string(i), c10::IValue(name));
      const auto it = optimizer.state().find(params[i].unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      torch::serialize::OutputArchive state(unit);
      static_cast<const State&>(*it->second).serialize(state);
      states.write(name, state);
    }
    torch::serialize::OutputArchive options(unit);
    static_cast<const Options&>(param_groups[g].options()).serialize(options);
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  archive.write("state", states);
  archive.write("param_groups", groups);
}

/// Writes `optimizer` by position when it is one of `Kinds` (AdamW before Adam: derived first).
template <class Optimizer, class State, class Options>
bool save_if(torch::serialize::OutputArchive& archive, const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const Optimizer*>(&optimizer) == nullptr) return false;
  save_by_position<State, Options>(archive, optimizer);
  return true;
}
}  // namespace optimizer_archive_detail

/// Writes `optimizer`'s state into `archive`, keyed by parameter position (see above).
inline void save_optimizer(torch::serialize::OutputArchive& archive,
                           torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  using optimizer_archive_detail::save_if;
  if (save_if<LionOptimizer, LionParamState, LionOptions>(archive, optimizer) ||
      save_if<ProdigyOptimizer, ProdigyParamState, ProdigyOptions>(archive, optimizer) ||
      save_if<AdafactorOptimizer, FactoredParamState, AdafactorOptions>(archive, optimizer) ||
      save_if<CameOptimizer, FactoredParamState, CameOptions>(archive, optimizer) ||
      save_if<AdamW8bitOptimizer, AdamW8bitParamState, AdamW8bitOptions>(archive, optimizer) ||
      save_if<ScheduleFreeAdamWOptimizer, ScheduleFreeParamState, ScheduleFreeAdamWOptions>(
          archive, optimizer) ||
      save_if<o::AdamW, o::AdamWParamState, o::AdamWOptions>(archive, optimizer) ||
      save_if<o::Adam, o::AdamParamState, o::AdamOptions>(archive, optimizer) ||
      save_if<o::SGD, o::SGDParamState, o::SGDOptions>(archive, optimizer) ||
      save_if<o::RMSprop, o::RMSpropParamState, o::RMSpropOptions>(archive, optimizer) ||
      save_if<o::Adagrad, o::AdagradParamState, o::AdagradOptions>(archive, optimizer))
    return;
  optimizer.save(archive);
}

/// `optimizer`'s whole state as LibTorch's archive bytes: what a checkpoint stores under
/// "optimizer" (equal state, equal bytes; LibTorch's `Optimizer::load` reads them).
inline std::string optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  std::string bytes;
  torch::serialize::OutputArchive archive;
  save_optimizer(archive, optimizer);
  // Sized first, then written into place: a string grown as the archive streams would hold up
  // to twice the state while it reallocates (the state is 8 B per parameter for AdamW).
  std::size_t total = 0;
  archive.save_to([&](const void*, std::size_t n) {
    total += n;
    return n;
  });
  bytes.reserve(total);
  archive.save_to([&](const void* data, std::size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

}  // namespace difftrain::train

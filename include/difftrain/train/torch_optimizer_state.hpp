#pragma once
// An optimizer's state in the layout of Python's `optimizer.state_dict()`, so that a file written
// here loads with `torch.optim.AdamW(...).load_state_dict(...)` and the reverse: the web UI keeps
// its adapters' optimizer state this way in `.optim` sidecars.
//
//   {'state': {0: {'step': tensor(float32), 'exp_avg': ..., 'exp_avg_sq': ...}, ...},
//    'param_groups': [{'lr': ..., 'betas': (b1, b2), 'eps': ..., ..., 'params': [0, 1, ...]}]}
//
// Parameters are numbered through the groups in order, as Python does. Covers LibTorch's AdamW,
// Adam and SGD. Loading checks every group, index and shape first and changes nothing on a
// mismatch; the groups' hyperparameters come from the file, as in Python.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/io/torch_file.hpp"

namespace difftrain::train {

/// Python's class name of a LibTorch optimizer: "AdamW", "Adam" or "SGD" (else a ConfigError).
inline std::string torch_optimizer_name(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "Adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "SGD";
  throw ConfigError("only AdamW, Adam and SGD states have a Python layout here",
                    "torch optimizer state");
}

namespace optim_state_detail {
inline c10::IValue step_tensor(std::int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}
inline c10::IValue betas(const std::tuple<double, double>& b) {
  return c10::ivalue::Tuple::create(std::get<0>(b), std::get<1>(b));
}
inline c10::IValue cpu(const at::Tensor& t) { return t.detach().cpu().clone(); }

template <class Options>
void adam_group(c10::impl::GenericDict& g, const Options& o, bool decoupled) {
  g.insert("lr", o.lr());
  g.insert("betas", betas(o.betas()));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("amsgrad", o.amsgrad());
  g.insert("maximize", false);
  g.insert("foreach", c10::IValue());
  g.insert("capturable", false);
  g.insert("differentiable", false);
  g.insert("fused", c10::IValue());
  g.insert("decoupled_weight_decay", decoupled);
}
template <class State>
c10::IValue adam_state(const State& s) {
  auto d = io::torch_dict();
  d.insert("step", step_tensor(s.step()));
  d.insert("exp_avg", cpu(s.exp_avg()));
  d.insert("exp_avg_sq", cpu(s.exp_avg_sq()));
  if (s.max_exp_avg_sq().defined()) d.insert("max_exp_avg_sq", cpu(s.max_exp_avg_sq()));
  return d;
}
}  // namespace optim_state_detail

/// The optimizer's state in Python's layout (tensors copied to the CPU).
inline c10::IValue torch_optimizer_state(const torch::optim::Optimizer& opt) {
  namespace d = optim_state_detail;
  const std::string kind = torch_optimizer_name(opt);
  auto state = io::torch_dict();
  auto groups = io::torch_list();
  std::int64_t index = 0;
  for (const auto& group : opt.param_groups()) {
    auto g = io::torch_dict();
    if (kind == "AdamW")
      d::adam_group(g, static_cast<const torch::optim::AdamWOptions&>(group.options()), true);
    else if (kind == "Adam")
      d::adam_group(g, static_cast<const torch::optim::AdamOptions&>(group.options()), false);
    else {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      g.insert("lr", o.lr());
      g.insert("momentum", o.momentum());
      g.insert("dampening", o.dampening());
      g.insert("weight_decay", o.weight_decay());
      g.insert("nesterov", o.nesterov());
      g.insert("maximize", false);
      g.insert("foreach", c10::IValue());
      g.insert("differentiable", false);
      g.insert("fused", c10::IValue());
    }
    auto params = io::torch_list();
    for (const auto& p : group.params()) {
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it != opt.state().end()) {
        if (kind == "AdamW")
          state.insert(
              index, d::adam_state(static_cast<const torch::optim::AdamWParamState&>(*it->second)));
        else if (kind == "Adam")
          state.insert(
              index, d::adam_state(static_cast<const torch::optim::AdamParamState&>(*it->second)));
        else {
          const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
          auto e = io::torch_dict();
          e.insert("momentum_buffer",
                   s.momentum_buffer().defined() ? d::cpu(s.momentum_buffer()) : c10::IValue());
          state.insert(index, e);
        }
      }
      params.push_back(index++);
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  auto root = io::torch_dict();
  root.insert("state", state);
  root.insert("param_groups", groups);
  return root;
}

/// Restores a state in Python's layout into `opt` (same kind, same groups, same shapes).
inline void load_torch_optimizer_state(torch::optim::Optimizer& opt, const io::TorchValue& root) {
  const std::string kind = torch_optimizer_name(opt);
  const std::string where = root.where();
  const auto saved_groups = root.at("param_groups").elements();
  auto& groups = opt.param_groups();
  if (saved_groups.size() != groups.size())
    throw ConfigError("has " + std::to_string(saved_groups.size()) +
                          " parameter groups, the optimizer has " + std::to_string(groups.size()),
                      where);
  // Check everything before anything changes.
  std::map<std::int64_t, const at::Tensor*> param_of;
  std::int64_t expected = 0;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const auto ids = saved_groups[gi].at("params").elements();
    if (ids.size() != groups[gi].params().size())
      throw ConfigError("group " + std::to_string(gi) + " has " + std::to_string(ids.size()) +
                            " parameters, the optimizer's has " +
                            std::to_string(groups[gi].params().size()),
                        where);
    for (std::size_t pi = 0; pi < ids.size(); ++pi) {
      if (ids[pi].integer() != expected)
        throw FormatError(
            "numbers its parameters out of order (expected " + std::to_string(expected) + ")",
            ids[pi].where());
      param_of[expected++] = &groups[gi].params()[pi];
    }
  }
  const bool adam = kind != "SGD";
  const auto entries = root.at("state").items();
  for (const auto& [key, value] : entries) {
    if (!key.isInt() || !param_of.count(key.toInt()))
      throw FormatError("holds state for a parameter the groups do not list", value.where());
    const at::Tensor& p = *param_of[key.toInt()];
    for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
      const auto t = value.find(name);
      if (!t || t->is_none()) continue;
      if (t->tensor().sizes() != p.sizes())
        throw ConfigError("has shape " + c10::str(t->tensor().sizes()) + ", the parameter's is " +
                              c10::str(p.sizes()),
                          t->where());
    }
    if (adam) {
      (void)value.at("exp_avg").tensor(), (void)value.at("exp_avg_sq").tensor();
      (void)value.at("step");
    }
  }
  // The groups' hyperparameters, read (and so checked) before anything is applied.
  struct Hyper {
    double lr = 0, eps = 0, weight_decay = 0, momentum = 0, dampening = 0;
    std::tuple<double, double> betas{};
    bool amsgrad = false, nesterov = false;
  };
  std::vector<Hyper> hyper;
  for (const auto& s : saved_groups) {
    Hyper h;
    h.lr = s.at("lr").number();
    h.weight_decay = s.at("weight_decay").number();
    if (adam) {
      const auto b = s.at("betas").elements();
      if (b.size() != 2) throw FormatError("must hold two betas", s.at("betas").where());
      h.betas = {b[0].number(), b[1].number()};
      h.eps = s.at("eps").number();
      h.amsgrad = s.at("amsgrad").boolean();
    } else {
      h.momentum = s.at("momentum").number();
      h.dampening = s.at("dampening").number();
      h.nesterov = s.at("nesterov").boolean();
    }
    hyper.push_back(h);
  }
  for (const auto& [key, value] : entries)
    if (adam) {
      const auto step = value.at("step");
      if (!step.is_tensor()) (void)step.number();
    }
  // Apply.
  auto step_of = [](const io::TorchValue& v) {
    return v.is_tensor() ? static_cast<std::int64_t>(v.tensor().item<double>())
                         : static_cast<std::int64_t>(v.number());
  };
  auto like = [](const io::TorchValue& v, const at::Tensor& p) {
    return v.tensor().to(p.device(), p.scalar_type()).clone();
  };
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const Hyper& h = hyper[gi];
    auto& o = groups[gi].options();
    o.set_lr(h.lr);
    if (kind == "AdamW")
      static_cast<torch::optim::AdamWOptions&>(o)
          .betas(h.betas)
          .eps(h.eps)
          .weight_decay(h.weight_decay)
          .amsgrad(h.amsgrad);
    else if (kind == "Adam")
      static_cast<torch::optim::AdamOptions&>(o)
          .betas(h.betas)
          .eps(h.eps)
          .weight_decay(h.weight_decay)
          .amsgrad(h.amsgrad);
    else
      static_cast<torch::optim::SGDOptions&>(o)
          .momentum(h.momentum)
          .dampening(h.dampening)
          .weight_decay(h.weight_decay)
          .nesterov(h.nesterov);
  }
  opt.state().clear();
  for (const auto& [key, value] : entries) {
    const at::Tensor& p = *param_of[key.toInt()];
    std::unique_ptr<torch::optim::OptimizerParamState> st;
    auto fill = [&](auto state) {
      state->step(step_of(value.at("step")));
      state->exp_avg(like(value.at("exp_avg"), p));
      state->exp_avg_sq(like(value.at("exp_avg_sq"), p));
      if (const auto m = value.find("max_exp_avg_sq"); m && !m->is_none())
        state->max_exp_avg_sq(like(*m, p));
      st = std::move(state);
    };
    if (kind == "AdamW")
      fill(std::make_unique<torch::optim::AdamWParamState>());
    else if (kind == "Adam")
      fill(std::make_unique<torch::optim::AdamParamState>());
    else {
      auto state = std::make_unique<torch::optim::SGDParamState>();
      if (const auto m = value.find("momentum_buffer"); m && !m->is_none())
        state->momentum_buffer(like(*m, p));
      st = std::move(state);
    }
    opt.state()[p.unsafeGetTensorImpl()] = std::move(st);
  }
}

}  // namespace difftrain::train

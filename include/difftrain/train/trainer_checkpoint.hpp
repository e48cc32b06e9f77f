#pragma once
// Trainer's checkpoint members, defined out of the class: the state it writes (one
// torch.save-compatible value, and under a sharding policy one optimizer shard and one weights
// file per rank beside it), the checks a state passes before anything changes, and applying it.
// Included by trainer.hpp; including this header alone includes the class too.

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "difftrain/nn/block_swap.hpp"
#include "difftrain/train/trainer.hpp"

namespace difftrain::train {

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::fingerprint() const {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : groups_) groups.push_back({{"label", g.label}, {"names", g.names}});
  // A policy chosen at run time (OptimizerByName) records the one it chose, so a checkpoint
  // reads the same whichever way the optimizer was named.
  std::string optimizer(OptimizerPolicyT::name);
  if constexpr (requires { OptimizerPolicyT::chosen_name(o_.optimizer); })
    optimizer = OptimizerPolicyT::chosen_name(o_.optimizer);
  return {{"optimizer", optimizer},      {"schedule", detail_name<ScheduleT>()},
          {"ema", detail_name<EmaT>()},  {"precision", precision_.name},
          {"clipping", ClippingT::name}, {"accumulation_steps", o_.accumulation_steps},
          {"param_groups", groups}};
}

template <class Model, class Config>
c10::IValue Trainer<Model, Config>::make_state(const RankFileRecords* files, bool contents) {
  const bool weights_in_set = files != nullptr && !files->weights.empty();
  std::set<std::string> in_shards;
  if (weights_in_set) in_shards.insert(param_names_.begin(), param_names_.end());
  auto root = io::torch_dict();
  root.insert("format", std::string("difftrain.checkpoint"));
  root.insert("version", kCheckpointFormatVersion);
  root.insert("step", step_);
  nlohmann::json js = {{"fingerprint", fingerprint()},
                       {"scheduler", scheduler_->state()},
                       {"scaler", scaler_.state()},
                       {"skipped_nonfinite", nonfinite_},
                       {"skipped_overflow", overflow_skips_}};
  // Without `contents` (a rank that writes nothing) only the collectives run: no copy of the
  // model, its optimizer state or its EMA is made (+19 B/param on every such rank before).
  auto model = io::torch_dict();
  if (contents) {
    for (const auto& item : model_->named_parameters(true))
      if (!in_shards.contains(item.key()))
        model.insert(item.key(), nn::readable(item.value()).detach().cpu().clone());
    for (const auto& item : model_->named_buffers(true))
      model.insert(item.key(), nn::readable(item.value()).detach().cpu().clone());
  }
  root.insert("model", model);
  // A sharded optimizer state is in one file per rank beside this one (save_checkpoint); here
  // is only the index of which rank holds which parameters' state.
  if (shards_state()) {
    js["sharding"] = sharding_index();
    if (weights_in_set) js["sharding"]["weights"] = weights_index(files->weights);
    if (files != nullptr) {
      nlohmann::json records = nlohmann::json::array();
      for (const auto& rec : files->optimizer)
        records.push_back({{"bytes", rec.bytes}, {"crc32", rec.crc32}});
      js["sharding"]["optimizer_files"] = records;
    }
  } else if (contents) {
    root.insert("optimizer", trainer_detail::bytes_tensor(optimizer_state_bytes(*optimizer_)));
  }
  if constexpr (has_ema) {
    js["ema"] = ema_->rule().state();
    // The trainer's parameters' shadows are in the weights files of a set; kept per rank
    // otherwise, they come to rank 0 from their owners, one bucket at a time (the other
    // ranks, which write nothing, keep none).
    const bool keep = contents && (!ema_->is_share() || parallel_->rank() == 0);
    std::map<std::string, at::Tensor> shadows;  // by name, as the file has always held them
    for_each_ema_shadow(!weights_in_set, [&](const std::string& name, const at::Tensor& v) {
      if (keep) shadows.emplace(name, v.detach().to(at::kCPU, false, /*copy=*/true));
    });
    auto e = io::torch_dict();
    for (const auto& [name, v] : shadows) e.insert(name, v);
    root.insert("ema", e);
  }
  js["world_size"] = parallel_->world_size();
  {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : option_groups_) groups.push_back(optimizer_settings(*g));
    js["settings"] = {{"schedule_curve", schedule_curve()},
                      {"optimizer", groups},
                      {"clipping", clipping_probe()}};
  }
  // Every rank's generator (each draws its own noise); rank 0's also under the old key.
  const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
  root.insert("rng_cpu", rng);
  if (parallel_->world_size() > 1) {
    auto ranks = io::torch_list();
    for (const at::Tensor& t : parallel_->gather(rng)) ranks.push_back(t);
    root.insert("rng_cpu_ranks", ranks);
  }
  const std::vector<at::Tensor> own_cuda = trainer_detail::cuda_generator_states();
  auto cuda = io::torch_list();
  for (const at::Tensor& t : own_cuda) cuda.push_back(t);
  root.insert("rng_cuda", cuda);
  // Each rank's CUDA generators as well: every rank draws its noise on its own device, and a
  // rank given rank 0's states would repeat rank 0's draws after a resume.
  if (parallel_->world_size() > 1) {
    auto ranks = io::torch_list();
    for (const auto& states : trainer_detail::gather_state_lists(*parallel_, own_cuda)) {
      auto list = io::torch_list();
      for (const at::Tensor& t : states) list.push_back(t);
      ranks.push_back(list);
    }
    root.insert("rng_cuda_ranks", ranks);
  }
  root.insert("json", js.dump());
  return root;
}

template <class Model, class Config>
auto Trainer<Model, Config>::check_state(const io::TorchValue& root,
                                         const std::filesystem::path& file) const -> CheckedState {
  const std::string where = root.where();
  check_checkpoint_format(root, "difftrain.checkpoint", "a difftrain checkpoint");
  nlohmann::json js = checkpoint_json(root, "settings");
  // Every piece apply_state reads is here and of the right kind, so applying cannot stop
  // halfway on a missing key.
  if (!js.is_object() || !js.contains("fingerprint") || !js["fingerprint"].is_object())
    throw FormatError("has settings without a fingerprint", where + " json");
  std::vector<std::string> parts = {"scheduler", "scaler"};
  if constexpr (has_ema) parts.emplace_back("ema");
  for (const auto& key : parts)
    if (!js.contains(key) || !js[key].is_object())
      throw FormatError("has no '" + key + "' state", where + " json");
  for (const char* key : {"skipped_nonfinite", "skipped_overflow"})
    if (js.contains(key) && !js[key].is_number_integer())
      throw FormatError(std::string("has a '") + key + "' that is not an integer", where + " json");
  {
    GradScaler probe = scaler_;  // load_state rebinds its tensors: the trainer's are untouched
    probe.load_state(js.at("scaler"));
  }
  scheduler_->check_state(js.at("scheduler"));
  const nlohmann::json want = fingerprint();
  for (const auto& [key, value] : want.items())
    if (!js["fingerprint"].contains(key) || js["fingerprint"][key] != value) {
      if (key == "param_groups" && js["fingerprint"].contains(key))
        throw ConfigError(
            "was written with " + trainer_detail::group_difference(js["fingerprint"][key], value),
            where);
      throw ConfigError(
          "was written with " + key + " = " +
              (js["fingerprint"].contains(key) ? io::json_brief(js["fingerprint"][key])
                                               : std::string("(missing)")) +
              ", this trainer has " + io::json_brief(value),
          where);
    }
  const std::int64_t saved_step = root.at("step").integer();
  if (saved_step < 0) throw FormatError("has a negative step", where);
  if constexpr (has_ema)
    trainer_detail::check_parts_agree(js, saved_step, where, ema_counter_keys());
  else
    trainer_detail::check_parts_agree(js, saved_step, where);
  // Model tensors: same names and shapes (the trainer's parameters of a sharded set, and their
  // shadows, from each rank's weights file).
  auto model_tensors = root.at("model").tensor_map();
  std::map<std::string, at::Tensor> shard_shadows;
  if (js.contains("sharding") && js["sharding"].is_object() && js["sharding"].contains("weights")) {
    if (file.empty())
      throw ConfigError(
          "holds its weights in files beside it, one per rank: load it with "
          "load_checkpoint(path)",
          where);
    read_weight_shards(file, js["sharding"], saved_step, where, model_tensors, &shard_shadows);
  }
  std::size_t expected = 0;
  auto check = [&](const std::string& name, const at::Tensor& t) {
    ++expected;
    const auto it = model_tensors.find(name);
    if (it == model_tensors.end())
      throw ConfigError("has no tensor '" + name + "' (a different model?)", where + " model");
    if (it->second.sizes() != t.sizes())
      throw ConfigError("tensor '" + name + "' has shape " + c10::str(it->second.sizes()) +
                            ", the model's is " + c10::str(t.sizes()),
                        where + " model");
  };
  for (const auto& item : model_->named_parameters(true)) check(item.key(), item.value());
  for (const auto& item : model_->named_buffers(true)) check(item.key(), item.value());
  if (model_tensors.size() != expected)
    throw ConfigError("holds tensors the model does not have", where + " model");
  check_settings(js, where);
  std::map<std::string, at::Tensor> ema_shadows;
  if constexpr (has_ema) {
    ema_shadows = root.at("ema").tensor_map();
    ema_shadows.merge(shard_shadows);
    ema_->check_state(js.at("ema"), ema_shadows);
  }
  std::vector<trainer_detail::OptimizerShard> opt_shards;
  if (js.contains("sharding")) {
    opt_shards = read_optimizer_shards(js["sharding"], saved_step, file, where);
  } else {
    trainer_detail::OptimizerShard whole;
    for (const auto& g : groups_) whole.names.push_back(g.names);
    whole.bytes = trainer_detail::tensor_bytes(root.at("optimizer").tensor(), where + " optimizer");
    whole.where = where + " optimizer";
    opt_shards.push_back(std::move(whole));
  }
  for (const auto& shard : opt_shards) {
    // LibTorch's reader of the inner archive checks no CRC-32: every record is checked here,
    // so a damaged optimizer state is refused instead of loading with different numbers.
    const io::ZipArchive inner({shard.bytes.data(), shard.bytes.size()}, shard.where);
    std::vector<char> buffer;
    for (const auto& [name, record] : inner.records()) {
      buffer.resize(static_cast<std::size_t>(record.size));
      inner.read_into(name, buffer.data());
    }
  }
  if (js.contains("world_size")) {
    if (!js["world_size"].is_number_integer() || js["world_size"].get<std::int64_t>() < 1)
      throw FormatError("has a world_size that is not a positive integer", where + " json");
  }
  const std::int64_t saved_world = js.value("world_size", std::int64_t{1});
  if (saved_world != parallel_->world_size() && !o_.allow_world_size_change)
    throw ConfigError("was written by " + std::to_string(saved_world) + " ranks, this run has " +
                          std::to_string(parallel_->world_size()) +
                          " (the global batch would change); set allow_world_size_change to "
                          "resume anyway",
                      where);
  // Each rank its own generators. With the world of the checkpoint, each rank's saved ones; with
  // another, rank r continues the saved generators of rank r where the checkpoint has them, and
  // a rank it has none for starts from a seed drawn from rank 0's state and its rank (as a fresh
  // start gives each rank its own seed), so that no two ranks draw the same noise.
  const std::int64_t rank = parallel_->rank();
  auto rank_states = [&](const char* key, const char* what) {
    const auto ranks = root.at(key).elements();
    if (static_cast<std::int64_t>(ranks.size()) != saved_world)
      throw FormatError(
          "holds " + std::to_string(ranks.size()) + what + std::to_string(saved_world) + " ranks",
          where + " " + key);
    return ranks;
  };
  at::Tensor rng_cpu = root.at("rng_cpu").tensor();
  std::vector<at::Tensor> rng_cuda;
  for (const auto& t : root.at("rng_cuda").elements()) rng_cuda.push_back(t.tensor());
  std::optional<std::uint64_t> cuda_seed;
  if (rank > 0 && saved_world > 1 && rank < saved_world) {
    rng_cpu = rank_states("rng_cpu_ranks", " generator states for ")[static_cast<std::size_t>(rank)]
                  .tensor();
    // Written before CUDA states were kept per rank: every rank takes rank 0's, as it did then.
    if (root.contains("rng_cuda_ranks")) {
      rng_cuda.clear();
      for (const auto& t :
           rank_states("rng_cuda_ranks",
                       " ranks' CUDA generator states for ")[static_cast<std::size_t>(rank)]
               .elements())
        rng_cuda.push_back(t.tensor());
    }
  } else if (rank > 0) {
    const std::uint64_t seed = trainer_detail::rank_seed(rng_cpu, rank, where + " rng_cpu");
    rng_cpu = trainer_detail::cpu_generator_state(seed);
    rng_cuda.clear();
    cuda_seed = seed;
  }
  return {where,         std::move(js),          saved_step,
          model_tensors, std::move(ema_shadows), std::move(opt_shards),
          rng_cpu,       std::move(rng_cuda),    cuda_seed};
}

template <class Model, class Config>
void Trainer<Model, Config>::apply_state(const CheckedState& s) {
  const std::string& where = s.where;
  const auto& js = s.js;
  const auto& model_tensors = s.model_tensors;
  // The optimizer first: its archive is the part that can still refuse. Its current state is
  // kept and put back if the saved one does not load, so a refusal changes nothing.
  const std::string before = optimizer_state_bytes(*optimizer_);
  // The moments go where the parameters are now, as torch.optim's load_state_dict moves them:
  // a checkpoint written on a GPU resumes on the CPU and the other way round.
  // (This rank's optimizer may step copies elsewhere: an offloaded one's are in host memory.)
  std::optional<c10::Device> device;
  for (const auto& g : local_groups_)
    if (!device && !g.params.empty()) device = g.params.front().device();
  if (!device && !params_.empty()) device = params_.front().device();
  auto load_optimizer = [&](torch::optim::Optimizer& optimizer, const std::string& bytes) {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size(), device);
    optimizer.load(archive);
  };
  try {
    load_optimizer_shards(s.opt_shards, load_optimizer);
  } catch (const std::exception& e) {  // c10::Error, or std::out_of_range from a damaged pickle
    optimizer_->state().clear();
    load_optimizer(*optimizer_, before);
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    throw FormatError(std::string("optimizer state does not load: ") +
                          (c10e != nullptr ? c10e->what_without_backtrace() : e.what()),
                      where + " optimizer");
  }
  {
    at::NoGradGuard no_grad;
    for (const auto& item : model_->named_parameters(true))
      nn::assign_tensor(item.value(), model_tensors.at(item.key()));
    for (const auto& item : model_->named_buffers(true))
      nn::assign_tensor(item.value(), model_tensors.at(item.key()));
  }
  if (o_.take_on_resume.optimizer)
    for (std::size_t i = 0; i < option_groups_.size(); ++i)
      optimizer_->param_groups()[i].set_options(option_groups_[i]->clone());
  scheduler_->load_state(js.at("scheduler"));
  if (o_.take_on_resume.lr) scheduler_->rebase(option_base_lrs_);
  scaler_.load_state(js.at("scaler"));
  if constexpr (has_ema) ema_->load_state(js.at("ema"), s.ema_shadows);
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
  cpu_gen.set_state(s.rng_cpu);
  if (torch::cuda::is_available())
    for (std::size_t i = 0;
         i < s.rng_cuda.size() && i < static_cast<std::size_t>(torch::cuda::device_count()); ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      gen.set_state(s.rng_cuda[i]);
    }
  if (s.cuda_seed && torch::cuda::is_available())
    for (std::size_t i = 0; i < static_cast<std::size_t>(torch::cuda::device_count()); ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      gen.set_current_seed(*s.cuda_seed + i);
    }
  step_ = s.step;
  nonfinite_ = js.value("skipped_nonfinite", std::int64_t{0});
  overflow_skips_ = js.value("skipped_overflow", std::int64_t{0});
}

template <class Model, class Config>
void Trainer<Model, Config>::save_checkpoint(const std::filesystem::path& path) {
  // A checkpoint holds the training weights: a run resumed from it and the run that goes on
  // both take the same ones back (the next step would switch a schedule-free optimizer too).
  switch_weights(/*train=*/true);
  const bool own_weights = weights_in_shards();
  // Each rank's weights file holds its own masters: nothing is gathered for those.
  std::optional<typename trainer_detail::WholeOf<ParallelT>::type> whole;
  if (!own_weights) whole.emplace(whole_parameters());
  if (!(own_weights ? parallel_->all_ok(own_weights_finite()) : all_finite()))
    throw NumericError("the model holds non-finite weights; not saving them over a good checkpoint",
                       path.string());
  RankFileRecords files;
  if (shards_state()) files = write_rank_files(path, own_weights);
  // Only rank 0 writes the file: the others take part in its collectives and copy nothing.
  const c10::IValue st =
      make_state(shards_state() ? &files : nullptr, /*contents=*/parallel_->rank() == 0);
  // Rank 0's file, written only once every rank's are on disk, commits the set: a run stopped
  // in between leaves the previous set whole (its own files), and resume_latest takes that one.
  agreed(
      [&] {
        if (parallel_->rank() == 0) io::save_torch_file(path, st);
      },
      [&](bool ok) { return parallel_->decide(ok); },
      [&] {
        return IoError("rank 0 could not write the checkpoint (its error says why)", path.string());
      });
}

template <class Model, class Config>
void Trainer<Model, Config>::load_checkpoint(const std::filesystem::path& path) {
  load_agreed(path.string(), [&] { return checked_naming_file(io::load_torch_file(path), path); });
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::schedule_curve() const {
  nlohmann::json curve = nlohmann::json::array();
  const ScheduleT& sch = scheduler_->schedule();
  for (std::int64_t step : {0,   1,   2,    3,    5,    8,     10,    20,    50,     100,
                            200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000}) {
    double lr = 0;
    if constexpr (schedule::HasGroupLrAt<ScheduleT>)
      lr = sch.lr(step, 1.0, 0);
    else
      lr = sch.lr(step, 1.0);
    curve.push_back(std::isfinite(lr) ? nlohmann::json(lr) : nlohmann::json(nullptr));
  }
  return curve;
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::clipping_probe() const {
  ClippingT clip(o_.clipping);
  nlohmann::json out = nlohmann::json::array();
  auto number = [](double v) {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  };
  for (std::int64_t step : {0, 10, 100, 1000, 10000})
    for (double scale : {0.01, 1.0, 100.0}) {
      at::Tensor p = at::zeros({2}, at::kDouble).requires_grad_();
      p.mutable_grad() = at::tensor({3.0, -4.0}, at::kDouble) * scale;
      const double norm = clip.apply({p}, step);
      out.push_back(
          {number(norm), number(p.grad()[0].item<double>()), number(p.grad()[1].item<double>())});
    }
  return out;
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::optimizer_settings(const torch::optim::OptimizerOptions& o) {
  auto adam = [](const auto& a) -> nlohmann::json {  // AdamW's and Adam's are the same fields
    return {{"beta1", std::get<0>(a.betas())},
            {"beta2", std::get<1>(a.betas())},
            {"eps", a.eps()},
            {"weight_decay", a.weight_decay()},
            {"amsgrad", a.amsgrad()}};
  };
  if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return adam(*w);
  if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return adam(*a);
  if (const auto* p = dynamic_cast<const ProdigyOptions*>(&o))
    return {{"beta1", std::get<0>(p->betas())},
            {"beta2", std::get<1>(p->betas())},
            {"weight_decay", p->weight_decay()},
            {"d0", p->d0()},
            {"d_coef", p->d_coef()},
            {"use_bias_correction", p->use_bias_correction()},
            {"safeguard_warmup", p->safeguard_warmup()}};
  if (const auto* f = dynamic_cast<const AdafactorOptions*>(&o))
    return {{"eps1", f->eps1()},
            {"eps2", f->eps2()},
            {"clip_threshold", f->clip_threshold()},
            {"decay_rate", f->decay_rate()},
            {"beta1", f->beta1()},
            {"weight_decay", f->weight_decay()},
            {"scale_parameter", f->scale_parameter()},
            {"relative_step", f->relative_step()},
            {"warmup_init", f->warmup_init()}};
  if (const auto* c = dynamic_cast<const CameOptions*>(&o))
    return {{"beta1", std::get<0>(c->betas())},
            {"beta2", std::get<1>(c->betas())},
            {"beta3", std::get<2>(c->betas())},
            {"eps1", c->eps1()},
            {"eps2", c->eps2()},
            {"clip_threshold", c->clip_threshold()},
            {"weight_decay", c->weight_decay()}};
  if (const auto* q = dynamic_cast<const AdamW8bitOptions*>(&o))
    return {{"beta1", std::get<0>(q->betas())},
            {"beta2", std::get<1>(q->betas())},
            {"eps", q->eps()},
            {"weight_decay", q->weight_decay()},
            {"min_8bit_size", q->min_8bit_size()}};
  if (const auto* f = dynamic_cast<const ScheduleFreeAdamWOptions*>(&o))
    return {{"beta1", std::get<0>(f->betas())},
            {"beta2", std::get<1>(f->betas())},
            {"eps", f->eps()},
            {"weight_decay", f->weight_decay()},
            {"warmup_steps", f->warmup_steps()},
            {"r", f->r()},
            {"weight_lr_power", f->weight_lr_power()}};
  if (const auto* l = dynamic_cast<const LionOptions*>(&o))
    return {{"beta1", std::get<0>(l->betas())},
            {"beta2", std::get<1>(l->betas())},
            {"weight_decay", l->weight_decay()}};
  if (const auto* g = dynamic_cast<const torch::optim::SGDOptions*>(&o))
    return {{"momentum", g->momentum()},
            {"dampening", g->dampening()},
            {"weight_decay", g->weight_decay()},
            {"nesterov", g->nesterov()}};
  return nlohmann::json::object();
}

template <class Model, class Config>
std::vector<std::string> Trainer<Model, Config>::ema_counter_keys() const requires has_ema {
  using Rule = typename EmaT::rule_type;
  Rule rule(o_.ema.rule);
  std::vector<std::string> keys;
  if constexpr (requires { rule.counter_keys(); }) {
    for (const auto key : rule.counter_keys()) keys.emplace_back(key);
  } else if constexpr (requires { Rule::counters; }) {
    for (const auto key : Rule::counters) keys.emplace_back(key);
  } else {
    const nlohmann::json before = rule.state();
    for (int i = 0; i < 3; ++i) (void)rule.next();
    const nlohmann::json after = rule.state();
    for (const auto& [key, value] : before.items())
      if (!after.contains(key) || after[key] != value) keys.push_back(key);
  }
  return keys;
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::ema_options() const requires has_ema {
  nlohmann::json out = typename EmaT::rule_type(o_.ema.rule).state();
  for (const auto& key : ema_counter_keys()) out.erase(key);
  return out;
}

template <class Model, class Config>
void Trainer<Model, Config>::check_settings(nlohmann::json& js, const std::string& where) const {
  const std::string at = where + " settings";
  auto refuse = [&](const std::string& what, const nlohmann::json& saved, const nlohmann::json& now,
                    const std::string& take) {
    throw ConfigError("was written with " + what + " = " + saved.dump() + ", this trainer has " +
                          now.dump() + "; set Options::take_on_resume." + take +
                          " to train on with this trainer's",
                      at);
  };
  const nlohmann::json bases = js["scheduler"].value("base_lrs", nlohmann::json::array());
  if (!o_.take_on_resume.lr && bases != nlohmann::json(option_base_lrs_)) {
    for (std::size_t i = 0; i < groups_.size() && i < bases.size(); ++i)
      if (bases[i] != nlohmann::json(option_base_lrs_[i]))
        refuse("lr of group '" + groups_[i].label + "'", bases[i], option_base_lrs_[i], "lr");
  }
  if (!js.contains("settings") || !js["settings"].is_object()) return;  // an older checkpoint
  const nlohmann::json& saved = js["settings"];
  if (!o_.take_on_resume.schedule && saved.contains("schedule_curve")) {
    const nlohmann::json now = schedule_curve();
    const nlohmann::json& was = saved["schedule_curve"];
    if (was != now)
      refuse("a schedule whose LR curve (base LR 1, at steps 0, 1, 2, 3, 5, 8, 10, 20, ...)", was,
             now, "schedule");
  }
  if (!o_.take_on_resume.clipping && saved.contains("clipping")) {
    const nlohmann::json now = clipping_probe();
    if (saved["clipping"] != now)
      refuse("a clipping policy whose effect on probe gradients", saved["clipping"], now,
             "clipping");
  }
  if (!o_.take_on_resume.optimizer && saved.contains("optimizer")) {
    const nlohmann::json& was = saved["optimizer"];
    for (std::size_t i = 0; i < option_groups_.size() && i < was.size(); ++i) {
      const nlohmann::json now = optimizer_settings(*option_groups_[i]);
      for (const auto& [key, value] : now.items())
        if (was[i].contains(key) && was[i][key] != value)
          refuse("optimizer " + key + " in group '" + groups_[i].label + "'", was[i][key], value,
                 "optimizer");
    }
  }
  if constexpr (has_ema) {
    const nlohmann::json now = ema_options();
    for (const auto& [key, value] : now.items()) {
      if (!js["ema"].contains(key) || js["ema"][key] == value) continue;
      if (!o_.take_on_resume.ema) refuse("EMA " + key, js["ema"][key], value, "ema");
      js["ema"][key] = value;
    }
  }
}

template <class Model, class Config>
auto Trainer<Model, Config>::checked_naming_file(const io::TorchValue& root,
                                                 const std::filesystem::path& file) const
    -> CheckedState {
  try {
    return check_state(root, file);
  } catch (const FormatError& e) {
    if (e.where().find(root.where()) != std::string::npos) throw;
    throw FormatError(e.message(), root.where() + ": " + e.where());
  }
}

template <class Model, class Config>
auto Trainer<Model, Config>::write_rank_files(const std::filesystem::path& path, bool weights)
    -> RankFileRecords {
  const std::int64_t r = parallel_->rank(), n = parallel_->world_size();
  WeightShardRecord optimizer_record;
  const WeightShardRecord record = agreed(
      [&] {
        const std::filesystem::path shard = shard_path(path, r, n);
        io::save_torch_file(shard, optimizer_shard_state());
        // Its size and CRC-32 go into the index: a shard of another run at the same step, rank
        // and world (copied over this one) is then refused instead of loading its moments.
        optimizer_record.crc32 = file_crc32(shard, &optimizer_record.bytes);
        return weights ? write_weight_shard(weight_shard_path(path, r, n), own_weight_tensors(),
                                            step_, r, n)
                       : WeightShardRecord{};
      },
      [&](bool ok) { return parallel_->all_ok(ok); },
      [&] {
        return IoError(
            "another rank could not write its shard of the checkpoint (its error says why); "
            "the previous checkpoint stays the latest",
            path.string());
      });
  RankFileRecords records;
  const at::Tensor mine = at::tensor(
      {static_cast<std::int64_t>(optimizer_record.bytes), std::int64_t{optimizer_record.crc32},
       static_cast<std::int64_t>(record.bytes), std::int64_t{record.crc32}},
      at::kLong);
  for (const at::Tensor& t : parallel_->gather(mine)) {
    records.optimizer.push_back({static_cast<std::uint64_t>(t[0].item<std::int64_t>()),
                                 static_cast<std::uint32_t>(t[1].item<std::int64_t>())});
    if (weights)
      records.weights.push_back({static_cast<std::uint64_t>(t[2].item<std::int64_t>()),
                                 static_cast<std::uint32_t>(t[3].item<std::int64_t>())});
  }
  return records;
}

template <class Model, class Config>
bool Trainer<Model, Config>::own_weights_finite() const {
  if constexpr (OwnerGatheringParallel<ParallelT>) {
    std::set<std::string> trainer_names(param_names_.begin(), param_names_.end());
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (parallel_->owner(i) == parallel_->rank() &&
          !at::isfinite(parallel_->master(i)).all().template item<bool>())
        return false;
    for (const auto& item : model_->named_parameters(true))
      if (!trainer_names.contains(item.key()) &&
          !at::isfinite(item.value()).all().template item<bool>())
        return false;
  }
  return true;
}

template <class Model, class Config>
std::map<std::string, at::Tensor> Trainer<Model, Config>::own_weight_tensors() {
  std::map<std::string, at::Tensor> out;
  if constexpr (OwnerGatheringParallel<ParallelT>) {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (parallel_->owner(i) == parallel_->rank())
        out.emplace(param_names_[i], parallel_->master(i).detach());
    if constexpr (has_ema) {
      const std::map<std::string, at::Tensor> shadows = ema_->shadows_here();
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const auto it = shadows.find(param_names_[i]);
        if (it != shadows.end() && parallel_->owner(i) == parallel_->rank())
          out.emplace(std::string(kEmaPrefix) + it->first, it->second.detach());
      }
    }
  }
  return out;
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::weights_index(
    const std::vector<WeightShardRecord>& records) const {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& rec : records) files.push_back({{"bytes", rec.bytes}, {"crc32", rec.crc32}});
  nlohmann::json tensors = nlohmann::json::object();
  if constexpr (OwnerGatheringParallel<ParallelT>)
    for (std::size_t i = 0; i < params_.size(); ++i)
      tensors[param_names_[i]] = {
          {"dtype",
           io::safetensors_detail::by_type(parallel_->master_dtype(i), param_names_[i]).name},
          {"shape", params_[i].sizes().vec()},
          {"rank", parallel_->owner(i)}};
  return {{"files", files}, {"tensors", tensors}};
}

template <class Model, class Config>
nlohmann::json Trainer<Model, Config>::sharding_index() const {
  nlohmann::json ranks = nlohmann::json::array();
  if constexpr (sharded) {
    for (std::int64_t r = 0; r < parallel_->world_size(); ++r) {
      nlohmann::json groups = nlohmann::json::array();
      for (const auto& g : parallel_->groups_of_rank(groups_, r)) groups.push_back(g.names);
      ranks.push_back(groups);
    }
    return {
        {"stage", parallel_->stage()}, {"world_size", parallel_->world_size()}, {"ranks", ranks}};
  }
  return {};
}

template <class Model, class Config>
c10::IValue Trainer<Model, Config>::optimizer_shard_state() const {
  auto root = io::torch_dict();
  root.insert("format", std::string("difftrain.optimizer_shard"));
  root.insert("version", kCheckpointFormatVersion);
  root.insert("step", step_);
  root.insert("rank", parallel_->rank());
  root.insert("world_size", parallel_->world_size());
  nlohmann::json names = nlohmann::json::array();
  for (const auto& g : local_groups_) names.push_back(g.names);
  root.insert("json", names.dump());
  root.insert("optimizer", trainer_detail::bytes_tensor(optimizer_state_bytes(*optimizer_)));
  return root;
}

template <class Model, class Config>
std::vector<trainer_detail::OptimizerShard> Trainer<Model, Config>::read_optimizer_shards(
    const nlohmann::json& index, std::int64_t step, const std::filesystem::path& file,
    const std::string& where) const {
  const std::string at = where + " json sharding";
  if (file.empty())
    throw ConfigError(
        "holds a sharded optimizer state, whose shards are files beside it: load "
        "it with load_checkpoint(path)",
        where);
  if (!index.is_object() || !index.contains("world_size") ||
      !index["world_size"].is_number_integer() || !index.contains("ranks") ||
      !index["ranks"].is_array())
    throw FormatError("is not an index of optimizer shards", at);
  const auto world = index["world_size"].get<std::int64_t>();
  if (world < 1 || static_cast<std::int64_t>(index["ranks"].size()) != world)
    throw FormatError("lists " + std::to_string(index["ranks"].size()) + " shards for " +
                          std::to_string(world) + " ranks",
                      at);
  std::vector<WeightShardRecord> files;
  if (index.contains("optimizer_files")) {
    const nlohmann::json& list = index["optimizer_files"];
    if (!list.is_array() || static_cast<std::int64_t>(list.size()) != world)
      throw FormatError("lists the optimizer shards' sizes for other than its " +
                            std::to_string(world) + " ranks",
                        at);
    for (const auto& f : list) {
      if (!f.is_object() || !f.contains("bytes") || !f["bytes"].is_number_unsigned() ||
          !f.contains("crc32") || !f["crc32"].is_number_unsigned() ||
          f["crc32"].get<std::uint64_t>() > 0xffffffffULL)
        throw FormatError("has an optimizer shard without its size and CRC-32", at);
      files.push_back({f["bytes"].get<std::uint64_t>(), f["crc32"].get<std::uint32_t>()});
    }
  }
  std::set<std::string> mine;
  for (const auto& g : local_groups_) mine.insert(g.names.begin(), g.names.end());
  std::vector<trainer_detail::OptimizerShard> out;
  for (std::int64_t r = 0; r < world; ++r) {
    trainer_detail::OptimizerShard shard;
    try {
      shard.names =
          index["ranks"][static_cast<std::size_t>(r)].get<std::vector<std::vector<std::string>>>();
    } catch (const nlohmann::json::exception&) {
      throw FormatError("rank " + std::to_string(r) + "'s entry is not a list of name lists", at);
    }
    if (shard.names.size() != groups_.size())
      throw FormatError("rank " + std::to_string(r) + "'s entry has " +
                            std::to_string(shard.names.size()) + " groups, the trainer " +
                            std::to_string(groups_.size()),
                        at);
    bool needed = false;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const std::set<std::string> known(groups_[g].names.begin(), groups_[g].names.end());
      for (const auto& n : shard.names[g]) {
        if (known.count(n) == 0)
          throw FormatError("rank " + std::to_string(r) + " holds '" + n +
                                "', not a parameter "
                                "of group " +
                                std::to_string(g),
                            at);
        needed = needed || mine.count(n) != 0;
      }
    }
    if (!needed) continue;
    const std::filesystem::path shard_file = shard_path(file, r, world);
    const std::string w = shard_file.string();
    if (!files.empty()) {  // written with its size and CRC-32 (every set since they were kept)
      std::uint64_t size = 0;
      const std::uint32_t crc = file_crc32(shard_file, &size);
      const WeightShardRecord& want = files[static_cast<std::size_t>(r)];
      if (size != want.bytes)
        throw FormatError("has " + std::to_string(size) + " bytes, the checkpoint's index says " +
                              std::to_string(want.bytes) +
                              " (a shard of another checkpoint, or damaged)",
                          w);
      if (crc != want.crc32)
        throw FormatError(
            "fails its CRC-32 check against the checkpoint's index (a shard of another "
            "checkpoint, or damaged)",
            w);
    }
    const io::TorchValue root = io::load_torch_file(shard_file);
    check_checkpoint_format(root, "difftrain.optimizer_shard", "a shard of an optimizer state");
    if (root.at("step").integer() != step || root.at("rank").integer() != r ||
        root.at("world_size").integer() != world)
      throw FormatError("belongs to another checkpoint (step " +
                            std::to_string(root.at("step").integer()) + ", rank " +
                            std::to_string(root.at("rank").integer()) + " of " +
                            std::to_string(root.at("world_size").integer()) + "; expected step " +
                            std::to_string(step) + ", rank " + std::to_string(r) + " of " +
                            std::to_string(world) + ")",
                        w);
    const nlohmann::json names = checkpoint_json(root, "names");
    if (names != index["ranks"][static_cast<std::size_t>(r)])
      throw FormatError(
          "holds other parameters than the checkpoint's index lists for rank " + std::to_string(r),
          w);
    shard.bytes = trainer_detail::tensor_bytes(root.at("optimizer").tensor(), w + " optimizer");
    shard.where = w + " optimizer";
    out.push_back(std::move(shard));
  }
  return out;
}

template <class Model, class Config>
template <class Load>
void Trainer<Model, Config>::load_optimizer_shards(
    const std::vector<trainer_detail::OptimizerShard>& shards, Load&& load_into) {
  std::vector<std::vector<std::string>> local;
  for (const auto& g : local_groups_) local.push_back(g.names);
  if (shards.size() == 1 && shards.front().names == local) {
    load_into(*optimizer_, shards.front().bytes);
    return;
  }
  std::map<std::string, at::Tensor> by_name, mine;
  for (const auto& g : groups_)
    for (std::size_t i = 0; i < g.names.size(); ++i) by_name.emplace(g.names[i], g.params[i]);
  for (const auto& g : local_groups_)  // what this rank's optimizer steps, by name
    for (std::size_t i = 0; i < g.names.size(); ++i) mine.emplace(g.names[i], g.params[i]);
  optimizer_->state().clear();
  bool options_taken = false;
  for (const auto& shard : shards) {
    std::vector<ParamGroup> gs;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      ParamGroup pg = groups_[g];
      pg.names = shard.names[g];
      pg.params.clear();
      for (const auto& n : pg.names) pg.params.push_back(by_name.at(n));
      gs.push_back(std::move(pg));
    }
    const auto temp = OptimizerPolicyT::make(gs, o_.optimizer);
    torch::optim::Optimizer& t = *temp;
    load_into(t, shard.bytes);
    for (std::size_t g = 0; g < gs.size(); ++g)
      for (std::size_t i = 0; i < gs[g].names.size(); ++i) {
        const auto it = t.state().find(t.param_groups()[g].params()[i].unsafeGetTensorImpl());
        const auto own = mine.find(gs[g].names[i]);
        if (own != mine.end() && it != t.state().end())
          optimizer_->state()[own->second.unsafeGetTensorImpl()] = std::move(it->second);
      }
    if (!options_taken) {  // the groups' settings (lr, betas, ...) as the checkpoint has them
      for (std::size_t g = 0; g < groups_.size(); ++g)
        optimizer_->param_groups()[g].set_options(t.param_groups()[g].options().clone());
      options_taken = true;
    }
  }
}

}  // namespace difftrain::train

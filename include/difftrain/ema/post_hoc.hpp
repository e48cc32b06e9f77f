#pragma once
// Post-hoc EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion Models",
// EDM2): during training keep several power-function EMAs (different γ) and snapshot them every N
// steps; afterwards synthesise the EMA of any other γ (or σ_rel) at any snapshot step as the
// least-squares combination of the snapshots. Numbers follow ema-pytorch's PostHocEMA.
//
// Snapshots live in memory, or (with `snapshot_dir`) one file each in a folder as ema-pytorch's
// checkpoint folder holds them (`<ema index>.<step>.pt`, torch.save format): memory then stays
// bounded on long runs, synthesis streams the files one at a time, and a resumed run finds the
// snapshots of the run before it.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "difftrain/core/error.hpp"
#include "difftrain/ema/moving_average.hpp"
#include "difftrain/io/torch_file.hpp"

namespace difftrain::ema {

/// ⟨p_a, p_b⟩ of two power-function EMA profiles (t: step, γ: exponent), as in EDM2.
inline at::Tensor profile_dot(const at::Tensor& t_a, const at::Tensor& g_a, const at::Tensor& t_b,
                              const at::Tensor& g_b) {
  const at::Tensor t_ratio = t_a / t_b;
  const at::Tensor t_exp = at::where(t_a < t_b, g_b, -g_a);
  const at::Tensor t_max = at::maximum(t_a, t_b);
  const at::Tensor num = (g_a + 1) * (g_b + 1) * t_ratio.pow(t_exp);
  const at::Tensor den = (g_a + g_b + 1) * t_max;
  return num / den;
}

/// Weights w (one per snapshot) with Σ wᵢ pᵢ ≈ p_r in the least-squares sense.
inline std::vector<double> solve_post_hoc_weights(const std::vector<double>& t_i,
                                                  const std::vector<double>& gamma_i, double t_r,
                                                  double gamma_r) {
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor ti = at::tensor(t_i, opts);
  const at::Tensor gi = at::tensor(gamma_i, opts);
  const at::Tensor a = profile_dot(ti.reshape({-1, 1}), gi.reshape({-1, 1}), ti.reshape({1, -1}),
                                   gi.reshape({1, -1}));
  const at::Tensor b = profile_dot(ti.reshape({-1, 1}), gi.reshape({-1, 1}),
                                   at::tensor({t_r}, opts).reshape({1, -1}),
                                   at::tensor({gamma_r}, opts).reshape({1, -1}));
  const at::Tensor w = at::linalg_solve(a, b).squeeze(-1).contiguous();
  return {w.data_ptr<double>(), w.data_ptr<double>() + w.numel()};
}

template <class Engine = PerTensor>
class PostHocEma {
 public:
  struct Options {
    std::vector<double> sigma_rels = {0.05, 0.28};  ///< or leave empty and give gammas
    std::vector<double> gammas = {};
    std::int64_t update_every = 1;
    std::int64_t snapshot_every = 1000;  ///< 0: only manual snapshot()
    at::ScalarType snapshot_dtype = at::kHalf;
    std::filesystem::path snapshot_dir = {};  ///< empty: keep snapshots in memory
  };

  struct Snapshot {
    std::size_t ema_index;
    std::int64_t step;
    std::map<std::string, at::Tensor> shadows;  ///< empty when the snapshot is a file
    std::filesystem::path file = {};            ///< set when the snapshot is a file
  };

  PostHocEma(torch::nn::Module& model, const Options& o, const Tracking& tracking = {})
      : model_(&model), o_(o), tracking_(tracking) {
    std::vector<double> gammas = o.gammas;
    if (!o.sigma_rels.empty() && !o.gammas.empty())
      throw ConfigError("give sigma_rels or gammas, not both", "post-hoc ema options");
    for (double s : o.sigma_rels) gammas.push_back(sigma_rel_to_gamma(s));
    if (gammas.size() < 2)
      throw ConfigError("needs at least 2 EMAs of different γ to synthesise another",
                        "post-hoc ema options");
    if (std::set<double>(gammas.begin(), gammas.end()).size() != gammas.size())
      throw ConfigError("the γ values must all differ", "post-hoc ema options");
    if (o.snapshot_every < 0)
      throw ConfigError("must be >= 0", "post-hoc ema option snapshot_every");
    for (double g : gammas)
      emas_.push_back(std::make_unique<Ema<Karras, Engine>>(
          model, typename Karras::Options{.gamma = g, .update_every = o.update_every},
          typename Engine::Options{}, tracking));
    gammas_ = std::move(gammas);
  }

  void update() {
    for (auto& e : emas_) e->update();
    if (o_.snapshot_every > 0 && step() % o_.snapshot_every == 0) snapshot();
  }

  /// Keeps the current shadows of every EMA (in `snapshot_dtype`, on the CPU).
  /// Keeps the current shadows of every EMA (in `snapshot_dtype`, on the CPU), or writes them to
  /// `snapshot_dir/<ema index>.<step>.pt` (atomically).
  void snapshot() {
    for (std::size_t i = 0; i < emas_.size(); ++i) {
      auto [scalars, shadows] = emas_[i]->state();
      for (auto& [name, t] : shadows) t = t.detach().to(at::kCPU, o_.snapshot_dtype, false, true);
      if (o_.snapshot_dir.empty()) {
        snapshots_.push_back({i, step(), std::move(shadows), {}});
      } else {
        const auto file =
            o_.snapshot_dir / (std::to_string(i) + "." + std::to_string(step()) + ".pt");
        io::save_torch_file(file, io::to_ivalue(shadows));
      }
    }
  }

  [[nodiscard]] std::int64_t step() const { return emas_.front()->rule().step(); }
  [[nodiscard]] const std::vector<double>& gammas() const noexcept { return gammas_; }
  /// The snapshots so far: those in memory, or the files in `snapshot_dir` (written by this run
  /// or an earlier one), ordered by step then EMA.
  [[nodiscard]] std::vector<Snapshot> snapshots() const {
    if (o_.snapshot_dir.empty()) return snapshots_;
    std::vector<Snapshot> out;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(o_.snapshot_dir, ec)) {
      const std::string name = entry.path().filename().string();
      const auto dot = name.find('.');
      if (dot == std::string::npos || !name.ends_with(".pt")) continue;
      std::size_t index = 0;
      std::int64_t at_step = 0;
      const char* end = name.data() + name.size() - 3;
      const auto a = std::from_chars(name.data(), name.data() + dot, index);
      const auto b = std::from_chars(name.data() + dot + 1, end, at_step);
      if (a.ec != std::errc() || a.ptr != name.data() + dot || b.ec != std::errc() || b.ptr != end)
        continue;  // not a snapshot's name
      if (index >= gammas_.size())
        throw ConfigError("snapshot of EMA " + std::to_string(index) + " but there are " +
                              std::to_string(gammas_.size()) + " EMAs (another configuration?)",
                          entry.path().string());
      out.push_back({index, at_step, {}, entry.path()});
    }
    std::sort(out.begin(), out.end(), [](const Snapshot& x, const Snapshot& y) {
      return std::pair(x.step, x.ema_index) < std::pair(y.step, y.ema_index);
    });
    return out;
  }
  [[nodiscard]] Ema<Karras, Engine>& ema(std::size_t i) { return *emas_.at(i); }

  /// The weights of the EMA with exponent `gamma` at `step` (default: the last snapshot's step),
  /// synthesised from every snapshot. Float32 tensors by name.
  [[nodiscard]] std::map<std::string, at::Tensor> synthesize(
      double gamma, std::optional<std::int64_t> at_step = std::nullopt) const {
    const std::vector<Snapshot> snapshots = this->snapshots();
    if (snapshots.empty())
      throw ConfigError("there are no snapshots yet", "post-hoc ema synthesize");
    std::int64_t last = 0;
    std::vector<double> t_i;
    std::vector<double> g_i;
    for (const Snapshot& s : snapshots) {
      last = std::max(last, s.step);
      t_i.push_back(static_cast<double>(s.step));
      // ema-pytorch builds its γ tensor in float32 before solving in float64; so do we.
      g_i.push_back(static_cast<double>(static_cast<float>(gammas_[s.ema_index])));
    }
    const std::int64_t target = at_step.value_or(last);
    if (target > last || target <= 0)
      throw ConfigError("step " + std::to_string(target) + " is outside the snapshots' range (1.." +
                            std::to_string(last) + ")",
                        "post-hoc ema synthesize");
    const std::vector<double> w = solve_post_hoc_weights(
        t_i, g_i, static_cast<double>(target), static_cast<double>(static_cast<float>(gamma)));
    std::map<std::string, at::Tensor> out;
    for (std::size_t k = 0; k < snapshots.size(); ++k) {
      // A file is read when its turn comes: one snapshot in memory at a time.
      const std::map<std::string, at::Tensor> shadows =
          snapshots[k].file.empty() ? snapshots[k].shadows
                                    : io::load_torch_file(snapshots[k].file).tensor_map();
      const std::string where = snapshots[k].file.empty() ? "post-hoc ema snapshot at step " +
                                                                std::to_string(snapshots[k].step)
                                                          : snapshots[k].file.string();
      if (k > 0 && shadows.size() != out.size())
        throw ShapeError("holds " + std::to_string(shadows.size()) + " tensors, the first " +
                             std::to_string(out.size()),
                         where);
      for (const auto& [name, t] : shadows) {
        const at::Tensor term = t.to(at::kFloat) * w[k];
        auto it = out.find(name);
        if (it == out.end()) {
          if (k > 0)
            throw ShapeError("holds '" + name + "', which the first snapshot lacks", where);
          out.emplace(name, term);
        } else if (it->second.sizes() != term.sizes()) {
          throw ShapeError("'" + name + "' has shape " + c10::str(term.sizes()) +
                               ", the first snapshot's is " + c10::str(it->second.sizes()),
                           where);
        } else {
          it->second.add_(term);
        }
      }
    }
    return out;
  }
  [[nodiscard]] std::map<std::string, at::Tensor> synthesize_sigma_rel(
      double sigma_rel, std::optional<std::int64_t> at_step = std::nullopt) const {
    return synthesize(sigma_rel_to_gamma(sigma_rel), at_step);
  }

 private:
  torch::nn::Module* model_;
  Options o_;
  Tracking tracking_;
  std::vector<double> gammas_;
  std::vector<std::unique_ptr<Ema<Karras, Engine>>> emas_;
  std::vector<Snapshot> snapshots_;
};

}  // namespace difftrain::ema

// demo/sft.cpp: full-weight SFT loop.
#include "demo/sft.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/model/logprobs.h"
#include "rl/optimizer.h"
#include "util/bench_report.h"
#include "util/error.h"

namespace lorasync::demo {

namespace {

std::vector<model::LogprobItem> to_items(const std::vector<SftExample>& data,
                                         const std::vector<std::size_t>& idx) {
  std::vector<model::LogprobItem> items;
  items.reserve(idx.size());
  for (auto i : idx) items.push_back({data[i].prompt, data[i].completion});
  return items;
}

double lr_at(const SftOptions& o, std::int64_t step) {  // step is 1-based
  if (step <= o.warmup_steps)
    return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  const double span = static_cast<double>(std::max<std::int64_t>(1, o.steps - o.warmup_steps));
  const double t = static_cast<double>(step - o.warmup_steps) / span;
  const double floor = o.min_lr_ratio * o.lr;
  return floor + (o.lr - floor) * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t)));
}

// Switches requires_grad on the model's weights for the lifetime of the guard.
class TrainableWeights {
 public:
  explicit TrainableWeights(const model::DecoderModel& m) {
    for (auto& [name, t] : m.named_weights()) {
      t.requires_grad_(true);
      (t.dim() >= 2 && name.find("norm") == std::string::npos ? decayed_ : plain_).push_back(t);
    }
  }
  ~TrainableWeights() {
    for (auto* v : {&decayed_, &plain_})
      for (auto& t : *v) {
        t.mutable_grad() = at::Tensor();
        t.requires_grad_(false);
      }
  }
  TrainableWeights(const TrainableWeights&) = delete;
  TrainableWeights& operator=(const TrainableWeights&) = delete;
  std::vector<at::Tensor>& decayed() { return decayed_; }
  std::vector<at::Tensor>& plain() { return plain_; }

 private:
  std::vector<at::Tensor> decayed_, plain_;  // matrices (embedding included) / norms and biases
};

}  // namespace

SftResult train_sft(model::DecoderModel& model, const std::vector<SftExample>& data,
                    const SftOptions& o, const std::function<void(const SftProgress&)>& on_step) {
  if (data.empty()) throw_invalid("SFT needs at least one example");
  if (o.steps <= 0) throw_invalid("SFT steps must be positive, got {}", o.steps);
  if (o.batch_size <= 0) throw_invalid("SFT batch size must be positive, got {}", o.batch_size);
  for (const auto& ex : data)
    if (ex.prompt.empty() || ex.completion.empty())
      throw_invalid("every SFT example needs a prompt and a completion");

  TrainableWeights w(model);
  rl::AdamWConfig ac;
  ac.beta2 = o.beta2;
  ac.weight_decay = o.weight_decay;
  rl::AdamW opt_decayed(w.decayed(), ac);
  ac.weight_decay = 0;
  rl::AdamW opt_plain(w.plain(), ac);
  std::vector<at::Tensor> all = w.decayed();
  all.insert(all.end(), w.plain().begin(), w.plain().end());

  std::mt19937_64 rng(o.seed);
  std::vector<std::size_t> order(data.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::size_t cursor = order.size();  // forces a shuffle on the first batch

  SftResult res;
  std::vector<double> tail;
  const double t0 = now_seconds();
  for (std::int64_t step = 1; step <= o.steps; ++step) {
    std::vector<std::size_t> idx;
    while (static_cast<std::int64_t>(idx.size()) < o.batch_size) {
      if (cursor == order.size()) {
        for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
        cursor = 0;
      }
      idx.push_back(order[cursor++]);
      if (static_cast<std::int64_t>(idx.size()) >= static_cast<std::int64_t>(data.size())) break;
    }
    auto items = to_items(data, idx);
    auto packed = model::packed_logprobs(model, nullptr, items, 1.0, o.logits_chunk);
    auto loss = -packed.logprobs.mean();
    opt_decayed.zero_grad();
    opt_plain.zero_grad();
    loss.backward();
    const double gnorm = rl::clip_grad_norm(all, o.grad_clip);
    const double lr = lr_at(o, step);
    opt_decayed.step(lr);
    opt_plain.step(lr);

    const double l = loss.item<double>();
    if (!std::isfinite(l) || !std::isfinite(gnorm))
      throw Error(ErrorKind::kInternal,
                  fmt::format("SFT diverged at step {} (loss {}, gradient norm {}); lower the "
                              "learning rate ({})",
                              step, l, gnorm, lr));
    if (step == 1) res.first_loss = l;
    tail.push_back(l);
    if (tail.size() > 10) tail.erase(tail.begin());
    res.n_tokens += packed.logprobs.size(0);
    if (on_step) on_step({step, l, lr, gnorm, now_seconds() - t0});
  }
  res.final_loss =
      std::accumulate(tail.begin(), tail.end(), 0.0) / static_cast<double>(tail.size());
  res.seconds = now_seconds() - t0;
  return res;
}

double sft_loss(const model::DecoderModel& model, const std::vector<SftExample>& data,
                std::int64_t batch_size) {
  if (data.empty()) throw_invalid("sft_loss needs at least one example");
  at::NoGradGuard ng;
  double sum = 0;
  std::int64_t n = 0;
  for (std::size_t s = 0; s < data.size(); s += static_cast<std::size_t>(batch_size)) {
    std::vector<std::size_t> idx;
    for (std::size_t i = s; i < std::min(data.size(), s + static_cast<std::size_t>(batch_size));
         ++i)
      idx.push_back(i);
    auto packed = model::packed_logprobs(model, nullptr, to_items(data, idx), 1.0);
    sum += -packed.logprobs.sum().item<double>();
    n += packed.logprobs.size(0);
  }
  return sum / static_cast<double>(n);
}

}  // namespace lorasync::demo

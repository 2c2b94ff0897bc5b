#include "rl/packed_forward.h"

#include <ATen/ATen.h>

#include "util/error.h"

namespace lorasync::rl {

RowOutput packed_row_logprobs(const model::Qwen2Model& model, const model::LoraAdapter* adapter,
                              const std::vector<PackedSample>& samples, double temperature,
                              std::int64_t logits_chunk) {
  if (!(temperature > 0)) throw_invalid("temperature must be positive, got {}", temperature);
  std::vector<std::vector<std::int64_t>> seqs;
  std::vector<std::int64_t> rows, targets;
  RowOutput out;
  out.offsets.push_back(0);
  std::int64_t offset = 0;
  for (const auto& s : samples) {
    if (s.prompt.empty()) throw_invalid("a packed sample needs at least one prompt token");
    std::vector<std::int64_t> seq = s.prompt;
    seq.insert(seq.end(), s.completion.begin(), s.completion.end());
    const auto P = static_cast<std::int64_t>(s.prompt.size());
    for (std::size_t t = 0; t < s.completion.size(); ++t) {
      rows.push_back(offset + P - 1 + static_cast<std::int64_t>(t));
      targets.push_back(s.completion[t]);
    }
    offset += static_cast<std::int64_t>(seq.size());
    out.offsets.push_back(out.offsets.back() + static_cast<std::int64_t>(s.completion.size()));
    seqs.push_back(std::move(seq));
  }
  const auto dev = model.device();
  const auto acc = model.dtype() == at::kDouble ? at::kDouble : at::kFloat;
  if (rows.empty()) {
    out.logprobs = at::zeros({0}, at::TensorOptions().dtype(acc).device(dev));
    out.entropy = out.logprobs;
    return out;
  }
  auto batch = model::make_batch(seqs, {}, dev);
  auto lora = model::LoraBatch::all(adapter);
  auto hidden = model.forward(batch, &lora);
  auto lopt = at::TensorOptions().dtype(at::kLong);
  auto idx = at::tensor(rows, lopt).to(dev);
  auto tgt = at::tensor(targets, lopt).to(dev);
  std::vector<at::Tensor> lps, ents;
  const auto N = idx.size(0);
  for (std::int64_t s = 0; s < N; s += logits_chunk) {
    const auto n = std::min(logits_chunk, N - s);
    auto h = hidden.index_select(0, idx.narrow(0, s, n));
    auto z = at::linear(h, model.lm_head_weight()).to(acc) / temperature;  // [n, V]
    auto logp = at::log_softmax(z, -1);
    lps.push_back(logp.gather(1, tgt.narrow(0, s, n).unsqueeze(1)).squeeze(1));
    at::NoGradGuard ng;
    auto ld = logp.detach();
    ents.push_back(-(ld.exp() * ld).sum(-1));
  }
  out.logprobs = lps.size() == 1 ? lps[0] : at::cat(lps);
  out.entropy = ents.size() == 1 ? ents[0] : at::cat(ents);
  return out;
}

}  // namespace lorasync::rl

#include "core/model/logprobs.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/model/autograd_ops.h"
#include "util/error.h"

namespace lorasync::model {

void check_token_ids(const std::vector<std::int64_t>& ids, std::int64_t vocab, const char* what) {
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw_invalid("{}[{}] = {} is outside the vocabulary [0, {})", what, i, ids[i], vocab);
}

PackedLogprobs packed_logprobs(const DecoderModel& model, const LoraAdapter* adapter,
                               const std::vector<LogprobItem>& items, double temperature,
                               std::int64_t chunk, bool with_entropy, bool checkpoint_layers) {
  if (!(temperature > 0)) throw_invalid("temperature must be positive, got {}", temperature);
  std::vector<std::vector<std::int64_t>> seqs;
  std::vector<std::int64_t> pred_rows, targets;
  PackedLogprobs out;
  out.offsets.push_back(0);
  std::int64_t offset = 0;
  for (const auto& it : items) {
    if (it.prompt.empty()) throw_invalid("a logprob item needs at least one prompt token");
    check_token_ids(it.prompt, model.config().vocab_size, "prompt_ids");
    check_token_ids(it.completion, model.config().vocab_size, "completion_ids");
    std::vector<std::int64_t> s = it.prompt;
    s.insert(s.end(), it.completion.begin(), it.completion.end());
    const auto P = static_cast<std::int64_t>(it.prompt.size());
    for (std::size_t t = 0; t < it.completion.size(); ++t) {
      pred_rows.push_back(offset + P - 1 + static_cast<std::int64_t>(t));
      targets.push_back(it.completion[t]);
    }
    offset += static_cast<std::int64_t>(s.size());
    out.offsets.push_back(out.offsets.back() + static_cast<std::int64_t>(it.completion.size()));
    seqs.push_back(std::move(s));
  }
  const auto dev = model.device();
  const auto acc = model.dtype() == at::kDouble ? at::kDouble : at::kFloat;
  if (pred_rows.empty()) {
    out.logprobs = at::zeros({0}, at::TensorOptions().dtype(acc).device(dev));
    out.entropy = out.logprobs;
    return out;
  }
  auto batch = make_batch(seqs, {}, dev);
  auto lora = LoraBatch::all(adapter);
  auto hidden = model.forward(batch, &lora, nullptr, nullptr, checkpoint_layers);
  auto lopt = at::TensorOptions().dtype(at::kLong);
  auto rows = at::tensor(pred_rows, lopt).to(dev);
  auto tgt = at::tensor(targets, lopt).to(dev);
  const TensorFn head = [&model](const at::Tensor& h) { return model.logits(h); };
  auto r = lm_head_logprobs(head, model.lm_head_weight(), hidden.index_select(0, rows), tgt, temperature, chunk,
                            with_entropy);
  out.logprobs = std::move(r.logprobs);
  out.entropy = std::move(r.entropy);
  return out;
}

std::vector<std::vector<float>> completion_logprobs(const DecoderModel& model,
                                                    const LoraAdapter* adapter,
                                                    const std::vector<LogprobItem>& items,
                                                    double temperature, std::int64_t chunk) {
  at::NoGradGuard no_grad;
  auto packed = packed_logprobs(model, adapter, items, temperature, chunk);
  auto all = packed.logprobs.to(at::kCPU).to(at::kFloat).contiguous();
  const float* p = all.data_ptr<float>();
  std::vector<std::vector<float>> out(items.size());
  for (std::size_t i = 0; i < items.size(); ++i)
    out[i].assign(p + packed.offsets[i], p + packed.offsets[i + 1]);
  return out;
}

GenerateResult generate(const DecoderModel& model, const LoraAdapter* adapter,
                        const std::vector<std::int64_t>& prompt, const GenerateOptions& opt) {
  if (prompt.empty()) throw_invalid("prompt must hold at least one token");
  check_token_ids(prompt, model.config().vocab_size, "prompt");
  const auto cap = static_cast<std::int64_t>(prompt.size()) + opt.max_new_tokens;
  ContiguousKvCache cache(model.config(), 1, cap, model.dtype(), model.device());
  auto lora = LoraBatch::all(adapter);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);
  at::NoGradGuard no_grad;
  GenerateResult res;
  std::vector<std::int64_t> next = prompt;
  std::int64_t past = 0;
  for (std::int64_t step = 0; step < opt.max_new_tokens; ++step) {
    auto batch = make_batch({next}, {past}, model.device());
    auto meta = cache.plan(batch.segs, {0});
    auto hidden = model.forward(batch, &lora, &cache.pool(), &meta);
    auto logits = model.logits(hidden.narrow(0, hidden.size(0) - 1, 1)).squeeze(0).to(at::kCPU);
    past += static_cast<std::int64_t>(next.size());
    std::int64_t tok;
    float lp;
    if (opt.temperature <= 0) {
      tok = logits.argmax().item<std::int64_t>();
      lp = at::log_softmax(logits, -1)[tok].item<float>();
    } else {
      auto logp = at::log_softmax(logits / opt.temperature, -1);
      tok = at::multinomial(logp.exp(), 1, false, gen).item<std::int64_t>();
      lp = logp[tok].item<float>();
    }
    res.ids.push_back(tok);
    res.logprobs.push_back(lp);
    next = {tok};
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      res.stopped = true;
      break;
    }
  }
  return res;
}

}  // namespace lorasync::model

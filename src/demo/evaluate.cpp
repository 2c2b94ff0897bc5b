// demo/evaluate.cpp: batched generation and grading.
#include "demo/evaluate.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "core/model/kv_cache.h"
#include "core/tokenizer/chat_template.h"
#include "reward/grade.h"
#include "util/error.h"

namespace lorasync::demo {

std::vector<std::int64_t> prompt_ids(const tok::Tokenizer& tokenizer,
                                     const std::string& system_prompt, const std::string& problem) {
  auto ids = tokenizer.encode(tok::chatml_prompt(system_prompt, problem));
  return {ids.begin(), ids.end()};
}

BatchGeneration generate_batch(const model::DecoderModel& model,
                               const std::vector<std::vector<std::int64_t>>& prompts,
                               std::int64_t max_new_tokens, double temperature, std::uint64_t seed,
                               const std::vector<std::int64_t>& stop_ids) {
  BatchGeneration out;
  const auto B = static_cast<std::int64_t>(prompts.size());
  out.ids.resize(prompts.size());
  out.stopped.assign(prompts.size(), false);
  if (B == 0 || max_new_tokens <= 0) return out;
  std::int64_t max_prompt = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw_invalid("generate_batch: empty prompt");
    max_prompt = std::max(max_prompt, static_cast<std::int64_t>(p.size()));
  }
  at::NoGradGuard ng;
  model::ContiguousKvCache cache(model.config(), B, max_prompt + max_new_tokens, model.dtype(),
                                 model.device());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);

  std::vector<std::int64_t> live(static_cast<std::size_t>(B));  // sequence ids still generating
  for (std::int64_t i = 0; i < B; ++i) live[static_cast<std::size_t>(i)] = i;
  std::vector<std::vector<std::int64_t>> next = prompts;
  std::vector<std::int64_t> pasts(prompts.size(), 0);
  for (std::int64_t step = 0; step < max_new_tokens && !live.empty(); ++step) {
    std::vector<std::vector<std::int64_t>> seqs;
    std::vector<std::int64_t> past;
    for (auto s : live) {
      seqs.push_back(next[static_cast<std::size_t>(s)]);
      past.push_back(pasts[static_cast<std::size_t>(s)]);
    }
    auto batch = model::make_batch(seqs, past, model.device());
    auto meta = cache.plan(batch.segs, live);
    auto hidden = model.forward(batch, nullptr, &cache.pool(), &meta);  // [T, d]
    std::vector<std::int64_t> last;
    for (const auto& sg : batch.segs) last.push_back(sg.begin + sg.len - 1);
    auto rows = at::tensor(last, at::TensorOptions().dtype(at::kLong)).to(model.device());
    auto logits = model.logits(hidden.index_select(0, rows)).to(at::kCPU);  // [n_live, V]
    at::Tensor tok;
    if (temperature <= 0) {
      tok = logits.argmax(-1);
    } else {
      auto probs = at::softmax(logits / temperature, -1);
      tok = at::multinomial(probs, 1, false, gen).squeeze(1);
    }
    auto acc = tok.accessor<std::int64_t, 1>();
    std::vector<std::int64_t> still;
    for (std::size_t j = 0; j < live.size(); ++j) {
      const auto s = static_cast<std::size_t>(live[j]);
      const std::int64_t t = acc[static_cast<std::int64_t>(j)];
      pasts[s] += static_cast<std::int64_t>(next[s].size());
      out.ids[s].push_back(t);
      next[s] = {t};
      if (std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end())
        out.stopped[s] = true;
      else
        still.push_back(live[j]);
    }
    live.swap(still);
  }
  return out;
}

EvalResult evaluate(const model::DecoderModel& model, const tok::Tokenizer& tokenizer,
                    const std::vector<TaskRow>& rows, const EvalOptions& o) {
  std::vector<std::int64_t> stops = o.stop_ids;
  if (stops.empty()) {
    if (!tokenizer.special_tokens().eos) throw_invalid("the tokenizer has no eos token");
    stops.push_back(*tokenizer.special_tokens().eos);
  }
  if (o.batch_size <= 0) throw_invalid("eval batch size must be positive, got {}", o.batch_size);
  EvalResult res;
  std::int64_t n_gen_tokens = 0;
  for (std::size_t s = 0; s < rows.size(); s += static_cast<std::size_t>(o.batch_size)) {
    const std::size_t e = std::min(rows.size(), s + static_cast<std::size_t>(o.batch_size));
    std::vector<std::vector<std::int64_t>> prompts;
    for (std::size_t i = s; i < e; ++i)
      prompts.push_back(prompt_ids(tokenizer, o.system_prompt, rows[i].problem));
    auto g = generate_batch(model, prompts, o.max_new_tokens, o.temperature, o.seed + s, stops);
    for (std::size_t i = s; i < e; ++i) {
      auto& ids = g.ids[i - s];
      n_gen_tokens += static_cast<std::int64_t>(ids.size());
      const bool stopped = g.stopped[i - s];
      if (stopped) ids.pop_back();  // the stop token is not part of the text
      std::vector<std::int32_t> ids32(ids.begin(), ids.end());
      std::string text = tokenizer.decode(ids32, /*skip_special=*/true);
      ++res.n;
      if (!stopped) ++res.n_truncated;
      if (text.find("\\boxed{") != std::string::npos) ++res.n_boxed;
      const bool ok = stopped && reward::grade(text, rows[i].answer).correct;
      res.n_correct += ok;
      res.correct.push_back(ok);
      res.completions.push_back(std::move(text));
    }
  }
  res.mean_tokens = res.n ? static_cast<double>(n_gen_tokens) / static_cast<double>(res.n) : 0;
  return res;
}

}  // namespace lorasync::demo

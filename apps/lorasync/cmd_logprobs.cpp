// `lorasync logprobs`: per-token logprobs of completion ids after prompt ids, for a model with an
// optional adapter: the trainer's numerics, to debug a trainer/server mismatch.
//   lorasync logprobs --model DIR [--adapter DIR] --prompt-ids 1,2,3 --completion-ids 4,5
//   -> {"logprobs": [lp4, lp5]}
// With --input FILE.jsonl ({"prompt_ids": [...], "completion_ids": [...]} rows) all rows are
// packed into one forward and one {"logprobs": [...]} row is printed per input row.
// --logits-out FILE.safetensors also writes each row's full fp32 logits over prompt + completion
// ("logits.<row>", [P + C, vocab], before temperature), for comparisons with other stacks.
// --grads-out FILE.safetensors (needs --adapter) writes the gradient of the sum of every row's
// completion logprobs (at --temperature) with respect to each LoRA A and B, under PEFT's tensor
// names: a training step's gradients, to compare with PEFT's autograd on the same rows.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

#include "commands.h"
#include "core/io/safetensors.h"
#include "core/model/logprobs.h"
#include "model_options.h"
#include "util/error.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct LogprobsOptions {
  ModelOptions model;
  std::string prompt_ids, completion_ids, input;
  std::string logits_out;  // optional safetensors of full logits per row
  std::string grads_out;   // optional safetensors of the LoRA gradients
  double temperature = 1.0;
};

std::vector<std::int64_t> ids_field(const nlohmann::json& row, const char* key, std::size_t line) {
  if (!row.contains(key) || !row[key].is_array())
    throw_invalid("line {}: '{}' must be a list of token ids", line, key);
  std::vector<std::int64_t> out;
  for (const auto& v : row[key]) {
    if (!v.is_number_integer()) throw_invalid("line {}: '{}' holds a non-integer {}", line, key, v.dump());
    out.push_back(v.get<std::int64_t>());
  }
  return out;
}

// One forward per row (no packing), logits [P + C, V] in fp32 on the CPU, written atomically.
void write_logits(const LoadedModel& lm, const std::vector<model::LogprobItem>& items,
                  const std::string& path) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> keep;
  std::vector<io::TensorToWrite> ts;
  auto lora = model::LoraBatch::all(lm.adapter.get());
  for (std::size_t i = 0; i < items.size(); ++i) {
    std::vector<std::int64_t> seq = items[i].prompt;
    seq.insert(seq.end(), items[i].completion.begin(), items[i].completion.end());
    auto batch = model::make_batch({seq}, {}, lm.model->device());
    auto logits = lm.model->logits(lm.model->forward(batch, &lora)).to(at::kCPU).to(at::kFloat).contiguous();
    keep.push_back(logits);
    ts.push_back({"logits." + std::to_string(i), io::DType::kF32, logits.sizes().vec(),
                  {static_cast<const std::uint8_t*>(logits.data_ptr()), static_cast<std::size_t>(logits.nbytes())}});
  }
  io::write_safetensors(path, ts);
}

// d/d(A, B) of the sum of the rows' completion logprobs, one forward and backward per row (the
// training path: libtorch autograd through the LoRA deltas), written with PEFT's names.
void write_grads(const LoadedModel& lm, const std::vector<model::LogprobItem>& items, double temperature,
                 const std::string& path) {
  if (!lm.adapter) throw_invalid("--grads-out needs --adapter (the gradients are the adapter's)");
  auto& adapter = *lm.adapter;
  adapter.set_requires_grad(true);
  auto lora = model::LoraBatch::all(&adapter);
  for (const auto& it : items) {
    if (it.prompt.empty() || it.completion.empty()) throw_invalid("--grads-out: a row needs prompt and completion ids");
    std::vector<std::int64_t> seq = it.prompt;
    seq.insert(seq.end(), it.completion.begin(), it.completion.end());
    auto batch = model::make_batch({seq}, {}, lm.model->device());
    const auto P = static_cast<std::int64_t>(it.prompt.size()), C = static_cast<std::int64_t>(it.completion.size());
    auto hidden = lm.model->forward(batch, &lora).narrow(0, P - 1, C);
    auto logp = at::log_softmax(lm.model->logits(hidden) / temperature, -1);
    auto target = at::tensor(it.completion, at::TensorOptions().dtype(at::kLong)).to(logp.device());
    logp.gather(1, target.unsqueeze(1)).sum().backward();  // accumulates over the rows
  }
  std::vector<at::Tensor> keep;
  std::vector<io::TensorToWrite> ts;
  for (std::int64_t l = 0; l < adapter.n_layers(); ++l)
    for (int mi = 0; mi < model::kNumLoraModules; ++mi) {
      const auto m = static_cast<model::LoraModule>(mi);
      if (!adapter.config().targets_module(m)) continue;
      const std::string stem = "base_model.model.model.layers." + std::to_string(l) +
                               (m <= model::LoraModule::kO ? ".self_attn." : ".mlp.") +
                               std::string(model::lora_module_name(m));
      for (const auto& [suffix, t] : {std::pair{".lora_A.weight", adapter.A(l, m)}, std::pair{".lora_B.weight", adapter.B(l, m)}}) {
        if (!t.grad().defined()) throw_invalid("--grads-out: no gradient reached {}{}", stem, suffix);
        auto g = t.grad().to(at::kCPU).to(at::kFloat).contiguous();
        keep.push_back(g);
        ts.push_back({stem + suffix, io::DType::kF32, g.sizes().vec(),
                      {static_cast<const std::uint8_t*>(g.data_ptr()), static_cast<std::size_t>(g.nbytes())}});
      }
    }
  io::write_safetensors(path, ts);
}

int run(const LogprobsOptions& o) {
  std::vector<model::LogprobItem> items;
  if (!o.input.empty()) {
    std::ifstream in(o.input);
    if (!in) throw_not_found("--input {}: cannot open", o.input);
    std::string line;
    std::size_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      if (trim(line).empty()) continue;
      nlohmann::json row;
      try {
        row = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw_invalid("{} line {}: not valid JSON: {}", o.input, n, e.what());
      }
      items.push_back({ids_field(row, "prompt_ids", n), ids_field(row, "completion_ids", n)});
    }
  } else {
    if (o.prompt_ids.empty()) throw_invalid("give --prompt-ids and --completion-ids, or --input FILE.jsonl");
    items.push_back({parse_int_list(o.prompt_ids, "--prompt-ids"),
                     parse_int_list(o.completion_ids, "--completion-ids")});
  }
  auto lm = load_model(o.model);
  auto lps = model::completion_logprobs(*lm.model, lm.adapter.get(), items, o.temperature);
  for (const auto& lp : lps) {
    nlohmann::json j = {{"logprobs", lp}};
    std::printf("%s\n", j.dump().c_str());
  }
  if (!o.logits_out.empty()) write_logits(lm, items, o.logits_out);
  if (!o.grads_out.empty()) write_grads(lm, items, o.temperature, o.grads_out);
  return 0;
}

}  // namespace

void register_logprobs(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<LogprobsOptions>();
  auto* sub = root.add_subcommand("logprobs", "per-token logprobs of completion ids (trainer numerics)");
  add_model_options(sub, o->model);
  sub->add_option("--prompt-ids", o->prompt_ids, "comma-separated prompt token ids");
  sub->add_option("--completion-ids", o->completion_ids, "comma-separated completion token ids");
  sub->add_option("--input", o->input, "JSONL rows {prompt_ids, completion_ids}");
  sub->add_option("--temperature", o->temperature, "logits are divided by it")->capture_default_str();
  sub->add_option("--logits-out", o->logits_out, "also write each row's fp32 logits to this .safetensors");
  sub->add_option("--grads-out", o->grads_out,
                  "also write d(sum of the completion logprobs)/d(LoRA A, B) to this .safetensors (PEFT names; "
                  "needs --adapter)");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli

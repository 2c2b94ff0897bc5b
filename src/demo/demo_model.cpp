// demo/demo_model.cpp: the make-demo-model pipeline (problems, tokenizer, SFT, evaluation, files).
#include "demo/demo_model.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

#include "core/io/checkpoint_dir.h"
#include "core/model/decoder_model.h"
#include "core/tokenizer/bpe_trainer.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "demo/evaluate.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::demo {

const char kDemoSystemPrompt[] = "Put the final answer in \\boxed{}.";

namespace {

namespace fs = std::filesystem;

void validate(const DemoModelOptions& o) {
  if (o.out.empty()) throw_invalid("an output directory is required");
  if (o.train_problems < 64)
    throw_invalid("train problems must be at least 64, got {}", o.train_problems);
  if (o.heldout_problems < 1)
    throw_invalid("held-out problems must be at least 1, got {}", o.heldout_problems);
  if (o.max_new_tokens < 8)
    throw_invalid("max_new_tokens must be at least 8, got {}", o.max_new_tokens);
  if (o.vocab_size < 259 || o.vocab_size > 8192)
    throw_invalid("vocab size must be in [259, 8192], got {}", o.vocab_size);
  if (o.num_heads <= 0 || o.hidden_size % o.num_heads != 0)
    throw_invalid("hidden size {} must be a multiple of the head count {}", o.hidden_size,
                  o.num_heads);
  if (o.num_kv_heads <= 0 || o.num_heads % o.num_kv_heads != 0)
    throw_invalid("head count {} must be a multiple of the KV head count {}", o.num_heads,
                  o.num_kv_heads);
}

// Staging directories of interrupted runs (`out.staging-*`): one run per output at a time.
void remove_stale_staging(const fs::path& out) {
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const std::string prefix = out.filename().string() + ".staging-";
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return;
  for (const auto& e : fs::directory_iterator(parent, ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) fs::remove_all(e.path(), ec);
}

// The BPE corpus: every train prompt and solution, as the model will see them.
std::string tokenizer_corpus(const std::vector<TaskRow>& rows, const std::string& system_prompt) {
  std::string corpus;
  for (const auto& r : rows) {
    corpus += tok::chatml_prompt(system_prompt, r.problem);
    corpus += r.solution();
    corpus += "<|im_end|>\n";
  }
  return corpus;
}

std::vector<SftExample> sft_examples(const tok::Tokenizer& tk, const std::vector<TaskRow>& rows,
                                     const std::string& system_prompt, std::int64_t eos) {
  std::vector<SftExample> out;
  out.reserve(rows.size());
  tok::EncodeOptions plain;
  plain.parse_special = false;
  for (const auto& r : rows) {
    SftExample ex;
    ex.prompt = prompt_ids(tk, system_prompt, r.problem);
    auto c = tk.encode(r.solution(), plain);
    ex.completion.assign(c.begin(), c.end());
    ex.completion.push_back(eos);
    out.push_back(std::move(ex));
  }
  return out;
}

void write_model_dir(const fs::path& dir, const model::DecoderModel& m, const tok::TrainedBpe& bpe) {
  fs::create_directories(dir);
  std::vector<io::TensorToWrite> ts;
  std::vector<at::Tensor> keep;
  for (auto& [name, t] : m.named_weights()) {
    auto c = t.detach().to(at::kFloat).contiguous();
    keep.push_back(c);
    ts.push_back(
        {name,
         io::DType::kF32,
         c.sizes().vec(),
         {static_cast<const std::uint8_t*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes())}});
  }
  io::write_weights(dir, ts, std::uint64_t{1} << 40);
  const auto& cfg = m.config();
  write_file_durable(dir / "config.json", cfg.to_json());
  nlohmann::ordered_json gen = {{"bos_token_id", nullptr},
                                {"eos_token_id", cfg.eos_token_ids},
                                {"do_sample", true},
                                {"temperature", 1.0},
                                {"top_p", 1.0}};
  write_file_durable(dir / "generation_config.json", gen.dump(2) + "\n");
  write_file_durable(dir / "tokenizer.json", bpe.tokenizer_json);
  write_file_durable(dir / "tokenizer_config.json", bpe.config_json);
  fsync_path(dir, true);
}

}  // namespace

DemoModelResult make_demo_model(const DemoModelOptions& o,
                                const std::function<void(const std::string&)>& log_fn) {
  validate(o);
  auto log = [&](const std::string& s) {
    if (log_fn) log_fn(s);
  };
  if (fs::exists(o.out) && !o.overwrite)
    throw_invalid("output {} exists; pass --overwrite to replace it", o.out.string());
  remove_stale_staging(o.out);
  const double t0 = now_seconds();
  DemoModelResult res;
  res.out = o.out;

  // 1. Problems.
  auto train = make_problems(o.seed, o.train_problems, Split::kTrain, o.task);
  auto heldout = make_problems(o.seed, o.heldout_problems, Split::kHeldout, o.task);
  log(fmt::format("problems: {} train, {} held-out", train.size(), heldout.size()));

  // 2. Tokenizer.
  tok::BpeTrainerOptions bo;
  bo.vocab_size = o.vocab_size;
  bo.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  bo.eos_token = "<|im_end|>";
  bo.pad_token = "<|endoftext|>";
  auto bpe = tok::train_bpe(tokenizer_corpus(train, o.system_prompt), bo);
  auto tk = tok::Tokenizer::from_json(bpe.tokenizer_json, bpe.config_json, "demo tokenizer");
  const auto eos = tk.token_to_id("<|im_end|>");
  LS_CHECK(eos.has_value(), "the trained tokenizer lacks <|im_end|>");
  res.vocab_size = tk.vocab_size();
  log(fmt::format("tokenizer: {} ids ({} merges)", bpe.vocab_size, bpe.n_merges));

  // 3. Model + SFT.
  model::ModelConfig cfg;
  cfg.vocab_size = tk.vocab_size();
  cfg.hidden_size = o.hidden_size;
  cfg.intermediate_size = o.intermediate_size;
  cfg.num_hidden_layers = o.num_layers;
  cfg.num_attention_heads = o.num_heads;
  cfg.num_key_value_heads = o.num_kv_heads;
  cfg.head_dim = o.hidden_size / o.num_heads;
  cfg.max_position_embeddings = 1024;
  cfg.rope_theta = 10000.0;
  cfg.rms_norm_eps = 1e-6;
  cfg.tie_word_embeddings = true;
  cfg.torch_dtype = "float32";
  cfg.bos_token_id.reset();
  cfg.eos_token_ids = {*eos};
  if (o.arch != "qwen2") cfg = cfg.as_family(model::parse_family(o.arch));
  cfg.validate("demo model");
  res.n_params = cfg.n_params();
  at::manual_seed(o.seed);
  auto model =
      model::DecoderModel::from_named(cfg, model::random_weights(cfg, o.seed, at::kFloat, o.init_std),
                                    at::kFloat, c10::Device(c10::kCPU), "demo model");
  auto data = sft_examples(tk, train, o.system_prompt, *eos);
  std::int64_t n_prompt = 0, n_completion = 0;
  for (const auto& ex : data) {
    n_prompt += static_cast<std::int64_t>(ex.prompt.size());
    n_completion += static_cast<std::int64_t>(ex.completion.size());
  }
  log(
      fmt::format("model: {} params (hidden {}, {} layers); SFT data: {} examples, {:.1f} prompt + "
                  "{:.1f} completion tokens each",
                  res.n_params, cfg.hidden_size, cfg.num_hidden_layers, data.size(),
                  static_cast<double>(n_prompt) / static_cast<double>(data.size()),
                  static_cast<double>(n_completion) / static_cast<double>(data.size())));
  SftOptions so = o.sft;
  so.seed = o.seed;
  const std::int64_t every = std::max<std::int64_t>(1, so.steps / 10);
  auto sft = train_sft(*model, data, so, [&](const SftProgress& p) {
    if (p.step == 1 || p.step % every == 0 || p.step == so.steps)
      log(fmt::format("sft step {}/{}: loss {:.4f} lr {:.2e} grad_norm {:.2f} ({:.1f}s)", p.step,
                      so.steps, p.loss, p.lr, p.grad_norm, p.seconds));
  });
  res.sft_first_loss = sft.first_loss;
  res.sft_final_loss = sft.final_loss;
  res.sft_seconds = sft.seconds;

  // 4. Held-out evaluation: sampled (T = 1) and greedy.
  const double te = now_seconds();
  EvalOptions eo;
  eo.system_prompt = o.system_prompt;
  eo.max_new_tokens = o.max_new_tokens;
  eo.seed = o.seed;
  eo.temperature = 1.0;
  auto sampled = evaluate(*model, tk, heldout, eo);
  eo.temperature = 0.0;
  auto greedy = evaluate(*model, tk, heldout, eo);
  res.base_accuracy = sampled.accuracy();
  res.greedy_accuracy = greedy.accuracy();
  res.boxed_rate = static_cast<double>(sampled.n_boxed) / static_cast<double>(sampled.n);
  res.greedy_boxed_rate = static_cast<double>(greedy.n_boxed) / static_cast<double>(greedy.n);
  res.sampled_mean_tokens = sampled.mean_tokens;
  res.eval_seconds = now_seconds() - te;
  log(
      fmt::format("held-out ({} problems): sampled accuracy {:.3f} (boxed {:.3f}, {:.1f} tokens), "
                  "greedy accuracy {:.3f} (boxed {:.3f}) ({:.1f}s)",
                  heldout.size(), res.base_accuracy, res.boxed_rate, sampled.mean_tokens,
                  res.greedy_accuracy, res.greedy_boxed_rate, res.eval_seconds));
  {
    std::map<std::string, std::pair<int, int>> by_kind;  // kind -> (greedy correct, n)
    for (std::size_t i = 0; i < heldout.size(); ++i) {
      auto& k = by_kind[heldout[i].kind];
      k.first += greedy.correct[i];
      ++k.second;
    }
    std::string line = "greedy accuracy by kind:";
    for (const auto& [kind, c] : by_kind)
      line +=
          fmt::format(" {} {:.2f} ({})", kind, static_cast<double>(c.first) / c.second, c.second);
    log(line);
  }
  for (std::size_t i = 0; i < std::min<std::size_t>(4, heldout.size()); ++i)
    log(fmt::format("  {:?} (reference {}): sampled {:?}, greedy {:?}", heldout[i].problem,
                    heldout[i].answer, sampled.completions[i], greedy.completions[i]));

  // 5. Files: staging dir, then rename.
  nlohmann::ordered_json dj = {{"format_version", kDemoFormatVersion},
                               {"seed", o.seed},
                               {"prompt_format", "chatml"},
                               {"system_prompt", o.system_prompt},
                               {"max_new_tokens", o.max_new_tokens},
                               {"base_accuracy", res.base_accuracy},
                               {"greedy_accuracy", res.greedy_accuracy},
                               {"base_boxed_rate", res.boxed_rate},
                               {"eval_temperature", 1.0},
                               {"train_problems", train.size()},
                               {"heldout_problems", heldout.size()},
                               {"p_boxed", o.task.p_boxed},
                               {"vocab_size", res.vocab_size},
                               {"n_params", res.n_params},
                               {"sft_steps", so.steps},
                               {"sft_batch_size", so.batch_size},
                               {"sft_lr", so.lr},
                               {"sft_first_loss", res.sft_first_loss},
                               {"sft_final_loss", res.sft_final_loss},
                               {"model_dir", "model"},
                               {"train_file", "train.jsonl"},
                               {"heldout_file", "heldout.jsonl"}};
  res.demo_json = dj.dump(2) + "\n";

  const fs::path parent = o.out.has_parent_path() ? o.out.parent_path() : fs::path(".");
  fs::create_directories(parent);
  const fs::path staging = o.out.string() + ".staging-" + random_hex(4);
  try {
    fs::create_directories(staging);
    write_model_dir(staging / "model", *model, bpe);
    write_file_durable(staging / "train.jsonl", to_jsonl(train));
    write_file_durable(staging / "heldout.jsonl", to_jsonl(heldout));
    write_file_durable(staging / "demo.json", res.demo_json);
    std::string samples;
    for (std::size_t i = 0; i < heldout.size(); ++i) {
      nlohmann::ordered_json j = {{"problem", heldout[i].problem},
                                  {"answer", heldout[i].answer},
                                  {"sampled", sampled.completions[i]},
                                  {"sampled_correct", static_cast<bool>(sampled.correct[i])},
                                  {"greedy", greedy.completions[i]},
                                  {"greedy_correct", static_cast<bool>(greedy.correct[i])}};
      samples += j.dump() + "\n";
    }
    write_file_durable(staging / "base_samples.jsonl", samples);
    fsync_path(staging, true);
    if (fs::exists(o.out)) fs::remove_all(o.out);
    rename_and_sync(staging, o.out);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(staging, ec);
    throw;
  }
  res.seconds = now_seconds() - t0;
  log(fmt::format("wrote {} ({:.1f}s)", o.out.string(), res.seconds));
  return res;
}

}  // namespace lorasync::demo

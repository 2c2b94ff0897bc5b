// tests/unit/demo/demo_task_test.cpp: the demo task generator, its tokenization and a tiny SFT.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>

#include "core/model/logprobs.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "core/tokenizer/bpe_trainer.h"
#include "core/tokenizer/chat_template.h"
#include "core/tokenizer/tokenizer.h"
#include "demo/demo_model.h"
#include "demo/evaluate.h"
#include "demo/sft.h"
#include "demo/task.h"
#include "reward/grade.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::demo {
namespace {

TEST(DemoTask, DeterministicPerSeed) {
  auto a = make_problems(7, 300, Split::kTrain);
  auto b = make_problems(7, 300, Split::kTrain);
  auto c = make_problems(8, 300, Split::kTrain);
  ASSERT_EQ(a.size(), 300u);
  EXPECT_EQ(to_jsonl(a), to_jsonl(b));
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].solution(), b[i].solution());
  EXPECT_NE(to_jsonl(a), to_jsonl(c));
  // A longer draw starts with the shorter one.
  auto longer = make_problems(7, 400, Split::kTrain);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].problem, longer[i].problem);
}

TEST(DemoTask, SplitsAreDisjointAndDistinct) {
  auto train = make_problems(3, 6000, Split::kTrain);
  auto held = make_problems(3, 500, Split::kHeldout);
  std::set<std::string> tp, hp;
  for (const auto& r : train) tp.insert(r.problem);
  for (const auto& r : held) hp.insert(r.problem);
  EXPECT_EQ(tp.size(), train.size());
  EXPECT_EQ(hp.size(), held.size());
  for (const auto& p : hp) EXPECT_EQ(tp.count(p), 0u) << p;
  // Every kind appears in both splits.
  std::set<std::string> kt, kh;
  for (const auto& r : train) kt.insert(r.kind);
  for (const auto& r : held) kh.insert(r.kind);
  EXPECT_EQ(kt, (std::set<std::string>{"expr", "word", "equation", "fraction"}));
  EXPECT_EQ(kh, kt);
}

TEST(DemoTask, BoxedSolutionsAreGradedCorrectAndOthersNot) {
  auto rows = make_problems(11, 3000, Split::kTrain);
  int n_boxed_style = 0;
  for (const auto& r : rows) {
    auto g = reward::grade(r.boxed_solution(), r.answer);
    EXPECT_TRUE(g.correct) << r.problem << " | " << r.boxed_solution() << " | ref " << r.answer
                           << " | " << g.reason;
    // The solution's own final line is rewarded exactly when it is boxed.
    EXPECT_EQ(reward::grade(r.solution(), r.answer).correct, r.style == FinalStyle::kBoxed)
        << r.solution();
    n_boxed_style += r.style == FinalStyle::kBoxed;
    // The worked steps end with the final value.
    EXPECT_NE(r.steps.rfind(" = " + r.final_value + "."), std::string::npos) << r.steps;
  }
  const double share = static_cast<double>(n_boxed_style) / static_cast<double>(rows.size());
  EXPECT_NEAR(share, TaskOptions{}.p_boxed, 0.03);
  // A wrong boxed value is graded wrong.
  EXPECT_FALSE(reward::grade("\\boxed{" + rows[0].final_value + "1}", rows[0].answer).correct);
}

TEST(DemoTask, BadCountsAreInvalidInput) {
  EXPECT_THROW(make_problems(1, 0, Split::kTrain), Error);
  TaskOptions t;
  t.p_boxed = 1.5;
  EXPECT_THROW(make_problems(1, 10, Split::kTrain, t), Error);
}

struct Tiny {
  tok::TrainedBpe bpe;
  tok::Tokenizer tk =
      tok::Tokenizer::from_json(R"({"model":{"type":"BPE","vocab":{},"merges":[]}})");
  std::vector<TaskRow> rows;
};

Tiny tiny_tokenizer() {
  Tiny t;
  t.rows = make_problems(5, 400, Split::kTrain);
  std::string corpus;
  for (const auto& r : t.rows)
    corpus += tok::chatml_prompt(kDemoSystemPrompt, r.problem) + r.solution() + "<|im_end|>\n";
  tok::BpeTrainerOptions o;
  o.vocab_size = 320;
  o.special_tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  t.bpe = tok::train_bpe(corpus, o);
  t.tk = tok::Tokenizer::from_json(t.bpe.tokenizer_json, t.bpe.config_json);
  return t;
}

TEST(DemoTask, SolutionsTokenizeAndRoundTrip) {
  auto t = tiny_tokenizer();
  ASSERT_EQ(t.tk.vocab_size(), 320);
  auto eos = t.tk.token_to_id("<|im_end|>");
  ASSERT_TRUE(eos.has_value());
  EXPECT_EQ(t.tk.special_tokens().eos, eos);
  // Held-out problems (never in the corpus) round-trip too.
  auto held = make_problems(5, 100, Split::kHeldout);
  auto all = t.rows;
  all.insert(all.end(), held.begin(), held.end());
  for (const auto& r : all) {
    tok::EncodeOptions plain;
    plain.parse_special = false;
    auto ids = t.tk.encode(r.solution(), plain);
    EXPECT_LT(ids.size(), 48u) << r.solution();
    EXPECT_EQ(t.tk.decode(ids), r.solution());
    auto p = prompt_ids(t.tk, kDemoSystemPrompt, r.problem);
    EXPECT_EQ(std::count(p.begin(), p.end(), static_cast<std::int64_t>(*eos)), 2);  // system, user
    std::vector<std::int32_t> p32(p.begin(), p.end());
    EXPECT_EQ(t.tk.decode(p32), tok::chatml_prompt(kDemoSystemPrompt, r.problem));
  }
}

TEST(DemoSft, AFewStepsLowerTheLoss) {
  model::set_compute_threads(1);
  auto t = tiny_tokenizer();
  model::ModelConfig cfg = model::ModelConfig::preset("tiny");
  cfg.vocab_size = t.tk.vocab_size();
  cfg.eos_token_ids = {*t.tk.token_to_id("<|im_end|>")};
  cfg.bos_token_id.reset();
  auto m = model::DecoderModel::from_named(cfg, model::random_weights(cfg, 3, at::kFloat), at::kFloat,
                                         c10::Device(c10::kCPU));
  std::vector<SftExample> data;
  for (std::size_t i = 0; i < 64; ++i) {
    SftExample ex;
    ex.prompt = prompt_ids(t.tk, kDemoSystemPrompt, t.rows[i].problem);
    auto c = t.tk.encode(t.rows[i].solution());
    ex.completion.assign(c.begin(), c.end());
    ex.completion.push_back(cfg.eos_token_ids[0]);
    data.push_back(std::move(ex));
  }
  const double before = sft_loss(*m, data);
  SftOptions o;
  o.steps = 12;
  o.batch_size = 16;
  o.lr = 1e-2;
  o.warmup_steps = 2;
  int calls = 0;
  auto r = train_sft(*m, data, o, [&](const SftProgress& p) {
    ++calls;
    EXPECT_EQ(p.step, calls);
    EXPECT_TRUE(std::isfinite(p.loss));
  });
  EXPECT_EQ(calls, 12);
  const double after = sft_loss(*m, data);
  EXPECT_LT(after, before - 0.5) << "before " << before << " after " << after;
  EXPECT_LT(r.final_loss, r.first_loss);
  // Weights are plain tensors again afterwards.
  for (auto& [name, w] : m->named_weights()) EXPECT_FALSE(w.requires_grad()) << name;

  // Batched generation: greedy equals the one-sequence reference loop, and it stops at eos.
  std::vector<std::vector<std::int64_t>> prompts = {data[0].prompt, data[1].prompt};
  auto g = generate_batch(*m, prompts, 12, 0.0, 1, {cfg.eos_token_ids[0]});
  ASSERT_EQ(g.ids.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    model::GenerateOptions go;
    go.max_new_tokens = 12;
    go.stop_ids = {cfg.eos_token_ids[0]};
    auto ref = model::generate(*m, nullptr, prompts[i], go);
    EXPECT_EQ(g.ids[i], ref.ids);
    EXPECT_EQ(g.stopped[i], ref.stopped);
  }
}

TEST(DemoModel, WritesTheDirectoryAtomically) {
  model::set_compute_threads(1);
  TempDir dir("demo-test");
  DemoModelOptions o;
  o.out = dir.path() / "demo";
  o.train_problems = 200;
  o.heldout_problems = 8;
  o.vocab_size = 300;
  o.hidden_size = 32;
  o.intermediate_size = 64;
  o.num_layers = 1;
  o.num_heads = 2;
  o.num_kv_heads = 1;
  o.max_new_tokens = 8;
  o.sft.steps = 2;
  o.sft.batch_size = 8;
  // A staging directory left by an interrupted run is cleaned up.
  fs::create_directories(dir.path() / "demo.staging-dead" / "model");
  auto r = make_demo_model(o);
  for (const char* f : {"model/config.json", "model/model.safetensors", "model/tokenizer.json",
                        "model/tokenizer_config.json", "model/generation_config.json",
                        "train.jsonl", "heldout.jsonl", "demo.json"})
    EXPECT_TRUE(fs::exists(o.out / f)) << f;
  EXPECT_NE(r.demo_json.find("\"format_version\": 1"), std::string::npos);
  auto loaded = model::DecoderModel::load(o.out / "model", at::kFloat, c10::Device(c10::kCPU));
  auto tk = tok::Tokenizer::load(o.out / "model");
  EXPECT_EQ(loaded->config().vocab_size, tk.vocab_size());
  EXPECT_EQ(loaded->config().eos_token_ids,
            std::vector<std::int64_t>{*tk.token_to_id("<|im_end|>")});
  // No staging directory is left, and an existing output is refused without overwrite.
  int n_entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++n_entries;
  EXPECT_EQ(n_entries, 1);
  EXPECT_THROW(make_demo_model(o), Error);
}

}  // namespace
}  // namespace lorasync::demo

// DecodeGraphs (core/model/decode_graphs.h) on the CPU: the static buffers, bucket padding,
// scratch slot and LoRA tiles that a captured CUDA graph replays, run eagerly, against the plain
// forward of the same steps. The capture itself is checked on a GPU (gpu_test.cpp, gpu-check).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "core/model/decode_graphs.h"
#include "core/model/device_kernels.h"
#include "core/model/kv_cache.h"
#include "core/model/lora.h"
#include "core/model/decoder_model.h"
#include "util/error.h"

namespace lorasync::model {
namespace {

ModelConfig graph_config() {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 1000;
  c.intermediate_size = 96;
  return c;
}

std::shared_ptr<const LoraAdapter> adapter(const ModelConfig& c, std::uint64_t seed) {
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  auto a = LoraAdapter::init(lc, c, seed, at::kCPU);
  for (std::int64_t l = 0; l < a.n_layers(); ++l)
    for (auto m : lc.targets) a.B(l, m).normal_(0, 0.3);
  return std::make_shared<const LoraAdapter>(std::move(a));
}

TEST(DecodeGraphs, EagerStepsOnTheStaticBuffersEqualThePlainForward) {
  const auto c = graph_config();
  auto model = DecoderModel::from_named(c, random_weights(c, 7, at::kFloat, 0.1), at::kFloat, at::kCPU);
  const AdapterSet ads = {adapter(c, 1), nullptr, adapter(c, 2)};  // slot 1 empty
  std::vector<const LoraAdapter*> raw = {ads[0].get(), nullptr, ads[2].get()};
  // Five sequences with prompts of different lengths; sequence i on adapter slot slot_of[i].
  const std::vector<std::vector<std::int64_t>> prompts = {
      {1, 2, 3}, {9, 8, 7, 100, 500, 5, 6, 7, 8, 10, 11}, {42}, {5, 6, 7, 8, 9, 10}, {77, 78}};
  const std::vector<int> slot_of = {0, -1, 2, 2, 1};  // slot 1 is empty: base model
  const std::int64_t n = 5, cap = 32;
  at::NoGradGuard ng;
  ContiguousKvCache plain(c, n, cap, at::kFloat, at::kCPU);
  std::vector<int> prow;
  for (std::int64_t i = 0; i < n; ++i) prow.insert(prow.end(), prompts[static_cast<std::size_t>(i)].size(), slot_of[static_cast<std::size_t>(i)]);
  auto pb = make_batch(prompts, {}, at::kCPU);
  auto pm = plain.plan(pb.segs, {0, 1, 2, 3, 4});
  auto pl = LoraBatch::from_row_slots(raw, prow, at::kCPU);
  model->forward(pb, &pl, &plain.pool(), &pm);
  // The graphs' pool: the same slots (sequence i owns [i cap, (i + 1) cap)) and one scratch slot.
  KvPool pool = KvPool::allocate(c, n * cap + 1, at::kFloat, at::kCPU);
  for (std::size_t l = 0; l < pool.k.size(); ++l) {
    pool.k[l].zero_();
    pool.v[l].zero_();
    pool.k[l].narrow(0, 0, n * cap).copy_(plain.pool().k[l]);
    pool.v[l].narrow(0, 0, n * cap).copy_(plain.pool().v[l]);
  }
  DecodeGraphs::Options o;
  o.buckets = {2, 4, 8};
  o.max_context = cap;
  o.scratch_slot = n * cap;
  o.lora_slots = 3;
  o.lora_rank = 6;  // the rank-4 adapters are copied zero-padded, their scaling folded in
  DecodeGraphs graphs(*model, pool, o);
  EXPECT_FALSE(graphs.capturing());
  std::vector<std::int64_t> lens;
  for (const auto& p : prompts) lens.push_back(static_cast<std::int64_t>(p.size()));
  // Steps of 5 rows (bucket 8), then 3 rows (bucket 4) and 1 row (bucket 2): padding every time.
  const std::vector<std::vector<std::int64_t>> step_rows = {{0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, {4, 0, 2}, {3}, {1, 3, 0, 2, 4}};
  for (std::size_t st = 0; st < step_rows.size(); ++st) {
    const auto& rows = step_rows[st];
    std::vector<std::vector<std::int64_t>> one;
    std::vector<std::int64_t> pasts, ids;
    std::vector<int> row_slot;
    DecodeStep ds;
    for (auto i : rows) {
      const auto k = static_cast<std::size_t>(i);
      const std::int64_t tok = (i * 37 + static_cast<std::int64_t>(st) * 11) % c.vocab_size;
      one.push_back({tok});
      pasts.push_back(lens[k]);
      ids.push_back(i);
      row_slot.push_back(slot_of[k]);
      ds.tokens.push_back(tok);
      ds.positions.push_back(lens[k]);
      ds.slot_mapping.push_back(i * cap + lens[k]);
      ds.lens.push_back(lens[k] + 1);
      for (std::int64_t p = 0; p <= lens[k]; ++p) ds.context.push_back(i * cap + p);
      ds.adapter_slot.push_back(slot_of[k]);
    }
    auto db = make_batch(one, pasts, at::kCPU);
    auto dm = plain.plan(db.segs, ids);
    auto dl = LoraBatch::from_row_slots(raw, row_slot, at::kCPU);
    auto want = model->logits(model->forward(db, &dl, &plain.pool(), &dm)).clone();
    auto got = graphs.run(ds, ads);
    ASSERT_EQ(got.sizes(), want.sizes()) << "step " << st;
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-4) << "step " << st;
    EXPECT_TRUE(at::equal(got.argmax(-1), want.argmax(-1))) << "step " << st;
    for (auto i : rows) ++lens[static_cast<std::size_t>(i)];
  }
  EXPECT_EQ(graphs.stats().eager, static_cast<std::int64_t>(step_rows.size()));
  // An adapter of a larger rank than the copies, or in a slot past them, does not fit.
  LoraConfig big;
  big.rank = 8;
  big.targets = LoraConfig::parse_targets({"q_proj"});
  AdapterSet too_big = {std::make_shared<const LoraAdapter>(LoraAdapter::init(big, c, 3, at::kCPU))};
  EXPECT_FALSE(graphs.fits(1, 4, too_big));
  EXPECT_FALSE(graphs.fits(1, 4, {nullptr, nullptr, nullptr, ads[0]}));
  EXPECT_TRUE(graphs.fits(1, 4, {nullptr, nullptr, nullptr, nullptr}));
  EXPECT_EQ(graphs.stats().replays, 0);
  // Every sequence's slots hold what the plain forward wrote; the padding rows wrote only the
  // scratch slot.
  for (std::size_t l = 0; l < pool.k.size(); ++l) {
    EXPECT_LE((pool.k[l].narrow(0, 0, n * cap) - plain.pool().k[l]).abs().max().item<double>(), 1e-4) << l;
    EXPECT_LE((pool.v[l].narrow(0, 0, n * cap) - plain.pool().v[l]).abs().max().item<double>(), 1e-4) << l;
    EXPECT_GT(pool.k[l][n * cap].abs().sum().item<double>(), 0) << "scratch slot of layer " << l;
  }
}

TEST(DecodeGraphs, StepsOutsideTheBucketsOrTheContextTableAreRefusedByName) {
  const auto c = graph_config();
  auto model = DecoderModel::from_named(c, random_weights(c, 7, at::kFloat, 0.1), at::kFloat, at::kCPU);
  KvPool pool = KvPool::allocate(c, 65, at::kFloat, at::kCPU);
  DecodeGraphs::Options o;
  o.buckets = {4, 1, 2, 2};  // sorted and deduplicated
  o.max_context = 8;
  o.scratch_slot = 64;
  DecodeGraphs g(*model, pool, o);
  EXPECT_EQ(g.bucket_for(1), 1);
  EXPECT_EQ(g.bucket_for(3), 4);
  EXPECT_EQ(g.bucket_for(4), 4);
  EXPECT_EQ(g.bucket_for(5), 0);
  EXPECT_EQ(g.bucket_for(0), 0);
  EXPECT_TRUE(g.fits(4, 8, {}));
  EXPECT_FALSE(g.fits(5, 8, {}));
  EXPECT_FALSE(g.fits(1, 9, {}));
  DecodeStep big;
  for (int i = 0; i < 5; ++i) {
    big.tokens.push_back(1);
    big.positions.push_back(0);
    big.slot_mapping.push_back(i);
    big.lens.push_back(1);
    big.context.push_back(i);
  }
  EXPECT_THROW(
      {
        try {
          g.run(big, {});
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("5 rows"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  DecodeStep torn = big;
  torn.context.pop_back();  // lengths sum to 5, four slots
  EXPECT_THROW(g.run(torn, {}), Error);
  DecodeStep zero;
  zero.tokens = {1};
  zero.positions = {0};
  zero.slot_mapping = {0};
  zero.lens = {0};
  EXPECT_THROW(g.run(zero, {}), Error);
  auto bad = o;
  bad.scratch_slot = 65;  // past the pool
  EXPECT_THROW(DecodeGraphs(*model, pool, bad), Error);
  bad = o;
  bad.buckets = {0, 2};
  EXPECT_THROW(DecodeGraphs(*model, pool, bad), Error);
}

TEST(DecodeGraphs, ATilesOnlyLoraBatchRefusesToRunWithoutTheKernel) {
  // A graph's LoRA batch has no per-adapter rows: where the batched kernel cannot run it must
  // refuse, not apply every adapter to every row.
  const auto c = graph_config();
  auto a = adapter(c, 1);
  const int tile_ints = 2 + cuda::kLoraKernelTileRows;
  auto lb = LoraBatch::with_tiles({a.get()}, at::zeros({1, tile_ints}, at::TensorOptions().dtype(at::kInt)), 2);
  auto x = at::randn({2, c.hidden_size});
  auto y = at::zeros({2, c.q_dim()});
  EXPECT_THROW(lb.apply(x, y, 0, LoraModule::kQ), Error);
}

TEST(DecodeGraphs, PaddedTilesKeepEveryRowOnceAndEndInEmptyTiles) {
  // Rows of three parts over a bucket of 40 rows: the tiles of lora_tiles, then count-0 tiles.
  const int tr = cuda::kLoraKernelTileRows;
  std::vector<std::vector<std::int64_t>> parts = {{}, {}, {}};
  for (std::int64_t r = 0; r < 37; ++r) parts[static_cast<std::size_t>(r % 3)].push_back(r);
  const std::int64_t max_tiles = (40 + tr - 1) / tr + 3;
  auto t = padded_lora_tiles(parts, tr, max_tiles);
  ASSERT_EQ(t.size(), static_cast<std::size_t>(max_tiles * (2 + tr)));
  std::vector<int> seen(37, 0);
  bool in_padding = false;
  for (std::int64_t k = 0; k < max_tiles; ++k) {
    const int* tile = t.data() + k * (2 + tr);
    if (tile[1] == 0) {
      in_padding = true;
      continue;
    }
    EXPECT_FALSE(in_padding) << "a real tile after an empty one";
    for (int i = 0; i < tile[1]; ++i) {
      const int row = tile[2 + i];
      ASSERT_GE(row, 0);
      ASSERT_LT(row, 37);
      EXPECT_EQ(row % 3, tile[0]) << "row in its adapter's tile";
      ++seen[static_cast<std::size_t>(row)];
    }
  }
  for (int r = 0; r < 37; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], 1) << r;
  EXPECT_THROW(padded_lora_tiles(parts, tr, 2), Error);
}

}  // namespace
}  // namespace lorasync::model

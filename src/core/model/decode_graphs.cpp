// core/model/decode_graphs.cpp: see decode_graphs.h.
#include "core/model/decode_graphs.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <optional>

#include "core/model/device_kernels.h"
#include "core/model/decoder_model.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::model {

namespace {
constexpr int kTileInts = 2 + cuda::kLoraKernelTileRows;
static_assert(kTileInts % 2 == 0, "a tile must fill whole int64 words");
constexpr std::int64_t kTileWords = kTileInts / 2;
}  // namespace

struct DecodeGraphs::Bucket {
  std::int64_t rows = 0;       // Bb
  std::int64_t max_tiles = 0;  // 0 without adapters
  at::Tensor in;               // int64 [4 Bb + tiles + Lcap Bb] on the model's device
  at::Tensor tokens, positions, slot_mapping, lens, tiles, slots;  // views of `in`
  at::Tensor logits;           // fp32 [Bb, vocab], a view of the shared buffer
  std::vector<std::int64_t> host;  // staging of the prefix of `in` copied per step
  std::shared_ptr<cuda::Graph> graph;
  std::int64_t ctx_offset() const { return 4 * rows + max_tiles * kTileWords; }
};

std::vector<int> padded_lora_tiles(const std::vector<std::vector<std::int64_t>>& rows_of_part, int tile_rows,
                                   std::int64_t max_tiles) {
  auto t = lora_tiles(rows_of_part, tile_rows);
  const auto per = static_cast<std::size_t>(2 + tile_rows);
  const auto n = static_cast<std::int64_t>(t.size() / per);
  if (n > max_tiles) throw_invalid("the decode rows need {} LoRA tiles, the graph bucket has {}", n, max_tiles);
  t.resize(static_cast<std::size_t>(max_tiles) * per, 0);  // empty tiles: part 0, count 0
  return t;
}

DecodeGraphs::DecodeGraphs(const DecoderModel& model, KvPool& pool, Options options)
    : model_(model), pool_(pool), opts_(std::move(options)) {
  auto& bk = opts_.buckets;
  if (bk.empty()) throw_invalid("decode graphs: no batch-size buckets");
  std::sort(bk.begin(), bk.end());
  bk.erase(std::unique(bk.begin(), bk.end()), bk.end());
  if (bk.front() <= 0) throw_invalid("decode graphs: bucket sizes must be positive (got {})", bk.front());
  if (opts_.max_context <= 0) throw_invalid("decode graphs: max_context must be positive (got {})", opts_.max_context);
  if (opts_.scratch_slot < 0 || opts_.scratch_slot >= pool_.n_slots())
    throw_invalid("decode graphs: scratch slot {} is outside the KV pool's {} slots", opts_.scratch_slot,
                  pool_.n_slots());
  const auto& cfg = model_.config();
  // Graphs need every kernel of the step to be ours or libtorch's without host synchronisation:
  // the paged decode attention kernel must take this model's heads.
  const bool attention_fits =
      have_cuda_kernels() &&
      cuda::paged_decode_attention_fits(
          at::empty({1, cfg.num_attention_heads, cfg.head_dim}, at::TensorOptions().dtype(model_.dtype()).device(at::kMeta)),
          at::empty({1, cfg.num_key_value_heads, cfg.head_dim}, at::TensorOptions().dtype(model_.dtype()).device(at::kMeta)));
  if (opts_.lora_slots < 0 || opts_.lora_rank < 0 || (opts_.lora_slots > 0 && opts_.lora_rank == 0))
    throw_invalid("decode graphs: {} adapter slots of rank {}", opts_.lora_slots, opts_.lora_rank);
  if (opts_.lora_slots > cuda::kLoraKernelMaxAdapters || opts_.lora_rank > cuda::kLoraKernelMaxRank)
    throw_invalid("decode graphs: {} adapter slots of rank {} exceed the batched LoRA kernel's {} of rank <= {}",
                  opts_.lora_slots, opts_.lora_rank, cuda::kLoraKernelMaxAdapters, cuda::kLoraKernelMaxRank);
  if (opts_.lora_slots > 0) {
    LoraConfig lc;
    lc.rank = opts_.lora_rank;
    lc.alpha = static_cast<double>(opts_.lora_rank);  // scaling 1: the copies carry it in B
    lc.targets = LoraConfig::parse_targets({"all-linear"});
    for (int i = 0; i < opts_.lora_slots; ++i) copies_.push_back(LoraAdapter::init(lc, cfg, 0, model_.device()));
  }
  capture_ = opts_.capture && model_.device().is_cuda() && cuda::graphs_available() && attention_fits;
  if (opts_.capture && model_.device().is_cuda() && !capture_)
    LS_LOG_WARN("model", "CUDA graphs unavailable ({}): decode steps run eagerly",
                have_cuda_kernels() ? "the paged decode kernel does not take this model's heads"
                                    : "this build has no CUDA kernels");
}

DecodeGraphs::~DecodeGraphs() = default;

std::int64_t DecodeGraphs::bucket_for(std::int64_t B) const {
  if (B <= 0) return 0;
  auto it = std::lower_bound(opts_.buckets.begin(), opts_.buckets.end(), B);
  return it == opts_.buckets.end() ? 0 : *it;
}

bool DecodeGraphs::adapters_fit(const AdapterSet& adapters) const {
  for (std::size_t s = 0; s < adapters.size(); ++s) {
    const auto& a = adapters[s];
    if (!a) continue;
    if (s >= copies_.size() || a->config().rank > opts_.lora_rank ||
        a->n_layers() != model_.config().num_hidden_layers)
      return false;
    for (std::int64_t l = 0; l < a->n_layers(); ++l)
      for (auto m : a->config().targets)
        if (!a->A(l, m).defined() || !a->B(l, m).defined()) return false;
  }
  return true;
}

// Copies each slot's adapter into the slot's fixed weights: A into the first r rows, B times the
// adapter's scaling into the first r columns, zeros elsewhere (the copy has rank R and scaling 1,
// and targets every module). The graphs read these addresses, so a new adapter needs no capture.
bool DecodeGraphs::set_adapters(const AdapterSet& adapters) {
  if (adapters == adapters_) return true;
  if (!adapters_fit(adapters)) return false;
  at::NoGradGuard no_grad;
  for (std::size_t s = 0; s < adapters.size() && s < copies_.size(); ++s) {
    const auto& a = adapters[s];
    if (!a || (s < adapters_.size() && adapters_[s] == a)) continue;
    LoraAdapter& dst = copies_[s];
    const double scale = a->config().scaling();
    const std::int64_t r = a->config().rank;
    for (std::int64_t l = 0; l < dst.n_layers(); ++l)
      for (auto m : dst.config().targets) {
        auto& A = dst.A(l, m);
        auto& B = dst.B(l, m);
        A.zero_();
        B.zero_();
        if (!a->config().targets_module(m)) continue;
        A.narrow(0, 0, r).copy_(a->A(l, m));
        B.narrow(1, 0, r).copy_(a->B(l, m).to(at::kFloat) * scale);
      }
  }
  adapters_ = adapters;  // holds them: no address is reused while a slot's copy stands for it
  return true;
}

bool DecodeGraphs::fits(std::int64_t B, std::int64_t max_len, const AdapterSet& adapters) {
  if (bucket_for(B) == 0 || max_len < 1 || max_len > opts_.max_context) return false;
  return set_adapters(adapters);
}

DecodeGraphs::Bucket& DecodeGraphs::bucket(std::int64_t Bb) {
  auto& slot = buckets_[Bb];
  if (slot) return *slot;
  slot = std::make_unique<Bucket>();
  Bucket& b = *slot;
  b.rows = Bb;
  const auto parts = static_cast<std::int64_t>(copies_.size());
  b.max_tiles = parts > 0 ? (Bb + cuda::kLoraKernelTileRows - 1) / cuda::kLoraKernelTileRows + parts : 0;
  const auto dev = model_.device();
  const std::int64_t words = b.ctx_offset() + opts_.max_context * Bb;
  b.in = at::zeros({words}, at::TensorOptions().dtype(at::kLong).device(dev));
  b.tokens = b.in.narrow(0, 0, Bb);
  b.positions = b.in.narrow(0, Bb, Bb);
  b.slot_mapping = b.in.narrow(0, 2 * Bb, Bb);
  b.lens = b.in.narrow(0, 3 * Bb, Bb);
  if (b.max_tiles > 0)
    b.tiles = b.in.narrow(0, 4 * Bb, b.max_tiles * kTileWords).view(at::kInt).view({b.max_tiles, kTileInts});
  b.slots = b.in.narrow(0, b.ctx_offset(), opts_.max_context * Bb).view({opts_.max_context, Bb}).t();
  // One logits buffer for every bucket, sized for the largest (graphs never run concurrently):
  // [Bb, vocab] per bucket would cost the sum of the buckets' rows, 0.5 GB with Qwen2's vocabulary.
  if (!logits_.defined())
    logits_ = at::empty({opts_.buckets.back(), model_.config().vocab_size},
                        at::TensorOptions().dtype(at::kFloat).device(dev));
  b.logits = logits_.narrow(0, 0, Bb);
  return b;
}

void DecodeGraphs::fill(Bucket& b, const DecodeStep& step, std::int64_t lmax) {
  const std::int64_t B = step.rows(), Bb = b.rows;
  const std::int64_t words = b.ctx_offset() + lmax * Bb;
  b.host.assign(static_cast<std::size_t>(words), 0);
  std::int64_t* h = b.host.data();
  const std::int64_t scratch = opts_.scratch_slot;
  for (std::int64_t i = 0; i < Bb; ++i) {
    const bool real = i < B;
    const auto k = static_cast<std::size_t>(i);
    h[i] = real ? step.tokens[k] : 0;
    h[Bb + i] = real ? step.positions[k] : 0;
    h[2 * Bb + i] = real ? step.slot_mapping[k] : scratch;
    h[3 * Bb + i] = real ? step.lens[k] : 1;
  }
  std::int64_t* ctx = h + b.ctx_offset();
  std::size_t off = 0;
  for (std::int64_t i = 0; i < B; ++i) {
    const auto L = step.lens[static_cast<std::size_t>(i)];
    for (std::int64_t p = 0; p < L; ++p) ctx[p * Bb + i] = step.context[off + static_cast<std::size_t>(p)];
    off += static_cast<std::size_t>(L);
  }
  for (std::int64_t i = B; i < Bb; ++i) ctx[i] = scratch;
  if (b.max_tiles > 0) {
    // Part p of the graph's LoRA batch is slot p's copy; rows of an empty slot use the base model.
    std::vector<std::vector<std::int64_t>> rows_of_part(copies_.size());
    for (std::int64_t i = 0; i < B && !step.adapter_slot.empty(); ++i) {
      const int s = step.adapter_slot[static_cast<std::size_t>(i)];
      if (s >= 0 && adapters_[static_cast<std::size_t>(s)]) rows_of_part[static_cast<std::size_t>(s)].push_back(i);
    }
    auto t = padded_lora_tiles(rows_of_part, cuda::kLoraKernelTileRows, b.max_tiles);
    std::memcpy(h + 4 * Bb, t.data(), t.size() * sizeof(int));
  }
  b.in.narrow(0, 0, words).copy_(at::from_blob(h, {words}, at::TensorOptions().dtype(at::kLong)));
}

// One step of the bucket on its static buffers. step == nullptr: the graph's body (every shape
// fixed by the bucket, the whole context table); else eager, with the step's own pasts and the
// table cut at its longest context.
void DecodeGraphs::forward_into(Bucket& b, std::int64_t lmax_eager, const DecodeStep* step) {
  at::NoGradGuard no_grad;
  const std::int64_t Bb = b.rows;
  Batch batch;
  batch.tokens = b.tokens;
  batch.positions = b.positions;
  for (std::int64_t i = 0; i < Bb; ++i) {
    const std::int64_t past = step && i < step->rows() ? step->lens[static_cast<std::size_t>(i)] - 1 : 0;
    batch.segs.push_back({i, 1, past});
  }
  AttnMeta meta;
  meta.slot_mapping = b.slot_mapping;
  meta.decode_lens = b.lens;
  // Slot s's copy, or none for an empty slot (eager); the graph's batch has every copy as a part.
  std::vector<const LoraAdapter*> by_slot;
  for (std::size_t s = 0; s < adapters_.size(); ++s) by_slot.push_back(adapters_[s] ? &copies_[s] : nullptr);
  LoraBatch lora;
  if (step == nullptr) {
    meta.decode_slots = b.slots.contiguous();  // once per step, not once per layer
    if (b.max_tiles > 0) {
      std::vector<const LoraAdapter*> parts;
      for (const auto& c : copies_) parts.push_back(&c);
      lora = LoraBatch::with_tiles(parts, b.tiles, Bb);
    }
  } else {
    meta.decode_slots = b.slots.narrow(1, 0, lmax_eager).contiguous();
    std::vector<float> bias(static_cast<std::size_t>(Bb * lmax_eager), -std::numeric_limits<float>::infinity());
    for (std::int64_t i = 0; i < Bb; ++i) {
      const std::int64_t L = i < step->rows() ? step->lens[static_cast<std::size_t>(i)] : 1;
      std::fill_n(bias.begin() + i * lmax_eager, L, 0.f);
    }
    meta.decode_bias = at::from_blob(bias.data(), {Bb, lmax_eager}, at::TensorOptions().dtype(at::kFloat))
                           .to(model_.device(), /*non_blocking=*/false, /*copy=*/true);
    if (!step->adapter_slot.empty() && !by_slot.empty()) {
      std::vector<int> row_slot(step->adapter_slot);
      row_slot.resize(static_cast<std::size_t>(Bb), -1);
      lora = LoraBatch::from_row_slots(by_slot, row_slot, model_.device());
    }
  }
  auto logits = model_.logits(model_.forward(batch, lora.empty() ? nullptr : &lora, &pool_, &meta));
  b.logits.copy_(logits);
}

at::Tensor DecodeGraphs::run(const DecodeStep& step, const AdapterSet& adapters) {
  const std::int64_t B = step.rows();
  const auto n = static_cast<std::size_t>(B);
  if (step.positions.size() != n || step.slot_mapping.size() != n || step.lens.size() != n ||
      (!step.adapter_slot.empty() && step.adapter_slot.size() != n))
    throw_invalid("decode step: {} tokens but {} positions, {} slots, {} lengths and {} adapter slots", B,
                  step.positions.size(), step.slot_mapping.size(), step.lens.size(), step.adapter_slot.size());
  std::int64_t total = 0, lmax = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (step.lens[i] < 1) throw_invalid("decode step: row {} has context length {} (at least its new token)", i, step.lens[i]);
    total += step.lens[i];
    lmax = std::max(lmax, step.lens[i]);
  }
  if (static_cast<std::int64_t>(step.context.size()) != total)
    throw_invalid("decode step: {} context slots for lengths summing to {}", step.context.size(), total);
  for (int s : step.adapter_slot)
    if (s >= static_cast<int>(adapters.size())) throw_invalid("decode step: adapter slot {} of {}", s, adapters.size());
  if (!fits(B, lmax, adapters))
    throw_invalid("decode step of {} rows with contexts up to {} does not fit the decode graphs (buckets up to {}, "
                  "contexts up to {}, at most {} adapter slots of rank <= {})",
                  B, lmax, opts_.buckets.back(), opts_.max_context, copies_.size(), opts_.lora_rank);
  Bucket& b = bucket(bucket_for(B));
  fill(b, step, lmax);
  if (capture_) {
    if (b.graph) {
      cuda::replay_graph(*b.graph);
      ++stats_.replays;
      return b.logits.narrow(0, 0, B);
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      // The warm-up run inside capture_graph computes this step; the capture only records.
      b.graph = cuda::capture_graph([&] { forward_into(b, 0, nullptr); }, model_.device(), first_graph_.get());
      if (!first_graph_) first_graph_ = b.graph;
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++stats_.captures;
      stats_.capture_seconds += secs;
      LS_LOG_INFO("model", "captured the decode graph of {} rows in {:.1f} ms", b.rows, 1e3 * secs);
      return b.logits.narrow(0, 0, B);
    } catch (const std::exception& e) {
      // The static buffers still hold this step: it runs eagerly below, as every later one.
      LS_LOG_WARN("model", "capturing the decode graph of {} rows failed ({}): decode steps run eagerly from now on",
                  b.rows, e.what());
      capture_ = false;
      for (auto& kv : buckets_) kv.second->graph.reset();
      first_graph_.reset();
    }
  }
  forward_into(b, lmax, &step);
  ++stats_.eager;
  return b.logits.narrow(0, 0, B);
}

}  // namespace lorasync::model

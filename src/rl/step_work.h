// rl/step_work.h: one GRPO step as data, so that N data-parallel ranks compute it together
// (docs/trainer.md "Data-parallel ranks"). Rank 0 assembles the step (StepWork: every sample's tokens, behaviour
// logprobs, advantage and version, the global loss denominator, the learning rate and loss scale),
// assigns each sample to a rank balancing FLOPs (the ΣL and ΣL² terms of trainer.md §6), and sends
// the work through the store; each rank packs its own samples into rows, runs the recompute/KL
// passes and the gradient pass on them (compute_share), the gradients are summed across ranks,
// and every rank takes the same clipped AdamW step (apply_gradients). With one rank this is
// exactly the single-process step.
//
// Messages between ranks are safetensors images (a format with a validating reader) with
// metadata "lorasync_dp" = kDpFormat and "kind" = config | init | step | stop | abort.
// Thread-safety: pure functions, or the trainer thread's model, adapter and optimizer.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/model/lora.h"
#include "core/model/decoder_model.h"
#include "rl/config.h"
#include "rl/dist.h"
#include "rl/grpo_loss.h"
#include "rl/optimizer.h"
#include "rl/packing.h"

namespace lorasync::rl {

inline constexpr const char* kDpFormat = "1";

struct StepSample {
  std::vector<std::int64_t> prompt, completion;
  std::vector<float> behaviour;  // one per completion token
  // Per completion token: 1 = trained (the model sampled it), 0 = context only (an environment's
  // turn in an episode: no loss, not in the denominator). Empty: every token is trained.
  std::vector<std::uint8_t> mask;
  // Per completion token: the version that sampled it (the recompute pass's old policy for that
  // token). Empty: `version` for all.
  std::vector<std::int64_t> versions;
  float advantage = 0;
  std::int64_t version = 0;      // the adapter version that generated it (recompute)
  bool trainable(std::size_t i) const { return mask.empty() || mask[i] != 0; }
  std::int64_t version_of(std::size_t i) const { return versions.empty() ? version : versions[i]; }
  std::int64_t trained_tokens() const;
  std::int64_t group = 0, member = 0;  // packing's deterministic tie-break
};

struct StepWork {
  std::string kind = "step";  // step | stop | abort
  std::int64_t step = 0;      // the trainer's step number (messages and the fault hook)
  double temperature = 1, denom = 1, lr = 0, loss_scale = 1;
  std::vector<StepSample> samples;
  std::vector<int> owner;  // rank of each sample
  // Snapshots (CPU fp32, LoraAdapter::parameters() order) the other ranks do not hold yet, and
  // the versions they keep after this step (everything else is dropped).
  std::map<std::int64_t, std::vector<at::Tensor>> versions;
  std::vector<std::int64_t> keep_versions;
  std::string message;  // abort: why; stop: the exit code
};

// The kind of any message (validated as a message first).
std::string message_kind(const std::string& bytes, const std::string& label);
// The first message: rank 0's resolved configuration (TOML), before any model is loaded.
std::string encode_config(const std::string& config_toml);
std::string decode_config(const std::string& bytes, const std::string& label);

std::string encode_step_work(const StepWork& w);
StepWork decode_step_work(const std::string& bytes, const std::string& label);

// The start of a run, for the other ranks: the resolved configuration, the adapter's
// configuration, its tensors and the optimizer's state (resume included).
struct InitState {
  std::string config_toml, lora_config_json;
  std::vector<at::Tensor> params, exp_avg, exp_avg_sq;  // CPU fp32
  std::int64_t optimizer_steps = 0;
};
std::string encode_init(const InitState& s);
InitState decode_init(const std::string& bytes, const std::string& label);

// A sample's forward+backward FLOPs (trainer.md §6): 4 P L + 6 n_layers d_attn L^2, plus the LM
// head over its completion, 4 d V C.
double sample_flops(const StepSample& s, const model::ModelConfig& cfg);

// Samples to ranks: longest-processing-time first by the FLOPs of trainer.md §6 (ties: lower
// rank), deterministic. Every rank gets at least one sample when there are as many as ranks.
std::vector<int> assign_ranks(const std::vector<StepSample>& samples, int world, const model::ModelConfig& cfg);
std::vector<std::size_t> samples_of(const std::vector<int>& owner, int rank);
// The rows a rank packs its samples into (packing.h over `mine`, in order).
PackPlan plan_share(const std::vector<StepSample>& samples, const std::vector<std::size_t>& mine, std::int64_t row_tokens);

LossConfig loss_config_of(const TrainConfig& cfg);

// The device a rank trains on: model.device, as cuda:local_rank for a data-parallel CUDA rank
// (local_rank >= 0); on CPU it also sets the compute threads (model.threads, 0 = all cores) and
// installs the block cache that reuses activations row to row.
c10::Device prepare_training_device(const TrainConfig& cfg, int local_rank);

// Refuses (Error InvalidInput) a row that cannot fit in what `device` has left after the model:
// model::training_row_bytes of batching.row_tokens against model::available_memory_bytes, with
// the row length that fits and, without checkpointing, what checkpointing would need. `where`
// names the process ("rank 1") in the message.
void check_row_fits(const TrainConfig& cfg, const model::ModelConfig& mc, c10::ScalarType dtype, c10::Device device,
                    const std::string& where);

struct StepContext {
  const model::DecoderModel& model;
  model::LoraAdapter& adapter;                                   // gets gradients
  const std::map<std::int64_t, model::LoraAdapter>& versions;   // snapshots for recompute
  LossConfig loss;
  const TrainConfig::Batching& batching;
  c10::Device device;
};

// One rank's part of a step (its sums over the global denominator; merged across ranks).
struct ShareResult {
  LossStats stats;
  double loss = 0, entropy_sum = 0;
  double fwd_s = 0, recompute_s = 0, fwd_bwd_s = 0;
  std::int64_t rows = 0;
  std::vector<double> to_values() const;
  // Sums of sums, extremes of extremes, the slowest rank's times; imbalance = slowest / mean.
  static ShareResult merge(const std::vector<std::vector<double>>& per_rank, double* imbalance);
};
ShareResult compute_share(const StepContext& ctx, const StepWork& w, const std::vector<std::size_t>& mine);

// Gradients as one flat fp32 buffer (zeros for a parameter without one) and back.
at::Tensor flatten_grads(const std::vector<at::Tensor>& params);
void unflatten_grads(const std::vector<at::Tensor>& params, const at::Tensor& flat);

// Every rank after its share, success or not: one all-reduce of [gradients, one flag per
// parameter that has a gradient, this rank failed], then one all-gather of the statistics. With
// no failure the parameters hold the summed gradients (a parameter no rank touched keeps none,
// as in one process) and `merged` the step's statistics; otherwise `failed` lists the ranks
// whose share failed and the gradients are dropped, so every rank leaves the collectives
// together and no rank steps. A failed rank's error goes to the store first (`err/<rank>`).
struct Reduced {
  ShareResult merged;
  double imbalance = 1;
  std::vector<int> failed;
};
Reduced reduce_step(DistGroup& dist, const std::vector<at::Tensor>& params, const ShareResult& mine, bool failed);

// Test hook (docs/trainer.md, "Data-parallel ranks"): LORASYNC_FAULT_STEP="RANK:STEP" makes that
// rank's share of that step throw, to exercise the failure paths of a real run.
void maybe_inject_fault(int rank, std::int64_t step);

// Unscale (fp16 loss scale), clip to max_norm, and step when the norm is finite; zeroes the grads.
struct GradStep {
  double grad_norm = 0;
  bool finite = true;
};
GradStep apply_gradients(AdamW& opt, const std::vector<at::Tensor>& params, double loss_scale, double max_norm, double lr);

}  // namespace lorasync::rl

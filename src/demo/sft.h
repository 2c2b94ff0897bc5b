// demo/sft.h: supervised fine-tuning of every weight of a (tiny) Qwen2 model on prompt/completion
// pairs, the step that gives the demo's base model its partial skill.
//
// Loss: -mean log p(completion token | prefix) over every completion token of the batch (token
// mean), computed by model::packed_logprobs on one packed flat batch per step (segments never
// attend to each other; the LM head runs only at completion positions). The base weights are made
// differentiable in place: named_weights() shares storage with the model, so requires_grad on
// those handles is enough; they are switched back off when training ends.
// Optimiser: AdamW (rl::AdamW; decay on matrices only), linear warm-up then cosine decay to
// min_lr_ratio * lr, global gradient-norm clipping. Batches are drawn by a seeded shuffle, so
// a run is deterministic for a fixed seed and thread count.
// Thread-safety: train_sft mutates the model; nothing else may use it meanwhile.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/decoder_model.h"

namespace lorasync::demo {

struct SftExample {
  std::vector<std::int64_t> prompt;      // chat prompt ids (at least one)
  std::vector<std::int64_t> completion;  // target ids, ending with the eos id
};

// Defaults are the demo's, tuned on 2 CPU cores for its ~0.4M-parameter model (make-demo-model):
// 1200 steps of 32 sequences take about 100 s; lr 2.5e-3 and above learned markedly slower.
struct SftOptions {
  std::int64_t steps = 1200;         // optimiser steps
  std::int64_t batch_size = 32;      // sequences per step (one packed forward)
  double lr = 1.5e-3;                // peak learning rate
  double min_lr_ratio = 0.1;         // cosine floor, as a fraction of lr
  std::int64_t warmup_steps = 30;    // linear warm-up from lr / warmup_steps
  double weight_decay = 0.01;        // decoupled decay of the weight matrices (not norms, biases)
  double beta2 = 0.99;               // AdamW second-moment decay
  double grad_clip = 1.0;            // global L2 norm cap (0 = off)
  std::uint64_t seed = 1;            // batch order
  std::int64_t logits_chunk = 4096;  // LM-head rows per chunk
};

struct SftProgress {
  std::int64_t step = 0;  // 1-based
  double loss = 0;        // this step's token-mean loss
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double seconds = 0;    // since the start
};

struct SftResult {
  double first_loss = 0;      // loss of step 1
  double final_loss = 0;      // mean loss of the last min(10, steps) steps
  std::int64_t n_tokens = 0;  // completion tokens trained on
  double seconds = 0;
};

// InvalidInput for an empty data set or non-positive steps/batch size.
SftResult train_sft(model::DecoderModel& model, const std::vector<SftExample>& data,
                    const SftOptions& options,
                    const std::function<void(const SftProgress&)>& on_step = {});

// Token-mean loss of `data` under the model, without gradients (batches of batch_size).
double sft_loss(const model::DecoderModel& model, const std::vector<SftExample>& data,
                std::int64_t batch_size = 64);

}  // namespace lorasync::demo

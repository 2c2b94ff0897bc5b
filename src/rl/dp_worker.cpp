// rl/dp_worker.cpp: a data-parallel rank other than 0 (docs/trainer.md "Data-parallel ranks"). It has no pipeline, queue,
// server connection or output directory: it loads the model named by rank 0's configuration,
// takes rank 0's adapter and optimizer state, then for every step computes its share of the
// rows, joins the gradient all-reduce and takes the same optimizer step. Stop signals are left to
// rank 0 (which checkpoints and then says stop); a second signal exits at once (cmd_train.cpp).
#include "rl/trainer_impl.h"

#include <fmt/ranges.h>

namespace lorasync::rl::detail {

namespace {

// Copies rank 0's tensors into the adapter's, checking the count and every shape.
void copy_into(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, const std::string& what) {
  if (dst.size() != src.size()) throw_invalid("{}: {} tensors sent, the adapter has {}", what, src.size(), dst.size());
  torch::NoGradGuard ng;
  for (std::size_t i = 0; i < dst.size(); ++i) {
    if (dst[i].sizes() != src[i].sizes())
      throw_invalid("{}: tensor {} has shape {}, the adapter's is {}", what, i, fmt::format("{}", fmt::join(src[i].sizes(), "x")),
                    fmt::format("{}", fmt::join(dst[i].sizes(), "x")));
    dst[i].detach().copy_(src[i]);
  }
}

}  // namespace

int run_dp_worker(const TrainArgs& /*args: rank 0 resolves the configuration*/, const DistEnv& env) {
  configure_process();
  const std::string me = "rank " + std::to_string(env.rank);
  std::unique_ptr<DistGroup> dist;
  std::int64_t seq = 0;
  auto next = [&] {
    const std::string key = "msg/" + std::to_string(seq++);
    auto bytes = dist->get_wait(key, 0, nullptr);
    LS_CHECK(bytes.has_value(), "no message without a deadline");
    return std::move(*bytes);
  };
  // stop/abort from rank 0: confirmed (rank 0 hosts the store and waits for it), then the exit code.
  auto finish = [&](const std::string& kind, const std::string& message) {
    try {
      dist->set("bye/" + std::to_string(env.rank), "");
    } catch (const std::exception&) {
    }
    if (kind == "stop") return 0;
    std::fprintf(stderr, "lorasync train: %s: rank 0 stopped the run: %s\n", me.c_str(), message.c_str());
    return 1;
  };
  try {
    dist = DistGroup::connect(env, DistOptions::from_environment());
    std::string msg = next();
    if (auto k = message_kind(msg, me + " msg/0"); k != "config") {
      StepWork w = decode_step_work(msg, me + " msg/0");
      return finish(w.kind, w.message);
    }
    const TrainConfig cfg = TrainConfig::parse(decode_config(msg, me + " msg/0"), "rank 0's configuration");
    const c10::Device device = prepare_training_device(cfg, env.local_rank);
    dist->use_device(device);
    const auto dtype = model::parse_dtype(cfg.model.dtype, device, "model.dtype");
    auto model = model::DecoderModel::load(cfg.model.path, dtype, device);
    check_row_fits(cfg, model->config(), model->dtype(), device, me);  // its own device's memory
    LS_LOG_INFO("trainer", "{}: model {} loaded ({}, {})", me, cfg.model.path, model::dtype_name(dtype), device.str());

    msg = next();
    if (auto k = message_kind(msg, me + " msg/1"); k != "init") {
      StepWork w = decode_step_work(msg, me + " msg/1");
      return finish(w.kind, w.message);
    }
    InitState init = decode_init(msg, me + " msg/1");
    const auto lc = model::LoraConfig::from_peft_json(init.lora_config_json, "rank 0's adapter configuration");
    model::LoraAdapter adapter = model::LoraAdapter::init(lc, model->config(), 0, device);
    copy_into(adapter.parameters(), init.params, "rank 0's adapter");
    adapter.set_requires_grad(true);
    AdamWConfig ac{cfg.optimizer.betas[0], cfg.optimizer.betas[1], cfg.optimizer.eps, cfg.optimizer.weight_decay};
    AdamW opt(adapter.parameters(), ac);
    {
      std::vector<at::Tensor> m, v;
      for (std::size_t i = 0; i < init.exp_avg.size(); ++i) {
        m.push_back(init.exp_avg[i].to(device));
        v.push_back(init.exp_avg_sq[i].to(device));
      }
      opt.load_state(m, v, init.optimizer_steps);
    }
    const LossConfig loss = loss_config_of(cfg);
    std::map<std::int64_t, model::LoraAdapter> versions;
    for (;;) {
      const std::string label = me + " msg/" + std::to_string(seq);
      StepWork w = decode_step_work(next(), label);
      if (w.kind != "step") return finish(w.kind, w.message);
      for (int o : w.owner)
        if (o < 0 || o >= env.world) throw_invalid("{}: a sample for rank {} in a group of {}", label, o, env.world);
      for (auto& [ver, ts] : w.versions) {
        model::LoraAdapter snap = adapter.clone();
        copy_into(snap.parameters(), ts, label + " version " + std::to_string(ver));
        versions[ver] = std::move(snap);
      }
      const std::set<std::int64_t> keep(w.keep_versions.begin(), w.keep_versions.end());
      std::erase_if(versions, [&](const auto& kv) { return !keep.count(kv.first); });
      StepContext ctx{*model, adapter, versions, loss, cfg.batching, device};
      ShareResult share;
      bool failed = false;
      try {
        maybe_inject_fault(env.rank, w.step);
        share = compute_share(ctx, w, samples_of(w.owner, env.rank));
      } catch (const std::exception& e) {
        // Rank 0 learns why through the store, and every rank leaves the collectives together.
        failed = true;
        std::fprintf(stderr, "lorasync train: %s: step %lld failed: %s\n", me.c_str(), static_cast<long long>(w.step), e.what());
        dist->set("err/" + std::to_string(env.rank), e.what());
      }
      auto params = adapter.parameters();
      const Reduced red = reduce_step(*dist, params, share, failed);
      if (!red.failed.empty()) {
        opt.zero_grad();
        continue;  // no rank steps; rank 0 ends the run (its next message is an abort)
      }
      apply_gradients(opt, params, w.loss_scale, cfg.optimizer.max_grad_norm, w.lr);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorasync train: %s: error: %s\n", me.c_str(), e.what());
    return 1;
  }
}

}  // namespace lorasync::rl::detail

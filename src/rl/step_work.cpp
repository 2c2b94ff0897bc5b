// rl/step_work.cpp: see step_work.h.
#include "rl/step_work.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <deque>
#include <numeric>
#include <set>
#include <thread>

#include "core/io/safetensors.h"
#include "core/model/perf.h"
#include "core/model/runtime.h"
#include "rl/packed_forward.h"
#include "util/error.h"

namespace lorasync::rl {

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Builds a message: tensors whose bytes live in `store_` until bytes() is called.
class Writer {
 public:
  template <class T>
  void put(const std::string& name, io::DType dt, const std::vector<T>& v, std::vector<std::int64_t> shape = {}) {
    auto& b = store_.emplace_back(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
    if (shape.empty()) shape = {static_cast<std::int64_t>(v.size())};
    tensors_.push_back({name, dt, std::move(shape), {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()}});
  }
  void put_tensor(const std::string& name, const at::Tensor& t) {
    auto c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    auto& b = store_.emplace_back(reinterpret_cast<const char*>(c.data_ptr<float>()), static_cast<std::size_t>(c.numel()) * 4);
    tensors_.push_back({name, io::DType::kF32, c.sizes().vec(), {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()}});
  }
  std::string bytes(std::map<std::string, std::string> meta) {
    meta["lorasync_dp"] = kDpFormat;
    return io::safetensors_bytes(tensors_, meta);
  }

 private:
  std::deque<std::string> store_;
  std::vector<io::TensorToWrite> tensors_;
};

// Reads a message, validating the format version, dtypes and ranks.
class Reader {
 public:
  Reader(const std::string& bytes, const std::string& label, const std::string& want_kind = "")
      : file_(io::SafetensorsFile::from_bytes({reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, label)),
        label_(label) {
    const auto& m = file_->metadata();
    auto f = m.find("lorasync_dp");
    if (f == m.end() || f->second != kDpFormat)
      throw_invalid("{}: not a data-parallel message of format {} (the ranks run different lorasync versions?)", label, kDpFormat);
    kind_ = meta("kind");
    if (!want_kind.empty() && kind_ != want_kind) throw_invalid("{}: expected a '{}' message, got '{}'", label, want_kind, kind_);
  }
  const std::string& kind() const { return kind_; }
  std::string meta(const std::string& k) const {
    auto f = file_->metadata().find(k);
    if (f == file_->metadata().end()) throw_invalid("{}: no '{}' in the message", label_, k);
    return f->second;
  }
  bool has(const std::string& name) const { return file_->find(name) != nullptr; }
  template <class T>
  std::vector<T> get(const std::string& name, io::DType dt) const {
    const auto& t = file_->get(name);
    if (t.dtype != dt || t.nbytes % sizeof(T) != 0)
      throw_invalid("{}: tensor '{}' has dtype {}, expected {}", label_, name, io::dtype_name(t.dtype), io::dtype_name(dt));
    std::vector<T> v(t.nbytes / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  }
  at::Tensor tensor(const std::string& name) const {
    const auto& t = file_->get(name);
    if (t.dtype != io::DType::kF32) throw_invalid("{}: tensor '{}' is not F32", label_, name);
    auto out = torch::empty(t.shape, torch::kFloat32);
    if (t.nbytes) std::memcpy(out.data_ptr<float>(), t.data, t.nbytes);
    return out;
  }
  const std::string& label() const { return label_; }

 private:
  std::unique_ptr<io::SafetensorsFile> file_;
  std::string label_, kind_;
};

std::string index_name(const std::string& prefix, std::size_t i) { return fmt::format("{}.{:05d}", prefix, i); }
std::string version_name(std::int64_t v, std::size_t i) { return fmt::format("v{}.{:05d}", v, i); }

// Splits `flat` (concatenated token ids) into n parts of the given lengths, checked.
std::vector<std::vector<std::int64_t>> split(const std::vector<std::int64_t>& flat, const std::vector<std::int64_t>& lens,
                                             const std::string& what, const std::string& label) {
  std::vector<std::vector<std::int64_t>> out;
  std::size_t at = 0;
  for (auto n : lens) {
    if (n < 0 || at + static_cast<std::size_t>(n) > flat.size()) throw_invalid("{}: {} lengths exceed the ids sent", label, what);
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at), flat.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(n)));
    at += static_cast<std::size_t>(n);
  }
  if (at != flat.size()) throw_invalid("{}: {} lengths do not cover the ids sent", label, what);
  return out;
}

}  // namespace

std::int64_t StepSample::trained_tokens() const {
  if (mask.empty()) return static_cast<std::int64_t>(completion.size());
  return std::count_if(mask.begin(), mask.end(), [](std::uint8_t m) { return m != 0; });
}

std::string message_kind(const std::string& bytes, const std::string& label) { return Reader(bytes, label).kind(); }

std::string encode_config(const std::string& config_toml) { return Writer().bytes({{"kind", "config"}, {"config_toml", config_toml}}); }

std::string decode_config(const std::string& bytes, const std::string& label) { return Reader(bytes, label, "config").meta("config_toml"); }

std::string encode_step_work(const StepWork& w) {
  Writer out;
  std::vector<std::int64_t> prompt_ids, prompt_len, comp_ids, comp_len, version, group, member, owner(w.owner.begin(), w.owner.end());
  std::vector<float> behaviour, advantage;
  for (const auto& s : w.samples) {
    prompt_ids.insert(prompt_ids.end(), s.prompt.begin(), s.prompt.end());
    comp_ids.insert(comp_ids.end(), s.completion.begin(), s.completion.end());
    behaviour.insert(behaviour.end(), s.behaviour.begin(), s.behaviour.end());
    prompt_len.push_back(static_cast<std::int64_t>(s.prompt.size()));
    comp_len.push_back(static_cast<std::int64_t>(s.completion.size()));
    advantage.push_back(s.advantage);
    version.push_back(s.version), group.push_back(s.group), member.push_back(s.member);
  }
  out.put("prompt_ids", io::DType::kI64, prompt_ids);
  out.put("prompt_len", io::DType::kI64, prompt_len);
  out.put("completion_ids", io::DType::kI64, comp_ids);
  out.put("completion_len", io::DType::kI64, comp_len);
  out.put("behaviour", io::DType::kF32, behaviour);
  out.put("advantage", io::DType::kF32, advantage);
  out.put("version", io::DType::kI64, version);
  out.put("group", io::DType::kI64, group);
  out.put("member", io::DType::kI64, member);
  out.put("owner", io::DType::kI64, owner);
  out.put("scalars", io::DType::kF64, std::vector<double>{w.temperature, w.denom, w.lr, w.loss_scale, static_cast<double>(w.step)});
  out.put("keep_versions", io::DType::kI64, w.keep_versions);
  std::vector<std::int64_t> sent;
  for (const auto& [v, ts] : w.versions) {
    sent.push_back(v);
    for (std::size_t i = 0; i < ts.size(); ++i) out.put_tensor(version_name(v, i), ts[i]);
  }
  out.put("sent_versions", io::DType::kI64, sent);
  // Episodes' per-token mask and versions, only when a sample has them.
  const bool per_token = std::any_of(w.samples.begin(), w.samples.end(), [](const StepSample& s) { return !s.mask.empty() || !s.versions.empty(); });
  if (per_token) {
    std::vector<std::int64_t> mask, vers;
    for (const auto& s : w.samples)
      for (std::size_t i = 0; i < s.completion.size(); ++i) mask.push_back(s.trainable(i) ? 1 : 0), vers.push_back(s.version_of(i));
    out.put("token_mask", io::DType::kI64, mask);
    out.put("token_version", io::DType::kI64, vers);
  }
  return out.bytes({{"kind", w.kind}, {"message", w.message}});
}

StepWork decode_step_work(const std::string& bytes, const std::string& label) {
  Reader in(bytes, label);
  StepWork w;
  w.kind = in.kind();
  w.message = in.meta("message");
  if (w.kind != "step") {
    if (w.kind != "stop" && w.kind != "abort") throw_invalid("{}: unknown message kind '{}'", label, w.kind);
    return w;
  }
  const auto plen = in.get<std::int64_t>("prompt_len", io::DType::kI64), clen = in.get<std::int64_t>("completion_len", io::DType::kI64);
  const std::size_t n = plen.size();
  auto prompts = split(in.get<std::int64_t>("prompt_ids", io::DType::kI64), plen, "prompt", label);
  auto comps = split(in.get<std::int64_t>("completion_ids", io::DType::kI64), clen, "completion", label);
  const auto beh = in.get<float>("behaviour", io::DType::kF32), adv = in.get<float>("advantage", io::DType::kF32);
  const auto version = in.get<std::int64_t>("version", io::DType::kI64), group = in.get<std::int64_t>("group", io::DType::kI64),
             member = in.get<std::int64_t>("member", io::DType::kI64), owner = in.get<std::int64_t>("owner", io::DType::kI64);
  const auto sc = in.get<double>("scalars", io::DType::kF64);
  if (clen.size() != n || adv.size() != n || version.size() != n || group.size() != n || member.size() != n ||
      owner.size() != n || sc.size() != 5)
    throw_invalid("{}: per-sample arrays of different lengths", label);
  std::size_t at = 0;
  for (std::size_t i = 0; i < n; ++i) {
    StepSample s;
    s.prompt = std::move(prompts[i]);
    s.completion = std::move(comps[i]);
    if (at + s.completion.size() > beh.size()) throw_invalid("{}: fewer behaviour logprobs than completion tokens", label);
    s.behaviour.assign(beh.begin() + static_cast<std::ptrdiff_t>(at), beh.begin() + static_cast<std::ptrdiff_t>(at + s.completion.size()));
    at += s.completion.size();
    s.advantage = adv[i], s.version = version[i], s.group = group[i], s.member = member[i];
    w.samples.push_back(std::move(s));
    w.owner.push_back(static_cast<int>(owner[i]));
  }
  if (at != beh.size()) throw_invalid("{}: more behaviour logprobs than completion tokens", label);
  if (in.has("token_mask") || in.has("token_version")) {
    const auto mask = in.get<std::int64_t>("token_mask", io::DType::kI64), vers = in.get<std::int64_t>("token_version", io::DType::kI64);
    if (mask.size() != at || vers.size() != at) throw_invalid("{}: token_mask / token_version do not hold one entry per completion token", label);
    std::size_t k = 0;
    for (auto& s : w.samples) {
      s.mask.assign(mask.begin() + static_cast<std::ptrdiff_t>(k), mask.begin() + static_cast<std::ptrdiff_t>(k + s.completion.size()));
      s.versions.assign(vers.begin() + static_cast<std::ptrdiff_t>(k), vers.begin() + static_cast<std::ptrdiff_t>(k + s.completion.size()));
      k += s.completion.size();
    }
  }
  w.temperature = sc[0], w.denom = sc[1], w.lr = sc[2], w.loss_scale = sc[3];
  w.step = static_cast<std::int64_t>(sc[4]);
  w.keep_versions = in.get<std::int64_t>("keep_versions", io::DType::kI64);
  for (auto v : in.get<std::int64_t>("sent_versions", io::DType::kI64)) {
    auto& ts = w.versions[v];
    for (std::size_t i = 0; in.has(version_name(v, i)); ++i) ts.push_back(in.tensor(version_name(v, i)));
  }
  return w;
}

std::string encode_init(const InitState& s) {
  Writer out;
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    out.put_tensor(index_name("param", i), s.params[i]);
    out.put_tensor(index_name("exp_avg", i), s.exp_avg[i]);
    out.put_tensor(index_name("exp_avg_sq", i), s.exp_avg_sq[i]);
  }
  return out.bytes({{"kind", "init"}, {"config_toml", s.config_toml}, {"lora_config_json", s.lora_config_json},
                    {"optimizer_steps", std::to_string(s.optimizer_steps)}});
}

InitState decode_init(const std::string& bytes, const std::string& label) {
  Reader in(bytes, label, "init");
  InitState s;
  s.config_toml = in.meta("config_toml");
  s.lora_config_json = in.meta("lora_config_json");
  try {
    s.optimizer_steps = std::stoll(in.meta("optimizer_steps"));
  } catch (const std::exception&) {
    throw_invalid("{}: optimizer_steps is not an integer", label);
  }
  for (std::size_t i = 0; in.has(index_name("param", i)); ++i) {
    s.params.push_back(in.tensor(index_name("param", i)));
    s.exp_avg.push_back(in.tensor(index_name("exp_avg", i)));
    s.exp_avg_sq.push_back(in.tensor(index_name("exp_avg_sq", i)));
  }
  return s;
}

double sample_flops(const StepSample& s, const model::ModelConfig& c) {
  const double P = static_cast<double>(c.num_hidden_layers) *
                   static_cast<double>(c.hidden_size * c.q_dim() * 2 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim +
                                       3 * c.hidden_size * c.intermediate_size);
  const auto L = static_cast<double>(s.prompt.size() + s.completion.size());
  return 4 * P * L + 6.0 * static_cast<double>(c.num_hidden_layers * c.q_dim()) * L * L +
         4.0 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size) * static_cast<double>(s.completion.size());
}

std::vector<int> assign_ranks(const std::vector<StepSample>& samples, int world, const model::ModelConfig& c) {
  std::vector<int> owner(samples.size(), 0);
  if (world <= 1) return owner;
  std::vector<double> cost(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) cost[i] = sample_flops(samples[i], c);
  std::vector<std::size_t> order(samples.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(static_cast<std::size_t>(world), 0.0);
  std::vector<std::size_t> count(static_cast<std::size_t>(world), 0);
  for (std::size_t k = 0; k < order.size(); ++k) {
    // An idle rank first (every rank gets a sample when there are enough), then the least loaded.
    std::size_t best = 0;
    for (std::size_t r = 1; r < load.size(); ++r) {
      const bool idle_r = count[r] == 0, idle_b = count[best] == 0;
      if (idle_r != idle_b ? idle_r : load[r] < load[best]) best = r;
    }
    owner[order[k]] = static_cast<int>(best);
    load[best] += cost[order[k]];
    ++count[best];
  }
  return owner;
}

std::vector<std::size_t> samples_of(const std::vector<int>& owner, int rank) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < owner.size(); ++i)
    if (owner[i] == rank) out.push_back(i);
  return out;
}

PackPlan plan_share(const std::vector<StepSample>& samples, const std::vector<std::size_t>& mine, std::int64_t row_tokens) {
  std::vector<PackItem> pack;
  for (auto i : mine)
    pack.push_back({static_cast<std::int64_t>(samples[i].prompt.size() + samples[i].completion.size()), samples[i].group, samples[i].member});
  PackPlan plan = plan_rows(pack, row_tokens);
  for (auto& row : plan.rows)
    for (auto& k : row) k = mine[k];  // indices into the step's samples
  return plan;
}

LossConfig loss_config_of(const TrainConfig& cfg) {
  LossConfig l;
  l.eps_low = cfg.grpo.epsilon_low;
  l.eps_high = cfg.grpo.epsilon_high;
  l.tis_cap = cfg.grpo.tis_cap;
  l.beta = cfg.grpo.beta;
  l.old_policy = parse_old_policy(cfg.grpo.old_policy);
  return l;
}

c10::Device prepare_training_device(const TrainConfig& cfg, int local_rank) {
  c10::Device device = model::parse_device(cfg.model.device);
  if (local_rank >= 0 && device.is_cuda()) device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  if (device.is_cpu()) {
    model::set_compute_threads(cfg.model.threads > 0 ? static_cast<int>(cfg.model.threads)
                                                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    model::use_cpu_block_cache(model::default_cpu_block_cache_bytes());  // activations reused row to row
  }
  return device;
}

void check_row_fits(const TrainConfig& cfg, const model::ModelConfig& mc, c10::ScalarType dtype, c10::Device device,
                    const std::string& where) {
  const auto& b = cfg.batching;
  const std::int64_t avail = model::available_memory_bytes(device);
  const std::int64_t need = model::training_row_bytes(mc, dtype, b.row_tokens, b.logits_chunk, b.activation_checkpointing);
  if (avail < 0 || need <= avail) return;
  const std::int64_t fixed = model::training_row_bytes(mc, dtype, 0, b.logits_chunk, b.activation_checkpointing);
  const double per_token = static_cast<double>(need - fixed) / static_cast<double>(b.row_tokens);
  const std::int64_t fits = avail > fixed ? static_cast<std::int64_t>(static_cast<double>(avail - fixed) / per_token) / 256 * 256 : 0;
  constexpr double GiB = 1024.0 * 1024 * 1024;
  std::string fix = fits >= cfg.generation.context_len
                        ? fmt::format("lower batching.row_tokens to {} or less", fits)
                        : fmt::format("lower generation.context_len and batching.row_tokens to {} or less", fits);
  if (!b.activation_checkpointing) {
    const std::int64_t ck = model::training_row_bytes(mc, dtype, b.row_tokens, b.logits_chunk, true);
    fix += fmt::format(", or set batching.activation_checkpointing = true (about {:.1f} GiB per row{})", static_cast<double>(ck) / GiB,
                       ck <= avail ? ", which fits" : "");
  }
  throw_invalid("{}batching.row_tokens = {} needs about {:.1f} GiB for one row's activations ({}, activation_checkpointing = {}) "
                "but {:.1f} GiB are available on {}: {}",
                where.empty() ? "" : where + ": ", b.row_tokens, static_cast<double>(need) / GiB, model::dtype_name(dtype),
                b.activation_checkpointing ? "true" : "false", static_cast<double>(avail) / GiB, device.str(), fix);
}

ShareResult compute_share(const StepContext& ctx, const StepWork& w, const std::vector<std::size_t>& mine) {
  ShareResult res;
  const auto& b = ctx.batching;
  const double temp = w.temperature;
  const PackPlan plan = plan_share(w.samples, mine, b.row_tokens);
  res.rows = static_cast<std::int64_t>(plan.rows.size());
  const std::size_t n = w.samples.size();
  auto item = [&](std::size_t i) { return PackedSample{w.samples[i].prompt, w.samples[i].completion}; };
  // Old-policy pass (recompute): the trainer's logprobs under each sample's version, no grad.
  std::vector<at::Tensor> old_lp(n), ref_lp(n);
  const bool recompute = ctx.loss.old_policy == OldPolicy::kRecompute;
  if (recompute || ctx.loss.beta > 0) {
    const double t0 = now_s();
    torch::NoGradGuard ng;
    for (const auto& row : plan.rows) {
      if (recompute) {
        // Each sample under each version that sampled one of its trained tokens (an episode's
        // turns may span versions: each token's old policy is its own turn's version).
        std::map<std::int64_t, std::vector<std::size_t>> by_version;
        for (auto i : row) {
          const auto& smp = w.samples[i];
          std::set<std::int64_t> vs;
          for (std::size_t t = 0; t < smp.completion.size(); ++t)
            if (smp.trainable(t)) vs.insert(smp.version_of(t));
          if (vs.empty()) vs.insert(smp.version);
          for (auto v : vs) by_version[v].push_back(i);
        }
        for (const auto& [v, idx] : by_version) {
          auto it = ctx.versions.find(v);
          if (it == ctx.versions.end())
            throw Error(ErrorKind::kInternal, fmt::format("no snapshot of version {} (in the staleness window) for the recompute pass", v));
          std::vector<PackedSample> sub;
          for (auto i : idx) sub.push_back(item(i));
          auto out = model::packed_logprobs(ctx.model, &it->second, sub, temp, b.logits_chunk);
          for (std::size_t k = 0; k < idx.size(); ++k) {
            const std::size_t i = idx[k];
            at::Tensor part = out.logprobs.slice(0, out.offsets[k], out.offsets[k + 1]);
            const auto& smp = w.samples[i];
            if (smp.versions.empty() || !old_lp[i].defined()) {
              old_lp[i] = part;
              continue;
            }
            std::vector<std::uint8_t> pick(smp.completion.size());
            for (std::size_t t = 0; t < pick.size(); ++t) pick[t] = smp.version_of(t) == v;
            at::Tensor sel = torch::from_blob(pick.data(), {static_cast<std::int64_t>(pick.size())}, torch::kUInt8).to(part.device()).to(torch::kBool);
            old_lp[i] = torch::where(sel, part, old_lp[i]);
          }
        }
      }
      if (ctx.loss.beta > 0) {
        std::vector<PackedSample> sub;
        for (auto i : row) sub.push_back(item(i));
        auto out = model::packed_logprobs(ctx.model, nullptr, sub, temp, b.logits_chunk);
        for (std::size_t k = 0; k < row.size(); ++k) ref_lp[row[k]] = out.logprobs.slice(0, out.offsets[k], out.offsets[k + 1]);
      }
    }
    res.recompute_s = now_s() - t0;
  }
  // Gradient pass, one row at a time; each row adds its partial sum over the global denominator.
  // Per-row figures stay on the device until the end: one host read per step, not per row.
  const auto opts = torch::TensorOptions().device(ctx.device);
  std::vector<at::Tensor> row_stats, row_loss, row_entropy;
  std::vector<std::int64_t> row_tokens;
  const double t_fb = now_s();
  for (const auto& row : plan.rows) {
    std::vector<PackedSample> sub;
    std::vector<float> beh, adv;
    // Episodes: only the model's own tokens enter the loss (their row positions in `keep`).
    bool masked = false;
    for (auto i : row) masked = masked || !w.samples[i].mask.empty();
    std::vector<std::int64_t> keep;
    std::int64_t pos = 0;
    for (auto i : row) {
      const auto& s = w.samples[i];
      sub.push_back(item(i));
      for (std::size_t t = 0; t < s.completion.size(); ++t, ++pos) {
        if (!s.trainable(t)) continue;
        beh.push_back(s.behaviour[t]);
        adv.push_back(s.advantage);
        if (masked) keep.push_back(pos);
      }
    }
    at::Tensor keep_idx;
    if (masked) keep_idx = torch::from_blob(keep.data(), {static_cast<std::int64_t>(keep.size())}, torch::kInt64).to(ctx.device);
    auto select = [&](const at::Tensor& t) { return masked ? t.index_select(0, keep_idx) : t; };
    const double f0 = now_s();
    auto out = packed_row_logprobs(ctx.model, &ctx.adapter, sub, temp, b.logits_chunk, b.activation_checkpointing);
    if (ctx.device.is_cuda()) model::device_synchronize(ctx.device);  // the forward's time, not its launch
    res.fwd_s += now_s() - f0;
    const auto fdt = out.logprobs.scalar_type();
    TokenInputs in;
    in.logp = select(out.logprobs);
    in.behaviour = torch::from_blob(beh.data(), {static_cast<std::int64_t>(beh.size())}, torch::kFloat32).to(opts.dtype(fdt));
    in.advantages = torch::from_blob(adv.data(), {static_cast<std::int64_t>(adv.size())}, torch::kFloat32).to(opts.dtype(fdt));
    if (recompute) {
      std::vector<at::Tensor> parts;
      for (auto i : row) parts.push_back(old_lp[i]);
      in.old = select(torch::cat(parts)).to(fdt);
    }
    if (ctx.loss.beta > 0) {
      std::vector<at::Tensor> parts;
      for (auto i : row) parts.push_back(ref_lp[i]);
      in.ref = select(torch::cat(parts)).to(fdt);
    }
    at::Tensor values;
    at::Tensor L = grpo_token_losses_with_stats(in, ctx.loss, &values);
    if (values.defined()) row_stats.push_back(values), row_tokens.push_back(in.logp.numel());
    at::Tensor loss = L.sum() / w.denom;
    row_loss.push_back(loss.detach().to(torch::kDouble));
    if (out.entropy.defined()) row_entropy.push_back(select(out.entropy).sum().to(torch::kDouble));
    (loss * w.loss_scale).backward();
  }
  if (!row_stats.empty()) {
    auto all = torch::stack(row_stats).to(torch::kCPU);
    for (std::size_t i = 0; i < row_stats.size(); ++i) res.stats.merge(loss_stats_from_values(all[static_cast<std::int64_t>(i)], row_tokens[i]));
  }
  if (!row_loss.empty()) res.loss = torch::stack(row_loss).sum().item<double>();
  if (!row_entropy.empty()) res.entropy_sum = torch::stack(row_entropy).sum().item<double>();
  res.fwd_bwd_s = now_s() - t_fb;
  return res;
}

std::vector<double> ShareResult::to_values() const {
  std::vector<double> v;
  stats.to_values(v);
  for (double x : {loss, entropy_sum, fwd_s, recompute_s, fwd_bwd_s, static_cast<double>(rows)}) v.push_back(x);
  return v;
}

ShareResult ShareResult::merge(const std::vector<std::vector<double>>& per_rank, double* imbalance) {
  ShareResult r;
  double sum_fb = 0;
  for (const auto& v : per_rank) {
    if (v.size() != LossStats::kNumValues + 6) throw_invalid("a rank sent {} step statistics, expected {}", v.size(), LossStats::kNumValues + 6);
    r.stats.merge(LossStats::from_values(v.data()));
    const double* x = v.data() + LossStats::kNumValues;
    r.loss += x[0], r.entropy_sum += x[1];
    r.fwd_s = std::max(r.fwd_s, x[2]), r.recompute_s = std::max(r.recompute_s, x[3]), r.fwd_bwd_s = std::max(r.fwd_bwd_s, x[4]);
    r.rows += static_cast<std::int64_t>(x[5]);
    sum_fb += x[4];
  }
  if (imbalance) *imbalance = sum_fb > 0 ? r.fwd_bwd_s * static_cast<double>(per_rank.size()) / sum_fb : 1.0;
  return r;
}

at::Tensor flatten_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> parts;
  for (const auto& p : params) {
    const auto& g = p.grad();
    parts.push_back(g.defined() ? g.reshape({-1}).to(torch::kFloat32) : torch::zeros({p.numel()}, p.options().dtype(torch::kFloat32)));
  }
  return torch::cat(parts);
}

void unflatten_grads(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  std::int64_t at = 0;
  for (const auto& p : params) {
    auto part = flat.slice(0, at, at + p.numel()).view(p.sizes()).to(p.scalar_type());
    at += p.numel();
    if (p.grad().defined()) p.mutable_grad().copy_(part);
    else p.mutable_grad() = part.clone();
  }
  LS_CHECK(at == flat.numel(), "gradient buffer of the wrong size");
}

Reduced reduce_step(DistGroup& dist, const std::vector<at::Tensor>& params, const ShareResult& mine, bool failed) {
  at::Tensor grads = flatten_grads(params);
  if (failed) grads.zero_();  // a share that failed part way leaves partial gradients
  std::vector<float> flags;
  for (const auto& p : params) flags.push_back(!failed && p.grad().defined() ? 1.0f : 0.0f);
  flags.push_back(failed ? 1.0f : 0.0f);
  at::Tensor flat = torch::cat({grads, torch::tensor(flags, grads.options())});
  dist.allreduce_sum(flat);
  std::vector<double> values = failed ? ShareResult{}.to_values() : mine.to_values();
  values.push_back(failed ? 1.0 : 0.0);
  auto gathered = dist.allgather(values);
  Reduced out;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    if (gathered[r].back() != 0) out.failed.push_back(static_cast<int>(r));
    gathered[r].pop_back();
  }
  if (!out.failed.empty()) return out;
  const auto n = grads.numel();
  unflatten_grads(params, flat.slice(0, 0, n));
  const at::Tensor touched = flat.slice(0, n, n + static_cast<std::int64_t>(params.size())).to(torch::kCPU);
  for (std::size_t i = 0; i < params.size(); ++i)
    if (touched[static_cast<std::int64_t>(i)].item<float>() == 0) params[i].mutable_grad() = at::Tensor();
  out.merged = ShareResult::merge(gathered, &out.imbalance);
  return out;
}

void maybe_inject_fault(int rank, std::int64_t step) {
  const char* v = std::getenv("LORASYNC_FAULT_STEP");
  if (!v || !*v) return;
  if (std::string(v) == fmt::format("{}:{}", rank, step))
    throw Error(ErrorKind::kInternal, fmt::format("injected fault (LORASYNC_FAULT_STEP={}) in rank {}'s share of step {}", v, rank, step));
}

GradStep apply_gradients(AdamW& opt, const std::vector<at::Tensor>& params, double loss_scale, double max_norm, double lr) {
  GradStep s;
  if (loss_scale != 1.0)
    for (const auto& p : params)
      if (p.grad().defined()) p.grad().div_(loss_scale);
  s.grad_norm = clip_grad_norm(params, max_norm);
  s.finite = std::isfinite(s.grad_norm);
  if (s.finite) opt.step(lr);
  opt.zero_grad();
  return s;
}

}  // namespace lorasync::rl

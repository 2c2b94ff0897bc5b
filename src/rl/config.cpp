#include "rl/config.h"

#include <toml++/toml.h>

#include <cctype>
#include <sstream>
#include <variant>

#include "core/tokenizer/unicode.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {

namespace {

using Field = std::variant<std::string*, std::int64_t*, double*, bool*, std::vector<std::string>*,
                           std::vector<std::int64_t>*, std::vector<double>*>;
struct Binding {
  std::string section, key;
  Field field;
};

std::vector<Binding> bindings(TrainConfig& c) {
  return {
      {"", "run_name", &c.run_name}, {"", "output_dir", &c.output_dir}, {"", "seed", &c.seed},
      {"", "max_steps", &c.max_steps},
      {"model", "path", &c.model.path}, {"model", "served_name", &c.model.served_name},
      {"model", "device", &c.model.device}, {"model", "dtype", &c.model.dtype}, {"model", "attention", &c.model.attention},
      {"model", "threads", &c.model.threads},
      {"lora", "rank", &c.lora.rank}, {"lora", "alpha", &c.lora.alpha}, {"lora", "dropout", &c.lora.dropout},
      {"lora", "target_modules", &c.lora.target_modules}, {"lora", "init_adapter", &c.lora.init_adapter},
      {"data", "train_file", &c.data.train_file}, {"data", "problem_key", &c.data.problem_key},
      {"data", "answer_key", &c.data.answer_key}, {"data", "prompt_format", &c.data.prompt_format},
      {"data", "system_prompt", &c.data.system_prompt}, {"data", "max_prompt_tokens", &c.data.max_prompt_tokens},
      {"data", "shuffle", &c.data.shuffle}, {"data", "epochs", &c.data.epochs},
      {"data", "enable_thinking", &c.data.enable_thinking},
      {"generation", "server_url", &c.generation.server_url}, {"generation", "request_mode", &c.generation.request_mode},
      {"generation", "max_new_tokens", &c.generation.max_new_tokens}, {"generation", "context_len", &c.generation.context_len},
      {"generation", "temperature", &c.generation.temperature}, {"generation", "top_p", &c.generation.top_p},
      {"generation", "top_k", &c.generation.top_k}, {"generation", "stop_token_ids", &c.generation.stop_token_ids},
      {"generation", "seed_requests", &c.generation.seed_requests},
      {"generation", "request_timeout_s", &c.generation.request_timeout_s}, {"generation", "server_wait_s", &c.generation.server_wait_s},
      {"grpo", "num_generations", &c.grpo.num_generations}, {"grpo", "reward_funcs", &c.grpo.reward_funcs},
      {"grpo", "reward_weights", &c.grpo.reward_weights}, {"grpo", "reward_timeout_s", &c.grpo.reward_timeout_s},
      {"grpo", "reward_on_timeout", &c.grpo.reward_on_timeout}, {"grpo", "truncated_reward", &c.grpo.truncated_reward},
      {"grpo", "advantage", &c.grpo.advantage}, {"grpo", "loss_agg", &c.grpo.loss_agg},
      {"grpo", "loss_norm_const", &c.grpo.loss_norm_const}, {"grpo", "epsilon_low", &c.grpo.epsilon_low},
      {"grpo", "epsilon_high", &c.grpo.epsilon_high}, {"grpo", "old_policy", &c.grpo.old_policy},
      {"grpo", "tis_cap", &c.grpo.tis_cap}, {"grpo", "beta", &c.grpo.beta},
      {"async", "max_inflight", &c.async.max_inflight}, {"async", "queue_maxsize", &c.async.queue_maxsize},
      {"async", "score_workers", &c.async.score_workers}, {"async", "score_queue_groups", &c.async.score_queue_groups},
      {"async", "max_staleness", &c.async.max_staleness}, {"async", "requeue_dropped", &c.async.requeue_dropped},
      {"async", "max_prompt_attempts", &c.async.max_prompt_attempts}, {"async", "max_retries", &c.async.max_retries},
      {"async", "retry_backoff_s", &c.async.retry_backoff_s}, {"async", "retry_backoff_max_s", &c.async.retry_backoff_max_s},
      {"async", "server_down_s", &c.async.server_down_s}, {"async", "ordered", &c.async.ordered},
      {"batching", "mode", &c.batching.mode}, {"batching", "samples_per_step", &c.batching.samples_per_step},
      {"batching", "step_token_budget", &c.batching.step_token_budget}, {"batching", "row_tokens", &c.batching.row_tokens},
      {"batching", "logits_chunk", &c.batching.logits_chunk},
      {"batching", "activation_checkpointing", &c.batching.activation_checkpointing},
      {"optimizer", "lr", &c.optimizer.lr}, {"optimizer", "betas", &c.optimizer.betas}, {"optimizer", "eps", &c.optimizer.eps},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay}, {"optimizer", "max_grad_norm", &c.optimizer.max_grad_norm},
      {"optimizer", "scheduler", &c.optimizer.scheduler}, {"optimizer", "warmup_steps", &c.optimizer.warmup_steps},
      {"optimizer", "min_lr_ratio", &c.optimizer.min_lr_ratio}, {"optimizer", "loss_scale_init", &c.optimizer.loss_scale_init},
      {"optimizer", "loss_scale_window", &c.optimizer.loss_scale_window},
      {"sync", "weight_sync_steps", &c.sync.weight_sync_steps}, {"sync", "publish_dir", &c.sync.publish_dir},
      {"sync", "server_publish_dir", &c.sync.server_publish_dir}, {"sync", "adapter_prefix", &c.sync.adapter_prefix},
      {"sync", "adapter_retry_interval", &c.sync.adapter_retry_interval},
      {"sync", "adapter_load_deadline", &c.sync.adapter_load_deadline}, {"sync", "blocking", &c.sync.blocking},
      {"sync", "pause_during_load", &c.sync.pause_during_load}, {"sync", "transport", &c.sync.transport},
      {"checkpoint", "save_steps", &c.checkpoint.save_steps}, {"checkpoint", "save_total_limit", &c.checkpoint.save_total_limit},
      {"checkpoint", "save_on_sigterm", &c.checkpoint.save_on_sigterm},
      {"logging", "metrics_file", &c.logging.metrics_file}, {"logging", "group_log", &c.logging.group_log},
      {"logging", "metrics_port", &c.logging.metrics_port}, {"logging", "metrics_bind", &c.logging.metrics_bind},
      {"logging", "log_every", &c.logging.log_every}, {"logging", "peak_tflops", &c.logging.peak_tflops},
      {"env", "command", &c.env.command}, {"env", "workdir", &c.env.workdir}, {"env", "environment", &c.env.environment},
      {"env", "workers", &c.env.workers}, {"env", "timeout_s", &c.env.timeout_s}, {"env", "startup_s", &c.env.startup_s},
      {"env", "cpu_s", &c.env.cpu_s}, {"env", "memory_mb", &c.env.memory_mb}, {"env", "network", &c.env.network},
      {"env", "max_turns", &c.env.max_turns}, {"env", "max_episode_tokens", &c.env.max_episode_tokens},
      {"env", "max_observation_tokens", &c.env.max_observation_tokens},
      {"env", "max_output_bytes", &c.env.max_output_bytes}, {"env", "episode_deadline_s", &c.env.episode_deadline_s},
      {"env", "rows", &c.env.rows},
  };
}

// The keys of one [rewards.NAME] table (section "rewards.NAME").
std::vector<Binding> reward_bindings(const std::string& name, ExternalRewardOptions& o) {
  const std::string sec = "rewards." + name;
  return {{sec, "kind", &o.kind}, {sec, "command", &o.command}, {sec, "workdir", &o.workdir}, {sec, "url", &o.url},
          {sec, "bearer_token_env", &o.bearer_token_env}, {sec, "workers", &o.workers}, {sec, "timeout_s", &o.timeout_s},
          {sec, "startup_s", &o.startup_s},
          {sec, "cpu_s", &o.cpu_s}, {sec, "memory_mb", &o.memory_mb}, {sec, "network", &o.network},
          {sec, "max_output_bytes", &o.max_output_bytes}};
}

bool valid_reward_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-') return false;
  return true;
}

ExternalRewardOptions& reward_entry(TrainConfig& c, const std::string& name, const std::string& where) {
  if (!valid_reward_name(name))
    throw_invalid("{}: reward name \"{}\" must be 1-64 letters, digits, '_' or '-'", where, name);
  auto& o = c.rewards[name];
  o.name = name;
  return o;
}

// Writes one bound value into a TOML table under its key.
void put(toml::table& t, const Binding& b) {
  std::visit(
      [&](auto* f) {
        using T = std::remove_pointer_t<decltype(f)>;
        if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::int64_t> ||
                      std::is_same_v<T, double> || std::is_same_v<T, bool>) {
          t.insert_or_assign(b.key, *f);
        } else {
          toml::array a;
          for (const auto& e : *f) a.push_back(e);
          t.insert_or_assign(b.key, a);
        }
      },
      b.field);
}

std::string full_key(const Binding& b) { return b.section.empty() ? b.key : b.section + "." + b.key; }

void assign(const Binding& b, const toml::node& n, const std::string& where) {
  const std::string key = full_key(b);
  auto fail = [&](const char* want) {
    std::ostringstream os;
    n.visit([&](const auto& v) { os << v; });
    throw_invalid("{}: {} must be {}, got {}", where, key, want, os.str());
  };
  std::visit(
      [&](auto* f) {
        using T = std::remove_pointer_t<decltype(f)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!n.is_string()) fail("a string");
          *f = n.as_string()->get();
        } else if constexpr (std::is_same_v<T, std::int64_t>) {
          if (!n.is_integer()) fail("an integer");
          *f = n.as_integer()->get();
        } else if constexpr (std::is_same_v<T, double>) {
          if (n.is_integer()) *f = static_cast<double>(n.as_integer()->get());
          else if (n.is_floating_point()) *f = n.as_floating_point()->get();
          else fail("a number");
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!n.is_boolean()) fail("true or false");
          *f = n.as_boolean()->get();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          f->clear();
          if (n.is_string()) f->push_back(n.as_string()->get());
          else if (n.is_array()) {
            for (const auto& e : *n.as_array()) {
              if (!e.is_string()) fail("a list of strings");
              f->push_back(e.as_string()->get());
            }
          } else fail("a string or a list of strings");
        } else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
          if (!n.is_array()) fail("a list of integers");
          f->clear();
          for (const auto& e : *n.as_array()) {
            if (!e.is_integer()) fail("a list of integers");
            f->push_back(e.as_integer()->get());
          }
        } else {
          if (!n.is_array()) fail("a list of numbers");
          f->clear();
          for (const auto& e : *n.as_array()) {
            if (e.is_integer()) f->push_back(static_cast<double>(e.as_integer()->get()));
            else if (e.is_floating_point()) f->push_back(e.as_floating_point()->get());
            else fail("a list of numbers");
          }
        }
      },
      b.field);
}

const Binding* find(const std::vector<Binding>& bs, const std::string& section, const std::string& key) {
  for (const auto& b : bs)
    if (b.section == section && b.key == key) return &b;
  return nullptr;
}

void apply_table(TrainConfig& c, const toml::table& root, const std::string& label) {
  auto bs = bindings(c);
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    if (key == "rewards" && v.is_table()) {
      for (const auto& [name, t] : *v.as_table()) {
        const std::string n(name.str());
        if (!t.is_table()) throw_invalid("{}: rewards.{} must be a table ([rewards.{}])", label, n, n);
        auto& o = reward_entry(c, n, label);
        auto rbs = reward_bindings(n, o);
        for (const auto& [k2, v2] : *t.as_table()) {
          const Binding* b = find(rbs, "rewards." + n, std::string(k2.str()));
          if (b == nullptr) throw_invalid("{}: unknown key rewards.{}.{}", label, n, std::string(k2.str()));
          assign(*b, v2, label);
        }
      }
      continue;
    }
    if (v.is_table()) {
      for (const auto& [k2, v2] : *v.as_table()) {
        const Binding* b = find(bs, key, std::string(k2.str()));
        if (b == nullptr) throw_invalid("{}: unknown key {}.{}", label, key, std::string(k2.str()));
        assign(*b, v2, label);
      }
    } else {
      const Binding* b = find(bs, "", key);
      if (b == nullptr) throw_invalid("{}: unknown key {}", label, key);
      assign(*b, v, label);
    }
  }
}

}  // namespace

TrainConfig TrainConfig::parse(const std::string& text, const std::string& label,
                               const std::vector<std::string>& overrides) {
  TrainConfig c;
  try {
    apply_table(c, toml::parse(text, label), label);
  } catch (const toml::parse_error& e) {
    throw_invalid("{}: not valid TOML at line {}: {}", label, e.source().begin.line, e.description());
  }
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    const auto dot = o.find('.');
    if (eq == std::string::npos) throw_invalid("--set {}: expected section.key=value", o);
    if (const auto bad = tok::validate_utf8(o); bad != std::string::npos)
      throw_invalid("--set: the override is not valid UTF-8 (byte {} of \"{}\")", bad,
                    tok::utf8_lossy(o));
    const std::string path = o.substr(0, eq), value = o.substr(eq + 1);
    const std::string section = dot != std::string::npos && dot < eq ? path.substr(0, dot) : "";
    const std::string key = section.empty() ? path : path.substr(dot + 1);
    auto bs = bindings(c);
    std::string lookup_section = section, lookup_key = key;
    if (section == "rewards") {  // rewards.NAME.key
      const auto dot2 = key.find('.');
      if (dot2 == std::string::npos) throw_invalid("--set {}: expected rewards.NAME.key=value", o);
      auto& entry = reward_entry(c, key.substr(0, dot2), "--set " + o);
      bs = reward_bindings(entry.name, entry);
      lookup_section = "rewards." + entry.name;
      lookup_key = key.substr(dot2 + 1);
    }
    const Binding* b = find(bs, lookup_section, lookup_key);
    if (b == nullptr) throw_invalid("--set {}: unknown key {}", o, path);
    toml::table t;
    try {
      t = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      t = toml::table{{"v", value}};  // a bare word: a string
    }
    assign(*b, *t.get("v"), "--set " + o);
  }
  return c;
}

TrainConfig TrainConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  return parse(path.empty() ? std::string() : read_file(path), path.empty() ? "defaults" : path, overrides);
}

void TrainConfig::validate() const {
  const auto& g = grpo;
  if (g.num_generations < 2) throw_invalid("grpo.num_generations must be at least 2, got {}", g.num_generations);
  if (batching.mode == "count" && batching.samples_per_step % g.num_generations != 0)
    throw_invalid("batching.samples_per_step ({}) must be a multiple of grpo.num_generations ({})",
                  batching.samples_per_step, g.num_generations);
  if (batching.mode != "count" && batching.mode != "tokens")
    throw_invalid("batching.mode must be \"count\" or \"tokens\", got \"{}\"", batching.mode);
  if (sync.transport != "auto" && sync.transport != "path" && sync.transport != "push")
    throw_invalid("sync.transport must be \"auto\", \"path\" or \"push\", got \"{}\"", sync.transport);
  if (batching.row_tokens < generation.context_len)
    throw_invalid("batching.row_tokens ({}) must be >= generation.context_len ({})", batching.row_tokens,
                  generation.context_len);
  if (data.max_prompt_tokens >= generation.context_len)
    throw_invalid("data.max_prompt_tokens ({}) must be < generation.context_len ({})", data.max_prompt_tokens,
                  generation.context_len);
  if (g.old_policy == "behaviour" && g.tis_cap > 0)
    throw_invalid("grpo.old_policy = \"behaviour\" needs grpo.tis_cap = 0 (got {}): the TIS weight is identically 1",
                  g.tis_cap);
  if (g.old_policy != "recompute" && g.old_policy != "step_start" && g.old_policy != "behaviour")
    throw_invalid("grpo.old_policy must be recompute, step_start or behaviour; got \"{}\"", g.old_policy);
  if (g.advantage != "dr_grpo" && g.advantage != "grpo")
    throw_invalid("grpo.advantage must be dr_grpo or grpo; got \"{}\"", g.advantage);
  if (g.loss_agg != "seq_sum_const" && g.loss_agg != "token_mean")
    throw_invalid("grpo.loss_agg must be seq_sum_const or token_mean; got \"{}\"", g.loss_agg);
  for (const auto& [name, r] : rewards) {
    if (r.kind != "command" && r.kind != "http")
      throw_invalid("rewards.{}.kind must be \"command\" or \"http\", got \"{}\"", name, r.kind);
    if (r.kind == "command" && r.command.empty())
      throw_invalid("rewards.{}.command must name a program (a list: [\"python3\", \"score.py\"])", name);
    if (r.kind == "http" && r.url.empty()) throw_invalid("rewards.{}.url is required for kind = \"http\"", name);
    if (r.workers < 1) throw_invalid("rewards.{}.workers must be at least 1, got {}", name, r.workers);
    if (!(r.timeout_s > 0)) throw_invalid("rewards.{}.timeout_s must be positive, got {}", name, r.timeout_s);
    if (name == "math_boxed" || name == "format_boxed")
      throw_invalid("rewards.{}: the name of a built-in reward function cannot be redefined", name);
  }
  if (g.reward_weights.size() != g.reward_funcs.size())
    throw_invalid("grpo.reward_weights has {} entries but grpo.reward_funcs has {}", g.reward_weights.size(),
                  g.reward_funcs.size());
  if (generation.top_p != 1.0)
    throw_invalid("generation.top_p must be 1.0 (got {}): truncated sampling biases every ratio", generation.top_p);
  if (generation.top_k != 0)
    throw_invalid("generation.top_k must be 0 (got {}): truncated sampling biases every ratio", generation.top_k);
  if (lora.dropout != 0.0)
    throw_invalid("lora.dropout must be 0 (got {}): it would make trainer logprobs differ from the servers'", lora.dropout);
  if (lora.rank <= 0) throw_invalid("lora.rank must be positive, got {}", lora.rank);
  if (optimizer.betas.size() != 2) throw_invalid("optimizer.betas must hold two numbers");
  if (sync.weight_sync_steps <= 0) throw_invalid("sync.weight_sync_steps must be positive");
  if (async.max_staleness < 0) throw_invalid("async.max_staleness must be >= 0");
  if (generation.request_mode != "group")
    throw_invalid("generation.request_mode = \"{}\" is not supported yet; use \"group\" (one request with n = G)",
                  generation.request_mode);
  if (batching.mode != "count")
    throw_invalid("batching.mode = \"{}\" is not supported yet; use \"count\"", batching.mode);
  if (model.path.empty()) throw_invalid("model.path is required (a local Hugging Face directory)");
  if (data.train_file.empty() && (env.command.empty() || env.rows <= 0))
    throw_invalid("data.train_file is required (JSONL with problem and answer fields), or env.rows with an [env] command "
                  "that makes its own tasks");
  if (env.rows < 0) throw_invalid("env.rows must be >= 0, got {}", env.rows);
  if (max_steps <= 0) throw_invalid("max_steps must be positive, got {}", max_steps);
  if (batching.samples_per_step <= 0) throw_invalid("batching.samples_per_step must be positive");
  if (async.max_inflight < grpo.num_generations)
    throw_invalid("async.max_inflight ({}) must be at least grpo.num_generations ({})", async.max_inflight, grpo.num_generations);
  if (async.queue_maxsize < grpo.num_generations)
    throw_invalid("async.queue_maxsize ({}) must be at least grpo.num_generations ({})", async.queue_maxsize, grpo.num_generations);
  if (checkpoint.save_steps <= 0) throw_invalid("checkpoint.save_steps must be positive");
  if (generation.max_new_tokens <= 0) throw_invalid("generation.max_new_tokens must be positive");
  if (optimizer.scheduler != "constant" && optimizer.scheduler != "cosine")
    throw_invalid("optimizer.scheduler must be \"constant\" or \"cosine\", got \"{}\"", optimizer.scheduler);
  if (generation.temperature <= 0)
    throw_invalid("generation.temperature must be > 0 (got {}): GRPO samples from the policy", generation.temperature);
  if (!env.command.empty()) {
    if (env.command[0].empty()) throw_invalid("env.command must name a program (a list: [\"python3\", \"env.py\"])");
    if (data.prompt_format == "llama3")
      throw_invalid(
          "env.command with data.prompt_format = \"llama3\": episodes render environment turns in ChatML "
          "(Qwen2, Qwen3) so far; Llama 3's header format is not supported in episodes yet");
    if (env.workers < 1) throw_invalid("env.workers must be at least 1, got {}", env.workers);
    if (!(env.timeout_s > 0)) throw_invalid("env.timeout_s must be positive, got {}", env.timeout_s);
    if (!(env.startup_s >= 0)) throw_invalid("env.startup_s must be >= 0, got {}", env.startup_s);
    if (!(env.cpu_s > 0)) throw_invalid("env.cpu_s must be positive, got {}", env.cpu_s);
    if (env.memory_mb < 16) throw_invalid("env.memory_mb must be at least 16, got {}", env.memory_mb);
    if (env.max_turns < 1) throw_invalid("env.max_turns must be at least 1, got {}", env.max_turns);
    if (env.max_episode_tokens < 0) throw_invalid("env.max_episode_tokens must be >= 0 (0 = generation.context_len), got {}", env.max_episode_tokens);
    if (env.max_observation_tokens < 1) throw_invalid("env.max_observation_tokens must be at least 1, got {}", env.max_observation_tokens);
    if (env.max_output_bytes < 64) throw_invalid("env.max_output_bytes must be at least 64, got {}", env.max_output_bytes);
    if (!(env.episode_deadline_s > 0)) throw_invalid("env.episode_deadline_s must be positive, got {}", env.episode_deadline_s);
    for (const auto& e : env.environment)
      if (e.find('=') == std::string::npos || e.front() == '=')
        throw_invalid("env.environment entries must read \"NAME=value\", got \"{}\"", e);
  }
}

std::string TrainConfig::to_toml() const {
  TrainConfig copy = *this;
  auto bs = bindings(copy);
  toml::table root;
  for (const auto& b : bs) {
    toml::table* t = &root;
    if (!b.section.empty()) {
      if (!root.contains(b.section)) root.insert(b.section, toml::table{});
      t = root.get(b.section)->as_table();
    }
    put(*t, b);
  }
  if (!copy.rewards.empty()) {
    toml::table rt;
    for (auto& [name, r] : copy.rewards) {
      toml::table t;
      for (const auto& b : reward_bindings(name, r)) put(t, b);
      rt.insert_or_assign(name, std::move(t));
    }
    root.insert_or_assign("rewards", std::move(rt));
  }
  std::ostringstream os;
  os << root << "\n";
  return os.str();
}

}  // namespace lorasync::rl

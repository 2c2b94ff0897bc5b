// Multi-turn environments through protocol v1 (contracts in environment.h).
#include "rl/environment.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>

#include "reward/reward_fn.h"
#include "util/log.h"

namespace lorasync::rl {

using nlohmann::json;

const char* env_failure_name(EnvFailure f) {
  switch (f) {
    case EnvFailure::kTimeout: return "timeout";
    case EnvFailure::kCrashed: return "crashed";
    case EnvFailure::kInvalid: return "invalid";
    case EnvFailure::kError: return "error";
    case EnvFailure::kUnavailable: return "unavailable";
  }
  return "unknown";
}

namespace {

[[noreturn]] void invalid(const std::string& why, const std::string& line) {
  std::string shown = line.size() > 200 ? line.substr(0, 200) + "..." : line;
  throw EnvFailed(EnvFailure::kInvalid,
                  "env: " + why + " (answer: " + json(shown).dump(-1, ' ', false, json::error_handler_t::replace) + ")");
}

json parse_answer(const std::string& line, std::int64_t id) {
  json j = json::parse(line, nullptr, false);
  if (j.is_discarded()) invalid("the answer is not JSON", line);
  if (!j.is_object()) invalid("the answer is not a JSON object", line);
  auto it = j.find("id");
  if (it == j.end() || !it->is_number_integer()) invalid("the answer has no integer \"id\"", line);
  if (it->get<std::int64_t>() != id)
    invalid("the answer's id is " + std::to_string(it->get<std::int64_t>()) + ", expected " + std::to_string(id), line);
  auto e = j.find("error");
  if (e != j.end() && !e->is_null()) {
    std::string msg = e->is_string() ? e->get<std::string>() : e->dump();
    if (msg.size() > 500) msg = msg.substr(0, 500) + "...";
    throw EnvFailed(EnvFailure::kError, "env: the environment answered an error: " + msg);
  }
  return j;
}

Observation parse_observation(const json& o, const std::string& line) {
  if (!o.is_object()) invalid("\"observation\" is not an object", line);
  Observation obs;
  const auto m = o.find("messages");
  const auto t = o.find("token_ids");
  if ((m != o.end()) == (t != o.end())) invalid("\"observation\" must hold exactly one of \"messages\" and \"token_ids\"", line);
  if (t != o.end()) {
    if (!t->is_array()) invalid("\"observation.token_ids\" is not an array", line);
    obs.tokens = true;
    for (const auto& x : *t) {
      if (!x.is_number_integer()) invalid("\"observation.token_ids\" holds a non-integer", line);
      obs.token_ids.push_back(x.get<std::int64_t>());
    }
    return obs;
  }
  if (!m->is_array()) invalid("\"observation.messages\" is not an array", line);
  for (const auto& x : *m) {
    if (!x.is_object() || !x.contains("role") || !x["role"].is_string() || !x.contains("content") || !x["content"].is_string())
      invalid("each observation message needs a string \"role\" and a string \"content\"", line);
    const std::string role = x["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "tool")
      invalid("observation role \"" + role + "\" is not one of system, user, tool", line);
    obs.messages.push_back({role, x["content"].get<std::string>()});
  }
  return obs;
}

std::string info_of(const json& j) {
  auto it = j.find("info");
  if (it == j.end() || it->is_null()) return "";
  return it->dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

Observation parse_reset_answer(const std::string& line, std::int64_t id) {
  json j = parse_answer(line, id);
  auto d = j.find("done");
  if (d != j.end() && !d->is_boolean()) invalid("\"done\" is not a boolean", line);
  if (d != j.end() && d->get<bool>()) invalid("reset answered done = true: an episode needs at least one model turn", line);
  auto o = j.find("observation");
  if (o == j.end() || o->is_null()) invalid("the reset answer has no \"observation\"", line);
  Observation obs = parse_observation(*o, line);
  if (!obs.tokens && obs.messages.empty()) invalid("the first observation has no message", line);
  return obs;
}

EnvStepResult parse_step_answer(const std::string& line, std::int64_t id) {
  json j = parse_answer(line, id);
  EnvStepResult r;
  auto d = j.find("done");
  if (d == j.end() || !d->is_boolean()) invalid("the step answer needs a boolean \"done\"", line);
  r.done = d->get<bool>();
  auto rw = j.find("reward");
  if (rw != j.end() && !rw->is_null()) {
    if (!rw->is_number()) invalid("\"reward\" is not a number", line);
    r.reward = rw->get<double>();
    if (!std::isfinite(r.reward)) invalid("\"reward\" is not finite", line);
  }
  auto o = j.find("observation");
  if (o != j.end() && !o->is_null()) {
    r.observation = parse_observation(*o, line);
    r.has_observation = true;
  }
  if (!r.done && !r.has_observation) invalid("a step that is not done needs an \"observation\"", line);
  r.info = info_of(j);
  return r;
}

EnvironmentPool::EnvironmentPool(EnvOptions opt)
    : opt_(std::move(opt)),
      sandbox_(sandbox_options("env", opt_.command, opt_.workdir, opt_.cpu_s, opt_.memory_mb, opt_.max_output_bytes, opt_.network)),
      slots_(static_cast<std::size_t>(std::max<std::int64_t>(1, opt_.workers))) {
  sandbox_.env = opt_.environment;
}

EnvironmentPool::~EnvironmentPool() { shutdown(); }

void EnvironmentPool::shutdown() {
  std::lock_guard lk(mu_);
  closing_ = true;
  for (auto& s : slots_)
    if (!s.busy) s.proc.kill();  // running exchanges notice closing_ and kill their own
  cv_.notify_all();
}

std::unique_ptr<EnvironmentPool::Session> EnvironmentPool::open() {
  std::unique_lock lk(mu_);
  for (;;) {
    if (closing_) throw EnvFailed(EnvFailure::kUnavailable, "env: shutting down");
    // A worker that is running is preferred: it starts no process.
    std::size_t pick = slots_.size();
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].busy && (pick == slots_.size() || (slots_[i].proc.running() && !slots_[pick].proc.running()))) pick = i;
    if (pick < slots_.size()) {
      slots_[pick].busy = true;
      return std::unique_ptr<Session>(new Session(this, pick));
    }
    cv_.wait(lk);
  }
}

EnvironmentPool::Session::~Session() {
  std::lock_guard lk(pool_->mu_);
  auto& s = pool_->slots_[slot_];
  s.busy = false;
  if (pool_->closing_) s.proc.kill();
  pool_->cv_.notify_one();
}

std::string EnvironmentPool::Session::exchange(const std::string& request) {
  auto& w = pool_->slots_[slot_].proc;
  const auto& o = pool_->opt_;
  try {
    const bool fresh = !w.running();
    const double allowed = o.timeout_s + (fresh ? o.startup_s : 0.0);
    const auto deadline = SandboxWorker::Clock::now() +
                          std::chrono::duration_cast<SandboxWorker::Clock::duration>(std::chrono::duration<double>(allowed));
    if (fresh) {
      w.start(pool_->sandbox_);
      ++pool_->started_;
    }
    w.send_line(request, deadline, o.timeout_s, &pool_->closing_);
    return w.read_line(deadline, o.timeout_s, &pool_->closing_);
  } catch (const reward::RewardCallFailed& e) {
    w.kill();
    EnvFailure k = EnvFailure::kCrashed;
    switch (e.kind()) {
      case reward::RewardFailure::kTimeout: k = EnvFailure::kTimeout; break;
      case reward::RewardFailure::kInvalidOutput: k = EnvFailure::kInvalid; break;
      case reward::RewardFailure::kUnavailable: k = EnvFailure::kUnavailable; break;
      default: k = EnvFailure::kCrashed; break;
    }
    throw EnvFailed(k, e.what());
  }
}

Observation EnvironmentPool::Session::reset(const std::string& row_json, std::int64_t seed) {
  const std::int64_t id = next_id_++;
  json row = json::parse(row_json, nullptr, false);
  json req = {{"lorasync_env", kEnvProtocol}, {"id", id}, {"op", "reset"}, {"row", row.is_discarded() ? json::object() : row}, {"seed", seed}};
  const std::string line = exchange(req.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
  try {
    return parse_reset_answer(line, id);
  } catch (const EnvFailed& e) {
    if (e.kind() != EnvFailure::kError) pool_->slots_[slot_].proc.kill();  // out of step: never reused
    throw;
  }
}

EnvStepResult EnvironmentPool::Session::step(const EnvAction& a) {
  const std::int64_t id = next_id_++;
  json req = {{"lorasync_env", kEnvProtocol}, {"id", id}, {"op", "step"},
              {"action", {{"text", a.text}, {"token_ids", a.token_ids}, {"finish_reason", a.finish_reason}}}};
  const std::string line = exchange(req.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
  try {
    return parse_step_answer(line, id);
  } catch (const EnvFailed& e) {
    if (e.kind() != EnvFailure::kError) pool_->slots_[slot_].proc.kill();
    throw;
  }
}

}  // namespace lorasync::rl

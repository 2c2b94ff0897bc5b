#include "rl/checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>

#include "core/io/safetensors.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/sha256.h"

namespace lorasync::rl {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "lorasync-checkpoint/1";

std::span<const std::uint8_t> bytes_of(const at::Tensor& t) {
  return {static_cast<const std::uint8_t*>(t.data_ptr()), static_cast<std::size_t>(t.numel() * t.element_size())};
}

// Keeps the tensors alive while their bytes are written.
struct TensorFile {
  std::vector<at::Tensor> keep;
  std::vector<io::TensorToWrite> items;
  void add(const std::string& name, const at::Tensor& t) {
    at::Tensor c = t.detach().to(torch::kCPU).contiguous();
    keep.push_back(c);
    io::DType d = c.scalar_type() == torch::kInt32 ? io::DType::kI32 : io::DType::kF32;
    LS_CHECK(c.scalar_type() == torch::kInt32 || c.scalar_type() == torch::kFloat32, "checkpoint tensors are fp32 or int32");
    items.push_back({name, d, c.sizes().vec(), bytes_of(keep.back())});
  }
};

at::Tensor load_tensor(const io::SafetensorsFile& f, const std::string& name) {
  const auto& v = f.get(name);
  auto dtype = v.dtype == io::DType::kI32 ? torch::kInt32 : torch::kFloat32;
  LS_CHECK(v.dtype == io::DType::kI32 || v.dtype == io::DType::kF32, "unexpected checkpoint tensor dtype");
  at::Tensor t = torch::empty(v.shape, torch::TensorOptions().dtype(dtype));
  if (v.nbytes) std::memcpy(t.data_ptr(), v.data, v.nbytes);
  return t;
}

std::string step_name(std::int64_t step) { return fmt::format("step-{:06d}", step); }

std::vector<std::pair<std::int64_t, fs::path>> list_steps(const fs::path& dir) {
  std::vector<std::pair<std::int64_t, fs::path>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0) continue;
    try {
      out.emplace_back(std::stoll(n.substr(5)), e.path());
    } catch (...) {
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

json cursor_to_json(const Cursor& c) {
  json redo = json::array();
  for (const auto& p : c.redo) redo.push_back({p.index, p.epoch, p.attempt});
  return {{"epoch", c.epoch}, {"position", c.position}, {"permutation", c.permutation}, {"redo", redo}};
}

Cursor cursor_from_json(const json& j) {
  Cursor c;
  c.epoch = j.at("epoch").get<std::int64_t>();
  c.position = j.at("position").get<std::int64_t>();
  c.permutation = j.at("permutation").get<std::vector<std::int64_t>>();
  for (const auto& r : j.at("redo")) c.redo.push_back({r.at(0).get<std::int64_t>(), r.at(1).get<std::int64_t>(), r.at(2).get<std::int64_t>()});
  return c;
}

fs::path write_checkpoint(const fs::path& checkpoints_dir, const CheckpointData& d, std::int64_t keep,
                          std::optional<std::int64_t> also_keep) {
  fs::create_directories(checkpoints_dir);
  const fs::path staging = checkpoints_dir / (".staging-" + step_name(d.step) + "-" + random_hex(4));
  fs::create_directories(staging);
  LS_CHECK(d.adapter, "checkpoint without an adapter");
  d.adapter->save_peft(staging / "adapter", /*atomic=*/false);

  TensorFile opt;
  for (std::size_t i = 0; i < d.exp_avg.size(); ++i) {
    opt.add(fmt::format("exp_avg.{}", i), d.exp_avg[i]);
    opt.add(fmt::format("exp_avg_sq.{}", i), d.exp_avg_sq[i]);
  }
  io::write_safetensors(staging / "optimizer.safetensors", opt.items, {{"format", "pt"}}, false);

  TensorFile ver;
  for (const auto& [v, ts] : d.version_tensors)
    for (std::size_t i = 0; i < ts.size(); ++i) ver.add(fmt::format("v{}.{}", v, i), ts[i]);
  io::write_safetensors(staging / "versions.safetensors", ver.items, {{"format", "pt"}}, false);

  TensorFile q;
  json groups = json::array();
  for (std::size_t gi = 0; gi < d.groups.size(); ++gi) {
    const Group& g = d.groups[gi];
    json members = json::array();
    for (std::size_t mi = 0; mi < g.members.size(); ++mi) {
      const Member& m = g.members[mi];
      q.add(fmt::format("g{}.m{}.ids", gi, mi),
            torch::from_blob(const_cast<std::int32_t*>(m.ids.data()), {static_cast<std::int64_t>(m.ids.size())}, torch::kInt32));
      q.add(fmt::format("g{}.m{}.lp", gi, mi),
            torch::from_blob(const_cast<float*>(m.logprobs.data()), {static_cast<std::int64_t>(m.logprobs.size())}, torch::kFloat32));
      json jm = {{"finish", m.finish}, {"reward", m.valid() ? json(m.reward) : json(nullptr)}, {"parts", m.parts},
                 {"advantage", m.advantage}};
      // An episode's member: its own prompt, the mask and the per-token versions (run-length).
      if (!m.prompt_ids.empty()) {
        std::vector<std::int32_t> p32(m.prompt_ids.begin(), m.prompt_ids.end());
        q.add(fmt::format("g{}.m{}.prompt", gi, mi), torch::tensor(p32, torch::kInt32));
      }
      if (!m.mask.empty()) {
        std::vector<std::int32_t> m32(m.mask.begin(), m.mask.end());
        q.add(fmt::format("g{}.m{}.mask", gi, mi), torch::tensor(m32, torch::kInt32));
      }
      if (!m.versions.empty()) {
        json runs = json::array();
        for (std::size_t t = 0; t < m.versions.size();) {
          std::size_t e = t;
          while (e < m.versions.size() && m.versions[e] == m.versions[t]) ++e;
          runs.push_back({m.versions[t], e - t});
          t = e;
        }
        jm["versions"] = runs;
      }
      if (m.turns) jm["turns"] = m.turns;
      members.push_back(std::move(jm));
    }
    groups.push_back({{"prompt", {g.prompt.index, g.prompt.epoch, g.prompt.attempt}}, {"version", g.version},
                      {"sync_index", g.sync_index}, {"seq", g.seq}, {"scored", g.scored}, {"prescored", g.prescored}, {"request_s", g.request_s},
                      {"members", members}});
  }
  io::write_safetensors(staging / "queue.safetensors", q.items, {{"format", "pt"}}, false);
  write_file_durable(staging / "queue.json", json{{"groups", groups}}.dump());
  json state = d.state;
  state["format"] = kFormat;
  state["step"] = d.step;
  write_file_durable(staging / "state.json", state.dump(1));

  json files = json::object();
  for (const auto& e : fs::recursive_directory_iterator(staging)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), staging).generic_string();
    files[rel] = {{"bytes", fs::file_size(e.path())}, {"sha256", sha256_file(e.path())}};
  }
  write_file_durable(staging / "manifest.json", json{{"format", kFormat}, {"step", d.step}, {"files", files}}.dump(1));
  fsync_path(staging / "adapter", true);
  fsync_path(staging, true);
  const fs::path final_dir = checkpoints_dir / step_name(d.step);
  if (fs::exists(final_dir)) fs::remove_all(final_dir);  // a re-run step after a resume
  rename_and_sync(staging, final_dir);
  write_file_atomic(checkpoints_dir / "latest", step_name(d.step) + "\n");

  // Retention: the newest `keep` plus `also_keep`, deleted only now that the new one is complete.
  auto steps = list_steps(checkpoints_dir);
  const auto n = static_cast<std::int64_t>(steps.size());
  for (std::int64_t i = 0; i + keep < n; ++i) {
    if (also_keep && steps[static_cast<std::size_t>(i)].first == *also_keep) continue;
    std::error_code ec;
    fs::remove_all(steps[static_cast<std::size_t>(i)].second, ec);
  }
  return final_dir;
}

bool checkpoint_complete(const fs::path& dir, std::string* why) {
  auto fail = [&](std::string w) {
    if (why) *why = std::move(w);
    return false;
  };
  const fs::path mf = dir / "manifest.json";
  if (!fs::exists(mf)) return fail("no manifest.json");
  json m = json::parse(read_file(mf), nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("format", "") != kFormat || !m.contains("files")) return fail("bad manifest");
  for (const auto& [rel, info] : m["files"].items()) {
    const fs::path p = dir / rel;
    if (!fs::exists(p)) return fail("missing " + rel);
    if (fs::file_size(p) != info.value("bytes", std::uint64_t{0})) return fail("size of " + rel + " differs");
    if (sha256_file(p) != info.value("sha256", std::string())) return fail("checksum of " + rel + " differs");
  }
  return true;
}

std::optional<fs::path> find_resume_checkpoint(const fs::path& checkpoints_dir) {
  const fs::path latest = checkpoints_dir / "latest";
  if (fs::exists(latest)) {
    std::string name = read_file(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    const fs::path p = checkpoints_dir / name;
    std::string why;
    if (!name.empty() && fs::is_directory(p) && checkpoint_complete(p, &why)) return p;
    LS_LOG_WARN("trainer", "checkpoint named by {} is not usable ({}); looking for an older one", latest.string(), why);
  }
  auto steps = list_steps(checkpoints_dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    std::string why;
    if (checkpoint_complete(it->second, &why)) return it->second;
    LS_LOG_WARN("trainer", "skipping incomplete checkpoint {}: {}", it->second.string(), why);
  }
  return std::nullopt;
}

CheckpointData read_checkpoint(const fs::path& dir, bool verified) {
  std::string why;
  if (!verified && !checkpoint_complete(dir, &why)) throw_invalid("checkpoint {} is incomplete: {}", dir.string(), why);
  CheckpointData d;
  d.state = json::parse(read_file(dir / "state.json"));
  if (d.state.value("format", "") != kFormat)
    throw_invalid("checkpoint {}: format '{}' is not {}", dir.string(), d.state.value("format", ""), kFormat);
  d.step = d.state.at("step").get<std::int64_t>();
  d.adapter_dir = dir / "adapter";
  {
    io::SafetensorsFile f(dir / "optimizer.safetensors");
    for (std::size_t i = 0;; ++i) {
      if (!f.find(fmt::format("exp_avg.{}", i))) break;
      d.exp_avg.push_back(load_tensor(f, fmt::format("exp_avg.{}", i)));
      d.exp_avg_sq.push_back(load_tensor(f, fmt::format("exp_avg_sq.{}", i)));
    }
  }
  {
    io::SafetensorsFile f(dir / "versions.safetensors");
    for (const auto& t : f.tensors()) {
      const auto dot = t.name.find('.');
      const std::int64_t v = std::stoll(t.name.substr(1, dot - 1));
      const auto i = static_cast<std::size_t>(std::stoll(t.name.substr(dot + 1)));
      auto& vec = d.version_tensors[v];
      if (vec.size() <= i) vec.resize(i + 1);
      vec[i] = load_tensor(f, t.name);
    }
  }
  {
    io::SafetensorsFile f(dir / "queue.safetensors");
    json q = json::parse(read_file(dir / "queue.json"));
    std::size_t gi = 0;
    for (const auto& jg : q.at("groups")) {
      Group g;
      g.prompt = {jg["prompt"][0].get<std::int64_t>(), jg["prompt"][1].get<std::int64_t>(), jg["prompt"][2].get<std::int64_t>()};
      g.version = jg.at("version").get<std::int64_t>();
      g.sync_index = jg.at("sync_index").get<std::int64_t>();
      g.seq = jg.at("seq").get<std::uint64_t>();
      g.scored = jg.at("scored").get<bool>();
      g.prescored = jg.value("prescored", false);
      g.request_s = jg.value("request_s", 0.0);
      std::size_t mi = 0;
      for (const auto& jm : jg.at("members")) {
        Member m;
        at::Tensor ids = load_tensor(f, fmt::format("g{}.m{}.ids", gi, mi));
        at::Tensor lp = load_tensor(f, fmt::format("g{}.m{}.lp", gi, mi));
        m.ids.assign(ids.data_ptr<std::int32_t>(), ids.data_ptr<std::int32_t>() + ids.numel());
        m.logprobs.assign(lp.data_ptr<float>(), lp.data_ptr<float>() + lp.numel());
        m.finish = jm.at("finish").get<std::string>();
        m.reward = jm.at("reward").is_null() ? std::nan("") : jm.at("reward").get<double>();
        m.parts = jm.at("parts").get<std::vector<double>>();
        m.advantage = jm.at("advantage").get<double>();
        if (f.find(fmt::format("g{}.m{}.prompt", gi, mi))) {
          at::Tensor t = load_tensor(f, fmt::format("g{}.m{}.prompt", gi, mi));
          m.prompt_ids.assign(t.data_ptr<std::int32_t>(), t.data_ptr<std::int32_t>() + t.numel());
        }
        if (f.find(fmt::format("g{}.m{}.mask", gi, mi))) {
          at::Tensor t = load_tensor(f, fmt::format("g{}.m{}.mask", gi, mi));
          m.mask.assign(t.data_ptr<std::int32_t>(), t.data_ptr<std::int32_t>() + t.numel());
          LS_CHECK(m.mask.size() == m.ids.size(), "checkpoint: a member's mask differs in length from its ids");
        }
        if (jm.contains("versions")) {
          for (const auto& run : jm.at("versions"))
            m.versions.insert(m.versions.end(), run.at(1).get<std::size_t>(), run.at(0).get<std::int64_t>());
          LS_CHECK(m.versions.size() == m.ids.size(), "checkpoint: a member's versions differ in length from its ids");
        }
        m.turns = jm.value("turns", std::int64_t{0});
        g.members.push_back(std::move(m));
        ++mi;
      }
      d.groups.push_back(std::move(g));
      ++gi;
    }
  }
  return d;
}

int remove_checkpoint_staging(const fs::path& checkpoints_dir) {
  int n = 0;
  if (!fs::is_directory(checkpoints_dir)) return 0;
  for (const auto& e : fs::directory_iterator(checkpoints_dir)) {
    if (e.path().filename().string().rfind(".staging-", 0) == 0) {
      std::error_code ec;
      fs::remove_all(e.path(), ec);
      ++n;
    }
  }
  return n;
}

}  // namespace lorasync::rl

#include "core/io/checkpoint_dir.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>

#include "util/error.h"
#include "util/files.h"
#include "util/sha256.h"

namespace lorasync::io {

namespace fs = std::filesystem;

const TensorView* WeightSet::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorView& WeightSet::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (t == nullptr) throw_invalid("model {}: weight '{}' not found", dir_.string(), name);
  return *t;
}

std::vector<std::string> WeightSet::names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : by_name_) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

WeightSet open_weights(const fs::path& dir) {
  WeightSet ws;
  ws.dir_ = dir;
  fs::path index = dir / "model.safetensors.index.json";
  fs::path single = dir / "model.safetensors";
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_file(index));
    } catch (const nlohmann::json::exception& e) {
      throw_invalid("{}: not valid JSON: {}", index.string(), e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw_invalid("{}: missing object 'weight_map'", index.string());
    std::map<std::string, std::shared_ptr<SafetensorsFile>> files;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw_invalid("{}: weight_map['{}'] must be a file name", index.string(), it.key());
      auto fname = it.value().get<std::string>();
      if (fname.find('/') != std::string::npos || fname == ".." || fname.empty())
        throw_invalid("{}: weight_map['{}'] = '{}' is not a plain file name", index.string(),
                      it.key(), fname);
      auto& f = files[fname];
      if (!f) f = std::make_shared<SafetensorsFile>(dir / fname);
      const TensorView* t = f->find(it.key());
      if (t == nullptr)
        throw_invalid("{}: weight '{}' is mapped to {} but that file does not hold it",
                      index.string(), it.key(), fname);
      ws.by_name_[it.key()] = t;
    }
    for (auto& [name, f] : files) {
      for (const auto& t : f->tensors())
        if (!ws.by_name_.count(t.name))
          throw_invalid("{}: shard {} holds '{}' which the index does not list", index.string(),
                        name, t.name);
      ws.files_.push_back(f);
    }
  } else if (fs::exists(single)) {
    auto f = std::make_shared<SafetensorsFile>(single);
    for (const auto& t : f->tensors()) ws.by_name_[t.name] = &t;
    ws.files_.push_back(f);
  } else {
    throw_not_found("model {}: neither model.safetensors nor model.safetensors.index.json found",
                    dir.string());
  }
  return ws;
}

std::string model_identity_sha256(const fs::path& dir) {
  Sha256 h;
  h.update(read_file(dir / "config.json"));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    MappedFile m(f);
    std::uint64_t n = 0;
    if (m.size() >= 8)
      for (int i = 7; i >= 0; --i) n = (n << 8) | m.data()[i];
    n = std::min<std::uint64_t>(n + 8, m.size());
    h.update(f.filename().string());
    h.update(m.data(), static_cast<std::size_t>(n));
  }
  return h.hex_digest();
}

int write_weights(const fs::path& dir, const std::vector<TensorToWrite>& tensors,
                  std::uint64_t max_shard_bytes) {
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += t.bytes.size();
  if (total <= max_shard_bytes) {
    write_safetensors(dir / "model.safetensors", tensors);
    return 1;
  }
  // Greedy shards in name order (the order the writer lays tensors out).
  std::vector<const TensorToWrite*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  std::vector<std::vector<TensorToWrite>> shards(1);
  std::uint64_t cur = 0;
  for (const auto* t : order) {
    if (cur > 0 && cur + t->bytes.size() > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(*t);
    cur += t->bytes.size();
  }
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  const int n = static_cast<int>(shards.size());
  for (int i = 0; i < n; ++i) {
    std::string fname = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    write_safetensors(dir / fname, shards[static_cast<std::size_t>(i)]);
    for (const auto& t : shards[static_cast<std::size_t>(i)]) weight_map[t.name] = fname;
  }
  nlohmann::ordered_json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic(dir / "model.safetensors.index.json", idx.dump(2) + "\n");
  return n;
}

}  // namespace lorasync::io

#include "rl/publisher.h"

#include <chrono>

#include "core/io/adapter_manifest.h"
#include "engine/adapter_store.h"
#include "util/error.h"
#include "util/files.h"
#include "util/strings.h"

namespace lorasync::rl {

namespace fs = std::filesystem;

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

AdapterPublisher::AdapterPublisher(fs::path adapters_dir, std::string prefix, std::string base_name,
                                   std::string base_sha256)
    : dir_(std::move(adapters_dir)), prefix_(std::move(prefix)), base_name_(std::move(base_name)),
      base_sha256_(std::move(base_sha256)) {
  if (prefix_.empty() || prefix_.find('/') != std::string::npos)
    throw_invalid("sync.adapter_prefix must be a plain non-empty name, got \"{}\"", prefix_);
  fs::create_directories(dir_);
}

std::string AdapterPublisher::name_of(std::int64_t version) const {
  return prefix_ + "-v" + std::to_string(version);
}

Published AdapterPublisher::publish(const model::LoraAdapter& adapter, std::int64_t version, std::int64_t step,
                                   bool keep_files) {
  Published p;
  p.name = name_of(version);
  p.dir = dir_ / p.name;
  if (fs::exists(p.dir)) throw_invalid("adapter version {} already exists at {}; names are never reused", p.name, p.dir.string());
  const fs::path staging = dir_ / (".staging-" + p.name + "-" + random_hex(4));
  try {
    auto t0 = std::chrono::steady_clock::now();
    adapter.save_peft(staging, /*atomic=*/false);
    p.adapter_sha256 = engine::write_adapter_manifest(staging, p.name, version, step, base_name_, base_sha256_);
    if (keep_files)
      for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "manifest.json"}) p.files[f] = read_file(staging / f);
    p.save_s = seconds_since(t0);
    auto t1 = std::chrono::steady_clock::now();
    fsync_path(staging, true);
    rename_and_sync(staging, p.dir);
    p.publish_s = seconds_since(t1);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(staging, ec);
    throw;
  }
  return p;
}

std::string push_bundle(const Published& p, const std::string& lora_path) {
  std::map<std::string, std::string> files = p.files;
  const auto manifest = files.extract("manifest.json");
  if (manifest.empty()) throw_invalid("adapter version {} was published without keep_files: nothing to push", p.name);
  return io::make_adapter_bundle(p.name, lora_path, manifest.mapped(), files);
}

std::vector<std::int64_t> AdapterPublisher::existing_versions() const {
  std::vector<std::int64_t> out;
  std::error_code ec;
  const std::string head = prefix_ + "-v";
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string n = e.path().filename().string();
    if (!starts_with(n, head) || !fs::exists(e.path() / "manifest.json")) continue;
    const std::string num = n.substr(head.size());
    if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) continue;
    out.push_back(std::stoll(num));
  }
  std::sort(out.begin(), out.end());
  return out;
}

int AdapterPublisher::remove_stale_staging() const {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (starts_with(e.path().filename().string(), ".staging-")) {
      fs::remove_all(e.path(), ec);
      ++n;
    }
  return n;
}

void AdapterPublisher::remove_version(std::int64_t version) const {
  std::error_code ec;
  fs::remove_all(dir_ / name_of(version), ec);
  if (ec) throw_env("cannot remove {}: {}", (dir_ / name_of(version)).string(), ec.message());
}

}  // namespace lorasync::rl

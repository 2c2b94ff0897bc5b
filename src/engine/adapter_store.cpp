#include "engine/adapter_store.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <system_error>

#include "core/io/safetensors.h"
#include "util/error.h"
#include "util/files.h"
#include "util/sha256.h"

namespace lorasync::engine {

namespace fs = std::filesystem;

namespace {

const char* const kPeftFiles[] = {"adapter_config.json", "adapter_model.safetensors"};

[[noreturn]] void not_found(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::kNotFound, fmt::format("No adapter found for {}: {}", path, why), "lora_path");
}

bool under_root(const fs::path& p, const fs::path& root) {
  auto pi = p.begin();
  for (auto ri = root.begin(); ri != root.end(); ++ri, ++pi) {
    if (ri->empty()) continue;  // trailing separator
    if (pi == p.end() || *pi != *ri) return false;
  }
  return true;
}

}  // namespace

std::string adapter_digest(const std::map<std::string, std::string>& file_sha256) {
  Sha256 h;
  for (const auto& [name, hex] : file_sha256) {
    h.update(name);
    h.update(std::string_view("\0", 1));
    h.update(hex);
    h.update("\n");
  }
  return h.hex_digest();
}

LoadedAdapter read_adapter(const std::string& name, const std::string& path,
                           const std::vector<std::string>& allowed_roots,
                           const model::Qwen2Config& base, std::int64_t max_rank,
                           c10::Device device) {
  if (path.empty()) throw Error(ErrorKind::kInvalidInput, "lora_path must not be empty", "lora_path");
  std::error_code ec;
  fs::path resolved = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) resolved = fs::absolute(path).lexically_normal();
  if (!allowed_roots.empty()) {
    bool ok = false;
    for (const auto& r : allowed_roots) {
      std::error_code ec2;
      fs::path root = fs::weakly_canonical(fs::absolute(r), ec2);
      if (ec2) root = fs::absolute(r).lexically_normal();
      if (under_root(resolved, root)) ok = true;
    }
    if (!ok)
      throw Error(ErrorKind::kForbidden,
                  fmt::format("lora_path {} (resolved {}) is outside the allowed adapter roots", path,
                              resolved.string()),
                  "lora_path");
  }
  if (!fs::is_directory(resolved, ec)) not_found(path, "the directory does not exist");

  std::map<std::string, std::string> shas;
  fs::path manifest = resolved / "manifest.json";
  std::string manifest_digest;
  if (fs::exists(manifest, ec)) {
    nlohmann::json m;
    try {
      m = nlohmann::json::parse(read_file(manifest));
    } catch (const nlohmann::json::exception& e) {
      not_found(path, fmt::format("manifest.json is incomplete or invalid ({})", e.what()));
    }
    if (!m.is_object() || !m.contains("files") || !m["files"].is_object())
      not_found(path, "manifest.json has no 'files' object");
    for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
      const std::string fname = it.key();
      if (fname.find('/') != std::string::npos || fname == "..")
        throw Error(ErrorKind::kInvalidInput, fmt::format("manifest.json lists an invalid file name '{}'", fname), "lora_path");
      fs::path f = resolved / fname;
      if (!fs::exists(f, ec)) not_found(path, fmt::format("{} is listed in manifest.json but missing", fname));
      const auto want_bytes = it.value().value("bytes", std::uint64_t{0});
      const auto have_bytes = fs::file_size(f, ec);
      if (ec || have_bytes != want_bytes)
        not_found(path, fmt::format("{} has {} bytes, the manifest says {}", fname, have_bytes, want_bytes));
      auto sha = sha256_file(f);
      if (sha != it.value().value("sha256", std::string()))
        not_found(path, fmt::format("{} does not match its SHA-256 in manifest.json", fname));
      shas[fname] = sha;
    }
    for (const char* f : kPeftFiles)
      if (!shas.count(f)) not_found(path, fmt::format("manifest.json does not list {}", f));
    manifest_digest = m.value("adapter_sha256", std::string());
    if (!manifest_digest.empty() && manifest_digest != adapter_digest(shas))
      not_found(path, "adapter_sha256 in manifest.json does not match its files");
  } else {
    for (const char* f : kPeftFiles) {
      if (!fs::exists(resolved / f, ec)) not_found(path, fmt::format("{} is missing", f));
      shas[f] = sha256_file(resolved / f);
    }
  }

  LoadedAdapter out;
  out.name = name;
  out.path = resolved.string();
  out.sha256 = adapter_digest(shas);
  try {
    out.weights = std::make_shared<const model::LoraAdapter>(
        model::LoraAdapter::load_peft(resolved, base, device, max_rank));
  } catch (const Error& e) {
    std::string what = e.what();
    // A file still being copied shows up as a truncated safetensors image.
    if (what.find("exceed the data size") != std::string::npos || what.find("too short") != std::string::npos)
      not_found(path, what);
    throw Error(ErrorKind::kInvalidInput, what, "lora_path");
  }
  return out;
}

std::string write_adapter_manifest(const fs::path& dir, const std::string& name, std::int64_t version,
                                   std::int64_t step, const std::string& base_name,
                                   const std::string& base_sha256) {
  std::map<std::string, std::string> shas;
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  for (const char* f : kPeftFiles) {
    auto sha = sha256_file(dir / f);
    shas[f] = sha;
    files[f] = {{"bytes", fs::file_size(dir / f)}, {"sha256", sha}};
  }
  auto digest = adapter_digest(shas);
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  nlohmann::ordered_json m = {{"format", "lorasync-adapter/1"},
                              {"name", name},
                              {"version", version},
                              {"step", step},
                              {"created_unix", now},
                              {"base_model", {{"name", base_name}, {"sha256", base_sha256}}},
                              {"files", files},
                              {"adapter_sha256", digest}};
  write_file_durable(dir / "manifest.json", m.dump(2) + "\n");
  return digest;
}

}  // namespace lorasync::engine

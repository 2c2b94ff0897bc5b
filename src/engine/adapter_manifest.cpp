#include "engine/adapter_manifest.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <utility>

#include "util/error.h"
#include "util/json_limits.h"

namespace lorasync::engine {

namespace {

[[noreturn]] void incomplete(const std::string& why) { throw Error(ErrorKind::kNotFound, "manifest.json " + why); }

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c)) || std::isupper(static_cast<unsigned char>(c))) return false;
  return true;
}

// A shown value: short and printable whatever the input held.
std::string shown(const nlohmann::json& v) {
  return v.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace).substr(0, 80);
}

}  // namespace

AdapterManifest parse_adapter_manifest(std::string_view text) {
  check_json_depth(text, "manifest.json");
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    incomplete(std::string("is incomplete or invalid (") + e.what() + ")");
  }
  if (!m.is_object() || !m.contains("files") || !m["files"].is_object()) incomplete("has no 'files' object");
  const auto& files = m["files"];
  if (files.size() > kMaxManifestFiles)
    throw_invalid("manifest.json lists {} files (at most {})", files.size(), kMaxManifestFiles);
  AdapterManifest out;
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string& fname = it.key();
    if (fname.empty() || fname.find('/') != std::string::npos || fname == "." || fname == ".." ||
        fname.find('\0') != std::string::npos)
      throw_invalid("manifest.json lists an invalid file name {}", shown(nlohmann::json(fname)));
    const auto& e = it.value();
    if (!e.is_object()) throw_invalid("manifest.json: the entry of {} is not an object", fname);
    if (!e.contains("bytes") || !e["bytes"].is_number_unsigned())
      throw_invalid("manifest.json: files.{}.bytes must be a non-negative integer", fname);
    if (!e.contains("sha256") || !e["sha256"].is_string() || !is_sha256_hex(e["sha256"].get<std::string>()))
      throw_invalid("manifest.json: files.{}.sha256 must be 64 lowercase hex digits", fname);
    out.files[fname] = {e["bytes"].get<std::uint64_t>(), e["sha256"].get<std::string>()};
  }
  if (m.contains("adapter_sha256") && !m["adapter_sha256"].is_null()) {
    if (!m["adapter_sha256"].is_string()) throw_invalid("manifest.json: adapter_sha256 must be a string, got {}", shown(m["adapter_sha256"]));
    out.adapter_sha256 = m["adapter_sha256"].get<std::string>();
  }
  if (m.contains("base_model") && !m["base_model"].is_null()) {
    const auto& b = m["base_model"];
    if (!b.is_object()) throw_invalid("manifest.json: base_model must be an object, got {}", shown(b));
    for (auto [key, dst] : {std::pair<const char*, std::string*>{"name", &out.base_name}, {"sha256", &out.base_sha256}}) {
      if (!b.contains(key) || b[key].is_null()) continue;
      if (!b[key].is_string()) throw_invalid("manifest.json: base_model.{} must be a string, got {}", key, shown(b[key]));
      *dst = b[key].get<std::string>();
    }
  }
  return out;
}

}  // namespace lorasync::engine

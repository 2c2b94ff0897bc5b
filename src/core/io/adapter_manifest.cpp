#include "core/io/adapter_manifest.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <utility>

#include "util/error.h"
#include "util/json_limits.h"
#include "util/sha256.h"

namespace lorasync::io {

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

AdapterBundle parse_adapter_bundle(std::string_view body, bool verify) {
  const std::size_t nl = body.substr(0, kMaxBundleHeaderBytes).find('\n');
  if (nl == std::string_view::npos)
    throw_invalid("the push body has no header line within its first {} bytes ({} received)", kMaxBundleHeaderBytes,
                  body.size());
  const std::string_view head = body.substr(0, nl);
  check_json_depth(head, "the push header");
  nlohmann::json h = nlohmann::json::parse(head, nullptr, false);
  if (!h.is_object()) throw_invalid("the push body's first line is not a JSON object");
  if (!h.contains("format") || !h["format"].is_string() || h["format"].get<std::string>() != kBundleFormat)
    throw_invalid("the push header's format must be \"{}\", got {}", kBundleFormat,
                  h.contains("format") ? shown(h["format"]) : std::string("nothing"));
  AdapterBundle out;
  if (!h.contains("lora_name") || !h["lora_name"].is_string() || h["lora_name"].get<std::string>().empty())
    throw_invalid("the push header's lora_name must be a non-empty string");
  out.lora_name = h["lora_name"].get<std::string>();
  if (out.lora_name.size() > 256) throw_invalid("the push header's lora_name has {} bytes (at most 256)", out.lora_name.size());
  if (h.contains("lora_path") && !h["lora_path"].is_null()) {
    if (!h["lora_path"].is_string()) throw_invalid("the push header's lora_path must be a string, got {}", shown(h["lora_path"]));
    out.lora_path = h["lora_path"].get<std::string>();
  }
  if (!h.contains("manifest") || !h["manifest"].is_object()) throw_invalid("the push header has no manifest object");
  try {
    out.manifest = parse_adapter_manifest(h["manifest"].dump());
  } catch (const Error& e) {
    throw_invalid("the pushed {}", e.what());  // a pushed manifest is complete by construction
  }
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
    if (!out.manifest.files.count(f)) throw_invalid("the pushed manifest.json does not list {}", f);
  std::uint64_t listed = 0;
  for (const auto& [fname, e] : out.manifest.files) {
    if (e.bytes > body.size()) throw_invalid("the pushed manifest lists {} with {} bytes, more than the body holds", fname, e.bytes);
    listed += e.bytes;
  }
  const std::uint64_t have = body.size() - nl - 1;
  if (have != listed)
    throw_invalid("the push body holds {} bytes after its header line, the manifest lists {} (truncated or padded upload)",
                  have, listed);
  std::size_t off = nl + 1;
  for (const auto& [fname, e] : out.manifest.files) {
    out.files[fname] = body.substr(off, static_cast<std::size_t>(e.bytes));
    off += static_cast<std::size_t>(e.bytes);
  }
  if (verify) {
    for (const auto& [fname, data] : out.files) {
      auto sha = sha256_hex(data);
      if (sha != out.manifest.files[fname].sha256)
        throw_invalid("the pushed {} does not match its SHA-256 in the manifest (corrupted upload)", fname);
      out.file_sha256[fname] = std::move(sha);
    }
    out.adapter_sha256 = adapter_digest(out.file_sha256);
    if (!out.manifest.adapter_sha256.empty() && out.manifest.adapter_sha256 != out.adapter_sha256)
      throw_invalid("the pushed manifest's adapter_sha256 does not match its files");
  }
  return out;
}

std::string make_adapter_bundle(const std::string& lora_name, const std::string& lora_path,
                                std::string_view manifest_json, const std::map<std::string, std::string>& files) {
  nlohmann::ordered_json h = {{"format", kBundleFormat}, {"lora_name", lora_name}};
  if (!lora_path.empty()) h["lora_path"] = lora_path;
  h["manifest"] = nlohmann::ordered_json::parse(manifest_json);
  std::string out = h.dump() + "\n";
  std::size_t total = out.size();
  for (const auto& [n, b] : files) total += b.size();
  out.reserve(total);
  for (const auto& [n, b] : files) out += b;
  return out;
}

}  // namespace lorasync::io

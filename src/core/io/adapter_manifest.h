// core/io/adapter_manifest.h: an adapter version's manifest.json (adapter-protocol.md: the file
// list with sizes and SHA-256s, the adapter digest, the base model), the digest itself, and the
// push bundle that carries a version over HTTP (docs/http-api.md). Free of libtorch.
//
// A manifest is untrusted input (a bucket anyone in the run can write). Two kinds of refusal:
//   Error(kNotFound)     the text is not a complete manifest: not JSON, not an object, no "files"
//                        object. A manifest still being written looks like this; the loader
//                        answers "No adapter found" and the caller retries.
//   Error(kInvalidInput) a complete manifest that breaks the rules: more than 64 files, a file
//                        name that is not one plain name, an entry that is not {"bytes": unsigned
//                        integer, "sha256": 64 hex digits}, a digest or base model of the wrong type.
// Messages name the key, not the path (the caller adds it).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace lorasync::io {

struct ManifestEntry {
  std::uint64_t bytes = 0;
  std::string sha256;  // 64 lowercase hex digits
};

struct AdapterManifest {
  std::map<std::string, ManifestEntry> files;
  std::string adapter_sha256;            // "" when absent
  std::string base_name, base_sha256;    // "" when absent
};

inline constexpr std::size_t kMaxManifestFiles = 64;

AdapterManifest parse_adapter_manifest(std::string_view text);

// adapter_sha256 from (file name -> file SHA-256 hex) pairs: SHA-256 over "<name>\0<hex>\n" in
// name order (docs/formats.md).
std::string adapter_digest(const std::map<std::string, std::string>& file_sha256);

// ---- push bundle ("lorasync-push/1") ------------------------------------------------------------
// One HTTP body carrying a whole adapter version:
//   a header line: {"format": "lorasync-push/1", "lora_name": "policy-v12",
//                   "lora_path": "/bucket/run/adapters/policy-v12" (optional: the durable copy),
//                   "manifest": {manifest.json}} followed by "\n";
//   then every file the manifest lists, in name order, each exactly its listed byte count.
// Untrusted input. Every refusal is InvalidInput naming the problem: no header line within
// kMaxBundleHeaderBytes, a header that is not that object (or another format), a manifest the
// rules refuse, a body shorter or longer than the header plus the listed sizes, a file whose
// SHA-256 differs, an adapter_sha256 that does not match, adapter_config.json or
// adapter_model.safetensors not listed.
inline constexpr std::string_view kBundleFormat = "lorasync-push/1";

// The HTTP routes that carry a bundle (serve and proxy) or name a prepared one.
inline constexpr std::string_view kPushPath = "/v1/lorasync/adapters/push";        // prepare + commit
inline constexpr std::string_view kPreparePath = "/v1/lorasync/adapters/prepare";  // stage in a slot
inline constexpr std::string_view kCommitPath = "/v1/lorasync/adapters/commit";    // {"lora_name"}: visible
inline constexpr std::string_view kAbortPath = "/v1/lorasync/adapters/abort";      // {"lora_name"}: slot freed
inline constexpr std::size_t kMaxBundleHeaderBytes = 1u << 20;

struct AdapterBundle {
  std::string lora_name, lora_path;
  AdapterManifest manifest;
  std::map<std::string, std::string_view> files;  // views into the parsed body
  std::map<std::string, std::string> file_sha256;  // as verified (empty when not verified)
  std::string adapter_sha256;                      // the digest of the files (when verified)
};

// verify = false checks the framing only (the proxy forwards, the replicas verify).
AdapterBundle parse_adapter_bundle(std::string_view body, bool verify = true);

// The body for `files` (name -> bytes) and their manifest.json text.
std::string make_adapter_bundle(const std::string& lora_name, const std::string& lora_path,
                                std::string_view manifest_json, const std::map<std::string, std::string>& files);

}  // namespace lorasync::io

// engine/adapter_manifest.h: reading an adapter directory's manifest.json (adapter-protocol.md:
// the file list with sizes and SHA-256s, the adapter digest, the base model). Free of libtorch.
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

namespace lorasync::engine {

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

}  // namespace lorasync::engine

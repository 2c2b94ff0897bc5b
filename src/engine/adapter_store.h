// engine/adapter_store.h: reading an adapter version from the bucket (adapter-protocol.md,
// loading side), off the engine thread.
//
//  1. The path is resolved (symlinks, "..") and must lie under one of the allowed roots
//     (Forbidden otherwise, and when it cannot be resolved: fail closed; no roots = any path).
//     The directory is then opened component by component from the root with O_NOFOLLOW, and
//     every file with openat(O_NOFOLLOW) from it: a symlink swapped in after the check is
//     refused. Files must be regular (a FIFO or a device is refused, never waited on), within
//     size caps (1 MiB for JSON, the largest valid adapter of max_rank for the weights), and
//     read within the load deadline. Each file is read once: the bytes hashed are the bytes
//     parsed.
//  2. With a manifest.json: every listed file must exist with its size and SHA-256, and the
//     manifest's adapter_sha256 must match; anything missing or different means the version may
//     still be arriving: NotFound "No adapter found for <path>: <why>" (callers retry).
//     Without a manifest (an adapter made by PEFT or another trainer): missing or truncated files
//     are NotFound the same way; the identity is computed from the files.
//  3. The PEFT config and every tensor are validated against the base model (rank <= max_rank,
//     targets, shapes, no DoRA or modules_to_save): InvalidInput naming the problem.
//  4. A manifest naming another base model (base_model.sha256) than the server's: Conflict.
//
// adapter_sha256 = SHA-256 over the sorted (file name, file SHA-256) pairs, each pair written as
// "<name>\0<hex>\n" (the same function the trainer's publisher uses; docs/formats.md).
// Thread-safety: functions are reentrant.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/io/adapter_manifest.h"
#include "core/model/lora.h"
#include "core/model/model_config.h"

namespace lorasync::engine {

struct LoadedAdapter {
  std::string name;      // the name it is served under (policy-v12)
  std::string path;      // resolved directory
  std::string sha256;    // adapter_sha256 (content identity)
  std::shared_ptr<const model::LoraAdapter> weights;  // on the serving device
};

// adapter_sha256 from (file name -> file sha256) pairs (core/io/adapter_manifest.h).
using io::adapter_digest;

struct AdapterLoadPolicy {
  std::vector<std::string> allowed_roots;  // empty = any path
  std::int64_t max_rank = 0;               // 0 = any rank
  std::string base_sha256;                 // this server's base model identity ("" = not checked)
  double deadline_s = 60;                  // reading the files takes at most this long
};

// The largest adapter_model.safetensors a valid adapter of rank <= max_rank (0: 256) can have for
// `base`, plus room for its header: the cap on a file read and on a push.
std::uint64_t max_adapter_weights_bytes(const model::ModelConfig& base, std::int64_t max_rank);

// Steps 1-4 above.
LoadedAdapter read_adapter(const std::string& name, const std::string& path, const AdapterLoadPolicy& policy,
                           const model::ModelConfig& base, c10::Device device);
inline LoadedAdapter read_adapter(const std::string& name, const std::string& path,
                                  const std::vector<std::string>& allowed_roots, const model::ModelConfig& base,
                                  std::int64_t max_rank, c10::Device device) {
  AdapterLoadPolicy p;
  p.allowed_roots = allowed_roots;
  p.max_rank = max_rank;
  return read_adapter(name, path, p, base, device);
}

// A pushed version (a bundle parsed with verification): steps 3-4 above, InvalidInput instead of
// NotFound (nothing of an upload is still arriving), the weights capped like a file read.
// `path` of the result: the bundle's lora_path, else "push:<name>".
LoadedAdapter adapter_from_bundle(const io::AdapterBundle& bundle, const AdapterLoadPolicy& policy,
                                  const model::ModelConfig& base, c10::Device device);

// Writes manifest.json for a directory holding PEFT files (the publisher's last step), durably.
// Returns adapter_sha256.
std::string write_adapter_manifest(const std::filesystem::path& dir, const std::string& name,
                                   std::int64_t version, std::int64_t step,
                                   const std::string& base_name, const std::string& base_sha256);

}  // namespace lorasync::engine

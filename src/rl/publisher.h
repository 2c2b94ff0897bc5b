// rl/publisher.h: publishing adapter versions into the bucket (adapter-protocol.md, trainer side).
//
//   1. adapters/.staging-<name>-<random>/: adapter_config.json + adapter_model.safetensors, each
//      fsynced; 2. manifest.json last (checksums, adapter_sha256), fsynced, then the directory;
//   3. rename to adapters/<name>, fsync adapters/. A crash leaves no final directory or a complete
//      one; stale staging directories are removed at start-up (remove_stale_staging).
// Names are <prefix>-v<N>; a name is never reused (publishing over an existing one is an error).
// Thread-safety: one publisher per run, used from the sync thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/model/lora.h"

namespace lorasync::rl {

struct Published {
  std::string name;              // <prefix>-v<N>, the name sent to the servers
  std::filesystem::path dir;     // final directory
  std::string adapter_sha256;
  double save_s = 0;             // serialise + write + fsync the files and the manifest
  double publish_s = 0;          // fsync of the directory + rename + fsync of the parent
  // With keep_files: every file of the version as written (manifest.json included), for a push.
  std::map<std::string, std::string> files;
};

// The push body (io::make_adapter_bundle) of a version published with keep_files; lora_path is
// its directory as the servers see it.
std::string push_bundle(const Published& p, const std::string& lora_path);

class AdapterPublisher {
 public:
  AdapterPublisher(std::filesystem::path adapters_dir, std::string prefix, std::string base_name,
                   std::string base_sha256);
  std::string name_of(std::int64_t version) const;
  Published publish(const model::LoraAdapter& adapter, std::int64_t version, std::int64_t step,
                    bool keep_files = false);
  // Versions of this prefix present in the directory (complete ones), ascending.
  std::vector<std::int64_t> existing_versions() const;
  // Removes .staging-* leftovers of a crash; returns how many.
  int remove_stale_staging() const;
  // Deletes a version's directory (retention: only once it is unloaded everywhere).
  void remove_version(std::int64_t version) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::string prefix_, base_name_, base_sha256_;
};

}  // namespace lorasync::rl

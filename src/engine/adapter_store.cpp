#include "engine/adapter_store.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <optional>
#include <span>
#include <system_error>
#include <utility>

#include "core/io/adapter_manifest.h"
#include "core/io/safetensors.h"
#include "core/model/runtime.h"
#include "util/error.h"
#include "util/files.h"
#include "util/sha256.h"

namespace lorasync::engine {

namespace fs = std::filesystem;
using io::AdapterManifest;
using io::parse_adapter_manifest;

// The largest adapter_model.safetensors a valid adapter of rank <= max_rank can have (8-byte
// values, every module targeted) plus room for the header.
std::uint64_t max_adapter_weights_bytes(const model::ModelConfig& base, std::int64_t max_rank) {
  const std::uint64_t r = static_cast<std::uint64_t>(max_rank > 0 ? max_rank : 256);
  std::uint64_t per_layer = 0;
  for (int m = 0; m < model::kNumLoraModules; ++m) {
    auto [in, out] = model::lora_module_shape(base, static_cast<model::LoraModule>(m));
    per_layer += r * static_cast<std::uint64_t>(in + out) * 8;
  }
  return per_layer * static_cast<std::uint64_t>(base.num_hidden_layers) + (16ull << 20);
}

namespace {

const char* const kPeftFiles[] = {"adapter_config.json", "adapter_model.safetensors"};
constexpr std::uint64_t kMaxJsonFileBytes = 1ull << 20;    // adapter_config.json, manifest.json
constexpr std::uint64_t kMaxOtherFileBytes = 64ull << 20;  // other files a manifest lists

[[noreturn]] void not_found(const std::string& path, const std::string& why) {
  throw Error(ErrorKind::kNotFound, fmt::format("No adapter found for {}: {}", path, why), "lora_path");
}

[[noreturn]] void invalid(const std::string& why) { throw Error(ErrorKind::kInvalidInput, why, "lora_path"); }

bool under_root(const fs::path& p, const fs::path& root) {
  auto pi = p.begin();
  for (auto ri = root.begin(); ri != root.end(); ++ri, ++pi) {
    if (ri->empty()) continue;  // trailing separator
    if (pi == p.end() || *pi != *ri) return false;
  }
  return true;
}

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Opens `dir` as a directory. Under a root, every component below the root is opened with
// O_NOFOLLOW from the root's descriptor, so a symlink swapped in after the check is refused.
Fd open_dir(const fs::path& resolved, const fs::path* root, const std::string& shown) {
  if (root == nullptr) {
    Fd d(::open(resolved.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.fd < 0) not_found(shown, "the directory does not exist");
    return d;
  }
  Fd d(::open(root->c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd < 0) not_found(shown, fmt::format("the allowed root {} cannot be opened ({})", root->string(), errno_text()));
  for (const auto& comp : resolved.lexically_relative(*root)) {
    if (comp.empty() || comp == ".") continue;
    if (comp == "..") throw Error(ErrorKind::kForbidden, fmt::format("lora_path {} leaves its root", shown), "lora_path");
    Fd next(::openat(d.fd, comp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (next.fd < 0) {
      if (errno == ELOOP || errno == ENOTDIR) {
        struct stat stt;
        if (::fstatat(d.fd, comp.c_str(), &stt, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(stt.st_mode))
          throw Error(ErrorKind::kForbidden,
                      fmt::format("lora_path {}: {} became a symbolic link after the path was checked", shown,
                                  comp.string()),
                      "lora_path");
      }
      not_found(shown, "the directory does not exist");
    }
    d = std::move(next);
  }
  return d;
}

// Reads one file of the adapter directory: no symlinks, regular files only (a FIFO or a device
// would block or never end), at most `cap` bytes, within the deadline. Absent: nullopt.
std::optional<std::string> read_member(int dirfd, const std::string& fname, std::uint64_t cap,
                                       std::chrono::steady_clock::time_point deadline, const std::string& shown) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  Fd f(::openat(dirfd, fname.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (f.fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    if (errno == ELOOP) invalid(fmt::format("{}/{} is a symbolic link; adapter files must be regular files", shown, fname));
    not_found(shown, fmt::format("{} cannot be opened ({})", fname, errno_text()));
  }
  struct stat stt;
  if (::fstat(f.fd, &stt) != 0) not_found(shown, fmt::format("{} cannot be read ({})", fname, errno_text()));
  if (!S_ISREG(stt.st_mode)) invalid(fmt::format("{}/{} is not a regular file", shown, fname));
  const auto size = static_cast<std::uint64_t>(stt.st_size);
  if (size > cap) invalid(fmt::format("{}/{} has {} bytes, more than the {} allowed", shown, fname, size, cap));
  std::string out;
  out.resize(static_cast<std::size_t>(size));
  std::size_t off = 0;
  while (off < out.size()) {
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(ErrorKind::kEnvironment,
                  fmt::format("reading {}/{} did not finish within the load deadline", shown, fname), "lora_path");
    const std::size_t want = std::min<std::size_t>(out.size() - off, 4u << 20);
    const ssize_t n = ::pread(f.fd, out.data() + off, want, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) not_found(shown, fmt::format("{} cannot be read ({})", fname, errno_text()));
    if (n == 0) not_found(shown, fmt::format("{} shrank while being read (still arriving?)", fname));
    off += static_cast<std::size_t>(n);
  }
  return out;
}


// An adapter trained on another base model computes nonsense on this one.
void check_base(const AdapterManifest& m, const AdapterLoadPolicy& policy, const std::string& shown) {
  if (!policy.base_sha256.empty() && !m.base_sha256.empty() && m.base_sha256 != policy.base_sha256)
    throw Error(ErrorKind::kConflict,
                fmt::format("{}: the adapter was trained on base model {} (sha256 {}), this server serves sha256 {}",
                            shown, m.base_name.empty() ? std::string("?") : m.base_name, m.base_sha256.substr(0, 16),
                            policy.base_sha256.substr(0, 16)),
                "lora_path");
}

// The weights on the serving device from the two PEFT files. `lagging_path`: a truncated
// safetensors image read from that path may still be arriving (NotFound); "": InvalidInput.
LoadedAdapter build_adapter(const std::string& name, const std::string& path, const std::string& sha256,
                            std::string_view config, std::string_view weights, const AdapterLoadPolicy& policy,
                            const model::ModelConfig& base, c10::Device device, const std::string& lagging_path) {
  LoadedAdapter out;
  out.name = name;
  out.path = path;
  out.sha256 = sha256;
  // Converting the weights may start compute workers on this (HTTP or loader) thread: end them
  // after, or the engine's workers stop spinning between regions (model::release_compute_threads).
  struct ReleaseWorkers {
    ~ReleaseWorkers() { model::release_compute_threads(); }
  } release_workers;
  try {
    out.weights = std::make_shared<const model::LoraAdapter>(model::LoraAdapter::from_peft(
        config, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(weights.data()), weights.size()),
        path, base, device, policy.max_rank));
  } catch (const Error& e) {
    std::string what = e.what();
    // A file still being copied shows up as a truncated safetensors image.
    if (!lagging_path.empty() &&
        (what.find("exceed the data size") != std::string::npos || what.find("too short") != std::string::npos))
      not_found(lagging_path, what);
    invalid(what);
  }
  return out;
}

}  // namespace

LoadedAdapter read_adapter(const std::string& name, const std::string& path, const AdapterLoadPolicy& policy,
                           const model::ModelConfig& base, c10::Device device) {
  if (path.empty()) invalid("lora_path must not be empty");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                               std::chrono::duration<double>(policy.deadline_s));
  std::error_code ec;
  fs::path resolved = fs::weakly_canonical(fs::absolute(path), ec);
  // Fail closed: a path that cannot be resolved is never compared lexically against the roots.
  if (ec) {
    if (!policy.allowed_roots.empty())
      throw Error(ErrorKind::kForbidden, fmt::format("lora_path {} cannot be resolved ({})", path, ec.message()),
                  "lora_path");
    not_found(path, fmt::format("the path cannot be resolved ({})", ec.message()));
  }
  std::optional<fs::path> root;
  if (!policy.allowed_roots.empty()) {
    for (const auto& r : policy.allowed_roots) {
      std::error_code ec2;
      fs::path rp = fs::weakly_canonical(fs::absolute(r), ec2);
      if (ec2) continue;  // a root that cannot be resolved allows nothing
      if (under_root(resolved, rp)) {
        root = rp;
        break;
      }
    }
    if (!root)
      throw Error(ErrorKind::kForbidden,
                  fmt::format("lora_path {} (resolved {}) is outside the allowed adapter roots", path,
                              resolved.string()),
                  "lora_path");
  }
  Fd dir = open_dir(resolved, root ? &*root : nullptr, path);

  // Every byte below is read once: what is hashed is what is parsed.
  std::map<std::string, std::string> shas;
  std::map<std::string, std::string> bytes;
  const std::uint64_t weights_cap = max_adapter_weights_bytes(base, policy.max_rank);
  auto cap_of = [&](const std::string& f) {
    if (f == "adapter_model.safetensors") return weights_cap;
    if (f == "adapter_config.json") return kMaxJsonFileBytes;
    return kMaxOtherFileBytes;
  };
  auto manifest_text = read_member(dir.fd, "manifest.json", kMaxJsonFileBytes, deadline, path);
  if (manifest_text) {
    AdapterManifest m;
    try {
      m = parse_adapter_manifest(*manifest_text);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kNotFound) not_found(path, e.what());
      invalid(fmt::format("{}: {}", path, e.what()));
    }
    for (const auto& [fname, entry] : m.files) {
      auto data = read_member(dir.fd, fname, cap_of(fname), deadline, path);
      if (!data) not_found(path, fmt::format("{} is listed in manifest.json but missing", fname));
      if (data->size() != entry.bytes)
        not_found(path, fmt::format("{} has {} bytes, the manifest says {}", fname, data->size(), entry.bytes));
      auto sha = sha256_hex(*data);
      if (sha != entry.sha256) not_found(path, fmt::format("{} does not match its SHA-256 in manifest.json", fname));
      shas[fname] = sha;
      if (fname == kPeftFiles[0] || fname == kPeftFiles[1]) bytes[fname] = std::move(*data);
    }
    for (const char* f : kPeftFiles)
      if (!shas.count(f)) not_found(path, fmt::format("manifest.json does not list {}", f));
    if (!m.adapter_sha256.empty() && m.adapter_sha256 != adapter_digest(shas))
      not_found(path, "adapter_sha256 in manifest.json does not match its files");
    check_base(m, policy, path);
  } else {
    for (const char* f : kPeftFiles) {
      auto data = read_member(dir.fd, f, cap_of(f), deadline, path);
      if (!data) not_found(path, fmt::format("{} is missing", f));
      shas[f] = sha256_hex(*data);
      bytes[f] = std::move(*data);
    }
  }

  return build_adapter(name, resolved.string(), adapter_digest(shas), bytes[kPeftFiles[0]], bytes[kPeftFiles[1]], policy,
                       base, device, path);
}

LoadedAdapter adapter_from_bundle(const io::AdapterBundle& b, const AdapterLoadPolicy& policy,
                                  const model::ModelConfig& base, c10::Device device) {
  if (b.adapter_sha256.empty()) invalid("the push bundle was not verified");
  const std::string shown = "pushed adapter " + b.lora_name;
  check_base(b.manifest, policy, shown);
  const std::uint64_t cap = max_adapter_weights_bytes(base, policy.max_rank);
  const auto& w = b.files.at(kPeftFiles[1]);
  if (w.size() > cap) invalid(fmt::format("{}: {} has {} bytes, more than the {} allowed", shown, kPeftFiles[1], w.size(), cap));
  try {
    return build_adapter(b.lora_name, b.lora_path.empty() ? "push:" + b.lora_name : b.lora_path, b.adapter_sha256,
                         b.files.at(kPeftFiles[0]), w, policy, base, device, "");
  } catch (const Error& e) {
    // Nothing of a pushed version is still arriving: a bad image is a bad upload.
    if (e.kind() == ErrorKind::kNotFound) invalid(e.what());
    throw;
  }
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

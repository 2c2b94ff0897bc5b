#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <set>

#include "core/io/safetensors.h"
#include "util/error.h"

namespace lorasync::io {

namespace {

void write_all(int fd, const void* p, std::size_t n, const std::filesystem::path& path) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_env("cannot write {}: {}", path.string(), errno_text());
    }
    c += w;
    n -= static_cast<std::size_t>(w);
  }
}

// The 8-byte length and the JSON header of `tensors` (validated), with the tensors in the order
// their bytes follow; `what` names the destination in errors.
std::string header_of(const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata,
                      const std::string& what, std::vector<const TensorToWrite*>& order) {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) throw_invalid("write_safetensors {}: duplicate tensor name '{}'", what, t.name);
    std::int64_t numel = 1;
    for (auto s : t.shape) {
      if (s < 0) throw_invalid("write_safetensors: tensor '{}' has a negative dimension", t.name);
      numel *= s;
    }
    if (static_cast<std::size_t>(numel) * dtype_size(t.dtype) != t.bytes.size())
      throw_invalid("write_safetensors: tensor '{}': {} bytes given, shape needs {}", t.name,
                    t.bytes.size(), static_cast<std::size_t>(numel) * dtype_size(t.dtype));
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  std::uint64_t offset = 0;
  for (const auto* t : order) {
    header[t->name] = {{"dtype", dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->bytes.size()}}};
    offset += t->bytes.size();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // align the data section to 8 bytes
  std::string out(8, '\0');
  const std::uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(static_cast<std::uint8_t>(n >> (8 * i)));
  return out + h;
}

}  // namespace

std::string safetensors_bytes(const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> order;
  std::string out = header_of(tensors, metadata, "(in memory)", order);
  std::size_t total = out.size();
  for (const auto* t : order) total += t->bytes.size();
  out.reserve(total);
  for (const auto* t : order) out.append(reinterpret_cast<const char*>(t->bytes.data()), t->bytes.size());
  return out;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata, bool atomic) {
  std::vector<const TensorToWrite*> order;
  const std::string head = header_of(tensors, metadata, path.string(), order);

  std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::filesystem::path target =
      atomic ? dir / fmt::format(".{}.tmp-{}", path.filename().string(), random_hex(6)) : path;
  int fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_env("cannot create {}: {}", target.string(), errno_text());
  try {
    write_all(fd, head.data(), head.size(), target);
    for (const auto* t : order) write_all(fd, t->bytes.data(), t->bytes.size(), target);
    if (::fsync(fd) != 0) throw_env("fsync of {} failed: {}", target.string(), errno_text());
    if (::close(fd) != 0) {
      fd = -1;
      throw_env("close of {} failed: {}", target.string(), errno_text());
    }
    fd = -1;
    if (atomic) rename_and_sync(target, path);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    if (atomic) {
      std::error_code ec;
      std::filesystem::remove(target, ec);
    }
    throw;
  }
}

}  // namespace lorasync::io

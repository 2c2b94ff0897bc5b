#include "core/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "util/error.h"

namespace lorasync::io {

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the reference library's bound

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4}, {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2}, {DType::kI8, "I8", 1}, {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

}  // namespace

std::string_view dtype_name(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i.name;
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& i : kDTypes)
    if (i.name == name) return i.dtype;
  return std::nullopt;
}

std::size_t dtype_size(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i.size;
  return 0;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : label_(path.string()) {
  mapping_ = std::make_unique<MappedFile>(path);
  parse({mapping_->data(), mapping_->size()});
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::from_bytes(std::span<const std::uint8_t> bytes,
                                                             std::string label) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->label_ = std::move(label);
  f->parse(bytes);
  return f;
}

void SafetensorsFile::parse(std::span<const std::uint8_t> bytes) {
  const std::string& file = label_;
  if (bytes.size() < 8)
    throw_invalid("safetensors {}: file is {} bytes, too short for the 8-byte header length", file,
                  bytes.size());
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
  if (n > kMaxHeaderBytes)
    throw_invalid("safetensors {}: header length {} exceeds the limit of {} bytes", file, n,
                  kMaxHeaderBytes);
  if (n > bytes.size() - 8)
    throw_invalid("safetensors {}: header length {} exceeds the file size {} minus 8", file, n,
                  bytes.size());
  if (n < 2 || bytes[8] != '{')
    throw_invalid("safetensors {}: header must be a JSON object starting with '{{'", file);
  std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8), n);
  const std::uint8_t* data = bytes.data() + 8 + n;
  const std::uint64_t data_size = bytes.size() - 8 - n;

  // Parse with a callback that rejects duplicate top-level names (nlohmann keeps the last).
  std::unordered_set<std::string> seen;
  std::string duplicate;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(
        header,
        [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
          if (depth == 1 && ev == nlohmann::json::parse_event_t::key) {
            auto k = parsed.get<std::string>();
            if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
          }
          return depth <= 64;  // nesting bound
        });
  } catch (const nlohmann::json::exception& e) {
    throw_invalid("safetensors {}: header is not valid JSON: {}", file, e.what());
  }
  if (!duplicate.empty())
    throw_invalid("safetensors {}: tensor name '{}' appears twice in the header", file, duplicate);
  if (!j.is_object()) throw_invalid("safetensors {}: header is not a JSON object", file);

  struct Span {
    std::uint64_t begin, end;
    std::size_t idx;
  };
  std::vector<Span> spans;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        throw_invalid("safetensors {}: __metadata__ must be an object of strings", file);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          throw_invalid("safetensors {}: __metadata__['{}'] must be a string", file, m.key());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object())
      throw_invalid("safetensors {}: tensor '{}': entry must be an object", file, name);
    auto dt_it = v.find("dtype");
    auto sh_it = v.find("shape");
    auto off_it = v.find("data_offsets");
    if (dt_it == v.end() || !dt_it->is_string())
      throw_invalid("safetensors {}: tensor '{}': missing or non-string 'dtype'", file, name);
    auto dt = parse_dtype(dt_it->get<std::string>());
    if (!dt)
      throw_invalid("safetensors {}: tensor '{}': unsupported dtype '{}'", file, name,
                    dt_it->get<std::string>());
    if (sh_it == v.end() || !sh_it->is_array())
      throw_invalid("safetensors {}: tensor '{}': missing or non-array 'shape'", file, name);
    if (off_it == v.end() || !off_it->is_array() || off_it->size() != 2)
      throw_invalid("safetensors {}: tensor '{}': 'data_offsets' must be [begin, end]", file, name);
    TensorView t;
    t.name = name;
    t.dtype = *dt;
    // numel with overflow checks (bounded by the data size anyway).
    std::uint64_t numel = 1;
    for (const auto& d : *sh_it) {
      if (!d.is_number_unsigned())
        throw_invalid("safetensors {}: tensor '{}': shape entries must be non-negative integers, got {}",
                      file, name, d.dump());
      auto dim = d.get<std::uint64_t>();
      if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw_invalid("safetensors {}: tensor '{}': dimension {} too large", file, name, dim);
      t.shape.push_back(static_cast<std::int64_t>(dim));
      if (__builtin_mul_overflow(numel, dim, &numel))
        throw_invalid("safetensors {}: tensor '{}': shape {} is too large", file, name, sh_it->dump());
    }
    for (const auto& o : *off_it)
      if (!o.is_number_unsigned())
        throw_invalid("safetensors {}: tensor '{}': data_offsets must be non-negative integers, got {}",
                      file, name, off_it->dump());
    auto begin = (*off_it)[0].get<std::uint64_t>();
    auto end = (*off_it)[1].get<std::uint64_t>();
    if (begin > end)
      throw_invalid("safetensors {}: tensor '{}': data_offsets [{}, {}] are reversed", file, name,
                    begin, end);
    if (end > data_size)
      throw_invalid("safetensors {}: tensor '{}': data_offsets [{}, {}] exceed the data size {}",
                    file, name, begin, end, data_size);
    std::uint64_t want = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(dtype_size(*dt)), &want))
      throw_invalid("safetensors {}: tensor '{}': shape {} is too large", file, name, sh_it->dump());
    if (want != end - begin)
      throw_invalid(
          "safetensors {}: tensor '{}': dtype {} x shape {} needs {} bytes but data_offsets [{}, {}] "
          "hold {}",
          file, name, dtype_name(*dt), sh_it->dump(), want, begin, end,
          end - begin);
    t.data = data + begin;
    t.nbytes = static_cast<std::size_t>(end - begin);
    spans.push_back({begin, end, tensors_.size()});
    tensors_.push_back(std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    const auto& a = spans[i - 1];
    const auto& b = spans[i];
    if (b.begin < a.end && b.end > b.begin && a.end > a.begin)
      throw_invalid("safetensors {}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", file,
                    tensors_[a.idx].name, a.begin, a.end, tensors_[b.idx].name, b.begin, b.end);
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorView& SafetensorsFile::get(std::string_view name) const {
  const TensorView* t = find(name);
  if (t == nullptr) throw_invalid("safetensors {}: tensor '{}' not found", label_, name);
  return *t;
}

}  // namespace lorasync::io

#include "core/model/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "core/io/safetensors.h"
#include "core/model/device_kernels.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::model {

namespace {

std::string peft_key(std::int64_t layer, LoraModule m, char ab) {
  const bool attn = m == LoraModule::kQ || m == LoraModule::kK || m == LoraModule::kV ||
                    m == LoraModule::kO;
  return "base_model.model.model.layers." + std::to_string(layer) + (attn ? ".self_attn." : ".mlp.") +
         std::string(lora_module_name(m)) + ".lora_" + ab + ".weight";
}

}  // namespace

LoraAdapter LoraAdapter::init(const LoraConfig& cfg, const ModelConfig& model, std::uint64_t seed,
                              c10::Device device) {
  if (cfg.rank <= 0) throw_invalid("LoRA rank must be positive, got {}", cfg.rank);
  LoraAdapter a;
  a.cfg_ = cfg;
  a.a_.resize(static_cast<std::size_t>(model.num_hidden_layers));
  a.b_.resize(static_cast<std::size_t>(model.num_hidden_layers));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (std::int64_t l = 0; l < model.num_hidden_layers; ++l)
    for (auto m : cfg.targets) {
      auto [in, out] = lora_module_shape(model, m);
      // kaiming_uniform_(a=sqrt(5)): bound = sqrt(6 / ((1 + 5) * fan_in)) = 1 / sqrt(fan_in).
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      auto A = at::empty({cfg.rank, in}, f32);
      A.uniform_(-bound, bound, gen);
      a.A(l, m) = A.to(device);
      a.B(l, m) = at::zeros({out, cfg.rank}, f32.device(device));
    }
  return a;
}

const at::Tensor& LoraAdapter::A(std::int64_t layer, LoraModule m) const {
  return a_.at(static_cast<std::size_t>(layer))[static_cast<std::size_t>(m)];
}
const at::Tensor& LoraAdapter::B(std::int64_t layer, LoraModule m) const {
  return b_.at(static_cast<std::size_t>(layer))[static_cast<std::size_t>(m)];
}
at::Tensor& LoraAdapter::A(std::int64_t layer, LoraModule m) {
  return a_.at(static_cast<std::size_t>(layer))[static_cast<std::size_t>(m)];
}
at::Tensor& LoraAdapter::B(std::int64_t layer, LoraModule m) {
  return b_.at(static_cast<std::size_t>(layer))[static_cast<std::size_t>(m)];
}

std::vector<at::Tensor> LoraAdapter::parameters() const {
  std::vector<at::Tensor> out;
  for (std::size_t l = 0; l < a_.size(); ++l)
    for (int m = 0; m < kNumLoraModules; ++m)
      if (a_[l][static_cast<std::size_t>(m)].defined()) {
        out.push_back(a_[l][static_cast<std::size_t>(m)]);
        out.push_back(b_[l][static_cast<std::size_t>(m)]);
      }
  return out;
}

std::int64_t LoraAdapter::n_params() const {
  std::int64_t n = 0;
  for (const auto& t : parameters()) n += t.numel();
  return n;
}

void LoraAdapter::set_requires_grad(bool on) {
  for (auto& t : parameters()) const_cast<at::Tensor&>(t).requires_grad_(on);
}

LoraAdapter LoraAdapter::clone() const {
  LoraAdapter c;
  c.cfg_ = cfg_;
  c.a_ = a_;
  c.b_ = b_;
  for (auto* v : {&c.a_, &c.b_})
    for (auto& row : *v)
      for (auto& t : row)
        if (t.defined()) t = t.detach().clone();
  return c;
}

LoraAdapter LoraAdapter::to(c10::Device device) const {
  LoraAdapter c = clone();
  for (auto* v : {&c.a_, &c.b_})
    for (auto& row : *v)
      for (auto& t : row)
        if (t.defined()) t = t.to(device);
  return c;
}

void LoraAdapter::save_peft(const std::filesystem::path& dir, bool atomic) const {
  std::filesystem::create_directories(dir);
  std::vector<at::Tensor> keep;  // contiguous CPU fp32 copies that back the spans
  std::vector<io::TensorToWrite> ts;
  for (std::int64_t l = 0; l < n_layers(); ++l)
    for (auto m : cfg_.targets)
      for (char ab : {'A', 'B'}) {
        const at::Tensor& t = ab == 'A' ? A(l, m) : B(l, m);
        auto c = t.detach().to(at::kCPU).to(at::kFloat).contiguous();
        keep.push_back(c);
        ts.push_back({peft_key(l, m, ab), io::DType::kF32, c.sizes().vec(),
                      {static_cast<const std::uint8_t*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes())}});
      }
  io::write_safetensors(dir / "adapter_model.safetensors", ts, {{"format", "pt"}}, atomic);
  if (atomic) write_file_atomic(dir / "adapter_config.json", cfg_.to_peft_json());
  else write_file_durable(dir / "adapter_config.json", cfg_.to_peft_json());
}

LoraAdapter LoraAdapter::load_peft(const std::filesystem::path& dir, const ModelConfig& model,
                                   c10::Device device, std::int64_t max_rank) {
  auto cfg_path = dir / "adapter_config.json";
  const std::string cfg = read_file(cfg_path);
  auto st_path = dir / "adapter_model.safetensors";
  io::SafetensorsFile st(st_path);
  return from_parts(cfg, cfg_path.string(), st, st_path.string(), dir.string(), model, device, max_rank);
}

LoraAdapter LoraAdapter::from_peft(std::string_view config_json, std::span<const std::uint8_t> safetensors,
                                   const std::string& label, const ModelConfig& model, c10::Device device,
                                   std::int64_t max_rank) {
  auto st = io::SafetensorsFile::from_bytes(safetensors, label + "/adapter_model.safetensors");
  return from_parts(config_json, label + "/adapter_config.json", *st, label + "/adapter_model.safetensors",
                    label, model, device, max_rank);
}

LoraAdapter LoraAdapter::from_parts(std::string_view config_json, const std::string& cfg_label,
                                    const io::SafetensorsFile& st, const std::string& st_label,
                                    const std::string& dir_label, const ModelConfig& model, c10::Device device,
                                    std::int64_t max_rank) {
  LoraAdapter a;
  a.cfg_ = LoraConfig::from_peft_json(std::string(config_json), cfg_label);
  if (max_rank > 0 && a.cfg_.rank > max_rank)
    throw_invalid("{}: LoRA rank {} is above this server's max_lora_rank {}", dir_label, a.cfg_.rank, max_rank);
  const std::string& st_path = st_label;
  const auto L = model.num_hidden_layers;
  a.a_.assign(static_cast<std::size_t>(L), {});
  a.b_.assign(static_cast<std::size_t>(L), {});
  std::set<std::string> used;
  auto load = [&](const std::string& key, std::vector<std::int64_t> shape) -> at::Tensor {
    const io::TensorView* v = st.find(key);
    std::string alt = key;
    if (v == nullptr) {  // PEFT in-memory naming with the adapter name
      alt.replace(alt.rfind(".weight"), 7, ".default.weight");
      v = st.find(alt);
    }
    if (v == nullptr) throw_invalid("{}: tensor '{}' is missing", st_path, key);
    used.insert(v->name);
    if (v->shape != shape)
      throw_invalid("{}: tensor '{}' has shape [{}], the base model needs [{}, {}]", st_path,
                    v->name, fmt::join(v->shape, ", "), shape[0], shape[1]);
    c10::ScalarType st_type;
    switch (v->dtype) {
      case io::DType::kF32: st_type = at::kFloat; break;
      case io::DType::kF16: st_type = at::kHalf; break;
      case io::DType::kBF16: st_type = at::kBFloat16; break;
      case io::DType::kF64: st_type = at::kDouble; break;
      default:
        throw_invalid("{}: tensor '{}' has dtype {}, expected a float type", st_path,
                      v->name, io::dtype_name(v->dtype));
    }
    auto t = at::from_blob(const_cast<std::uint8_t*>(v->data), v->shape,
                           at::TensorOptions().dtype(st_type));
    auto f = t.to(at::kFloat).clone();
    if (!at::isfinite(f).all().item<bool>())
      throw_invalid("{}: tensor '{}' holds NaN or infinite values", st_path, v->name);
    return f.to(device);
  };
  for (std::int64_t l = 0; l < L; ++l)
    for (auto m : a.cfg_.targets) {
      auto [in, out] = lora_module_shape(model, m);
      a.A(l, m) = load(peft_key(l, m, 'A'), {a.cfg_.rank, in});
      a.B(l, m) = load(peft_key(l, m, 'B'), {out, a.cfg_.rank});
    }
  for (const auto& t : st.tensors())
    if (!used.count(t.name))
      throw_invalid(
          "{}: tensor '{}' does not belong to a targeted module of this base model ({} layers, "
          "targets from adapter_config.json)",
          st_path, t.name, L);
  return a;
}

LoraBatch LoraBatch::all(const LoraAdapter* adapter) {
  LoraBatch b;
  if (adapter != nullptr) b.parts_.push_back({adapter, at::Tensor()});
  return b;
}

namespace {
std::atomic<bool> g_batched_lora_kernel{true};
}

bool set_batched_lora_kernel(bool on) { return g_batched_lora_kernel.exchange(on); }

LoraBatch LoraBatch::from_row_slots(const std::vector<const LoraAdapter*>& adapters,
                                    const std::vector<int>& slot_of_row, c10::Device device) {
  LoraBatch b;
  std::map<int, std::vector<std::int64_t>> rows;
  for (std::size_t r = 0; r < slot_of_row.size(); ++r)
    if (slot_of_row[r] >= 0) rows[slot_of_row[r]].push_back(static_cast<std::int64_t>(r));
  std::vector<std::vector<std::int64_t>> rows_of_part;
  for (auto& [slot, idx] : rows) {
    const LoraAdapter* a = adapters.at(static_cast<std::size_t>(slot));
    if (a == nullptr) continue;
    if (idx.size() == slot_of_row.size()) {
      b.parts_.push_back({a, at::Tensor()});
    } else {
      b.parts_.push_back({a, at::tensor(idx, at::TensorOptions().dtype(at::kLong)).to(device)});
    }
    rows_of_part.push_back(std::move(idx));
  }
  b.rows_ = static_cast<std::int64_t>(slot_of_row.size());
  bool fits = device.is_cuda() && g_batched_lora_kernel.load() && have_cuda_kernels() && !b.parts_.empty() &&
              b.parts_.size() <= static_cast<std::size_t>(cuda::kLoraKernelMaxAdapters);
  for (const auto& p : b.parts_) fits = fits && p.adapter->config().rank <= cuda::kLoraKernelMaxRank;
  if (fits) {
    auto t = lora_tiles(rows_of_part, cuda::kLoraKernelTileRows);
    b.tiles_ = at::tensor(t, at::TensorOptions().dtype(at::kInt))
                   .view({-1, 2 + cuda::kLoraKernelTileRows})
                   .to(device);
  }
  return b;
}

LoraBatch LoraBatch::with_tiles(const std::vector<const LoraAdapter*>& parts, at::Tensor tiles, std::int64_t rows) {
  LoraBatch b;
  for (const LoraAdapter* a : parts) {
    LS_CHECK(a != nullptr, "with_tiles: a null adapter");
    b.parts_.push_back({a, at::Tensor()});
  }
  b.tiles_ = std::move(tiles);
  b.rows_ = rows;
  b.tiles_only_ = true;
  return b;
}

std::vector<int> lora_tiles(const std::vector<std::vector<std::int64_t>>& rows_of_part, int tile_rows) {
  std::vector<int> out;
  for (std::size_t part = 0; part < rows_of_part.size(); ++part) {
    const auto& idx = rows_of_part[part];
    for (std::size_t i = 0; i < idx.size(); i += static_cast<std::size_t>(tile_rows)) {
      const auto n = std::min(idx.size() - i, static_cast<std::size_t>(tile_rows));
      out.push_back(static_cast<int>(part));
      out.push_back(static_cast<int>(n));
      for (std::size_t k = 0; k < static_cast<std::size_t>(tile_rows); ++k)
        out.push_back(k < n ? static_cast<int>(idx[i + k]) : 0);
    }
  }
  return out;
}

std::vector<at::Tensor> LoraBatch::parameters(std::int64_t layer) const {
  std::vector<at::Tensor> out;
  std::set<const LoraAdapter*> seen;  // an adapter in two parts is still one set of leaves
  for (const auto& p : parts_)
    if (seen.insert(p.adapter).second)
      for (auto m : p.adapter->config().targets) {
        out.push_back(p.adapter->A(layer, m));
        out.push_back(p.adapter->B(layer, m));
      }
  return out;
}

bool LoraBatch::apply_batched(const at::Tensor& x, at::Tensor& y, std::int64_t layer, LoraModule m) const {
  if (!tiles_.defined() || !x.is_cuda() || x.dim() != 2 || x.size(0) != rows_ ||
      (c10::GradMode::is_enabled() && x.requires_grad()))
    return false;
  std::vector<at::Tensor> A, B;
  std::vector<double> scales;
  for (const auto& p : parts_) {
    const bool on = p.adapter->config().targets_module(m);
    A.push_back(on ? p.adapter->A(layer, m) : at::Tensor());
    B.push_back(on ? p.adapter->B(layer, m) : at::Tensor());
    scales.push_back(p.adapter->config().scaling());
    if (on && c10::GradMode::is_enabled() && (A.back().requires_grad() || B.back().requires_grad())) return false;
  }
  if (std::none_of(A.begin(), A.end(), [](const at::Tensor& a) { return a.defined(); })) return true;
  if (!cuda::lora_tiles_fit(x, A, B)) return false;
  if (!y.is_contiguous()) y = y.contiguous();
  cuda::lora_apply_tiles(x, y, tiles_, A, B, scales);
  return true;
}

at::Tensor LoraBatch::apply(const at::Tensor& x, at::Tensor y, std::int64_t layer,
                            LoraModule m) const {
  if (apply_batched(x, y, layer, m)) return y;
  if (tiles_only_)
    throw_unsupported("LoraBatch::with_tiles: layer {} {} cannot run the batched LoRA kernel (x {} on {}, {} adapters)",
                      layer, lora_module_name(m), std::string(c10::str(x.sizes())), x.device().str(), parts_.size());
  for (const auto& p : parts_) {
    if (!p.adapter->config().targets_module(m)) continue;
    const auto& A = p.adapter->A(layer, m);
    const auto& B = p.adapter->B(layer, m);
    const double s = p.adapter->config().scaling();
    auto a = A.to(x.scalar_type());
    auto b = B.to(x.scalar_type());
    if (!p.rows.defined()) {
      y = y + at::linear(at::linear(x, a), b) * s;
    } else {
      auto xs = x.index_select(0, p.rows);
      y = y.index_add(0, p.rows, at::linear(at::linear(xs, a), b) * s);
    }
  }
  return y;
}

}  // namespace lorasync::model

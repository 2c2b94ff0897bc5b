#include "core/model/perf.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>

#include "core/model/cpu_kernels.h"
#include "util/process.h"

namespace lorasync::model {

void device_synchronize(c10::Device device) {
  if (device.is_cuda()) {
    // A tiny device-to-host copy waits for the queued kernels without a CUDA header here.
    (void)at::zeros({1}, at::TensorOptions().device(device)).cpu();
  }
}

std::int64_t peak_device_memory(c10::Device device) {
  if (!device.is_cuda()) return 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void reset_peak_device_memory(c10::Device device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
}

std::int64_t training_row_bytes(const ModelConfig& c, c10::ScalarType dtype, std::int64_t tokens,
                                std::int64_t logits_chunk, bool checkpointing) {
  const double b = static_cast<double>(c10::elementSize(dtype));
  const double d = static_cast<double>(c.hidden_size), q = static_cast<double>(c.q_dim()),
               kv = static_cast<double>(c.num_key_value_heads * c.head_dim), i = static_cast<double>(c.intermediate_size);
  const double L = static_cast<double>(c.num_hidden_layers);
  const double kept = (4 * d + 3 * q + 3 * kv + 4 * i) * b, backward = 2 * i * b, ends = 3 * d * b;
  const double per_token = checkpointing ? L * d * b + kept + backward + ends : L * kept + backward + ends;
  const double head = static_cast<double>(std::max<std::int64_t>(1, logits_chunk)) * static_cast<double>(c.vocab_size) * 4;
  return static_cast<std::int64_t>(per_token * static_cast<double>(tokens) + head);
}

namespace {

// "/proc/meminfo"-style "Key: N kB" value in bytes, or -1.
std::int64_t meminfo_bytes(const std::string& key) {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    std::istringstream in(line.substr(key.size() + 1));
    std::int64_t kb = -1;
    in >> kb;
    return kb < 0 ? -1 : kb * 1024;
  }
  return -1;
}

}  // namespace

std::int64_t available_memory_bytes(c10::Device device) {
  if (device.is_cuda()) {
    const auto idx = device.index() < 0 ? 0 : device.index();
    auto* alloc = c10::cuda::CUDACachingAllocator::get();
    if (alloc == nullptr) return -1;
    const auto [free, total] = alloc->getMemoryInfo(idx);
    (void)total;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
    const auto agg = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const std::int64_t unused = stats.reserved_bytes[agg].current - stats.allocated_bytes[agg].current;
    return static_cast<std::int64_t>(free) + std::max<std::int64_t>(0, unused);
  }
  std::int64_t avail = meminfo_bytes("MemAvailable");
  const std::int64_t limit = cgroup_memory_limit(), used = cgroup_memory_usage();
  if (limit > 0 && used >= 0) avail = avail < 0 ? limit - used : std::min(avail, limit - used);
  return avail;
}

double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k, c10::ScalarType dtype,
                   c10::Device device, double min_seconds) {
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  auto x = at::randn({m, k}, opts);
  auto w = at::randn({n, k}, opts);
  at::NoGradGuard ng;
  at::Tensor y;
  const double s = seconds_per_call([&] { y = at::linear(x, w); }, device, min_seconds);
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / s / 1e9;
}

double seconds_per_call(const std::function<void()>& f, c10::Device device, double min_seconds) {
  f();  // warm-up
  device_synchronize(device);
  using clk = std::chrono::steady_clock;
  int iters = 0;
  const auto t0 = clk::now();
  double elapsed = 0;
  do {
    f();
    ++iters;
    device_synchronize(device);
    elapsed = std::chrono::duration<double>(clk::now() - t0).count();
  } while (elapsed < min_seconds);
  return elapsed / iters;
}

double gemm_peak_gflops(c10::ScalarType dtype, c10::Device device, double min_seconds) {
  double best = 0;
  for (std::int64_t s : {1024, 2048, 4096})
    best = std::max(best, gemm_gflops(s, s, s, dtype, device, min_seconds));
  // On CPU in fp32 our outer-product kernel can beat BLAS (with AVX-512 tiles, where the wheel's
  // MKL stays on AVX2): its rate counts too, so no figure's utilisation passes 1.
  if (device.is_cpu() && dtype == at::kFloat && cpu::linear_gemm_available()) {
    for (std::int64_t s : {1024, 2048}) {
      const std::int64_t m = 512;
      auto x = at::randn({m, s});
      auto w = at::randn({s, s});
      auto y = at::empty({m, s});
      const cpu::LinearOut part{w.data_ptr<float>(), nullptr, s, y.data_ptr<float>(), s};
      const double sec = seconds_per_call(
          [&] { cpu::linear_gemm(x.data_ptr<float>(), m, s, s, std::span<const cpu::LinearOut>(&part, 1)); }, device,
          min_seconds);
      best = std::max(best, 2.0 * static_cast<double>(m) * static_cast<double>(s) * static_cast<double>(s) / sec / 1e9);
    }
  }
  return best;
}

double forward_flops(const ModelConfig& c, double tokens, double context, double lm_head_rows) {
  const double linear = 2.0 * static_cast<double>(c.n_linear_params()) * tokens;
  // QK^T and PV: 2 * 2 * d_attn per (query, key) pair, per layer.
  const double attn = 4.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(c.q_dim()) *
                      tokens * context;
  const double head = 2.0 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size) *
                      lm_head_rows;
  return linear + attn + head;
}

namespace {

struct MeterCounts {
  std::atomic<std::int64_t> current{0}, peak{0};
  void add(std::int64_t n) {
    const auto now = current.fetch_add(n) + n;
    auto p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};

// One allocation: the inner allocator's pointer (which frees it) and what to subtract.
struct MeteredBlock {
  c10::DataPtr inner;
  std::int64_t bytes;
  std::shared_ptr<MeterCounts> counts;
};

void free_metered(void* ctx) {
  auto* b = static_cast<MeteredBlock*>(ctx);
  b->counts->current.fetch_sub(b->bytes);
  delete b;  // frees the memory through the inner DataPtr's deleter
}

class MeteredAllocator final : public c10::Allocator {
 public:
  MeteredAllocator(c10::Allocator* inner, std::shared_ptr<MeterCounts> counts)
      : inner_(inner), counts_(std::move(counts)) {}
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr d = inner_->allocate(n);
    void* data = d.get();
    const auto dev = d.device();
    auto* b = new MeteredBlock{std::move(d), static_cast<std::int64_t>(n), counts_};
    counts_->add(b->bytes);
    return {data, b, &free_metered, dev};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }
  c10::Allocator* inner() const { return inner_; }

 private:
  c10::Allocator* inner_;
  std::shared_ptr<MeterCounts> counts_;
};

constexpr std::uint8_t kMeterPriority = 255;  // the highest: replaces any earlier choice

}  // namespace

struct CpuTensorMeter::Impl {
  std::shared_ptr<MeterCounts> counts = std::make_shared<MeterCounts>();
  std::unique_ptr<MeteredAllocator> alloc;
};

CpuTensorMeter::CpuTensorMeter() : impl_(new Impl) {
  impl_->alloc = std::make_unique<MeteredAllocator>(c10::GetCPUAllocator(), impl_->counts);
  c10::SetCPUAllocator(impl_->alloc.get(), kMeterPriority);
}

CpuTensorMeter::~CpuTensorMeter() {
  c10::SetCPUAllocator(impl_->alloc->inner(), kMeterPriority);
  // Blocks still alive keep the counts (shared) and free through the inner allocator's deleter.
  // Storages keep a pointer to the allocator that made them (a resize allocates through it), so
  // the small allocator object stays alive for the process's lifetime, kept (reachable, not
  // leaked) in a list that is never destroyed.
  static std::mutex kept_mu;
  static auto* kept = new std::vector<std::unique_ptr<MeteredAllocator>>();
  {
    std::lock_guard lk(kept_mu);
    kept->push_back(std::move(impl_->alloc));
  }
  delete impl_;
}

std::int64_t CpuTensorMeter::current_bytes() const { return impl_->counts->current.load(); }
std::int64_t CpuTensorMeter::peak_bytes() const { return impl_->counts->peak.load(); }
void CpuTensorMeter::reset_peak() { impl_->counts->peak.store(impl_->counts->current.load()); }

}  // namespace lorasync::model

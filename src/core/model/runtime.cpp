#include "core/model/runtime.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "util/error.h"
#include "util/process.h"

namespace lorasync::model {

c10::ScalarType parse_dtype(const std::string& name, c10::Device device, const std::string& what) {
  if (name == "auto") return device.is_cpu() ? c10::kFloat : c10::kBFloat16;
  if (name == "float32" || name == "fp32" || name == "float") return c10::kFloat;
  if (name == "bfloat16" || name == "bf16") return c10::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return c10::kHalf;
  throw_invalid("{}: dtype must be one of auto, float32, bfloat16, float16; got '{}'", what, name);
}

c10::Device parse_device(const std::string& name) {
  c10::Device d(c10::kCPU);
  try {
    d = c10::Device(name);
  } catch (const std::exception&) {
    throw_invalid("device must be cpu, cuda or cuda:N; got '{}'", name);
  }
  if (d.is_cuda() && !at::hasCUDA())
    throw_unsupported("device '{}' requested but this build of libtorch has no CUDA device available",
                      name);
  if (!d.is_cpu() && !d.is_cuda()) throw_unsupported("device '{}' is not supported (cpu or cuda)", name);
  return d;
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kBFloat16: return "bfloat16";
    case c10::kHalf: return "float16";
    case c10::kDouble: return "float64";
    default: return std::string(c10::toString(t));
  }
}

void set_compute_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
}

int compute_threads() { return at::get_num_threads(); }

// OpenMP 5.0's omp_pause_resource on the host, bound weakly: this file is compiled without
// -fopenmp (in every build, sanitizers included), and the call means something only where a
// libgomp is loaded, which is also the only case in which a pool can exist.
extern "C" int omp_pause_resource(int kind, int device_num) __attribute__((weak));
extern "C" int omp_get_initial_device() __attribute__((weak));

void release_compute_threads() {
  constexpr int kOmpPauseHard = 2;  // omp_pause_hard: the calling thread's pool is freed
  if (omp_pause_resource != nullptr && omp_get_initial_device != nullptr)
    (void)omp_pause_resource(kOmpPauseHard, omp_get_initial_device());
}

namespace {

constexpr std::size_t kBlockMin = std::size_t{1} << 20;
constexpr std::size_t kHugePage = std::size_t{2} << 20;

class BlockCache final : public c10::Allocator {
 public:
  explicit BlockCache(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (n < kBlockMin) return inner_->allocate(n);
    const std::size_t size = (n + kHugePage - 1) / kHugePage * kHugePage;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= size;
      }
    }
    if (p == nullptr) p = map(size);
    return {p, new Block{this, p, size}, &release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  void set_cap(std::size_t cap) {
    std::vector<std::pair<void*, std::size_t>> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      cap_ = cap;
      for (auto& [size, list] : free_)
        while (cached_ > cap_ && !list.empty()) {
          drop.emplace_back(list.back(), size);
          list.pop_back();
          cached_ -= size;
        }
    }
    for (auto [p, size] : drop) ::munmap(p, size);
  }

  std::size_t cached() {
    std::lock_guard<std::mutex> lk(mu_);
    return cached_;
  }

 private:
  struct Block {
    BlockCache* owner;
    void* p;
    std::size_t size;
  };

  static void* map(std::size_t size) {
    // 2 MiB-aligned: map one huge page more and trim both ends.
    void* raw = ::mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU block cache: cannot map ", size, " bytes");
    const auto r = reinterpret_cast<std::uintptr_t>(raw);
    const auto base = (r + kHugePage - 1) / kHugePage * kHugePage;
    if (base > r) ::munmap(raw, base - r);
    const auto end = r + size + kHugePage;
    if (end > base + size) ::munmap(reinterpret_cast<void*>(base + size), end - (base + size));
    (void)::madvise(reinterpret_cast<void*>(base), size, MADV_HUGEPAGE);  // advice only
    return reinterpret_cast<void*>(base);
  }

  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    b->owner->give_back(b->p, b->size);
    delete b;
  }

  void give_back(void* p, std::size_t size) {
    std::vector<std::pair<void*, std::size_t>> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (size > cap_) {
        drop.emplace_back(p, size);
      } else {
        // The newest block stays: sizes the program no longer asks for make room for it.
        for (auto it = free_.begin(); cached_ + size > cap_ && it != free_.end(); ++it)
          while (cached_ + size > cap_ && !it->second.empty()) {
            drop.emplace_back(it->second.front(), it->first);
            it->second.erase(it->second.begin());
            cached_ -= it->first;
          }
        free_[size].push_back(p);
        cached_ += size;
      }
    }
    for (auto [q, n] : drop) ::munmap(q, n);
  }

  c10::Allocator* inner_;
  std::mutex mu_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // by size, most recent last
  std::size_t cached_ = 0, cap_ = 0;
};

std::mutex g_cache_mu;
BlockCache* g_cache = nullptr;  // installed once, never freed (storages keep their allocator)

}  // namespace

std::size_t default_cpu_block_cache_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  std::size_t mem = pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                                          : std::size_t{4} << 30;
  // A container's memory limit (cgroup v2, then v1) when it is below the machine's memory.
  const std::int64_t limit = cgroup_memory_limit();
  if (limit > 0 && static_cast<std::size_t>(limit) < mem) mem = static_cast<std::size_t>(limit);
  return mem / 4;
}

std::size_t use_cpu_block_cache(std::size_t max_cached_bytes) {
  std::lock_guard<std::mutex> lk(g_cache_mu);
  if (g_cache == nullptr) {
    g_cache = new BlockCache(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_cache, /*priority=*/255);  // the highest: over any earlier choice
  }
  g_cache->set_cap(max_cached_bytes);
  return g_cache->cached();
}

}  // namespace lorasync::model

// core/model/cuda/kernels.cpp: the glue between at::Tensor and our raw CUDA launchers (launch.h):
// checks devices, dtypes and layouts, allocates outputs through libtorch's caching allocator and
// launches on the current stream. Compiled only in the `cuda` preset.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "core/model/cuda/launch.h"
#include "core/model/device_kernels.h"
#include "util/error.h"

namespace lorasync::model {

bool have_cuda_kernels() { return true; }

namespace cuda {

namespace {

ElemType elem_type(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return ElemType::kF32;
    case at::kBFloat16: return ElemType::kBF16;
    case at::kHalf: return ElemType::kF16;
    default:
      throw_unsupported("cuda::{}: dtype {} (float32, bfloat16 or float16 only)", what,
                        std::string(c10::toString(t.scalar_type())));
  }
}

void check_launch(int err, const char* what) {
  if (err != 0) throw_env("cuda::{}: kernel launch failed (cudaError {})", what, err);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!x.is_cuda() || weight.device() != x.device())
    throw_unsupported("cuda::rms_norm: x and weight must be on one CUDA device");
  if (weight.scalar_type() != x.scalar_type())
    throw_unsupported("cuda::rms_norm: weight dtype {} differs from x dtype {}",
                      std::string(c10::toString(weight.scalar_type())),
                      std::string(c10::toString(x.scalar_type())));
  const auto d = x.size(-1);
  if (weight.dim() != 1 || weight.size(0) != d)
    throw_unsupported("cuda::rms_norm: weight must be [{}]", d);
  const auto type = elem_type(x, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const auto rows = d == 0 ? 0 : xc.numel() / d;
  check_launch(launch_rms_norm(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, d,
                               static_cast<float>(eps), type,
                               c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "rms_norm");
  return y;
}

bool paged_decode_attention_fits(const at::Tensor& q, const at::Tensor& k_pool) {
  return q.dim() == 3 && k_pool.dim() == 3 && q.size(2) == k_pool.size(2) &&
         paged_decode_fits(q.size(1), k_pool.size(1), q.size(2));
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& lens) {
  const auto dev = q.device();
  if (!q.is_cuda() || k_pool.device() != dev || v_pool.device() != dev || slots.device() != dev ||
      lens.device() != dev)
    throw_unsupported("cuda::paged_decode_attention: q, the pools, slots and lens must be on one CUDA device");
  if (!paged_decode_attention_fits(q, k_pool) || v_pool.sizes() != k_pool.sizes())
    throw_unsupported("cuda::paged_decode_attention: q [B, nh, hd] and pools [n, nkv, hd] with nh/nkv <= 8 "
                      "and hd <= 256 (got q {}, k_pool {}, v_pool {})",
                      std::string(c10::str(q.sizes())), std::string(c10::str(k_pool.sizes())),
                      std::string(c10::str(v_pool.sizes())));
  if (k_pool.scalar_type() != q.scalar_type() || v_pool.scalar_type() != q.scalar_type())
    throw_unsupported("cuda::paged_decode_attention: q and the pools must share one dtype");
  const auto B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_pool.size(1);
  if (slots.scalar_type() != at::kLong || lens.scalar_type() != at::kLong || slots.dim() != 2 ||
      slots.size(0) != B || lens.dim() != 1 || lens.size(0) != B)
    throw_unsupported("cuda::paged_decode_attention: slots int64 [{}, Lmax] and lens int64 [{}]", B, B);
  if (!k_pool.is_contiguous() || !v_pool.is_contiguous())
    throw_unsupported("cuda::paged_decode_attention: the pools must be contiguous");
  const auto type = elem_type(q, "paged_decode_attention");
  c10::cuda::CUDAGuard guard(dev);
  auto qc = q.contiguous();
  auto sc = slots.contiguous();
  auto lc = lens.contiguous();
  auto out = at::empty({B, nh * hd}, q.options());
  const auto lmax = sc.size(1);
  // Split long contexts so that B * nkv * chunks blocks fill the SMs twice over, each chunk at
  // least 128 keys (32 per warp); the merge kernel then combines the chunks' partial softmaxes.
  const std::int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const std::int64_t want = std::max<std::int64_t>(1, (2 * sms + B * nkv - 1) / std::max<std::int64_t>(1, B * nkv));
  const std::int64_t most = std::max<std::int64_t>(1, (lmax + 127) / 128);
  const std::int64_t n_chunks = std::min(want, most);
  const std::int64_t chunk = std::max<std::int64_t>(1, (lmax + n_chunks - 1) / n_chunks);
  at::Tensor ws_m, ws_l, ws_acc;
  const auto g = nh / nkv;
  if (n_chunks > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    ws_m = at::empty({B * nkv * n_chunks * g}, f32);
    ws_l = at::empty({B * nkv * n_chunks * g}, f32);
    ws_acc = at::empty({B * nkv * n_chunks * g * hd}, f32);
  }
  PagedDecodeArgs a{qc.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), sc.data_ptr<std::int64_t>(),
                    lc.data_ptr<std::int64_t>(), out.data_ptr(),
                    n_chunks > 1 ? ws_m.data_ptr<float>() : nullptr,
                    n_chunks > 1 ? ws_l.data_ptr<float>() : nullptr,
                    n_chunks > 1 ? ws_acc.data_ptr<float>() : nullptr,
                    B, nh, nkv, hd, lmax, n_chunks, chunk,
                    static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)))};
  check_launch(launch_paged_decode_attention(a, type, c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               "paged_decode_attention");
  return out;
}

static_assert(kLoraKernelTileRows == kLoraTileRows && kLoraKernelMaxRank == kLoraMaxRank &&
              kLoraKernelMaxAdapters == kLoraMaxSlots);

bool lora_tiles_fit(const at::Tensor& x, const std::vector<at::Tensor>& A, const std::vector<at::Tensor>& B) {
  if (!x.is_cuda() || x.dim() != 2 || A.size() != B.size() || A.size() > static_cast<std::size_t>(kLoraMaxSlots))
    return false;
  const auto xt = x.scalar_type();
  if (xt != at::kFloat && xt != at::kBFloat16 && xt != at::kHalf) return false;
  std::optional<at::ScalarType> wt;
  for (std::size_t i = 0; i < A.size(); ++i) {
    if (!A[i].defined()) continue;
    const auto& a = A[i];
    const auto& b = B[i];
    if (!b.defined() || a.device() != x.device() || b.device() != x.device() || a.dim() != 2 || b.dim() != 2 ||
        a.size(1) != x.size(1) || b.size(1) != a.size(0) || a.size(0) > kLoraMaxRank || !a.is_contiguous() ||
        !b.is_contiguous() || a.scalar_type() != b.scalar_type() || (wt && *wt != a.scalar_type()))
      return false;
    wt = a.scalar_type();
    if (*wt != at::kFloat && *wt != at::kBFloat16 && *wt != at::kHalf) return false;
  }
  return true;
}

void lora_apply_tiles(const at::Tensor& x, at::Tensor& y, const at::Tensor& tiles, const std::vector<at::Tensor>& A,
                      const std::vector<at::Tensor>& B, const std::vector<double>& scales) {
  if (!lora_tiles_fit(x, A, B) || scales.size() != A.size())
    throw_unsupported("cuda::lora_apply_tiles: x [T, in] on CUDA and at most {} adapters of rank <= {}, "
                      "A [r, in] and B [out, r] contiguous, of one dtype, on x's device",
                      kLoraMaxSlots, kLoraMaxRank);
  if (y.device() != x.device() || y.scalar_type() != x.scalar_type() || y.dim() != 2 || y.size(0) != x.size(0) ||
      !y.is_contiguous())
    throw_unsupported("cuda::lora_apply_tiles: y must be contiguous [{}, out] of x's dtype and device", x.size(0));
  if (tiles.device() != x.device() || tiles.scalar_type() != at::kInt || tiles.dim() != 2 ||
      tiles.size(1) != 2 + kLoraTileRows || !tiles.is_contiguous())
    throw_unsupported("cuda::lora_apply_tiles: tiles must be int32 [n, {}] on x's device", 2 + kLoraTileRows);
  LoraTilesArgs a{};
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  a.x = xc.data_ptr();
  a.y = y.data_ptr();
  a.in = x.size(1);
  a.out = y.size(1);
  a.x_ld = xc.stride(0);
  a.y_ld = y.stride(0);
  a.tiles = tiles.data_ptr<int>();
  a.n_tiles = tiles.size(0);
  a.cols_per_block = 1024;
  ElemType wtype = ElemType::kF32;
  for (std::size_t i = 0; i < A.size(); ++i) {
    a.A[i] = A[i].defined() ? A[i].data_ptr() : nullptr;
    a.B[i] = A[i].defined() ? B[i].data_ptr() : nullptr;
    a.rank[i] = A[i].defined() ? static_cast<int>(A[i].size(0)) : 0;
    a.scale[i] = static_cast<float>(scales[i]);
    if (A[i].defined()) wtype = elem_type(A[i], "lora_apply_tiles");
  }
  c10::cuda::CUDAGuard guard(x.device());
  check_launch(launch_lora_tiles(a, elem_type(x, "lora_apply_tiles"), wtype,
                                 c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "lora_apply_tiles");
}

}  // namespace cuda
}  // namespace lorasync::model

// A step's new K and V rows into the paged KV cache, each row from where the projection left it to its slot.
//
// PagedKVCache.write stacked K and V into one [2, H, T, D] copy and scattered its rows with index_copy_: about
// 75 us a layer for a decode step of 16 tokens of 8 KV heads of 64 (32 KiB), 1.8 ms of a 0.35B bf16 model's
// 46-ms step on a 2-core Zen 4 (4%), most of it the operators' overhead. Here one pass copies the rows from K
// and V as they lie (any head and token strides, the projection's output rows) to their slots.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// slots [N, D] (one layer of the cache, a row a slot of one head's K or V plane); index [2 H T] (K rows, head by
// head, then V rows: PagedKVCache.write_index); key, value [H, T, D] with unit stride in D, the cache's dtype.
void write_kv_(at::Tensor slots, const at::Tensor& index, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(slots.device().is_cpu() && index.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "pdserve::write_kv_ takes CPU tensors");
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous(), "pdserve::write_kv_: slots [N, D] contiguous, got ",
              slots.sizes());
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(2) == slots.size(1) && key.stride(2) == 1 &&
                  value.stride(2) == 1,
              "pdserve::write_kv_: key and value [H, T, D] alike with unit stride in D = ", slots.size(1), ", got ",
              key.sizes(), " and ", value.sizes());
  TORCH_CHECK(key.scalar_type() == slots.scalar_type() && value.scalar_type() == slots.scalar_type(),
              "pdserve::write_kv_: key and value in the cache's dtype ", slots.scalar_type());
  const int64_t heads = key.size(0), tokens = key.size(1), rows = 2 * heads * tokens, n = slots.size(0);
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.numel() == rows,
              "pdserve::write_kv_: index int64 [2 H T] = [", rows, "], got ", index.scalar_type(), " ",
              index.sizes());
  const at::Tensor idx = index.contiguous();
  const int64_t* slot = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)  // before anything is written
    TORCH_CHECK(slot[r] >= 0 && slot[r] < n, "pdserve::write_kv_: slot ", slot[r], " outside the cache's ", n);
  const int64_t elem = slots.element_size(), row_bytes = slots.size(1) * elem;
  char* dst = static_cast<char*>(slots.data_ptr());
  const char* src[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const int64_t head_stride[2] = {key.stride(0) * elem, value.stride(0) * elem};
  const int64_t token_stride[2] = {key.stride(1) * elem, value.stride(1) * elem};
  // at least 64 KiB a chunk: a decode step's rows stay on one thread, a prompt's go over all
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes));
  pdserve::parallel_claim(rows, chunk, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t plane = r / tokens, t = r % tokens, kv = plane / heads, h = plane % heads;
      std::memcpy(dst + slot[r] * row_bytes, src[kv] + h * head_stride[kv] + t * token_stride[kv], row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("write_kv_(Tensor(a!) slots, Tensor index, Tensor key, Tensor value) -> ()");
  m.impl("write_kv_", c10::DispatchKey::CPU, TORCH_FN(write_kv_));
}

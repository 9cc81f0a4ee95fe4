// The host extension's planned calls (host_plan.h): the split cache, the forward's executor
// (launch_spec, which every fused and epilogue-path forward runs) and a plan's checks around it.
#include "host_plan.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include "host_common.h"

namespace gemmfuse {
namespace host {

bool Derived::made_from(const at::Tensor& t) const {
  const c10::Storage& s = t.storage();
  return storage.unsafeGetStorageImpl() == s.unsafeGetStorageImpl() && data == s.data() &&
         version == static_cast<int64_t>(t._version()) && offset == t.storage_offset() &&
         dtype == t.scalar_type() && t.sizes().equals(sizes) && t.strides().equals(strides);
}

void Derived::keep(const at::Tensor& t, std::vector<at::Tensor> made) {
  storage = t.storage();
  data = storage.data();
  version = static_cast<int64_t>(t._version());
  offset = t.storage_offset();
  dtype = t.scalar_type();
  sizes = t.sizes().vec();
  strides = t.strides().vec();
  value = std::move(made);
}

std::vector<at::Tensor> SplitCache::get(Kind kind, int64_t arg, int64_t width,
                                        const at::Tensor& t, const Make& make) {
  if (!keeps_) return make(t);
  if (t.is_inference()) {
    // (reading its version would raise; and inside inference_mode it may change in place
    // unseen) What an earlier tensor left in the slot goes, as the Python cache's does.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      entries_.erase({kind, arg, width});
    }
    return make(t);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Derived& entry = entries_[{kind, arg, width}];
  if (!entry.made_from(t)) {
    entry.value.clear();  // the old value's memory goes before the new one is made
    if (c10::InferenceMode::is_enabled()) {
      // kept past this call, an ordinary tensor even when made under inference_mode (a later
      // training call may save it for backward, which an inference tensor refuses)
      c10::InferenceMode ordinary(false);
      at::AutoGradMode no_grad(false);
      entry.keep(t, make(t));
    } else {
      entry.keep(t, make(t));
    }
  }
  return entry.value;
}

std::vector<at::Tensor> SplitCache::rows(const at::Tensor& weight, int64_t k_padded) {
  return get(kRows, k_padded, 0, weight, [k_padded](const at::Tensor& w) {
    at::AutoGradMode no_grad(false);
    return split_rows(unit_stride(w), k_padded);
  });
}

std::vector<at::Tensor> SplitCache::cols(const at::Tensor& weight, int64_t n_padded) {
  return get(kCols, n_padded, 0, weight, [n_padded](const at::Tensor& w) {
    at::AutoGradMode no_grad(false);
    return split_cols(unit_stride(w), n_padded);
  });
}

at::Tensor SplitCache::channel_vector(int64_t slot, const at::Tensor& t, int64_t n) {
  if (t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n) return t;
  return get(kVector, slot, n, t, [n](const at::Tensor& v) {
    at::AutoGradMode no_grad(false);
    return std::vector<at::Tensor>{v.reshape({-1}).expand({n}).to(at::kFloat).contiguous()};
  }).front();
}

TensorKey TensorKey::of(const at::Tensor& t) {
  TensorKey key;
  key.defined = t.defined();
  if (!key.defined) return key;
  key.dtype = t.scalar_type();
  key.device = t.device();
  key.sizes = t.sizes().vec();
  key.strides = t.strides().vec();
  key.aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return key;
}

bool TensorKey::matches(const at::Tensor& t) const {
  if (t.defined() != defined) return false;
  if (!defined) return true;
  return t.scalar_type() == dtype && t.device() == device && t.sizes().equals(sizes) &&
         t.strides().equals(strides) &&
         (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) == aligned;
}

void check_launch(const PlanSpec& spec, const SplitCache* cache,
                  const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(cache != nullptr && spec.table != 0, "gemmfuse: a launch needs a cache and a table");
  TORCH_CHECK(!spec.chain_apart || (spec.plain_table != 0 && !spec.model16 && !spec.epilogue_path),
              "gemmfuse: a float32 launch whose chain runs apart needs the plain GEMM's table");
  TORCH_CHECK(!spec.gemv || (spec.epilogue_path && !spec.model16),
              "gemmfuse: the few-rows kernel serves a float32 epilogue-path launch");
  TORCH_CHECK(spec.k_splits == 1 ||
                  (spec.k_splits > 1 && spec.k_splits <= gemmfuse::kMaxKSplits && !spec.model16 &&
                   !spec.epilogue_path && spec.kernel == gemmfuse::kHopperKernel && spec.split),
              "gemmfuse: split K serves a float32 launch of the Hopper kernel's split variant, "
              "in at most ", std::to_string(gemmfuse::kMaxKSplits), " slices");
  TORCH_CHECK(tensors.size() >= 5 && tensors[0].defined() && tensors[1].defined(),
              "gemmfuse: a launch takes x, weight, bias, gn_weight, gn_bias and the params");
  for (int64_t i : spec.channel_params)
    TORCH_CHECK(i >= 0 && 5 + i < static_cast<int64_t>(tensors.size()) && tensors[5 + i].defined(),
                "gemmfuse: a launch's channel params index its tensors");
}

Plan::Plan(std::shared_ptr<SplitCache> cache, PlanSpec spec,
           const std::vector<at::Tensor>& tensors) {
  check_launch(spec, cache.get(), tensors);
  auto state = std::make_shared<PlanState>();
  state->spec = std::move(spec);
  state->cache = std::move(cache);
  for (const auto& t : tensors) state->keys.push_back(TensorKey::of(t));
  state_ = std::move(state);
}

namespace {

// Whether autograd records this call: grad mode on and a tensor the kernels read wants a
// gradient (ops.records_grad); tail params get theirs from PyTorch's ops after the call.
bool records_grad(const PlanSpec& spec, const std::vector<at::Tensor>& t) {
  if (!at::GradMode::is_enabled()) return false;
  for (int i = 0; i < 5; ++i)
    if (t[i].defined() && t[i].requires_grad()) return true;
  for (int64_t i : spec.channel_params)
    if (t[5 + i].requires_grad()) return true;
  return false;
}

// What the Python path's autograd.Function handles and a plan does not: forward-mode AD's
// tangents on a tensor, and saved-tensor hooks (activation checkpointing, offloading), which
// save_for_backward honours.
bool autograd_extras(const std::vector<at::Tensor>& t, bool grad) {
  for (const auto& v : t)
    if (v.defined() && v._fw_grad(/*level=*/0).defined()) return true;
  return grad && at::SavedTensorDefaultHooks::get_hooks().has_value();
}

// A per-element tensor argument that wants a gradient: its (M, N) gradient is not among the
// chain backward kernel's column sums (the Python path gives it, by PyTorch's backward).
bool per_element_grad(const PlanSpec& spec, const std::vector<at::Tensor>& t, int64_t M,
                      int64_t N) {
  for (int64_t i : spec.channel_params) {
    const at::Tensor& p = t[5 + i];
    if (p.requires_grad() && per_element(p.sizes(), M, N)) return true;
  }
  return false;
}

}  // namespace

bool Plan::serves(const std::vector<at::Tensor>& t) const {
  const PlanState& state = *state_;
  if (t.size() != state.keys.size()) return false;
  for (size_t i = 0; i < t.size(); ++i)
    if (!state.keys[i].matches(t[i])) return false;
  // A graph captured with the cache's split would replay on it after the weight changed in
  // place (weight_cache.cache_for_call): the Python path splits afresh during capture.
  c10::cuda::CUDAGuard guard(t[0].device());
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}

at::Tensor Plan::run(const std::vector<at::Tensor>& t) const {
  const PlanSpec& spec = state_->spec;
  if (!serves(t)) return {};
  const bool grad = records_grad(spec, t);
  if (autograd_extras(t, grad)) return {};
  const int64_t M = t[0].size(0), N = t[1].size(0);
  if (grad && (!spec.backward || per_element_grad(spec, t, M, N) ||
               ((spec.split_dx || spec.split_dw) && spec.plain_table == 0)))
    return {};
  Launched call = launch_spec(spec, *state_->cache, t, grad);
  if (grad)
    record_backward(state_, call.out, t, call.z, call.gn_weight, call.gn_bias, call.vectors);
  return call.out;
}

std::pair<at::Tensor, at::Tensor> Plan::run_saving_z(const std::vector<at::Tensor>& t) const {
  if (!serves(t) || autograd_extras(t, false)) return {};
  Launched call = launch_spec(state_->spec, *state_->cache, t, true);
  return {call.out, call.z};
}

Launched launch_spec(const PlanSpec& spec, SplitCache& cache, const std::vector<at::Tensor>& t,
                     bool save_z) {
  const at::Tensor &x = t[0], &weight = t[1];
  const int64_t M = x.size(0), N = weight.size(0);
  c10::cuda::CUDAGuard guard(x.device());
  at::AutoGradMode no_grad(false);
  const auto vector32 = [&](int64_t slot) -> std::optional<at::Tensor> {
    const at::Tensor& v = t[slot];
    if (!v.defined()) return std::nullopt;
    return cache.channel_vector(slot, v, N);
  };
  const auto gn_weight = vector32(3), gn_bias = vector32(4);
  std::vector<at::Tensor> vectors;
  for (int64_t i : spec.channel_params) {
    const at::Tensor& p = t[5 + i];
    vectors.push_back(per_element(p.sizes(), M, N) ? p.to(at::kFloat).contiguous()
                                                   : cache.channel_vector(5 + i, p, N));
  }
  at::Tensor z;
  at::Tensor out;
  if (spec.gemv && !save_z) {
    out = gemv_forward(spec.table, x, weight, vector32(2), gn_weight, gn_bias, vectors,
                       spec.scalars, spec.group_size, spec.eps, spec.norm_wide);
  } else if (spec.epilogue_path) {
    // PyTorch's GEMM with the model's own bias (eager's bits; no float32 copy of it is made),
    // its result saved as z, else overwritten by the chain (a 16-bit y never is: its kernel
    // writes a tensor of its own whatever in_place says).
    const at::Tensor y = at::linear(x, weight, t[2].defined() ? std::optional<at::Tensor>(t[2])
                                                             : std::nullopt);
    if (save_z) z = y;
    out = epilogue_forward(spec.table, y, gn_weight, gn_bias, vectors, spec.scalars,
                           spec.group_size, spec.eps, spec.norm_wide, !save_z, spec.group_stats);
  } else if (spec.model16) {
    if (save_z) z = x.new_empty({M, N});
    out = fused_forward_16bit(spec.table, x, weight.is_contiguous() ? weight : weight.contiguous(),
                              vector32(2), gn_weight, gn_bias, vectors, spec.scalars,
                              spec.group_size, spec.eps, spec.norm_wide, maybe(z));
  } else {
    const auto w = cache.rows(weight, split_padded(weight.size(1)));
    if (spec.chain_apart) {
      // The chain kernel follows the GEMM's tiles where it can (group_tiles.cuh): the split
      // variant's direct stores count them. `keep`: the counts' tensor under graph capture, and
      // what the GEMM reads, held until the chain kernel is launched (fused_forward).
      std::vector<at::Tensor> keep;
      int* follow = spec.kernel == gemmfuse::kHopperKernel && spec.split && !spec.norm_wide
                        ? follow_flags(spec.table, x, N, gn_weight, gn_bias, vectors, spec.scalars,
                                       spec.group_size, spec.eps, keep)
                        : nullptr;
      const at::Tensor y = fused_forward(spec.plain_table, x, w[0], w[1], w[2], vector32(2),
                                         std::nullopt, std::nullopt, {}, {}, 1, 0.0, spec.kernel,
                                         spec.split, spec.k_splits, false, std::nullopt, follow,
                                         &keep);
      if (save_z) z = y;  // kept: the chain writes a new tensor
      out = follow != nullptr
                ? epilogue_forward_following(spec.table, y, gn_weight, gn_bias, vectors,
                                             spec.scalars, spec.group_size, spec.eps, !save_z,
                                             follow)
                : epilogue_forward(spec.table, y, gn_weight, gn_bias, vectors, spec.scalars,
                                   spec.group_size, spec.eps, spec.norm_wide, !save_z, 0);
    } else {
      if (save_z) z = x.new_empty({M, N});
      out = fused_forward(spec.table, x, w[0], w[1], w[2], vector32(2), gn_weight, gn_bias,
                          vectors, spec.scalars, spec.group_size, spec.eps, spec.kernel,
                          spec.split, spec.k_splits, spec.norm_wide, maybe(z));
    }
  }
  // The kernels' fresh [M] result, as the reduction's [M, 1] (not a view: autograd's node
  // goes on this tensor itself)
  if (spec.keepdim) out.unsafeGetTensorImpl()->set_sizes_contiguous({M, 1});
  return {out, z, gn_weight.value_or(at::Tensor()), gn_bias.value_or(at::Tensor()),
          std::move(vectors)};
}

}  // namespace host
}  // namespace gemmfuse

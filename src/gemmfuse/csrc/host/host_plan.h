// A fused call decided once and run in C++ (gemmfuse/plan.py makes them): the Python rules
// (validation, path, kernel arguments, the backward's products) decide a call on its first
// sighting; a Plan keeps those decisions with the kinds of tensors they were made for, and runs
// every later call whose tensors are of the same kinds in one host call: the checks, the weight's
// split from the cache, the input's split and the launch, and under autograd a node whose
// backward (the chain backward kernel, the products) runs without Python (host_autograd.cpp).
// Host time before the first launch is GPU idle time where a caller's timing starts on an idle
// GPU (KernelBench's), and a step whose host work outlasts its GPU work runs at its host time.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace gemmfuse {
namespace host {

// A tensor computed from another (a weight's split, a float32 copy of a vector), kept for one
// version of that tensor: the same storage (held, so its address cannot be reused by a new
// tensor unnoticed), data address, version counter, offset, sizes, strides and dtype.
struct Derived {
  c10::Storage storage;
  const void* data = nullptr;
  int64_t version = -1, offset = 0;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  std::vector<at::Tensor> value;

  bool made_from(const at::Tensor& t) const;
  void keep(const at::Tensor& t, std::vector<at::Tensor> made);
};

// A module's weight splits and float32 vectors, each made once per version of its tensor:
// gemmfuse.SplitWeightCache keeps one, and its plans share it. Thread-safe (a backward runs on
// autograd's thread while a forward may run on the caller's).
class SplitCache {
 public:
  using Make = std::function<std::vector<at::Tensor>(const at::Tensor&)>;
  enum Kind { kRows, kCols, kVector };
  // keeps = false: a cache that keeps nothing (every get is make(t)), for calls that a CUDA
  // graph may record (the graph-safe op, gemmfuse/library.py): torch.compile's CUDA graphs warm
  // up with allocations routed to their private pool, where nothing may outlive the call.
  explicit SplitCache(bool keeps = true) : keeps_(keeps) {}
  // make(t) for the slot (kind, arg, width), kept until t changes (another tensor, storage or
  // version), an ordinary tensor even when made under inference_mode; an inference tensor, which
  // has no version counter, gets make(t) at every call and empties the slot.
  std::vector<at::Tensor> get(Kind kind, int64_t arg, int64_t width, const at::Tensor& t,
                              const Make& make);
  // The weight's rows split: fp16 hi, lo [N, k_padded] and scales [N] (the forward's B).
  std::vector<at::Tensor> rows(const at::Tensor& weight, int64_t k_padded);
  // The weight's columns split: hi, lo [K, n_padded] and scales [K] (the input gradient's B).
  std::vector<at::Tensor> cols(const at::Tensor& weight, int64_t n_padded);
  // A per-channel tensor as the kernels read it: n contiguous float32 values (t itself when it
  // is that already); slot names its role (a copy per slot and n: one scalar tensor may serve
  // weights of different widths).
  at::Tensor channel_vector(int64_t slot, const at::Tensor& t, int64_t n);

 private:
  const bool keeps_;
  std::mutex mutex_;
  std::map<std::tuple<int, int64_t, int64_t>, Derived> entries_;
};

// What a plan's decisions read of one of its call's tensors, compared on every run.
struct TensorKey {
  bool defined = false;
  at::ScalarType dtype = at::kFloat;
  c10::Device device{c10::kCPU};
  std::vector<int64_t> sizes, strides;
  bool aligned = false;  // data address a multiple of 16 bytes (TMA rows, vector loads)

  static TensorKey of(const at::Tensor& t);
  bool matches(const at::Tensor& t) const;
};

// The decisions: every argument of the launch and of the backward that is not a tensor.
struct PlanSpec {
  int64_t table = 0;        // the chain library's ChainTable
  int64_t plain_table = 0;  // the plain GEMM's (the backward's split products); 0: not loaded
  bool model16 = false;     // a bf16 or fp16 model: one product on its operands (else the fp16 split)
  int64_t kernel = 0;       // fused kernel launch code (dispatch.fused_kernel_code; 0: none)
  bool split = true;        // three products (fp32) or one (tf32)
  std::vector<double> scalars;
  int64_t group_size = 1;
  double eps = 0.0;
  bool norm_wide = false;
  bool keepdim = false;                 // the reduction keeps its dimension: an [M, 1] output
  std::vector<int64_t> channel_params;  // params index of each kernel tensor argument, in order
  int64_t first_slot = 1;               // chain_backward's column-sum slot of the first one
  bool backward = false;                // the chain backward kernel serves this call's backward
  bool split_dx = false, split_dw = false;  // the backward products on the split kernel
  bool sparse = false;  // dz is zero but for a few groups a row: the sparse products (before split)
  // The epilogue path (a float32 call below the fused kernel's sizes, a 16-bit model's chain that
  // norms or reduces in tiles): PyTorch's GEMM, then epilogue_forward with this group_stats, in
  // place of the fused kernel.
  bool epilogue_path = false;
  int64_t group_stats = 0;
  // A float32 epilogue-path call of one or two aligned rows (dispatch.gemv_fits): where it saves
  // no z, the few-rows kernel (gemv_forward) does the product and the chain in one launch.
  bool gemv = false;
  // A float32 call whose chain runs apart (dispatch.chain_apart): the plain library's split GEMM
  // stores z, then epilogue_forward runs the chain on it.
  bool chain_apart = false;
  // The fused kernel's K cut into this many slices, a block each (dispatch.fused_k_splits: the
  // Hopper kernel's split variant at few output tiles); 1: none.
  int64_t k_splits = 1;
};

// A launch's results and the float32 vectors it read (a backward node keeps them); z undefined
// where none was saved.
struct Launched {
  at::Tensor out, z, gn_weight, gn_bias;
  std::vector<at::Tensor> vectors;
};

// The forward's one executor: the kernels that spec's decisions name (the Python rules make them
// once, gemmfuse/plan.py's forward_spec) on tensors (x, weight, bias, gn_weight, gn_bias,
// params...; undefined for None), z written where save_z. A planned call and a call decided
// afresh (ops.launch_path) both run it; the weight's split and float32 vectors come from cache.
Launched launch_spec(const PlanSpec& spec, SplitCache& cache, const std::vector<at::Tensor>& t,
                     bool save_z);

// Raises unless launch_spec can run spec with cache on tensors: a cache and a table, the plain
// GEMM's table where the chain runs apart, the few-rows kernel only on the float32 epilogue
// path, and tensors (x, weight, bias, gn_weight, gn_bias, params...) as spec reads them.
void check_launch(const PlanSpec& spec, const SplitCache* cache,
                  const std::vector<at::Tensor>& tensors);

// What a plan and the backward nodes it records share.
struct PlanState {
  PlanSpec spec;
  std::vector<TensorKey> keys;  // x, weight, bias, gn_weight, gn_bias, params...
  std::shared_ptr<SplitCache> cache;
};

class Plan {
 public:
  Plan(std::shared_ptr<SplitCache> cache, PlanSpec spec, const std::vector<at::Tensor>& tensors);
  // The chain's output up to its tail ops for tensors (x, weight, bias, gn_weight, gn_bias,
  // params...; undefined for None), with a backward node where autograd records the call; an
  // undefined tensor where the plan does not serve the call (a tensor of another kind, a CUDA
  // graph being captured, a gradient the plan does not give): the caller decides it afresh.
  at::Tensor run(const std::vector<at::Tensor>& tensors) const;
  // The same launch as the forward op ``gemmfuse::fused_linear_saving_z`` makes it (library.py):
  // (out, z) with no autograd node (the op's own formula is the backward); both undefined
  // where the plan does not serve the call.
  std::pair<at::Tensor, at::Tensor> run_saving_z(const std::vector<at::Tensor>& tensors) const;
  const PlanSpec& spec() const { return state_->spec; }

 private:
  // Whether the tensors are of the plan's kinds and no CUDA graph is being captured.
  bool serves(const std::vector<at::Tensor>& tensors) const;

  std::shared_ptr<const PlanState> state_;
};

// The call's backward as an autograd node on `out` (host_autograd.cpp): edges to x, weight,
// bias, gn_weight, gn_bias and each params tensor the kernels read; `vectors` are the float32
// gn_weight, gn_bias and kernel tensor arguments the forward launched with.
void record_backward(const std::shared_ptr<const PlanState>& plan, const at::Tensor& out,
                     const std::vector<at::Tensor>& tensors, const at::Tensor& z,
                     const at::Tensor& gn_weight, const at::Tensor& gn_bias,
                     const std::vector<at::Tensor>& vectors);

// Python's tensor list (None for an absent one) as the executor takes it (undefined for None).
inline std::vector<at::Tensor> defined_or_empty(
    const std::vector<std::optional<at::Tensor>>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.value_or(at::Tensor()));
  return out;
}

}  // namespace host
}  // namespace gemmfuse

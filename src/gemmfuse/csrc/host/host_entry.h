// The host extension's entry points: most as host_module.cpp binds them for Python (names and
// arguments: gemmfuse/sources.py's CHAIN_FUNCTIONS and SHARED_FUNCTIONS); fused_forward,
// fused_forward_16bit and gemv_forward only through the forward's executor (host_plan.h's
// launch_spec). Those taking `table` launch the kernels of the chain library whose ChainTable
// (chain_table.h) it addresses.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

std::vector<at::Tensor> split_rows(at::Tensor x, int64_t k_padded);
std::vector<at::Tensor> split_cols(at::Tensor x, int64_t rows_padded);
std::vector<at::Tensor> sparse_products(at::Tensor dz, at::Tensor weight, at::Tensor x,
                                        bool want_dx, bool want_dw);
at::Tensor gemm_split(int64_t table, at::Tensor a_hi, at::Tensor a_lo, at::Tensor a_inv_scale,
                      at::Tensor b_hi, at::Tensor b_lo, at::Tensor b_inv_scale, int64_t kernel,
                      bool split);
at::Tensor fused_forward(int64_t table, at::Tensor x, at::Tensor w_hi, at::Tensor w_lo,
                         at::Tensor w_inv_scale, std::optional<at::Tensor> bias,
                         std::optional<at::Tensor> gn_weight, std::optional<at::Tensor> gn_bias,
                         std::vector<at::Tensor> vec_params, std::vector<double> scalar_params,
                         int64_t group_size, double eps, int64_t kernel, bool split,
                         int64_t k_splits, bool norm_wide, std::optional<at::Tensor> z_out,
                         int* tile_flags = nullptr, std::vector<at::Tensor>* keep = nullptr);
at::Tensor fused_forward_16bit(int64_t table, at::Tensor x, at::Tensor w,
                               std::optional<at::Tensor> bias, std::optional<at::Tensor> gn_weight,
                               std::optional<at::Tensor> gn_bias, std::vector<at::Tensor> vec_params,
                               std::vector<double> scalar_params, int64_t group_size, double eps,
                               bool norm_wide, std::optional<at::Tensor> z_out);
at::Tensor epilogue_forward(int64_t table, at::Tensor y, std::optional<at::Tensor> gn_weight,
                            std::optional<at::Tensor> gn_bias, std::vector<at::Tensor> vec_params,
                            std::vector<double> scalar_params, int64_t group_size, double eps,
                            bool norm_wide, bool in_place, int64_t group_stats);
// epilogue_forward of a float32 y that the plain GEMM is storing with tile counts in tile_flags
// (from follow_flags): the chain kernel follows its tiles (group_tiles.cuh).
at::Tensor epilogue_forward_following(int64_t table, at::Tensor y,
                                      std::optional<at::Tensor> gn_weight,
                                      std::optional<at::Tensor> gn_bias,
                                      std::vector<at::Tensor> vec_params,
                                      std::vector<double> scalar_params, int64_t group_size,
                                      double eps, bool in_place, int* tile_flags);
// Zeroed tile counts for a chain-apart call of `table`'s chain on an [M, N] z, a reducing
// chain's row-band counters after them (kept in `keep` where a graph is captured), or nullptr
// where its chain kernel cannot follow the GEMM's tiles.
int* follow_flags(int64_t table, const at::Tensor& x, int64_t N,
                  const std::optional<at::Tensor>& gn_weight,
                  const std::optional<at::Tensor>& gn_bias, const std::vector<at::Tensor>& vec_params,
                  const std::vector<double>& scalar_params, int64_t group_size, double eps,
                  std::vector<at::Tensor>& keep);
at::Tensor gemv_forward(int64_t table, at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias,
                        std::optional<at::Tensor> gn_weight, std::optional<at::Tensor> gn_bias,
                        std::vector<at::Tensor> vec_params, std::vector<double> scalar_params,
                        int64_t group_size, double eps, bool norm_wide);
std::vector<at::Tensor> chain_backward(int64_t table, at::Tensor z, at::Tensor grad,
                                       std::optional<at::Tensor> gn_weight,
                                       std::optional<at::Tensor> gn_bias,
                                       std::vector<at::Tensor> vec_params,
                                       std::vector<double> scalar_params, int64_t group_size,
                                       double eps);
at::Tensor tail_outer(at::Tensor value, at::Tensor operand, int64_t op, bool value_inner,
                      std::vector<int64_t> shape);
std::vector<int64_t> chain_backward_plan(int64_t table, int64_t M, int64_t N, int64_t group_size,
                                         bool model16);
void check_table(int64_t table);
int64_t linked_chain_table();
std::map<std::string, int64_t> constants();

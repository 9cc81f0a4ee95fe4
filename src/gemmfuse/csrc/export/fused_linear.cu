// A standalone export's one CUDA translation unit (load_inline builds one library): the operand
// splits, the sparse backward products, the column sums, the tail's outer broadcast and every
// part of the chain's library.
// The package builds the same files apart: the host extension's once, the parts of each chain
// in parallel (gemmfuse/jit.py).
#include "split.cu"
#include "sparse_products.cu"
#include "column_sums.cu"
#include "outer_binary.cu"
#include "chain_table.cu"
#include "chain_sm90_split.cu"
#include "chain_sm90_one_pass.cu"
#include "chain_sm90_fp16.cu"
#include "chain_sm90_bf16.cu"
#include "chain_sm80.cu"
#include "chain_epilogue.cu"
#include "chain_epilogue_16bit.cu"
#include "chain_gemv.cu"
#include "chain_backward.cu"

// What the host extension's autograd nodes share (host_autograd.cpp, host_tail.cpp): the
// autograd headers, the heaviest the host extension parses, and making a node.
#pragma once
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace gemmfuse {
namespace host {

// torch 2.13 holds nodes by intrusive_ptr, earlier versions by shared_ptr.
using NodePtr = decltype(torch::autograd::Edge::function);

template <class N, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<N>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
}

}  // namespace host
}  // namespace gemmfuse

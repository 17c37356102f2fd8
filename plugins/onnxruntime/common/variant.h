// The preamble of code compiled once per CPU variant (CMakeLists.txt: baseline, and on x86-64
// also -march=x86-64-v3 and -march=x86-64-v4), each copy in its own namespace
// infmoe::INFMOE_VARIANT; common/dispatch.cc picks one at run time. Why the copies cannot leak
// into each other: see CMakeLists.txt.
#pragma once

#include <Eigen/Core>
#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/kernel.h"

#ifndef INFMOE_VARIANT
#error "compile with -DINFMOE_VARIANT=<name> (see CMakeLists.txt)"
#endif

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

using Index = Eigen::Index;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;

// {make(1), ..., make(N)}, make called with std::integral_constant<int, n>: a kernel's instances
// for 1 to N tokens (or rows), indexed by the count less one.
template <class Make, size_t... I>
constexpr auto CountTable(Make make, std::index_sequence<I...>) {
  return std::array{make(std::integral_constant<int, static_cast<int>(I) + 1>{})...};
}
template <int N, class Make>
constexpr auto CountTable(Make make) {
  return CountTable(make, std::make_index_sequence<N>());
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe

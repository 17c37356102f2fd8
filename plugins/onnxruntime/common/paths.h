// Which path a call of a few or many tokens takes: per-token GEMV (decode), the batched kernels
// (common/batched.h) or the prefill GEMM (common/gemm.h). Every path reads each weight row a call
// needs once, so they differ in arithmetic only; the choice comes from timing each path's
// arithmetic on this machine (rows of the call's own matrix, in cache) once per process and
// weight format, not from a fixed token count. INFMOE_PATH=gemv|batched|prefill forces one
// (tests, benchmarks). The paths' results differ by float rounding only.
#pragma once

#include <chrono>

#include "common/variant.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

enum class Path { kGemv, kBatched, kPrefill };

// The token counts timed; a call takes the path chosen at the largest one not above its count.
constexpr int64_t kPathGrid[] = {1, 2, 4, 8, 16, 32, 64, 128};
constexpr int kPathGridSize = sizeof kPathGrid / sizeof kPathGrid[0];

struct PathChoice {
  Path at[kPathGridSize];
  Path For(int64_t tokens) const {
    int i = 0;
    while (i + 1 < kPathGridSize && kPathGrid[i + 1] <= tokens) ++i;
    return at[i];
  }
};

inline const char* ForcedPath() {
  static const char* forced = [] {
    const char* value = std::getenv("INFMOE_PATH");
    return value && *value && std::strcmp(value, "auto") != 0 ? value : nullptr;
  }();
  return forced;
}

// run(path, tokens) runs one call of `tokens` tokens on the given path, on the calling thread.
// Per grid point the fastest path (the best of three timings each); then made monotone, the
// order in which the paths' costs grow with the tokens (GEMV the fastest-growing, prefill the
// slowest): once a later path wins, no earlier one is taken for more tokens, so timing noise
// can never put a cliff into the curve.
template <class Run>
PathChoice MeasurePaths(Run&& run, int64_t max_gemv_tokens) {
  PathChoice choice;
  const char* forced = ForcedPath();
  for (int i = 0; i < kPathGridSize; ++i) {
    const int64_t tokens = kPathGrid[i];
    if (forced) {
      const bool batched = std::strcmp(forced, "batched") == 0, prefill = std::strcmp(forced, "prefill") == 0;
      choice.at[i] = batched ? Path::kBatched : prefill ? Path::kPrefill : Path::kGemv;
      if (choice.at[i] == Path::kGemv && tokens > max_gemv_tokens) choice.at[i] = Path::kBatched;
      continue;
    }
    double best = 0;
    for (Path path : {Path::kGemv, Path::kBatched, Path::kPrefill}) {
      if (path == Path::kGemv && tokens > max_gemv_tokens) continue;
      double fastest = 1e30;
      for (int repeat = 0; repeat < 3; ++repeat) {
        const auto start = std::chrono::steady_clock::now();
        run(path, tokens);
        fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      if (best == 0 || fastest < best) best = fastest, choice.at[i] = path;
    }
    if (i > 0 && choice.at[i] < choice.at[i - 1]) choice.at[i] = choice.at[i - 1];
  }
  return choice;
}

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe

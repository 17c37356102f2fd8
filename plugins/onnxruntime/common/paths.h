// Which path a call of a few or many tokens takes: per-token GEMV (decode), the batched kernels
// (common/batched.h), the prefill GEMM (common/gemm.h), or with int8 activations the integer dots
// (common/int8_dots.h; the float paths then multiply the dequantized int8 activations). Every path reads each weight row a call
// needs once, so they differ in arithmetic only; the choice comes from timing each path's
// arithmetic on this machine (rows of the call's own matrix) once per process and weight format,
// as calls reach each token count (PathTiming), not from a fixed token count. INFMOE_PATH=gemv|batched|prefill|integer forces one
// (tests, benchmarks; where the call cannot take it, the next in the order below). The paths'
// results differ by float rounding only.
#pragma once

#include <chrono>
#include <mutex>

#include "common/variant.h"

namespace infmoe {
namespace INFMOE_VARIANT {
namespace {

// In the order in which their costs grow more slowly with the tokens.
enum class Path { kInteger, kGemv, kBatched, kPrefill };
constexpr const char* kPathNames[] = {"integer", "gemv", "batched", "prefill"};

// The token counts timed (each of the few a decode batch most often has, then doubling); a call
// takes the path chosen at the largest one not above its count.
constexpr int64_t kPathGrid[] = {1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512};
constexpr int kPathGridSize = sizeof kPathGrid / sizeof kPathGrid[0];

// The calibration's activations stay within this many values (a wide matrix is timed at fewer
// tokens; the larger grid points then keep the last timed choice).
constexpr int64_t kCalibrationValues = int64_t{1} << 21;

// The grid points timed for rows of `width` columns: 1 to 512 tokens, fewer for wide rows.
inline int64_t CalibrationTokens(int64_t width) {
  return std::clamp<int64_t>(kCalibrationValues / std::max<int64_t>(width, 1), 1, 512);
}

struct PathChoice {
  Path at[kPathGridSize];
  int timed = 0;         // grid points [0, timed) are chosen
  bool settled = false;  // the points after the last timed keep its choice
  Path For(int64_t tokens) const {
    int i = 0;
    while (i + 1 < timed && kPathGrid[i + 1] <= tokens) ++i;
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

// Once the fastest path of a grid point takes this long, the larger points are not timed (they
// keep its choice): the timing of a prefill's sizes stays within a fraction of a second.
constexpr double kLongestTimedSeconds = 0.05;

// Chooses grid points [choice.timed, end): run(path, tokens) runs one call of `tokens` tokens on
// the given path, on the calling thread; allowed(path, tokens) says whether a call can take it.
// Per grid point the fastest path (the best of three timings each, the paths taking turns), up
// to max_tokens and until the fastest path of a point takes kLongestTimedSeconds; made monotone in
// the order of Path: once a later path wins, no earlier one is taken (or timed) for more tokens,
// so timing noise can never put a cliff into the curve.
template <class Run, class Allowed>
void MeasurePaths(PathChoice& choice, int end, Run&& run, Allowed&& allowed, int64_t max_tokens) {
  const char* forced = ForcedPath();
  const Path paths[] = {Path::kInteger, Path::kGemv, Path::kBatched, Path::kPrefill};
  for (int i = choice.timed; i < end; choice.timed = ++i) {
    const int64_t tokens = kPathGrid[i];
    if (forced) {
      int p = 0;
      while (p < 3 && std::strcmp(forced, kPathNames[p]) != 0) ++p;
      while (p < 3 && !allowed(paths[p], tokens)) ++p;
      choice.at[i] = paths[p];
      continue;
    }
    if (i > 0 && (choice.settled || tokens > max_tokens)) {  // not timed: as the last timed point
      choice.at[i] = choice.at[i - 1];
      choice.settled = true;
      continue;
    }
    const auto candidate = [&](Path path) { return allowed(path, tokens) && (i == 0 || path >= choice.at[i - 1]); };
    // The paths take turns, three rounds: a burst of load on a shared machine falls on all of
    // them alike, not on one path's three runs (the choice holds for the process's life).
    double fastest[4] = {1e30, 1e30, 1e30, 1e30};
    for (int repeat = 0; repeat < 3; ++repeat) {
      for (Path path : paths) {
        if (!candidate(path)) continue;
        const auto start = std::chrono::steady_clock::now();
        run(path, tokens);
        double& best = fastest[static_cast<int>(path)];
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
    double best = 0;
    choice.at[i] = i ? choice.at[i - 1] : Path::kGemv;
    for (Path path : paths) {
      if (!candidate(path)) continue;
      if (best == 0 || fastest[static_cast<int>(path)] < best) best = fastest[static_cast<int>(path)], choice.at[i] = path;
    }
    if (best > kLongestTimedSeconds) choice.settled = true;
  }
}

// The path of a call of `tokens` tokens, timed as calls need it, once per process and kind of
// call: a call first times the grid points up to its own count not timed yet (measure(choice,
// end) runs MeasurePaths up to grid point end, with what the call can time on), so a process
// that only decodes never times a prefill's sizes. Calls from several threads wait for it.
class PathTiming {
 public:
  template <class Measure>
  Path For(int64_t tokens, Measure&& measure) {
    std::lock_guard<std::mutex> lock(mutex_);
    int end = choice_.timed;
    while (end < kPathGridSize && kPathGrid[end] <= tokens) ++end;
    if (end > choice_.timed) measure(choice_, end);
    return choice_.For(tokens);
  }

 private:
  std::mutex mutex_;
  PathChoice choice_{};
};

}  // namespace
}  // namespace INFMOE_VARIANT
}  // namespace infmoe

// The one choice of instruction set every kernel of the library runs with.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string>

namespace jmoe {

enum class Isa { kAvx512, kAvx2, kPortable };

// Whether this CPU has what the paths of `isa` run (the portable one needs nothing).
inline bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return true;
}

// The widest instruction set the CPU has; JMOE_CPU_ISA=avx2 or =portable asks for a narrower one.
inline Isa chosen_isa() {
  const char* forced = std::getenv("JMOE_CPU_ISA");
  const std::string want = forced ? forced : "";
  if (want == "portable") return Isa::kPortable;
  if (want == "avx2" && cpu_has(Isa::kAvx2)) return Isa::kAvx2;
  if (cpu_has(Isa::kAvx512)) return Isa::kAvx512;
  return cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kPortable;
}

// The instruction set every kernel runs with: chosen_isa() from the first call on, switched for the
// calls after it by jmoe_cpu_set_isa (so the tests run every narrower path in one process). One
// instance for the whole library (an inline function's static).
inline std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{chosen_isa()};
  return isa;
}

inline Isa current_isa() { return active_isa().load(std::memory_order_relaxed); }

}  // namespace jmoe

// The one choice of instruction set every kernel of the library runs with.
#pragma once

#include <cstdlib>
#include <string>

namespace jmoe {

enum class Isa { kAvx512, kAvx2, kPortable };

// The widest instruction set the CPU has; JMOE_CPU_ISA=avx2 or =portable asks for a narrower one
// (the tests run every path on one machine).
inline Isa chosen_isa() {
  __builtin_cpu_init();
  const char* forced = std::getenv("JMOE_CPU_ISA");
  const std::string want = forced ? forced : "";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (want == "portable") return Isa::kPortable;
  if (want == "avx2" && avx2) return Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  return avx2 ? Isa::kAvx2 : Isa::kPortable;
}

}  // namespace jmoe

// Process-wide kernel choices a reproducible job needs on a GPU, which tch 0.26 does not
// expose: deterministic algorithms (an op without a deterministic kernel throws rather than
// adding in a racy order), deterministic cuDNN without autotuning, no TF32 (it rounds f32
// products to 10 bits of mantissa), no reduced-precision split-K reductions in cuBLAS, and
// SDPA's math kernel rather than flash, memory-efficient or cuDNN attention, whose backward
// passes accumulate with atomics. Turning them off again gives libtorch's defaults back.
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/api/include/torch/version.h>

#include <cstdio>

// Returns 0, or 1 when libtorch threw.
extern "C" int limpet_reproducible_kernels(int on) {
  try {
    auto &ctx = at::globalContext();
    bool exact = on != 0;
    ctx.setDeterministicAlgorithms(exact, /*warn_only=*/false);
    ctx.setDeterministicCuDNN(exact);
    ctx.setBenchmarkCuDNN(false);
    ctx.setAllowTF32CuBLAS(false);
    ctx.setAllowTF32CuDNN(!exact);
    ctx.setAllowFP16ReductionCuBLAS(!exact);
    ctx.setAllowBF16ReductionCuBLAS(!exact);
    ctx.setSDPUseFlash(!exact);
    ctx.setSDPUseMemEfficient(!exact);
    ctx.setSDPUseCuDNN(!exact);
    return 0;
  } catch (...) {
    return 1;
  }
}

// Whether the choices above are in force: 1 or 0, as libtorch reports deterministic
// algorithms and flash attention.
extern "C" int limpet_reproducible_kernels_on() {
  auto &ctx = at::globalContext();
  return ctx.deterministicAlgorithms() && !ctx.userEnabledFlashSDP() ? 1 : 0;
}

// The libraries a GPU's kernels come from, as text into `out` (at most `len` bytes, ended by
// a zero): libtorch's version, and where CUDA is loaded, the CUDA runtime's and cuDNN's.
// Returns 0, or 1 when libtorch threw.
extern "C" int limpet_library_versions(char *out, int len) {
  try {
    const auto &cuda = at::detail::getCUDAHooks();
    if (cuda.hasCUDA()) {
      std::snprintf(out, len, "torch %d.%d.%d, cudart %ld, cudnn %ld", TORCH_VERSION_MAJOR,
                    TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, cuda.versionCUDART(),
                    cuda.hasCuDNN() ? cuda.versionCuDNN() : 0L);
    } else {
      std::snprintf(out, len, "torch %d.%d.%d", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
                    TORCH_VERSION_PATCH);
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

// libtorch's fused AdamW (`at::_fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs),
// which tch 0.26 does not expose: one pass over each tensor instead of eight kernels, and on a
// GPU one launch for many tensors. The update of `torch.optim.AdamW` to float tolerance. Used
// on a GPU (`optim::Kernels`); reproducible jobs and the CPU keep limpet's own eight passes.
// The two operators' own headers rather than all of ATen.h, which is slow to compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>

#include <cstdio>
#include <vector>

// Updates `n` parameters in place from their gradients and moments (all of one device and
// dtype, each list in the same order) at update count `step`. Every pointer is a tch tensor's
// handle (an `at::Tensor*`). Returns 0, or 1 when libtorch threw, with its message in `err`
// (at most `err_len` bytes, ended by a zero).
extern "C" int limpet_fused_adamw(at::Tensor **params, at::Tensor **grads, at::Tensor **exp_avgs,
                                  at::Tensor **exp_avg_sqs, int n, double lr, double beta1,
                                  double beta2, double weight_decay, double eps, double step,
                                  char *err, int err_len) {
  try {
    if (n <= 0) {
      return 0;
    }
    std::vector<at::Tensor> p, g, m, v;
    p.reserve(n), g.reserve(n), m.reserve(n), v.reserve(n);
    for (int i = 0; i < n; i++) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
    }
    // The kernel reads each tensor's step count and writes none (torch.optim advances them
    // before the call), so one count on the parameters' device serves every tensor.
    auto count = at::full({}, step, at::TensorOptions().dtype(at::kFloat).device(p[0].device()));
    std::vector<at::Tensor> steps(n, count);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2, weight_decay,
                      eps, /*amsgrad=*/false, /*maximize=*/false);
    return 0;
  } catch (const c10::Error &e) {
    std::snprintf(err, err_len, "%s", e.what_without_backtrace());
    return 1;
  } catch (const std::exception &e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  } catch (...) {
    std::snprintf(err, err_len, "an exception of unknown type");
    return 1;
  }
}

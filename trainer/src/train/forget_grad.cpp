// The one libtorch call the trainer needs that tch 0.26 does not expose: making a
// parameter's gradient undefined again, as PyTorch's `p.grad = None` does
// (`THPVariable_set_grad` resets the same handle). A job that shards its gradients copies
// each device gradient into the host buffer and then has no use for it until the next
// backward, which creates it afresh; without this the device would hold every parameter's
// gradient between steps.
#include <ATen/core/Tensor.h>

// Returns 0, or 1 when libtorch threw (nothing is changed then). `t` is a tch tensor's
// handle (an `at::Tensor*`); the gradient lives in the tensor's autograd metadata, which
// every handle of the tensor shares.
extern "C" int limpet_forget_grad(at::Tensor *t) {
  try {
    // Asked only of a tensor that has a gradient: `mutable_grad` would give one that has no
    // autograd metadata some, which is a change of its own.
    if (t != nullptr && t->defined() && t->grad().defined()) {
      t->mutable_grad().reset();
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

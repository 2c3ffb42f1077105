// The mHC site's CUDA ops and their autograd, in C++ (mhc_lab/ops/native.py builds and loads this file).
//
// Each op allocates its outputs and scratch buffers and launches the site's TileLang kernels through their TVM FFI
// entry functions, on torch's current stream; the autograd Functions save what the backward needs and call the
// backward ops. Which kernels run is decided once per configuration in Python (a Plan: the entry functions and
// the few sizes their buffers take), so that a call costs the host only its allocations and launches: in Python
// the same orchestration took about 0.8 ms of host time per site forward and backward, more than a small
// model's site takes on the GPU.
//
//   pre_forward(plan, x, phi, bias, alpha, partial_in)   -> y, post, res, pre, partial, link
//   pre_backward(plan, x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post) -> dx, dphi, dbias_alpha
//   post_forward(plan, x, f, post, res, phi_next)        -> the next lanes, partial_next
//   post_backward(plan, x, f, post, res, g)              -> dx, df, dpost, dres
//   pre(...), post(...)                                   the same forwards, differentiable (torch autograd)
//
// The contracts (shapes, dtypes, what link and partial stand for) are those of mhc_lab/ops/site_ops.py.

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <optional>
#include <string>

namespace mhc_native {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A kernel's TVM FFI entry function (borrowed: Python keeps the compiled kernel alive with its plan).
using Entry = int64_t;

struct Plan {
  int64_t n = 0, C = 0;
  int64_t splits = 0;       // the first axis of the partial sums this op makes (pre, post) or takes (pre backward)
  int64_t phi_rows = 0;     // rows of phi split into bf16 hi and lo (pre_split.phi_rows)
  int64_t gemm_depth = 0;   // kernel 2's K per half (pre_backward_operands.gemm_depth)
  int64_t coef_width = 0;   // columns of kernel 1's coef output (pre_backward_operands.coef_width)
  int64_t extra = 0;        // kernel 1's per-token extras after dlogit (pre_backward_operands.EXTRA)
  int64_t lane_splits = 0;  // token splits of kernel 2 (the first axis of its dphi output)
  bool add_dx = false, post_grad = false, lanes_grad = true;
  // pre forward: phi_split, project (none where the previous post projected), coefficients, mix
  // post forward: post; with the next phi also phi_split and post_project (Hopper), or project after post
  // pre backward: k1_reduce and k1_tokens (or k1_fused), then k2; post backward: post_backward
  Entry phi_split = 0, project = 0, coefficients = 0, mix = 0, post = 0, post_project = 0;
  Entry k1_reduce = 0, k1_tokens = 0, k1_fused = 0, k2 = 0, post_backward = 0;

  int64_t mixes() const { return n * n + 2 * n; }
};

DLDataType dl_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DLDataType{kDLFloat, 32, 1};
    case at::kBFloat16: return DLDataType{kDLBfloat, 16, 1};
    case at::kHalf: return DLDataType{kDLFloat, 16, 1};
    default: TORCH_CHECK(false, "mhc_lab native ops: a kernel takes float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
}

// One kernel call: its tensors as DLTensors (views of the torch tensors, which outlive the call).
class Call {
 public:
  explicit Call(const char* name) : name_(name) {}

  Call& operator<<(const Tensor& t) {
    TORCH_CHECK(count_ < kMax, name_, ": too many arguments");
    DLTensor& d = tensors_[count_];
    d.data = t.data_ptr();
    d.device = DLDevice{t.is_cuda() ? kDLCUDA : kDLCPU, t.is_cuda() ? static_cast<int32_t>(t.get_device()) : 0};
    d.ndim = static_cast<int32_t>(t.dim());
    d.dtype = dl_dtype(t);
    d.shape = const_cast<int64_t*>(t.sizes().data());
    d.strides = const_cast<int64_t*>(t.strides().data());
    d.byte_offset = 0;
    TVMFFIAny& a = args_[count_];
    a.type_index = kTVMFFIDLTensorPtr;
    a.zero_padding = 0;
    a.v_int64 = 0;
    a.v_ptr = &d;
    ++count_;
    return *this;
  }

  void run(Entry entry) {
    TORCH_CHECK(entry != 0, name_, ": the plan holds no such kernel (built for another configuration)");
    TVMFFIAny result;
    result.type_index = kTVMFFINone;
    result.zero_padding = 0;
    result.v_int64 = 0;
    if (TVMFFIFunctionCall(reinterpret_cast<TVMFFIObjectHandle>(entry), args_, count_, &result) != 0) {
      TVMFFIObjectHandle error = nullptr;
      TVMFFIErrorMoveFromRaised(&error);
      std::string what = "unknown error";
      if (error != nullptr) {
        const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
        what = std::string(cell->kind.data, cell->kind.size) + ": " +
               std::string(cell->message.data, cell->message.size);
        TVMFFIObjectDecRef(error);
      }
      TORCH_CHECK(false, "mhc_lab kernel ", name_, " failed: ", what);
    }
  }

 private:
  static constexpr int kMax = 16;
  const char* name_;
  DLTensor tensors_[kMax];
  TVMFFIAny args_[kMax];
  int count_ = 0;
};

// The kernels launch on torch's current stream of x's GPU, with that GPU current, as TileLang's Python calls do.
class OnDevice {
 public:
  explicit OnDevice(const Tensor& x) : guard_(x.device()), device_(static_cast<int32_t>(x.get_device())) {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    void* stream = impl.getStream(x.device()).native_handle();
    TORCH_CHECK(TVMFFIEnvSetStream(kDLCUDA, device_, stream, &previous_) == 0, "mhc_lab: setting the stream failed");
  }
  ~OnDevice() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }

 private:
  c10::DeviceGuard guard_;
  int32_t device_;
  TVMFFIStreamHandle previous_ = nullptr;
};

void check_cuda(const Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.scalar_type() == at::kBFloat16,
              op, ": x: expected bfloat16 lanes [T, n, C] on a CUDA device, got ", x.sizes(), " ", x.scalar_type(),
              " on ", x.device());
}

Tensor f32(const Tensor& t) { return t.to(at::kFloat).contiguous(); }

Tensor empty_partial(const Tensor& x) { return at::empty({0}, x.options().dtype(at::kFloat)); }

// phi [n^2+2n, nC] split into bf16 hi and lo rows (the projection's tensor-core operand)
Tensor split_phi(const Plan& p, const Tensor& phi32) {
  Tensor phi_hl = at::empty({p.phi_rows, p.n * p.C}, phi32.options().dtype(at::kBFloat16));
  (Call("phi split") << phi32 << phi_hl).run(p.phi_split);
  return phi_hl;
}

// ------------------------------------------------------------------------------------------------ the ops

std::vector<Tensor> pre_forward(const Plan& p, const Tensor& x_in, const Tensor& phi, const Tensor& bias,
                                const Tensor& alpha, const std::optional<Tensor>& partial_in) {
  check_cuda(x_in, "pre_forward");
  const Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), n = p.n, C = p.C, m = p.mixes();
  TORCH_CHECK(x.size(1) == n && x.size(2) == C, "pre_forward: x: expected [T, ", n, ", ", C, "] (the plan's), got ",
              x.sizes());
  const auto opts = x.options().dtype(at::kFloat);
  Tensor y = at::empty({T, C}, x.options());
  Tensor post = at::empty({T, n}, opts), res = at::empty({T, n, n}, opts), pre = at::empty({T, n}, opts);
  const bool projected = partial_in.has_value();
  Tensor partial;
  if (projected) {
    partial = partial_in->contiguous();
    TORCH_CHECK(partial.dim() == 3 && partial.size(0) == p.splits && partial.size(1) == T &&
                    partial.size(2) == m + 1 && partial.scalar_type() == at::kFloat,
                "pre_forward: partial_in: expected [", p.splits, ", ", T, ", ", m + 1, "] float32, got ",
                partial.sizes(), " ", partial.scalar_type());
  } else {
    partial = at::empty({p.splits, T, m + 1}, opts);
  }
  if (T > 0) {
    OnDevice on(x);
    const Tensor bias32 = f32(bias), alpha32 = f32(alpha);
    if (!projected) {
      const Tensor phi_hl = split_phi(p, f32(phi));
      (Call("projection pass") << x.view({T, n * C}) << phi_hl << partial).run(p.project);
    }
    (Call("pre coefficients") << partial << bias32 << alpha32 << pre << post << res).run(p.coefficients);
    (Call("lane mix") << x << pre << y).run(p.mix);
  }
  // link stands for H_res x without holding it: a view of one element that nothing reads
  Tensor link = at::empty({1}, x.options()).expand(x.sizes());
  return {y, post, res, pre, projected ? empty_partial(x) : partial, link};
}

std::vector<Tensor> pre_backward(const Plan& p, const Tensor& x_in, const Tensor& phi, const Tensor& bias,
                                 const Tensor& alpha, const Tensor& pre, const Tensor& partial, const Tensor& res,
                                 const Tensor& dy_in, const Tensor& dpost_in, const Tensor& dres_in,
                                 const std::optional<Tensor>& dx_post) {
  check_cuda(x_in, "pre_backward");
  const Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), n = p.n, C = p.C, m = p.mixes();
  const bool linked = p.add_dx || p.post_grad;
  TORCH_CHECK(linked == dx_post.has_value(), "pre_backward: dx_post: the plan ",
              linked ? "adds the linked post's gradient, got none" : "is for a pre without a linked post, got one");
  const auto opts = x.options().dtype(at::kFloat);
  Tensor dpre = at::empty({T, n}, opts), dtok = at::empty({T, m + p.extra}, opts), dmix = at::empty({T, m}, opts);
  Tensor dsplit = at::empty({T, 3, 2 * p.gemm_depth}, x.options());
  Tensor coef = at::empty({T, p.coef_width}, opts);
  Tensor dphi_partial = (T > 0 ? at::empty({p.lane_splits, 2 * p.gemm_depth, n * C}, opts)
                               : at::zeros({p.lane_splits, 2 * p.gemm_depth, n * C}, opts));
  Tensor dx = at::empty_like(x);
  if (T > 0) {
    OnDevice on(x);
    const Tensor dy = dy_in.contiguous(), dpost = f32(dpost_in), dres = f32(dres_in), pre32 = pre.contiguous();
    const Tensor bias32 = f32(bias), alpha32 = f32(alpha), partial_c = partial.contiguous();
    if (p.k1_fused != 0) {
      (Call("pre backward kernel 1") << x << dy << partial_c << bias32 << alpha32 << dpost << dres << pre32 << dpre
                                     << dtok << dmix << dsplit << coef).run(p.k1_fused);
    } else {
      (Call("pre backward kernel 1 (reduction)") << x << dy << dpre).run(p.k1_reduce);
      (Call("pre backward kernel 1") << partial_c << bias32 << alpha32 << dpost << dres << pre32 << dpre << dtok
                                     << dmix << dsplit << coef).run(p.k1_tokens);
    }
    const Tensor phi32 = f32(phi);
    Call lanes("pre backward kernel 2");
    lanes << x << dy << dsplit << coef << phi32;
    Tensor more, res32;
    if (linked) {
      more = dx_post->to(x.scalar_type()).contiguous();
      lanes << more;
    }
    if (p.post_grad) {
      res32 = f32(res);
      lanes << res32;
    }
    (lanes << dx << dphi_partial).run(p.k2);
  }
  // dphi: kernel 2's partial sums over token splits and the dmix hi and lo halves (rows past m are padding)
  const int64_t first_two[] = {0, 1};
  Tensor dphi = dphi_partial.view({p.lane_splits, 2, p.gemm_depth, n * C}).narrow(2, 0, m)
                    .sum(at::IntArrayRef(first_two, 2));
  return {dx, dphi.to(phi.scalar_type()), dtok.sum(at::IntArrayRef(first_two, 1))};
}

std::vector<Tensor> post_forward(const Plan& p, const Tensor& x_in, const Tensor& f_in, const Tensor& post,
                                 const Tensor& res, const std::optional<Tensor>& phi_next) {
  check_cuda(x_in, "post_forward");
  const Tensor x = x_in.contiguous(), f = f_in.contiguous();
  const int64_t T = x.size(0), n = p.n, C = p.C, m = p.mixes();
  TORCH_CHECK(x.size(1) == n && x.size(2) == C, "post_forward: x: expected [T, ", n, ", ", C, "] (the plan's), got ",
              x.sizes());
  Tensor out = at::empty_like(x);
  Tensor partial = phi_next.has_value() ? at::empty({p.splits, T, m + 1}, x.options().dtype(at::kFloat))
                                        : empty_partial(x);
  if (T > 0) {
    OnDevice on(x);
    const Tensor post32 = f32(post), res32 = f32(res);
    if (phi_next.has_value() && p.post_project != 0) {  // the next lanes projected while on chip
      const Tensor phi_hl = split_phi(p, f32(*phi_next));
      (Call("post + projection") << x << f << post32 << res32 << phi_hl << out << partial).run(p.post_project);
    } else {
      (Call("post") << x << f << post32 << res32 << out).run(p.post);
      if (phi_next.has_value()) {  // the next pre's projection pass on the next lanes
        const Tensor phi_hl = split_phi(p, f32(*phi_next));
        (Call("projection pass") << out.view({T, n * C}) << phi_hl << partial).run(p.project);
      }
    }
  }
  return {out, partial};
}

std::vector<Tensor> post_backward(const Plan& p, const Tensor& x_in, const Tensor& f_in, const Tensor& post,
                                  const Tensor& res, const Tensor& g_in) {
  check_cuda(x_in, "post_backward");
  const Tensor x = x_in.contiguous(), f = f_in.contiguous();
  const int64_t T = x.size(0), n = p.n;
  const auto opts = x.options().dtype(at::kFloat);
  Tensor dpost = at::empty({T, n}, opts), dres = at::empty({T, n, n}, opts);
  Tensor dx = p.lanes_grad ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor df = at::empty_like(f);
  if (T > 0) {
    OnDevice on(x);
    const Tensor g = g_in.contiguous(), post32 = f32(post), res32 = f32(res);
    Call call("post backward");
    call << x << f << g << post32 << res32;
    if (p.lanes_grad) call << dx;
    (call << df << dpost << dres).run(p.post_backward);
  }
  return {dx, df, dpost.to(post.scalar_type()), dres.to(res.scalar_type())};
}

// ------------------------------------------------------------------------------------------- autograd

const Plan& plan_of(AutogradContext* ctx, const char* key) {
  return *reinterpret_cast<const Plan*>(ctx->saved_data[key].toInt());
}

// The pre of a site. backward_plan: kernel 2 for a pre linked to its post (link's gradient added to dx) or not.
struct Pre : public torch::autograd::Function<Pre> {
  static variable_list forward(AutogradContext* ctx, const Plan* forward_plan, const Plan* backward_plan, Tensor x,
                               Tensor phi, Tensor bias, Tensor alpha, std::optional<Tensor> partial_in) {
    auto out = pre_forward(*forward_plan, x, phi, bias, alpha, partial_in);
    ctx->saved_data["plan"] = reinterpret_cast<int64_t>(backward_plan);
    ctx->save_for_backward({x, phi, bias, alpha, out[3], partial_in.has_value() ? *partial_in : out[4], out[2]});
    ctx->mark_non_differentiable({out[3], out[4]});
    // an unused output's gradient arrives undefined: a materialised zero link gradient would cost a pass
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Plan& p = plan_of(ctx, "plan");
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &phi = saved[1], &bias = saved[2], &alpha = saved[3], &pre = saved[4];
    const int64_t T = x.size(0), n = x.size(1), C = x.size(2), m = bias.size(0);
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros({T, C}, x.options());
    const Tensor dpost = grads[1].defined() ? grads[1] : at::zeros_like(pre);
    const Tensor dres = grads[2].defined() ? grads[2] : at::zeros({T, n, n}, pre.options());
    std::optional<Tensor> dx_post;
    if (p.add_dx || p.post_grad) {  // the next lanes unused: their gradient is zero
      dx_post = grads[5].defined() ? grads[5] : at::zeros_like(x);
    } else {
      TORCH_CHECK(!grads[5].defined(), "mhc_lab native pre: link was used, but the plan has no linked backward");
    }
    auto g = pre_backward(p, x, phi, bias, alpha, pre, saved[5], saved[6], dy, dpost, dres, dx_post);
    return {Tensor(), Tensor(), g[0], g[1], g[2].narrow(0, 0, m).to(bias.scalar_type()),
            g[2].narrow(0, m, 3).to(alpha.scalar_type()), Tensor()};
  }
};

// The post of a site: linked (link from the site's pre stands for H_res x; the lanes' gradient goes back through
// link, as H_res^T g or, with the plan's post_grad, as g itself for the pre's kernel 2 to finish) or not.
struct Post : public torch::autograd::Function<Post> {
  static variable_list forward(AutogradContext* ctx, const Plan* forward_plan, const Plan* backward_plan,
                               bool linked, Tensor x, std::optional<Tensor> link, Tensor f, Tensor post, Tensor res,
                               std::optional<Tensor> phi_next) {
    auto out = post_forward(*forward_plan, x, f, post, res, phi_next);
    ctx->saved_data["plan"] = reinterpret_cast<int64_t>(backward_plan);
    ctx->saved_data["linked"] = linked;
    ctx->save_for_backward({x, f, post, res});
    ctx->mark_non_differentiable({out[1]});
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return variable_list(9);  // the next lanes unused
    const Plan& p = plan_of(ctx, "plan");
    const bool linked = ctx->saved_data["linked"].toBool();
    auto saved = ctx->get_saved_variables();
    auto d = post_backward(p, saved[0], saved[1], saved[2], saved[3], g.contiguous());
    Tensor dlanes = linked && !p.lanes_grad ? g.contiguous() : d[0];
    return {Tensor(), Tensor(), Tensor(), linked ? Tensor() : dlanes, linked ? dlanes : Tensor(),
            d[1], d[2], d[3], Tensor()};
  }
};

std::vector<Tensor> pre(const Plan& forward_plan, const Plan& backward_plan, const Tensor& x, const Tensor& phi,
                        const Tensor& bias, const Tensor& alpha, const std::optional<Tensor>& partial_in) {
  return Pre::apply(&forward_plan, &backward_plan, x, phi, bias, alpha, partial_in);
}

std::vector<Tensor> post(const Plan& forward_plan, const Plan& backward_plan, bool linked, const Tensor& x,
                         const std::optional<Tensor>& link, const Tensor& f, const Tensor& post_,
                         const Tensor& res, const std::optional<Tensor>& phi_next) {
  return Post::apply(&forward_plan, &backward_plan, linked, x, link, f, post_, res, phi_next);
}

}  // namespace mhc_native

using namespace mhc_native;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The mHC site's CUDA ops and their autograd (mhc_lab.ops.native).";
  auto plan = pybind11::class_<Plan>(m, "Plan", pybind11::dynamic_attr()).def(pybind11::init<>());
#define MHC_FIELD(name) plan.def_readwrite(#name, &Plan::name)
  MHC_FIELD(n); MHC_FIELD(C); MHC_FIELD(splits); MHC_FIELD(phi_rows); MHC_FIELD(gemm_depth); MHC_FIELD(coef_width);
  MHC_FIELD(extra); MHC_FIELD(lane_splits); MHC_FIELD(add_dx); MHC_FIELD(post_grad); MHC_FIELD(lanes_grad);
  MHC_FIELD(phi_split); MHC_FIELD(project); MHC_FIELD(coefficients); MHC_FIELD(mix); MHC_FIELD(post);
  MHC_FIELD(post_project); MHC_FIELD(k1_reduce); MHC_FIELD(k1_tokens); MHC_FIELD(k1_fused); MHC_FIELD(k2);
  MHC_FIELD(post_backward);
#undef MHC_FIELD
  m.def("pre_forward", &pre_forward);
  m.def("pre_backward", &pre_backward);
  m.def("post_forward", &post_forward);
  m.def("post_backward", &post_backward);
  m.def("pre", &pre);
  m.def("post", &post);
}

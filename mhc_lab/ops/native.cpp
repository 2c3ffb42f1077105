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
//   joint(post plans, pre plans, project, x, link, f, post, res, phi, bias, alpha)
//                                                         a post, then the next site's pre: one autograd node
//
// Loading the module also registers these ops as the CUDA kernels of torch.ops.mhc_lab.* (the custom ops of
// site_ops.py), with an AutogradCUDA kernel that skips Python where no gradient is needed: the end of this file.
//
// x: lanes [..., n, C]; the per-token outputs keep x's leading dims (y [..., C], post [..., n], res [..., n, n]).
// The contracts (shapes, dtypes, what link and partial stand for) are those of mhc_lab/ops/site_ops.py.

#include <torch/extension.h>

#include <ATen/record_function.h>

#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <array>
#include <map>
#include <mutex>
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
  // pre backward: k1_reduce and k1_tokens (or k1_fused), k2, then sums; post backward: post_backward
  Entry phi_split = 0, project = 0, coefficients = 0, mix = 0, post = 0, post_project = 0;
  Entry k1_reduce = 0, k1_tokens = 0, k1_fused = 0, k2 = 0, sums = 0, post_backward = 0;

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

// One kernel call: its tensors as DLTensors (views of the torch tensors, which outlive the call). `as` hands a
// contiguous tensor over in the shape the kernel declares (lanes [..., n, C] as [T, n, C] or [T, n*C]) without
// making a view of it on the host.
class Call {
 public:
  explicit Call(const char* name) : name_(name) {}

  Call& arg(const Tensor& t) { return add(t, t.sizes(), t.strides()); }

  Call& as(const Tensor& t, std::initializer_list<int64_t> shape) {
    const int i = count_;
    TORCH_CHECK(i < kMax && static_cast<int>(shape.size()) <= kDims, name_, ": too many arguments or dimensions");
    TORCH_CHECK(t.is_contiguous() && c10::multiply_integers(shape) == t.numel(), name_, ": a tensor of shape ",
                t.sizes(), " handed over as ", at::IntArrayRef(shape));
    const auto dims = static_cast<int64_t>(shape.size());
    std::copy(shape.begin(), shape.end(), shapes_[i]);
    int64_t stride = 1;
    for (int64_t d = dims - 1; d >= 0; --d) {
      strides_[i][d] = stride;
      stride *= shapes_[i][d];
    }
    return add(t, at::IntArrayRef(shapes_[i], dims), at::IntArrayRef(strides_[i], dims));
  }

  void run(Entry entry) {
    // a profiler's trace names each launch (the launch's host time, not the kernel's GPU time)
    RECORD_FUNCTION(name_, std::vector<c10::IValue>());
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
      TORCH_CHECK(false, name_, " failed: ", what);
    }
  }

 private:
  static constexpr int kMax = 16, kDims = 4;

  Call& add(const Tensor& t, at::IntArrayRef shape, at::IntArrayRef strides) {
    TORCH_CHECK(count_ < kMax, name_, ": too many arguments");
    DLTensor& d = tensors_[count_];
    d.data = t.data_ptr();
    d.device = DLDevice{t.is_cuda() ? kDLCUDA : kDLCPU, t.is_cuda() ? static_cast<int32_t>(t.get_device()) : 0};
    d.ndim = static_cast<int32_t>(shape.size());
    d.dtype = dl_dtype(t);
    d.shape = const_cast<int64_t*>(shape.data());
    d.strides = const_cast<int64_t*>(strides.data());
    d.byte_offset = 0;
    TVMFFIAny& a = args_[count_];
    a.type_index = kTVMFFIDLTensorPtr;
    a.zero_padding = 0;
    a.v_int64 = 0;
    a.v_ptr = &d;
    ++count_;
    return *this;
  }

  const char* name_;
  DLTensor tensors_[kMax];
  TVMFFIAny args_[kMax];
  int64_t shapes_[kMax][kDims], strides_[kMax][kDims];
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

// ------------------------------------------------------------------------------------------- allocations
//
// Each at::empty and each view made through ATen costs the host a dispatch (an allocation also a trip through
// the caching allocator), several microseconds each where one site's forward and backward made about twenty.
// So an op's tensors share one allocation where they can, views are made by hand on a tensor's storage, and the lanes
// keep their leading dims ([..., n, C]: no reshape before the ops, no view backward after them).

// A tensor of this dtype, sizes and strides on t's storage, elements from t's start on (no dispatch; autograd
// does not see it as a view of t: made only for scratch and for outputs, never written through another).
Tensor on_storage(const Tensor& t, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype,
                  int64_t byte_offset = 0) {
  Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(),
                                                        c10::scalarTypeToTypeMeta(dtype));
  const int64_t start = t.storage_offset() * static_cast<int64_t>(t.element_size()) + byte_offset;
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, start / c10::elementSize(dtype));
  return out;
}

// The lanes' leading dims followed by these: [..., n, C] -> [..., tail].
c10::DimVector batch_shape(const Tensor& x, std::initializer_list<int64_t> tail) {
  c10::DimVector shape(x.sizes().begin(), x.sizes().end() - 2);
  shape.append(tail.begin(), tail.end());
  return shape;
}

struct Piece {
  c10::DimVector sizes;
  at::ScalarType dtype;
  bool broadcast = false;  // one element seen at every index (strides 0): link
};

// The pieces, each contiguous (or broadcast), in one allocation where pooled, else one allocation each:
// torch.library's custom ops promise outputs that alias nothing, not even each other, so only the C++ autograd
// path pools its outputs (scratch is always pooled).
std::vector<Tensor> allocate(const Tensor& like, std::initializer_list<Piece> pieces, bool pooled) {
  constexpr int64_t kAlign = 256;  // each piece's start, for the kernels' wide loads
  std::vector<Tensor> out;
  out.reserve(pieces.size());
  c10::SmallVector<int64_t, 8> counts, offsets;
  int64_t bytes = 0;
  for (const Piece& piece : pieces) {
    counts.push_back(piece.broadcast ? 1 : c10::multiply_integers(piece.sizes));
    offsets.push_back(bytes);
    bytes += (counts.back() * static_cast<int64_t>(c10::elementSize(piece.dtype)) + kAlign - 1) / kAlign * kAlign;
  }
  const Tensor block = pooled ? at::empty({bytes}, like.options().dtype(at::kByte)) : Tensor();
  size_t i = 0;
  for (const Piece& piece : pieces) {
    const c10::DimVector strides = piece.broadcast ? c10::DimVector(piece.sizes.size(), 0)
                                                   : c10::DimVector(c10::contiguous_strides(piece.sizes));
    const Tensor base = pooled ? block : at::empty({counts[i]}, like.options().dtype(piece.dtype));
    out.push_back(on_storage(base, piece.sizes, strides, piece.dtype, pooled ? offsets[i] : 0));
    ++i;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ the ops

// T of lanes x [..., n, C], bf16 on a CUDA device, n and C the plan's.
int64_t tokens_of(const Tensor& x, const Plan& p, const char* op) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 2 && x.scalar_type() == at::kBFloat16, op,
              ": x: expected bfloat16 lanes [..., n, C] on a CUDA device, got ", x.sizes(), " ", x.scalar_type(),
              " on ", x.device());
  TORCH_CHECK(x.size(-2) == p.n && x.size(-1) == p.C, op, ": x: expected [..., ", p.n, ", ", p.C,
              "] (the plan's), got ", x.sizes());
  return x.numel() / (p.n * p.C);
}

Tensor as_dtype(const Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

Tensor f32(const Tensor& t) { return as_dtype(t, at::kFloat).contiguous(); }

// The piece of an op's allocation that phi split takes (wanted: the op splits phi and pools its scratch).
Piece phi_hl_piece(const Plan& p, bool wanted) {
  return {wanted ? c10::DimVector{p.phi_rows, p.n * p.C} : c10::DimVector{0}, at::kBFloat16};
}

// phi [n^2+2n, nC] split into bf16 hi and lo rows [phi_rows, nC] (the projection's tensor-core operand): into
// `piece` (the op's phi_hl_piece) where it was wanted, else into an allocation of its own.
Tensor split_phi(const Plan& p, const Tensor& phi, const Tensor& piece) {
  const Tensor phi_hl =
      piece.numel() ? piece : at::empty({p.phi_rows, p.n * p.C}, phi.options().dtype(at::kBFloat16));
  Call("mhc_lab launch: phi split").arg(f32(phi)).arg(phi_hl).run(p.phi_split);
  return phi_hl;
}

// Each op takes lanes x [..., n, C] and gives its per-token outputs the same leading dims. pooled: an op's
// outputs and scratch share one allocation (the C++ autograd path; see allocate), except the pre backward's dx
// and its parameter gradients, which outlive the op (the scratch would live as long as they do).

std::vector<Tensor> pre_forward_impl(const Plan& p, const Tensor& x_in, const Tensor& phi, const Tensor& bias,
                                     const Tensor& alpha, const std::optional<Tensor>& partial_in, bool pooled) {
  RECORD_FUNCTION("mhc_lab_native::pre_forward", std::vector<c10::IValue>());
  const int64_t T = tokens_of(x_in, p, "pre_forward"), n = p.n, C = p.C, m = p.mixes();
  const Tensor x = x_in.contiguous();
  const bool projected = partial_in.has_value();
  if (projected) {
    const Tensor& given = *partial_in;
    TORCH_CHECK(given.dim() == 3 && given.size(0) == p.splits && given.size(1) == T && given.size(2) == m + 1 &&
                    given.scalar_type() == at::kFloat,
                "pre_forward: partial_in: expected [", p.splits, ", ", T, ", ", m + 1, "] float32, got ",
                given.sizes(), " ", given.scalar_type());
  }
  const auto f = at::kFloat;
  // link stands for H_res x without holding it: one element seen at every index, which nothing reads
  auto out = allocate(x, {{batch_shape(x, {C}), x.scalar_type()}, {batch_shape(x, {n}), f},
                          {batch_shape(x, {n, n}), f}, {batch_shape(x, {n}), f},
                          {projected ? c10::DimVector{0} : c10::DimVector{p.splits, T, m + 1}, f},
                          {c10::DimVector(x.sizes().begin(), x.sizes().end()), x.scalar_type(), true},
                          phi_hl_piece(p, !projected && pooled && T > 0)},
                      pooled);
  const Tensor &y = out[0], &post = out[1], &res = out[2], &pre = out[3];
  const Tensor partial = projected ? partial_in->contiguous() : out[4];
  if (T > 0) {
    OnDevice on(x);
    const Tensor bias32 = f32(bias), alpha32 = f32(alpha);
    if (!projected) {
      const Tensor phi_hl = split_phi(p, phi, out[6]);
      Call("mhc_lab launch: projection pass").as(x, {T, n * C}).arg(phi_hl).arg(partial).run(p.project);
    }
    Call("mhc_lab launch: pre coefficients").arg(partial).arg(bias32).arg(alpha32).as(pre, {T, n})
        .as(post, {T, n}).as(res, {T, n, n}).run(p.coefficients);
    Call("mhc_lab launch: lane mix").as(x, {T, n, C}).as(pre, {T, n}).as(y, {T, C}).run(p.mix);
  }
  out.pop_back();  // phi_hl
  return out;
}

std::vector<Tensor> pre_backward_impl(const Plan& p, const Tensor& x_in, const Tensor& phi, const Tensor& bias,
                                      const Tensor& alpha, const Tensor& pre, const Tensor& partial,
                                      const Tensor& res, const Tensor& dy_in, const Tensor& dpost_in,
                                      const Tensor& dres_in, const std::optional<Tensor>& dx_post, bool pooled) {
  RECORD_FUNCTION("mhc_lab_native::pre_backward", std::vector<c10::IValue>());
  const int64_t T = tokens_of(x_in, p, "pre_backward"), n = p.n, C = p.C, m = p.mixes();
  const Tensor x = x_in.contiguous();
  const bool linked = p.add_dx || p.post_grad;
  TORCH_CHECK(linked == dx_post.has_value(), "pre_backward: dx_post: the plan ",
              linked ? "adds the linked post's gradient, got none" : "is for a pre without a linked post, got one");
  const auto f = at::kFloat;
  const int64_t depth = p.gemm_depth, splits = p.lane_splits, width = m + p.extra, nC = n * C;
  auto scratch = allocate(x, {{{T, n}, f}, {{T, width}, f}, {{T, m}, f}, {{T, 3, 2 * depth}, x.scalar_type()},
                              {{T, p.coef_width}, f}, {{splits, 2 * depth, nC}, f}}, true);
  const Tensor &dpre = scratch[0], &dtok = scratch[1], &dmix = scratch[2], &dsplit = scratch[3];
  const Tensor &coef = scratch[4], &dphi_partial = scratch[5];
  Tensor dx = at::empty(x.sizes(), x.options());
  auto sums = allocate(x, {{{m, nC}, f}, {{width}, f}}, pooled);
  Tensor &dphi = sums[0], &dtok_sum = sums[1];
  if (T == 0) {
    dphi.zero_();
    dtok_sum.zero_();
    return {dx, as_dtype(dphi, phi.scalar_type()), dtok_sum};
  }
  {
    OnDevice on(x);
    const Tensor dy = dy_in.contiguous(), dpost = f32(dpost_in), dres = f32(dres_in), pre32 = pre.contiguous();
    const Tensor bias32 = f32(bias), alpha32 = f32(alpha), partial_c = partial.contiguous();
    if (p.k1_fused != 0) {
      Call("mhc_lab launch: pre backward kernel 1").as(x, {T, n, C}).as(dy, {T, C}).arg(partial_c).arg(bias32)
          .arg(alpha32).as(dpost, {T, n}).as(dres, {T, n, n}).as(pre32, {T, n}).arg(dpre).arg(dtok).arg(dmix)
          .arg(dsplit).arg(coef).run(p.k1_fused);
    } else {
      Call("mhc_lab launch: pre backward kernel 1 (reduction)").as(x, {T, n, C}).as(dy, {T, C}).arg(dpre)
          .run(p.k1_reduce);
      Call("mhc_lab launch: pre backward kernel 1").arg(partial_c).arg(bias32).arg(alpha32).as(dpost, {T, n})
          .as(dres, {T, n, n}).as(pre32, {T, n}).arg(dpre).arg(dtok).arg(dmix).arg(dsplit).arg(coef)
          .run(p.k1_tokens);
    }
    const Tensor phi32 = f32(phi);
    Call lanes("mhc_lab launch: pre backward kernel 2");
    lanes.as(x, {T, n, C}).as(dy, {T, C}).arg(dsplit).arg(coef).arg(phi32);
    Tensor more, res32;
    if (linked) {
      more = as_dtype(*dx_post, x.scalar_type()).contiguous();
      lanes.as(more, {T, n, C});
    }
    if (p.post_grad) {
      res32 = f32(res);
      lanes.as(res32, {T, n, n});
    }
    lanes.as(dx, {T, n, C}).arg(dphi_partial).run(p.k2);
    // dphi from kernel 2's sums per token split and dmix half, bias's and alpha's gradients from kernel 1's per
    // token: the two reductions over the tokens in one launch
    Call("mhc_lab launch: pre backward sums").arg(dphi_partial).arg(dtok).arg(dphi).arg(dtok_sum).run(p.sums);
  }
  return {dx, as_dtype(dphi, phi.scalar_type()), dtok_sum};
}

std::vector<Tensor> post_forward_impl(const Plan& p, const Tensor& x_in, const Tensor& f_in, const Tensor& post,
                                      const Tensor& res, const std::optional<Tensor>& phi_next, bool pooled) {
  RECORD_FUNCTION("mhc_lab_native::post_forward", std::vector<c10::IValue>());
  const int64_t T = tokens_of(x_in, p, "post_forward"), n = p.n, C = p.C, m = p.mixes();
  const Tensor x = x_in.contiguous(), f = f_in.contiguous();
  const bool project = phi_next.has_value();
  // the next lanes, their projection for the next pre, and phi_next split (scratch: with the outputs when pooled)
  auto out = allocate(x, {{c10::DimVector(x.sizes().begin(), x.sizes().end()), x.scalar_type()},
                          {project ? c10::DimVector{p.splits, T, m + 1} : c10::DimVector{0}, at::kFloat},
                          phi_hl_piece(p, project && pooled && T > 0)},
                      pooled);
  const Tensor &next = out[0], &partial = out[1];
  if (T > 0) {
    OnDevice on(x);
    const Tensor post32 = f32(post), res32 = f32(res);
    const Tensor phi_hl = project ? split_phi(p, *phi_next, out[2]) : Tensor();
    if (project && p.post_project != 0) {  // the next lanes projected while on chip
      Call("mhc_lab launch: post + projection").as(x, {T, n, C}).as(f, {T, C}).as(post32, {T, n})
          .as(res32, {T, n, n}).arg(phi_hl).as(next, {T, n, C}).arg(partial).run(p.post_project);
    } else {
      Call("mhc_lab launch: post").as(x, {T, n, C}).as(f, {T, C}).as(post32, {T, n}).as(res32, {T, n, n})
          .as(next, {T, n, C}).run(p.post);
      if (project) {  // the next pre's projection pass on the next lanes
        Call("mhc_lab launch: projection pass").as(next, {T, n * C}).arg(phi_hl).arg(partial).run(p.project);
      }
    }
  }
  return {next, partial};  // not phi_hl
}

std::vector<Tensor> post_backward_impl(const Plan& p, const Tensor& x_in, const Tensor& f_in, const Tensor& post,
                                       const Tensor& res, const Tensor& g_in, bool pooled) {
  RECORD_FUNCTION("mhc_lab_native::post_backward", std::vector<c10::IValue>());
  const int64_t T = tokens_of(x_in, p, "post_backward"), n = p.n, C = p.C;
  const Tensor x = x_in.contiguous(), f = f_in.contiguous();
  const auto fl = at::kFloat;
  auto out = allocate(x, {{c10::DimVector(post.sizes().begin(), post.sizes().end()), fl},
                          {c10::DimVector(res.sizes().begin(), res.sizes().end()), fl},
                          {p.lanes_grad ? c10::DimVector(x.sizes().begin(), x.sizes().end()) : c10::DimVector{0},
                           x.scalar_type()},
                          {c10::DimVector(f.sizes().begin(), f.sizes().end()), f.scalar_type()}},
                      pooled);
  const Tensor &dpost = out[0], &dres = out[1], &dx = out[2], &df = out[3];
  if (T > 0) {
    OnDevice on(x);
    const Tensor g = g_in.contiguous(), post32 = f32(post), res32 = f32(res);
    Call call("mhc_lab launch: post backward");
    call.as(x, {T, n, C}).as(f, {T, C}).as(g, {T, n, C}).as(post32, {T, n}).as(res32, {T, n, n});
    if (p.lanes_grad) call.as(dx, {T, n, C});
    call.as(df, {T, C}).as(dpost, {T, n}).as(dres, {T, n, n}).run(p.post_backward);
  }
  return {dx, df, as_dtype(dpost, post.scalar_type()), as_dtype(dres, res.scalar_type())};
}

// The raw ops (torch.library's custom ops call these): outputs of their own.
std::vector<Tensor> pre_forward(const Plan& p, const Tensor& x, const Tensor& phi, const Tensor& bias,
                                const Tensor& alpha, const std::optional<Tensor>& partial_in) {
  return pre_forward_impl(p, x, phi, bias, alpha, partial_in, false);
}

std::vector<Tensor> pre_backward(const Plan& p, const Tensor& x, const Tensor& phi, const Tensor& bias,
                                 const Tensor& alpha, const Tensor& pre, const Tensor& partial, const Tensor& res,
                                 const Tensor& dy, const Tensor& dpost, const Tensor& dres,
                                 const std::optional<Tensor>& dx_post) {
  return pre_backward_impl(p, x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post, false);
}

std::vector<Tensor> post_forward(const Plan& p, const Tensor& x, const Tensor& f, const Tensor& post,
                                 const Tensor& res, const std::optional<Tensor>& phi_next) {
  return post_forward_impl(p, x, f, post, res, phi_next, false);
}

std::vector<Tensor> post_backward(const Plan& p, const Tensor& x, const Tensor& f, const Tensor& post,
                                  const Tensor& res, const Tensor& g) {
  return post_backward_impl(p, x, f, post, res, g, false);
}

// ------------------------------------------------------------------------------------------- autograd
//
// Pre (a site's pre), Post (a site's post) and Joint: a post and the next site's pre as one node, the lanes
// between them its own. A chain of L sites is then L + 1 nodes (a pre, L - 1 joints, a post) instead of 2L, and
// L + 1 calls from Python: each node costs the autograd engine's bookkeeping and each call a crossing from Python,
// more host time per site than several kernel launches. pre_gradients and post_gradients are their backwards.

const Plan& plan_of(AutogradContext* ctx, const char* key) {
  return *reinterpret_cast<const Plan*>(ctx->saved_data[key].toInt());
}

// The pre's gradients (x, phi, bias, alpha) from what its forward saved and the gradients of its outputs y, post,
// res and link (undefined where unused).
std::array<Tensor, 4> pre_gradients(const Plan& p, const Tensor& x, const Tensor& phi, const Tensor& bias,
                                    const Tensor& alpha, const Tensor& pre, const Tensor& partial, const Tensor& res,
                                    const Tensor& dy_in, const Tensor& dpost_in, const Tensor& dres_in,
                                    const Tensor& dlink) {
  const int64_t n = p.n, m = bias.size(0);
  const Tensor dy = dy_in.defined() ? dy_in : at::zeros(batch_shape(x, {p.C}), x.options());
  const Tensor dpost = dpost_in.defined() ? dpost_in : at::zeros_like(pre);
  const Tensor dres = dres_in.defined() ? dres_in : at::zeros(batch_shape(x, {n, n}), pre.options());
  std::optional<Tensor> dx_post;
  if (p.add_dx || p.post_grad) {  // the next lanes unused: their gradient is zero
    dx_post = dlink.defined() ? dlink : at::zeros_like(x);
  } else {
    TORCH_CHECK(!dlink.defined(), "mhc_lab native pre: link was used, but the plan has no linked backward");
  }
  auto g = pre_backward_impl(p, x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post, true);
  // bias's and alpha's gradients: the first m and the next 3 of kernel 1's per-token sums
  const Tensor dbias = on_storage(g[2], {m}, {1}, at::kFloat), dalpha = on_storage(g[2], {3}, {1}, at::kFloat, 4 * m);
  return {g[0], g[1], as_dtype(dbias, bias.scalar_type()), as_dtype(dalpha, alpha.scalar_type())};
}

// The post's gradients (lanes, f, post, res) for the gradient g of its output. Linked with the plan's post_grad,
// the lanes' gradient is g itself: the pre's kernel 2 forms H_res^T g.
std::array<Tensor, 4> post_gradients(const Plan& p, bool linked, const Tensor& x, const Tensor& f, const Tensor& post,
                                     const Tensor& res, const Tensor& g) {
  auto d = post_backward_impl(p, x, f, post, res, g, true);
  return {linked && !p.lanes_grad ? g.contiguous() : d[0], d[1], d[2], d[3]};
}

// The pre of a site. backward_plan: kernel 2 for a pre linked to its post (link's gradient added to dx) or not.
struct Pre : public torch::autograd::Function<Pre> {
  static variable_list forward(AutogradContext* ctx, const Plan* forward_plan, const Plan* backward_plan, Tensor x,
                               Tensor phi, Tensor bias, Tensor alpha, std::optional<Tensor> partial_in) {
    auto out = pre_forward_impl(*forward_plan, x, phi, bias, alpha, partial_in, true);
    ctx->saved_data["plan"] = reinterpret_cast<int64_t>(backward_plan);
    ctx->save_for_backward({x, phi, bias, alpha, out[3], partial_in.has_value() ? *partial_in : out[4], out[2]});
    ctx->mark_non_differentiable({out[3], out[4]});
    // an unused output's gradient arrives undefined: a materialised zero link gradient would cost a pass
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto d = pre_gradients(plan_of(ctx, "plan"), s[0], s[1], s[2], s[3], s[4], s[5], s[6], grads[0], grads[1],
                           grads[2], grads[5]);
    return {Tensor(), Tensor(), d[0], d[1], d[2], d[3], Tensor()};
  }
};

// The post of a site: linked (link from the site's pre stands for H_res x without holding it; the lanes'
// gradient goes back through link) or not.
struct Post : public torch::autograd::Function<Post> {
  static variable_list forward(AutogradContext* ctx, const Plan* forward_plan, const Plan* backward_plan,
                               bool linked, Tensor x, std::optional<Tensor> link, Tensor f, Tensor post, Tensor res,
                               std::optional<Tensor> phi_next) {
    auto out = post_forward_impl(*forward_plan, x, f, post, res, phi_next, true);
    ctx->saved_data["plan"] = reinterpret_cast<int64_t>(backward_plan);
    ctx->saved_data["linked"] = linked;
    ctx->save_for_backward({x, f, post, res});
    ctx->mark_non_differentiable({out[1]});
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(9);  // the next lanes unused
    const bool linked = ctx->saved_data["linked"].toBool();
    auto s = ctx->get_saved_variables();
    auto d = post_gradients(plan_of(ctx, "plan"), linked, s[0], s[1], s[2], s[3], grads[0]);
    return {Tensor(), Tensor(), Tensor(), linked ? Tensor() : d[0], linked ? d[0] : Tensor(), d[1], d[2], d[3],
            Tensor()};
  }
};

// A linked post on lanes x, then the next site's linked pre (phi, bias, alpha) on the lanes it makes; project:
// the post projects those lanes with phi while they are on chip, for the pre. Outputs the next lanes, then the
// pre's y, post, res, pre and link. The next lanes' gradient is the pre's dx (plus theirs, where they are used
// elsewhere too), which the post's backward takes.
struct Joint : public torch::autograd::Function<Joint> {
  static variable_list forward(AutogradContext* ctx, const Plan* post_forward_plan, const Plan* post_backward_plan,
                               const Plan* pre_forward_plan, const Plan* pre_backward_plan, bool project, Tensor x,
                               Tensor link, Tensor f, Tensor post, Tensor res, Tensor phi, Tensor bias,
                               Tensor alpha) {
    auto lanes = post_forward_impl(*post_forward_plan, x, f, post, res,
                                   project ? std::optional<Tensor>(phi) : std::nullopt, true);
    const Tensor &next = lanes[0], &partial = lanes[1];
    auto out = pre_forward_impl(*pre_forward_plan, next, phi, bias, alpha,
                                project ? std::optional<Tensor>(partial) : std::nullopt, true);
    ctx->saved_data["post"] = reinterpret_cast<int64_t>(post_backward_plan);
    ctx->saved_data["pre"] = reinterpret_cast<int64_t>(pre_backward_plan);
    ctx->save_for_backward({x, f, post, res, next, phi, bias, alpha, out[3], project ? partial : out[4], out[2]});
    ctx->mark_non_differentiable({out[3]});
    ctx->set_materialize_grads(false);
    return {next, out[0], out[1], out[2], out[3], out[5]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto pre = pre_gradients(plan_of(ctx, "pre"), s[4], s[5], s[6], s[7], s[8], s[9], s[10], grads[1], grads[2],
                             grads[3], grads[5]);
    const Tensor g = grads[0].defined() ? pre[0] + grads[0] : pre[0];
    auto post = post_gradients(plan_of(ctx, "post"), true, s[0], s[1], s[2], s[3], g);
    return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), post[0], post[1], post[2], post[3],
            pre[1], pre[2], pre[3]};
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

std::vector<Tensor> joint(const Plan& post_forward_plan, const Plan& post_backward_plan, const Plan& pre_forward_plan,
                          const Plan& pre_backward_plan, bool project, const Tensor& x, const Tensor& link,
                          const Tensor& f, const Tensor& post_, const Tensor& res, const Tensor& phi,
                          const Tensor& bias, const Tensor& alpha) {
  return Joint::apply(&post_forward_plan, &post_backward_plan, &pre_forward_plan, &pre_backward_plan, project, x,
                      link, f, post_, res, phi, bias, alpha);
}

// ------------------------------------------------------------------------ torch.ops.mhc_lab.* on CUDA
//
// site_ops.py defines the ops (schemas, fake tensors, autograd, and the implementations the CPU and the reference
// backend run). Once this module is loaded, the ops' CUDA kernels are these functions: a call from a compiled
// graph goes from torch's dispatcher straight to the launches, without the Python implementation between
// (torch.library's wrappers, the plan's lookup, the call into this module). The plans are site_ops' own
// (site_ops.plan_for_native, asked once per configuration); other backends than "kernels" go to site_ops'
// implementations.

namespace registered {

enum class Op : int64_t { pre_forward, pre_backward, post_forward, post_backward };
const char* const kOpNames[] = {"pre_forward", "pre_backward", "post_forward", "post_backward"};

// Python objects that live as long as the process (never released: the interpreter may be gone by the time
// static destructors run).
pybind11::object* plan_source = nullptr;      // site_ops.plan_for_native(op, x, *flags) -> Plan
pybind11::object* implementations = nullptr;  // {op name: site_ops' <op>_impl}

std::mutex plans_mutex;
std::map<std::array<int64_t, 7>, const Plan*> plans;

// The plan of an op on lanes x (on x's GPU, for its n and C) with up to three flags, asked of Python once.
const Plan& plan_for(Op op, const Tensor& x, std::initializer_list<int64_t> flags) {
  TORCH_CHECK(x.dim() >= 2, "mhc_lab::", kOpNames[static_cast<int64_t>(op)], ": x: expected lanes [..., n, C], got ",
              x.sizes());
  std::array<int64_t, 7> key{static_cast<int64_t>(op), x.size(-2), x.size(-1), x.get_device(), -1, -1, -1};
  std::copy(flags.begin(), flags.end(), key.begin() + 4);
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto found = plans.find(key);
    if (found != plans.end()) return *found->second;
  }
  TORCH_CHECK(plan_source != nullptr, "mhc_lab native ops: no plan source (mhc_lab.ops.native.extension() sets it)");
  pybind11::gil_scoped_acquire gil;
  pybind11::tuple args(flags.size() + 2);
  args[0] = pybind11::str(kOpNames[static_cast<int64_t>(op)]);
  args[1] = pybind11::cast(x);
  size_t i = 2;
  for (int64_t flag : flags) args[i++] = pybind11::int_(flag);
  pybind11::object plan = (*plan_source)(*args);
  const Plan* found = plan.cast<const Plan*>();
  plan.inc_ref();  // kept for the process, as site_ops keeps it
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.emplace(key, found);
  return *found;
}

// site_ops' implementation of an op, for a backend other than "kernels".
template <typename Result, typename... Args>
Result in_python(const char* op, const Args&... args) {
  TORCH_CHECK(implementations != nullptr, "mhc_lab native ops: no implementations to hand mhc_lab::", op, " to");
  pybind11::gil_scoped_acquire gil;
  return (*implementations)[op](args...).template cast<Result>();
}

bool native(c10::string_view backend) { return backend == "kernels"; }

using PreOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

PreOutputs pre_forward_op(const Tensor& x, const Tensor& phi, const Tensor& bias, const Tensor& alpha,
                          c10::string_view backend, const std::optional<Tensor>& partial_in) {
  if (!native(backend)) {
    return in_python<PreOutputs>("pre_forward", x, phi, bias, alpha, std::string(backend), partial_in);
  }
  auto o = pre_forward(plan_for(Op::pre_forward, x, {partial_in.has_value()}), x, phi, bias, alpha, partial_in);
  return {o[0], o[1], o[2], o[3], o[4], o[5]};
}

std::tuple<Tensor, Tensor, Tensor> pre_backward_op(const Tensor& x, const Tensor& phi, const Tensor& bias,
                                                   const Tensor& alpha, const Tensor& pre, const Tensor& partial,
                                                   const Tensor& res, const Tensor& dy, const Tensor& dpost,
                                                   const Tensor& dres, const std::optional<Tensor>& dx_post,
                                                   c10::string_view backend, bool post_grad) {
  using Result = std::tuple<Tensor, Tensor, Tensor>;
  if (!native(backend)) {
    return in_python<Result>("pre_backward", x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post,
                             std::string(backend), post_grad);
  }
  // the plan for what the op was given (site_ops.kernel2_inputs says which kernel 2 that takes)
  const Plan& p = plan_for(Op::pre_backward, x, {partial.size(0), dx_post.has_value(), post_grad});
  auto o = pre_backward(p, x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post);
  return {o[0], o[1], o[2]};
}

Tensor post_forward_op(const Tensor& x, const Tensor& f, const Tensor& post, const Tensor& res,
                       c10::string_view backend) {
  if (!native(backend)) return in_python<Tensor>("post_forward", x, f, post, res, std::string(backend));
  return post_forward(plan_for(Op::post_forward, x, {false}), x, f, post, res, std::nullopt)[0];
}

std::tuple<Tensor, Tensor> post_forward_linked_op(const Tensor& x, const Tensor& link, const Tensor& f,
                                                  const Tensor& post, const Tensor& res, c10::string_view backend,
                                                  const std::optional<Tensor>& phi_next) {
  using Result = std::tuple<Tensor, Tensor>;
  if (!native(backend)) {
    return in_python<Result>("post_forward_linked", x, link, f, post, res, std::string(backend), phi_next);
  }
  auto o = post_forward(plan_for(Op::post_forward, x, {phi_next.has_value()}), x, f, post, res, phi_next);
  return {o[0], o[1]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> post_backward_op(const Tensor& x, const Tensor& f, const Tensor& post,
                                                            const Tensor& res, const Tensor& g,
                                                            c10::string_view backend, bool lanes_grad) {
  using Result = std::tuple<Tensor, Tensor, Tensor, Tensor>;
  if (!native(backend)) {
    return in_python<Result>("post_backward", x, f, post, res, g, std::string(backend), lanes_grad);
  }
  auto o = post_backward(plan_for(Op::post_backward, x, {lanes_grad}), x, f, post, res, g);
  return {o[0], o[1], o[2], o[3]};
}

// The ops' autograd on CUDA. A call that needs none (grad mode off, or no input requiring grad: every call from
// a compiled graph) goes on to the CUDA kernel above without Python. One that does (an eager call under a
// dispatch mode, torch.compile tracing) goes to the autograd torch.library built from site_ops' formulas.
pybind11::object* autograd = nullptr;  // site_ops._autograd_for_native(op name, raw dispatch key set, *args)

pybind11::object to_python(const c10::IValue& v) {
  if (v.isTensor()) return pybind11::cast(v.toTensor());
  if (v.isNone()) return pybind11::none();
  if (v.isBool()) return pybind11::bool_(v.toBool());
  if (v.isInt()) return pybind11::int_(v.toInt());
  if (v.isString()) return pybind11::str(std::string(v.toStringRef()));
  TORCH_CHECK(false, "mhc_lab native ops: an argument of type ", v.tagKind(), " (the ops take tensors, None, "
              "bools, ints and strings)");
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t count = schema.arguments().size();
  bool needs_grad = false;
  if (at::GradMode::is_enabled()) {
    for (const c10::IValue& v : torch::jit::last(*stack, count)) {
      needs_grad = needs_grad || (v.isTensor() && v.toTensor().requires_grad());
    }
  }
  if (!needs_grad) {
    at::AutoDispatchBelowAutograd below;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  TORCH_CHECK(autograd != nullptr, "mhc_lab native ops: no autograd to hand ", schema.name(), " to");
  pybind11::gil_scoped_acquire gil;
  pybind11::tuple args(count + 2);
  args[0] = pybind11::str(schema.name().substr(schema.name().find("::") + 2));
  args[1] = pybind11::int_(keys.raw_repr());
  size_t i = 2;
  for (const c10::IValue& v : torch::jit::last(*stack, count)) args[i++] = to_python(v);
  pybind11::object result = (*autograd)(*args);
  torch::jit::drop(*stack, count);
  if (schema.returns().size() == 1) {
    stack->emplace_back(result.cast<Tensor>());
  } else {
    for (auto item : result.cast<pybind11::tuple>()) stack->emplace_back(item.cast<Tensor>());
  }
}

void connect(pybind11::object source, pybind11::object impls, pybind11::object autograd_entry) {
  plan_source = new pybind11::object(std::move(source));
  implementations = new pybind11::object(std::move(impls));
  autograd = new pybind11::object(std::move(autograd_entry));
}

}  // namespace registered

}  // namespace mhc_native

TORCH_LIBRARY_IMPL(mhc_lab, AutogradCUDA, m) {
  for (const char* name : {"pre_forward", "pre_backward", "post_forward", "post_forward_linked", "post_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&mhc_native::registered::autograd_kernel>());
  }
}

TORCH_LIBRARY_IMPL(mhc_lab, CUDA, m) {
  m.impl("pre_forward", &mhc_native::registered::pre_forward_op);
  m.impl("pre_backward", &mhc_native::registered::pre_backward_op);
  m.impl("post_forward", &mhc_native::registered::post_forward_op);
  m.impl("post_forward_linked", &mhc_native::registered::post_forward_linked_op);
  m.impl("post_backward", &mhc_native::registered::post_backward_op);
}

using namespace mhc_native;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The mHC site's CUDA ops and their autograd (mhc_lab.ops.native).";
  auto plan = pybind11::class_<Plan>(m, "Plan", pybind11::dynamic_attr()).def(pybind11::init<>());
#define MHC_FIELD(name) plan.def_readwrite(#name, &Plan::name)
  MHC_FIELD(n); MHC_FIELD(C); MHC_FIELD(splits); MHC_FIELD(phi_rows); MHC_FIELD(gemm_depth); MHC_FIELD(coef_width);
  MHC_FIELD(extra); MHC_FIELD(lane_splits); MHC_FIELD(add_dx); MHC_FIELD(post_grad); MHC_FIELD(lanes_grad);
  MHC_FIELD(phi_split); MHC_FIELD(project); MHC_FIELD(coefficients); MHC_FIELD(mix); MHC_FIELD(post);
  MHC_FIELD(post_project); MHC_FIELD(k1_reduce); MHC_FIELD(k1_tokens); MHC_FIELD(k1_fused); MHC_FIELD(k2);
  MHC_FIELD(sums); MHC_FIELD(post_backward);
#undef MHC_FIELD
  m.def("pre_forward", &pre_forward);
  m.def("pre_backward", &pre_backward);
  m.def("post_forward", &post_forward);
  m.def("post_backward", &post_backward);
  m.def("pre", &pre);
  m.def("post", &post);
  m.def("joint", &joint);
  m.def("connect", &registered::connect,
        "connect(plan_source, implementations, autograd): where the registered CUDA and AutogradCUDA kernels of "
        "torch.ops.mhc_lab.* get their plans, the other backends' implementations and the ops' autograd");
}

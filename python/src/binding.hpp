// spectral_cond Python binding: what both translation units share. Arrays come in as read-only
// views of the caller's memory (numpy, or anything with DLPack or the buffer protocol); a
// Fortran-order array of the computing dtype is read in place, a C-order one is copied once into
// column-major storage (the library's layout, MATH.md §1). Results leave as numpy arrays that own
// the library's Eigen storage (no copy) and as dicts of plain Python values, which the pure-Python
// layer turns into result objects.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <spectral_cond/spectral_cond.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace spectral_cond::python {

namespace nb = nanobind;

/// Any read-only array on any device; every property is checked by `check_matrix`.
using Array = nb::ndarray<nb::ro>;

enum class Dtype { Float32, Float64 };

inline std::string dtype_name(nb::dlpack::dtype t) {
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  const char* kind = code == nb::dlpack::dtype_code::Int       ? "int"
                     : code == nb::dlpack::dtype_code::UInt    ? "uint"
                     : code == nb::dlpack::dtype_code::Float   ? "float"
                     : code == nb::dlpack::dtype_code::Bfloat  ? "bfloat"
                     : code == nb::dlpack::dtype_code::Complex ? "complex"
                     : code == nb::dlpack::dtype_code::Bool    ? "bool"
                                                               : "dtype code ";
  if (code == nb::dlpack::dtype_code::Bool) return kind;
  if (std::string(kind) == "dtype code ")
    return kind + std::to_string(int(t.code)) + ", " + std::to_string(int(t.bits)) + " bits";
  return std::string(kind) + std::to_string(int(t.bits));
}

inline std::string shape_of(const Array& a) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

[[noreturn]] inline void value_error(const std::string& fn, const std::string& msg) {
  throw nb::value_error((fn + ": " + msg).c_str());
}
[[noreturn]] inline void type_error(const std::string& fn, const std::string& msg) {
  throw nb::type_error((fn + ": " + msg).c_str());
}

/// The dtype of a 2-D CPU array, after checking device, rank, dtype and layout; throws
/// ValueError or TypeError naming `fn` and `name` otherwise.
inline Dtype check_matrix(const char* fn, const char* name, const Array& a) {
  if (a.device_type() != nb::device::cpu::value) {
    std::ostringstream s;
    s << name << " is on a device (DLPack device type " << a.device_type() << ", id "
      << a.device_id() << "); this build computes on the CPU only: pass " << name << ".cpu()";
    value_error(fn, s.str());
  }
  if (a.ndim() != 2)
    value_error(fn, std::string(name) + " must be a 2-D array (got " + std::to_string(a.ndim()) +
                        "-D, shape " + shape_of(a) + ")");
  Dtype d;
  if (a.dtype() == nb::dtype<double>())
    d = Dtype::Float64;
  else if (a.dtype() == nb::dtype<float>())
    d = Dtype::Float32;
  else
    type_error(
        fn, std::string(name) + " must be float32 or float64 (got " + dtype_name(a.dtype()) + ")");
  const int64_t r = int64_t(a.shape(0)), c = int64_t(a.shape(1));
  const bool f_order = (r <= 1 || a.stride(0) == 1) && (c <= 1 || a.stride(1) == r);
  const bool c_order = (c <= 1 || a.stride(1) == 1) && (r <= 1 || a.stride(0) == c);
  if (!f_order && !c_order) {
    std::ostringstream s;
    s << name << " must be C- or Fortran-contiguous (got shape " << shape_of(a) << " with strides ("
      << a.stride(0) << ", " << a.stride(1) << ") in elements); pass numpy.ascontiguousarray("
      << name << ")";
    value_error(fn, s.str());
  }
  return d;
}

inline bool is_f_order(const Array& a) {
  const int64_t r = int64_t(a.shape(0)), c = int64_t(a.shape(1));
  return (r <= 1 || a.stride(0) == 1) && (c <= 1 || a.stride(1) == r);
}

template <typename Scalar>
using ColMap = Eigen::Map<const Mat<Scalar>>;
template <typename Scalar>
using RowMap =
    Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

/// A read-only view of a checked array as the library's CRef: the caller's memory for Fortran
/// order, a column-major copy (made by Eigen::Ref) for C order.
template <typename Scalar>
CRef<Scalar> view(const Array& a) {
  const auto* p = static_cast<const Scalar*>(a.data());
  const Index r = Index(a.shape(0)), c = Index(a.shape(1));
  // Two returns of prvalues (guaranteed elision): an Eigen::Ref that owns a copy must never be
  // copied, since its copy constructor does not copy the owned storage.
  if (is_f_order(a)) return CRef<Scalar>(ColMap<Scalar>(p, r, c));
  return CRef<Scalar>(RowMap<Scalar>(p, r, c));
}

/// Calls f(Scalar{}) with the scalar of `d`.
template <typename F>
decltype(auto) dispatch(Dtype d, F&& f) {
  if (d == Dtype::Float64) return f(double{});
  return f(float{});
}

/// Throws ValueError when a view holds NaN or Inf (the library's InvalidInput, raised in Python).
template <typename Scalar>
void require_finite(const char* fn, const char* name, const CRef<Scalar>& m) {
  if (!m.allFinite()) value_error(fn, std::string(name) + " contains NaN or Inf");
}

/// Checks several arrays of one call: same device, rank, layout rules, one dtype.
inline Dtype check_same_dtype(const char* fn,
                              std::initializer_list<std::pair<const char*, const Array*>> arrays) {
  std::optional<Dtype> first;
  const char* first_name = nullptr;
  for (const auto& [name, a] : arrays) {
    if (!a) continue;
    const Dtype d = check_matrix(fn, name, *a);
    if (!first) {
      first = d;
      first_name = name;
    } else if (d != *first) {
      type_error(fn, std::string(name) + " is " + (d == Dtype::Float64 ? "float64" : "float32") +
                         " but " + first_name + " is " +
                         (*first == Dtype::Float64 ? "float64" : "float32") +
                         "; pass every array in one dtype");
    }
  }
  return *first;
}

/// A numpy array that owns `m` (moved, not copied), in Fortran order.
template <typename Scalar>
nb::object to_numpy(Mat<Scalar>&& m) {
  auto* p = new Mat<Scalar>(std::move(m));
  nb::capsule owner(p, [](void* q) noexcept { delete static_cast<Mat<Scalar>*>(q); });
  const size_t shape[2] = {size_t(p->rows()), size_t(p->cols())};
  const int64_t strides[2] = {1, int64_t(p->rows())};
  return nb::cast(nb::ndarray<nb::numpy, Scalar>(p->data(), 2, shape, owner, strides));
}

template <typename Scalar>
nb::object to_numpy(Vec<Scalar>&& v) {
  auto* p = new Vec<Scalar>(std::move(v));
  nb::capsule owner(p, [](void* q) noexcept { delete static_cast<Vec<Scalar>*>(q); });
  const size_t shape[1] = {size_t(p->size())};
  return nb::cast(nb::ndarray<nb::numpy, Scalar>(p->data(), 1, shape, owner));
}

/// The attention options from Python: scale None (1/sqrt(d_k)) or > 0; mask "none", "causal" or
/// an N x N additive mask array (finite values and -inf).
template <typename Scalar>
AttentionOptions<Scalar> attention_options(const char* fn, std::optional<double> scale,
                                           const nb::object& mask) {
  AttentionOptions<Scalar> o;
  if (scale) o.scale = static_cast<Scalar>(*scale);
  if (mask.is_none()) return o;
  if (nb::isinstance<nb::str>(mask)) {
    const std::string m = nb::cast<std::string>(mask);
    if (m == "none")
      o.mask = MaskKind::None;
    else if (m == "causal")
      o.mask = MaskKind::Causal;
    else
      value_error(fn, "mask must be 'none', 'causal' or an N x N array (got '" + m + "')");
    return o;
  }
  Array a;
  if (!nb::try_cast<Array>(mask, a))
    type_error(fn, "mask must be 'none', 'causal' or an N x N array");
  const Dtype d = check_matrix(fn, "mask", a);
  o.mask = MaskKind::Additive;
  o.additive_mask = d == Dtype::Float64 ? view<double>(a).template cast<Scalar>().eval()
                                        : view<float>(a).template cast<Scalar>().eval();
  return o;
}

/// Adds the biases and RoPE of `extras` to `o` (MATH.md §10): None, or the dict built by
/// spectral_cond._arrays.as_extras, {"bias_q": k x 1 array or None, "bias_k", "bias_v",
/// "rope": (pairing, theta, dims, offset[, cos, sin]) or None}, cos and sin N x dims tables or
/// None. Biases of either float dtype are converted.
template <typename Scalar>
void apply_extras(const char* fn, const nb::object& extras, AttentionOptions<Scalar>& o) {
  if (extras.is_none()) return;
  const nb::dict d = nb::cast<nb::dict>(extras);
  auto bias = [&](const char* key, Vec<Scalar>& dst) {
    if (!d.contains(key) || d[key].is_none()) return;
    Array a;
    if (!nb::try_cast<Array>(d[key], a)) type_error(fn, std::string(key) + " must be an array");
    const Dtype t = check_matrix(fn, key, a);
    const Mat<Scalar> m = t == Dtype::Float64 ? view<double>(a).template cast<Scalar>().eval()
                                              : view<float>(a).template cast<Scalar>().eval();
    if (m.cols() != 1) value_error(fn, std::string(key) + " must be a vector");
    dst = m.col(0);
  };
  bias("bias_q", o.bias_q);
  bias("bias_k", o.bias_k);
  bias("bias_v", o.bias_v);
  if (d.contains("rope") && !d["rope"].is_none()) {
    const nb::tuple t = nb::cast<nb::tuple>(d["rope"]);
    RopeOptions r;
    try {
      r.pairing = parse_rope_pairing(nb::cast<std::string>(t[0]));
    } catch (const std::invalid_argument& e) {
      value_error(fn, e.what());
    }
    r.theta = nb::cast<double>(t[1]);
    r.dims = nb::cast<Index>(t[2]);
    r.offset = nb::cast<Index>(t[3]);
    if (t.size() >= 6 && !t[4].is_none()) {  // the model's own angle tables (N x dims each)
      auto table = [&](const char* key, nb::handle h, Eigen::MatrixXd& dst) {
        Array a;
        if (!nb::try_cast<Array>(h, a)) type_error(fn, std::string(key) + " must be an array");
        const Dtype t2 = check_matrix(fn, key, a);
        dst = t2 == Dtype::Float64 ? view<double>(a).eval() : view<float>(a).template cast<double>().eval();
      };
      table("rope cos", t[4], r.cos);
      table("rope sin", t[5], r.sin);
    }
    o.rope = r;
  }
}

/// attention_options with the biases and RoPE of `extras` (apply_extras).
template <typename Scalar>
AttentionOptions<Scalar> attention_options(const char* fn, std::optional<double> scale,
                                           const nb::object& mask, const nb::object& extras) {
  AttentionOptions<Scalar> o = attention_options<Scalar>(fn, scale, mask);
  apply_extras<Scalar>(fn, extras, o);
  return o;
}

/// The four inputs of every attention routine, checked and viewed.
template <typename Scalar>
struct Inputs {
  CRef<Scalar> X, WQ, WK, WV;
  Inputs(const char* fn, const Array& x, const Array& wq, const Array& wk, const Array& wv)
      : X(view<Scalar>(x)), WQ(view<Scalar>(wq)), WK(view<Scalar>(wk)), WV(view<Scalar>(wv)) {
    require_finite<Scalar>(fn, "X", X);
    require_finite<Scalar>(fn, "W_Q", WQ);
    require_finite<Scalar>(fn, "W_K", WK);
    require_finite<Scalar>(fn, "W_V", WV);
  }
};

/// Raised through the library by a progress callback to cancel a call; carries nothing: the
/// Python error it stands for is kept by the Progress object that threw it.
struct Cancelled {};

/// The bridge between the library's `progress` callback and Python: each call takes the GIL,
/// runs pending signal handlers (Ctrl-C) and the user's callback (with the fraction done), and
/// cancels the computation by throwing Cancelled when either raised. `run` executes the work
/// with the GIL released and re-raises the Python error in the caller's thread.
class Progress {
 public:
  explicit Progress(nb::object callback) : callback_(std::move(callback)) {}

  std::function<void(double)> function() {
    return [this](double fraction) {
      nb::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) {
        error_.emplace();
        throw Cancelled{};
      }
      if (callback_.is_none()) return;
      try {
        callback_(fraction);
      } catch (nb::python_error& e) {
        error_.emplace(std::move(e));
        throw Cancelled{};
      }
    };
  }

  template <typename F>
  auto run(F&& work) {
    try {
      nb::gil_scoped_release release;
      return work();
    } catch (const Cancelled&) {
      nb::python_error e = std::move(*error_);
      error_.reset();
      throw e;
    }
  }

 private:
  nb::object callback_;
  std::optional<nb::python_error> error_;
};

/// ConditionResult as a dict (+inf stays float('inf'), NaN float('nan')).
template <typename Scalar>
nb::dict to_dict(const ConditionResult<Scalar>& r) {
  nb::dict d;
  d["sigma_max"] = double(r.sigma_max);
  d["sigma_min"] = double(r.sigma_min);
  d["kappa"] = double(r.kappa);
  d["sigma_min_plus"] = double(r.sigma_min_plus);
  d["kappa_plus"] = double(r.kappa_plus);
  d["rank"] = int64_t(r.rank);
  d["rank_tol"] = double(r.rank_tol);
  d["method"] = r.method;
  d["accuracy"] = double(r.accuracy);
  d["iterations"] = int64_t(r.iterations);
  d["residual"] = double(r.residual);
  d["info"] = std::string(to_string(r.info));
  d["note"] = r.note;
  return d;
}

/// A ConditionResult from the dict to_dict writes (a κ(J) the caller already has), for
/// theorem34's `jacobian`; TypeError naming `fn` when a key is missing or of the wrong type.
inline ConditionResult<double> condition_from_dict(const char* fn, const nb::dict& d) {
  ConditionResult<double> r;
  try {
    r.sigma_max = nb::cast<double>(d["sigma_max"]);
    r.sigma_min = nb::cast<double>(d["sigma_min"]);
    r.kappa = nb::cast<double>(d["kappa"]);
    r.sigma_min_plus = nb::cast<double>(d["sigma_min_plus"]);
    r.kappa_plus = nb::cast<double>(d["kappa_plus"]);
    r.rank = nb::cast<int64_t>(d["rank"]);
    r.rank_tol = nb::cast<double>(d["rank_tol"]);
    r.method = nb::cast<std::string>(d["method"]);
    r.accuracy = nb::cast<double>(d["accuracy"]);
    r.iterations = nb::cast<int64_t>(d["iterations"]);
    r.residual = nb::cast<double>(d["residual"]);
    r.note = nb::cast<std::string>(d["note"]);
    const std::string info = nb::cast<std::string>(d["info"]);
    bool known = false;
    for (Info i : {Info::Success, Info::Singular, Info::NotConverging, Info::InvalidInput,
                   Info::Inaccurate, Info::TooLarge})
      if (info == to_string(i)) {
        r.info = i;
        known = true;
      }
    if (!known) type_error(fn, "jacobian: unknown info '" + info + "'");
  } catch (const nb::cast_error&) {
    type_error(fn, "jacobian must be a kappa_jacobian result of the same inputs");
  } catch (const nb::python_error&) {
    type_error(fn, "jacobian must be a kappa_jacobian result of the same inputs");
  }
  return r;
}

/// An InvalidInput result is bad input in Python: ValueError with the library's note.
template <typename Scalar>
void raise_if_invalid(const char* fn, const ConditionResult<Scalar>& r) {
  if (r.info == Info::InvalidInput) value_error(fn, r.note);
}

/// The attention diagnostics (MATH.md §11) as a dict of plain values.
inline nb::dict diagnostics_dict(const AttentionDiagnostics& d) {
  nb::dict out;
  const AttentionPattern& a = d.pattern;
  out["rows"] = int64_t(a.rows);
  out["row_max_min"] = a.row_max_min;
  out["row_max_mean"] = a.row_max_mean;
  out["entropy_mean"] = a.entropy_mean;
  out["saturated"] = int64_t(a.saturated);
  out["saturated_diagonal"] = int64_t(a.saturated_diagonal);
  out["saturated_fraction"] = a.saturated_fraction;
  out["forced"] = int64_t(a.forced);
  const JacobianBlockNorms& n = d.norms;
  out["sigma_max_JQ"] = n.sigma_max_JQ;
  out["sigma_max_JK"] = n.sigma_max_JK;
  out["sigma_max_JQK"] = n.sigma_max_JQK;
  out["sigma_max_JV"] = n.sigma_max_JV;
  out["ratio_QK_V"] = n.ratio_QK_V;
  out["norms_converged"] = n.converged;
  out["collapsed"] = d.collapsed;
  out["note"] = d.note;
  return out;
}

/// The bound without hypothesis (MATH.md §5) as a dict of plain values.
inline nb::dict free_bound_dict(const HypothesisFreeBound& b) {
  nb::dict out;
  out["applicable"] = b.applicable;
  out["bound"] = b.bound;
  out["sigma_max_J"] = b.sigma_max_J;
  out["sigma_max_residual"] = b.sigma_max_residual;
  out["sigma_N_PX"] = b.PX.sigma_min;
  out["accuracy"] = b.accuracy;
  out["info"] = std::string(to_string(b.info));
  out["note"] = b.note;
  return out;
}

void bind_attention(nb::module_& m);
/// open_checkpoint and the Checkpoint class (checkpoint.cpp).
void bind_checkpoint(nb::module_& m);
/// verify, the tool's sweep with its extended-precision re-checks (verify.cpp).
void bind_verify(nb::module_& m);
/// advise_head, the λ advisor of one head (advise.cpp).
void bind_advise(nb::module_& m);

}  // namespace spectral_cond::python

"""spectral_cond: condition numbers of attention Jacobians, from the C++ library of the same name.

The functions are the library's (docs/MATH.md has every formula; docs/python.md is a tutorial):

- kappa, kappa_plus, singular_values: condition numbers of any matrix (MATH.md §4)
- attention, attention_jvp, attention_vjp: one attention block and its derivatives (§1–2)
- attention_jacobian, attention_gram: J (or one block) and J J^T in closed form (§3)
- kappa_jacobian: kappa(J) by dense, gram, iterative, lobpcg, qr or auto, with its accuracy (§12)
- theorem34: every term of the paper's bound on kappa(J) and the verdict (§5)
- attention_diagnostics: the attention pattern, J's block norms, the bound without hypothesis
  (§5, §11)
- exact_correction, lambda_correction, lambda_identity: the corrections (§6–7)
- advise_head: which λ and placement of λ I lower κ(J) without saturating attention (§17);
  spectral_cond.torch.advise does it for a live model
- open_checkpoint, analyze: a checkpoint on disk, and the tool's analyze of it as rows (§8)

Arrays: numpy float32/float64 (C or Fortran order; Fortran-order arrays are read in place) or
PyTorch CPU tensors (read through a detached view). Matrices follow MATH.md §1: X is N x D,
W_Q, W_K are D x d_k, W_V is D x d_v (a torch Linear's weight is out x in, so W = weight.T).
Misuse raises ValueError or TypeError with the library's message. Long calls release the GIL,
stop on Ctrl-C (KeyboardInterrupt) and report progress to `progress(fraction)` when given.
spectral_cond.torch has the paper's method for PyTorch models and a model analysis.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

from . import _core
from ._arrays import as_array, as_extras, as_mask, as_optional_array
from ._results import (
    AttentionDiagnostics,
    AttentionGradients,
    ConditionResult,
    ExactCorrection,
    HypothesisFreeBound,
    JacobianConditionResult,
    LambdaCorrection,
    Theorem34Report,
    VerifyReport,
    condition,
    diagnostics,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointAnalysis",
    "MatrixAnalysis",
    "analyze",
    "AttentionDiagnostics",
    "Checkpoint",
    "CheckpointError",
    "AttentionGradients",
    "ConditionResult",
    "ExactCorrection",
    "HypothesisFreeBound",
    "JacobianConditionResult",
    "LambdaCorrection",
    "Rope",
    "Theorem34Report",
    "attention",
    "attention_diagnostics",
    "attention_gram",
    "attention_jacobian",
    "attention_jvp",
    "attention_vjp",
    "exact_correction",
    "kappa",
    "kappa_jacobian",
    "kappa_plus",
    "lambda_correction",
    "lambda_identity",
    "open_checkpoint",
    "singular_values",
    "theorem34",
    "verify",
    "VerifyReport",
    "Advice",
    "AdviceChoice",
    "AdvicePoint",
    "HeadAdvice",
    "advise_head",
]

Checkpoint = _core.Checkpoint
"""A checkpoint opened by open_checkpoint: names(), shape(name), dtype(name), file_of(name),
matrix(name) (float64, checked finite), layers(layout='auto', map='', heads=0, kv_heads=0) (the
attention layers, as dicts of their W_Q/W_K/W_V slots; map as the tool's --map; with heads, each
layer's heads too, and the slots of GPT-NeoX / Falcon tensors, which need them),
projection(tensor, transposed, offset, width, block=0, stride=0) (W, D x width)."""

CheckpointError = _core.CheckpointError
"""A checkpoint that cannot be read (an OSError); the message names the file and the tensor."""


def open_checkpoint(path) -> Checkpoint:
    """Opens a checkpoint in any format the library reads (docs/checkpoints.md): safetensors
    (single, sharded index, or a directory), PyTorch .bin/.pt (a restricted unpickler that never
    runs code), GGUF, .npz, or a directory of .npy files. Only the headers are read here; each
    matrix(name) call decodes one tensor."""
    import os
    return _core.open_checkpoint(os.fspath(path))


Mask = Union[None, str, Any]
"""None or 'none', 'causal', or an N x N additive mask (finite values and -inf)."""

Progress = Optional[Callable[[float], Any]]
"""Called with the fraction done in [0, 1]; raising from it cancels the call."""


def kappa(M: Any, rtol: Optional[float] = None, svd: str = "auto") -> ConditionResult:
    """kappa(M) = sigma_1/sigma_r (+inf when numerically singular) and kappa_plus, by a dense SVD.

    rtol: rank tolerance relative to sigma_1 (default max(m, n) eps of M's dtype, MATH.md §15).
    svd: 'auto', 'jacobi', 'bdc' or 'lapack'.
    """
    return ConditionResult(**_core.kappa(as_array("M", M, "kappa"), rtol, svd))


def kappa_plus(M: Any, rtol: Optional[float] = None, svd: str = "auto") -> ConditionResult:
    """The same result as kappa(): kappa_plus, rank and rank_tol are its fields (MATH.md §4)."""
    return kappa(M, rtol, svd)


def singular_values(M: Any, svd: str = "auto"):
    """Singular values of M in decreasing order (numpy array of M's dtype)."""
    return _core.singular_values(as_array("M", M, "singular_values"), svd)


def _qkv(fn: str, X, WQ, WK, WV):
    return (as_array("X", X, fn), as_array("W_Q", WQ, fn), as_array("W_K", WK, fn),
            as_array("W_V", WV, fn))


@dataclass(frozen=True)
class Rope:
    """Rotary position embeddings of the queries and keys (MATH.md §10).

    pairing: 'rotate_half' (Hugging Face: pairs (j, j + dims/2)) or 'interleaved' (pairs
    (2j, 2j + 1)); theta: the frequency base (rope_theta); dims: rotated columns per head
    (0: all); offset: the position of token 0. cos, sin: optional N x dims tables of the angles'
    cosines and sines exactly as a model computes them (Hugging Face's position_embeddings: any
    rope_type, any positions, scaled by an attention factor where the model does so); when
    given, theta and offset are not used (MATH.md §10).
    """

    pairing: str = "rotate_half"
    theta: float = 10000.0
    dims: int = 0
    offset: int = 0
    cos: Any = dataclasses.field(default=None, compare=False, repr=False)
    sin: Any = dataclasses.field(default=None, compare=False, repr=False)


Biases = Optional[Tuple[Any, Any, Any]]
"""None, or (b_Q, b_K, b_V): Q = X W_Q + 1 b_Q^T, … (MATH.md §10); any entry may be None."""


def attention(X, WQ, WK, WV, scale: Optional[float] = None, mask: Mask = None,
              biases: Biases = None, rope: Any = None):
    """A = softmax(c Q K^T + M) V, N x d_v (MATH.md §1, §10); c defaults to 1/sqrt(d_k).

    Q = X W_Q (+ 1 b_Q^T), K, V likewise; with rope, rows of Q and K are rotated.
    """
    fn = "attention"
    return _core.attention(*_qkv(fn, X, WQ, WK, WV), scale, as_mask(mask, fn),
                           as_extras(fn, biases, rope))


def attention_jvp(X, WQ, WK, WV, dWQ=None, dWK=None, dWV=None, dX=None,
                  scale: Optional[float] = None, mask: Mask = None, biases: Biases = None,
                  rope: Any = None):
    """dA for tangents dW_Q, dW_K, dW_V, dX (None: zero) (MATH.md §2, §10)."""
    fn = "attention_jvp"
    return _core.attention_jvp(
        *_qkv(fn, X, WQ, WK, WV), as_optional_array("dW_Q", dWQ, fn),
        as_optional_array("dW_K", dWK, fn), as_optional_array("dW_V", dWV, fn),
        as_optional_array("dX", dX, fn), scale, as_mask(mask, fn), as_extras(fn, biases, rope))


def attention_vjp(X, WQ, WK, WV, G, scale: Optional[float] = None, mask: Mask = None,
                  biases: Biases = None, rope: Any = None) -> AttentionGradients:
    """dL/dW_Q, dL/dW_K, dL/dW_V, dL/dX and dL/db_Q, dL/db_K, dL/db_V for the cotangent
    G = dL/dA, N x d_v (MATH.md §2, §10)."""
    fn = "attention_vjp"
    d = _core.attention_vjp(*_qkv(fn, X, WQ, WK, WV), as_array("G", G, fn), scale,
                            as_mask(mask, fn), as_extras(fn, biases, rope))
    for k in ("dbQ", "dbK", "dbV"):
        d[k] = d[k].reshape(-1)
    return AttentionGradients(**d)


def attention_jacobian(X, WQ, WK, WV, block: str = "all", scale: Optional[float] = None,
                       mask: Mask = None, biases: Biases = None, rope: Any = None):
    """J = d vec(A) / d [vec W_Q; vec W_K; vec W_V], (N d_v) x (2 D d_k + D d_v) (MATH.md §3).

    vec is column-major: row i + N q is A[i, q], column a + D b is W_Q[a, b]. block: 'all', 'q',
    'k', 'v' (one column block), 'x' (J_X, the Jacobian with respect to X; not with rope) or
    'bias' (J_b = d vec(A) / d [b_Q; b_K; b_V], N d_v x (2 d_k + d_v), MATH.md §10).
    """
    fn = "attention_jacobian"
    return _core.attention_jacobian(*_qkv(fn, X, WQ, WK, WV), block, scale, as_mask(mask, fn),
                                    as_extras(fn, biases, rope))


def attention_gram(X, WQ, WK, WV, block: str = "all", scale: Optional[float] = None,
                   mask: Mask = None, biases: Biases = None, rope: Any = None):
    """J J^T (N d_v x N d_v) of J or of one block, without forming J (MATH.md §3)."""
    fn = "attention_gram"
    return _core.attention_gram(*_qkv(fn, X, WQ, WK, WV), block, scale, as_mask(mask, fn),
                                as_extras(fn, biases, rope))


def kappa_jacobian(X, WQ, WK, WV, method: str = "auto", tol: float = 1e-6,
                   scale: Optional[float] = None, mask: Mask = None,
                   rtol: Optional[float] = None, progress: Progress = None, threads: int = 0,
                   block_cols: int = 0, seed: Optional[int] = None, biases: Biases = None,
                   rope: Any = None, include_biases: bool = False,
                   memory_budget: int = 0) -> JacobianConditionResult:
    """kappa(J) of one attention block, with the method used and its accuracy (MATH.md §12).

    method: 'auto' (dense when small, else the accurate method, matfree, lobpcg or qr, with the
    least estimated time within the memory budget, the next while one declines; the note says
    which and why), 'dense', 'gram', 'iterative', 'lobpcg', 'matfree' or 'qr'. threads:
    threads of qr's updates (0: all cores). block_cols: qr's streamed block width (0:
    automatic). memory_budget: bytes the methods' large arrays may take (0: a quarter of the
    machine's memory); where no accurate method fits, auto declines before allocating (info
    'too_large', the sizes in the note). Computes in float64 whatever the inputs' dtype.
    biases, rope: attention as trained models compute it (MATH.md §10); include_biases: J with
    respect to the weights and the biases together, [J_W | J_b].
    """
    fn = "kappa_jacobian"
    if not (isinstance(memory_budget, int) and memory_budget >= 0):
        raise ValueError(f"{fn}: memory_budget must be an int >= 0 (got {memory_budget!r})")
    d = _core.kappa_jacobian(*_qkv(fn, X, WQ, WK, WV), method, tol, scale, as_mask(mask, fn),
                             rtol, threads, block_cols, seed, progress,
                             as_extras(fn, biases, rope), include_biases, memory_budget)
    return JacobianConditionResult(**d)


def theorem34(X, WQ, WK, WV, method: str = "auto", tol: float = 1e-6,
              scale: Optional[float] = None, mask: Mask = None, rtol: Optional[float] = None,
              blocks: bool = True, progress: Progress = None,
              threads: int = 0, biases: Biases = None, rope: Any = None,
              jacobian: Optional[JacobianConditionResult] = None) -> Theorem34Report:
    """Theorem 3.4 term by term: kappa and kappa_plus of X, Lambda, W_Q, W_K, W_V, P and J, the
    bound with plain kappa (+inf: Lambda is always singular) and with kappa_plus, and the
    verdict (MATH.md §5). With ``biases`` or ``rope`` every term and kappa(J) are those of the
    block with them, and the bound is not applicable (``bound_applies`` False, the bound NaN;
    MATH.md §10): the theorem is stated without them. ``jacobian``: kappa(J) of these inputs
    already computed (a kappa_jacobian result), used as is instead of computing it again."""
    fn = "theorem34"
    given = None
    if jacobian is not None:
        keys = ("sigma_max", "sigma_min", "kappa", "sigma_min_plus", "kappa_plus", "rank",
                "rank_tol", "method", "accuracy", "iterations", "residual", "info", "note")
        given = {k: getattr(jacobian, k) for k in keys}
    d = _core.theorem34(*_qkv(fn, X, WQ, WK, WV), method, tol, scale, as_mask(mask, fn), rtol,
                        blocks, threads, progress, as_extras(fn, biases, rope), given)
    for k in ("X", "Lambda", "WQ", "WK", "WV", "P", "J", "JQ", "JK", "JV"):
        d[k] = condition(d[k])
    free = d.pop("free_bound")
    d["diagnostics"] = diagnostics(d["diagnostics"], free)
    d["free_bound"] = None if d["diagnostics"] is None else d["diagnostics"].free_bound
    return Theorem34Report(**d)


def attention_diagnostics(X, WQ, WK, WV, scale: Optional[float] = None,
                          mask: Mask = None, biases: Biases = None,
                          rope: Any = None) -> AttentionDiagnostics:
    """The attention pattern of P (row maxima, entropy, saturated rows), the spectral norms of
    J_Q, J_K, [J_Q | J_K] and J_V with ||J_QK||/||J_V||, whether attention collapsed to the
    identity (then kappa(J) = kappa(X) for N <= D: query/key gradients vanish), and the bound
    without hypothesis kappa(J) <= sigma_max(J)/sigma_N(P X) (MATH.md §5, §11). Float64."""
    fn = "attention_diagnostics"
    return diagnostics(_core.attention_diagnostics(*_qkv(fn, X, WQ, WK, WV), scale,
                                                   as_mask(mask, fn),
                                                   as_extras(fn, biases, rope)))


def exact_correction(W, target: Optional[float] = None) -> ExactCorrection:
    """C = alpha U V^T with kappa(W + C) = 2 sigma_1/(sigma_1 + sigma_r) (alpha = sigma_1), or
    = target when a target t > 1 is given (Theorem 3.5, MATH.md §6)."""
    return ExactCorrection(**_core.exact_correction(as_array("W", W, "exact_correction"), target))


def lambda_correction(W, lam: float = 10.0) -> LambdaCorrection:
    """W + lam I_k (I_k the rectangular identity of W's shape), kappa before and after, and the
    Weyl bound (lam + s)/(lam - s), s = sigma_1(W), where it applies (MATH.md §7)."""
    return LambdaCorrection(**_core.lambda_correction(as_array("W", W, "lambda_correction"), lam))


def lambda_identity(D: int, heads: int, d_head: int, placement: str = "fused",
                    packed_offset: int = 0):
    """The D x (heads d_head) matrix E added as lam E to a fused projection (MATH.md §7):
    'fused' is the rectangular identity I(D, heads d_head); 'per-head' (or 'per_head') gives
    each head's D x d block its own I(D, d); 'packed' is this projection's slice of the identity
    of the packed D x [W_Q | W_K | W_V] weight, whose columns start at packed_offset there:
    E[packed_offset + j, j] = 1 for rows below D."""
    return _core.lambda_identity(D, heads, d_head, placement, packed_offset)


def verify(seed: int = 0, instances_per_regime: int = 16, extended: bool = True,
           progress: Progress = None) -> VerifyReport:
    """The sweep of `spectral-cond verify` (MATH.md §4-7): every proven statement (Theorem 3.5,
    its target form, the Weyl bound, the Kronecker and concatenation lemmas, the bound that needs
    no hypothesis) and the paper's Theorem 3.4 checked on seeded random instances of every shape
    class, logit scale, weight scale, mask and lambda. Every would-be violation and every
    uncertain rank decision is recomputed in extended precision (MPFR) unless extended=False
    (then they are reported unchecked). Deterministic for a seed; the same report as the tool's
    JSON. Releases the GIL; progress(fraction) is called as instances finish; Ctrl-C stops it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TypeError(f"verify: seed must be a non-negative int (got {seed!r})")
    return VerifyReport.from_json(_core.verify(seed, instances_per_regime, extended, progress))


def advise_head(X, WQ, WK, WV, head: int = 0, heads: int = 1, kv_heads: int = 0,
                lambdas=(0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0),
                placements=("fused", "per_head", "packed"), scale: Optional[float] = None,
                mask: Mask = None, biases: Biases = None, rope: Any = None,
                max_saturated_fraction: float = 0.01, min_qk_ratio: float = 0.1,
                method: str = "auto", tol: float = 1e-6, memory_budget: int = 0,
                progress: Progress = None, packed_columns=None) -> "HeadAdvice":
    """The λ advisor for one head (MATH.md §17). WQ, WK, WV are the head's D x d slices; head,
    heads, kv_heads say where it sits in its layer (for the fused and packed identities;
    packed_columns overrides the columns of its Q, K, V slices in a packed weight whose order is
    not [Q | K | V]). For every λ in `lambdas` and placement in `placements` ('fused',
    'per_head', 'packed', or a subset such as 'fused:qk' or 'per_head:v'): κ of the corrected
    slices, κ(J) by `method` with its stated accuracy, κ₊(J), the bound without hypothesis, the
    attention diagnostics; the predicted (closed form) and measured onset of saturation; and
    the recommendation: the admissible point (saturated fraction at most
    max_saturated_fraction, ||J_QK||/||J_V|| at least min_qk_ratio times its λ = 0 value) of
    least κ(J), or none with the reason. Computes in float64."""
    fn = "advise_head"
    lams, pls = check_grid(fn, lambdas, placements)
    d = _core.advise_head(*_qkv(fn, X, WQ, WK, WV), scale, as_mask(mask, fn),
                          as_extras(fn, biases, rope), head, heads, kv_heads,
                          None if packed_columns is None else [int(c) for c in packed_columns],
                          lams, pls, max_saturated_fraction, min_qk_ratio, method, tol,
                          memory_budget, progress)
    return head_advice(d, placements=pls)


from ._advice import Advice, AdviceChoice, AdvicePoint, HeadAdvice, check_grid, head_advice  # noqa: E402,E501
from ._analyze import CheckpointAnalysis, MatrixAnalysis, analyze  # noqa: E402

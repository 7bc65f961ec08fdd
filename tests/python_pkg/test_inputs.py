"""Arrays in as people hold them (numpy C/F order, float32/64, torch tensors) and bad input: every
misuse raises ValueError or TypeError with a message naming the function and the argument."""

import numpy as np
import pytest
import torch

import spectral_cond as sc
from conftest import instance


def test_fortran_float64_is_read_in_place_and_c_order_is_copied(rng):
    F = np.asfortranarray(rng.standard_normal((5, 4)))
    C = np.ascontiguousarray(F)
    assert sc._core.input_is_borrowed(F)
    assert not sc._core.input_is_borrowed(C)
    assert sc._core.input_is_borrowed(F.astype(np.float32, order="F"))
    assert sc.kappa(F).to_dict() == sc.kappa(C).to_dict()


def test_c_and_f_order_give_identical_results(rng):
    F = instance(rng, order="F")
    C = instance(np.random.default_rng(20251201), order="C")
    np.testing.assert_array_equal(sc.attention(*F), sc.attention(*C))
    np.testing.assert_array_equal(sc.attention_jacobian(*F), sc.attention_jacobian(*C))
    assert sc.kappa_jacobian(*F).kappa == sc.kappa_jacobian(*C).kappa


def test_torch_tensors_in_including_requires_grad(rng):
    X, WQ, WK, WV = instance(rng)
    tensors = [torch.tensor(a) for a in (X, WQ, WK, WV)]
    tensors[1].requires_grad_(True)
    A = sc.attention(*tensors)
    np.testing.assert_array_equal(A, sc.attention(X, WQ, WK, WV))
    assert sc.kappa(tensors[1]).kappa == sc.kappa(WQ).kappa
    assert tensors[1].grad is None and tensors[1].requires_grad
    # A tensor's transpose (Fortran order in memory) is read in place too.
    t = torch.tensor(np.ascontiguousarray(X.T)).T
    assert sc._core.input_is_borrowed(sc._arrays.as_array("X", t, "test"))
    f32 = [t.float() for t in tensors]
    assert sc.attention(*f32).dtype == np.float32


def test_lists_are_float64(rng):
    r = sc.kappa([[1.0, 0.0], [0.0, 4.0]])
    assert r.kappa == 4.0


def test_device_tensor_is_refused_naming_it():
    meta = torch.empty((3, 3), device="meta")
    with pytest.raises(ValueError, match=r"kappa: M is a tensor on meta; .*CPU only.*M\.cpu\(\)"):
        sc.kappa(meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensor_is_refused_naming_it(rng):
    X, WQ, WK, WV = instance(rng)
    with pytest.raises(ValueError, match=r"attention: W_K is a tensor on cuda:0"):
        sc.attention(X, WQ, torch.tensor(WK, device="cuda"), WV)


@pytest.mark.parametrize("dtype", [np.int64, np.float16, np.complex128, np.bool_])
def test_wrong_dtype(rng, dtype):
    M = np.ones((3, 3), dtype=dtype)
    with pytest.raises(TypeError, match=r"kappa: M must be float32 or float64 \(got "):
        sc.kappa(M)


def test_mixed_dtypes(rng):
    X, WQ, WK, WV = instance(rng)
    with pytest.raises(TypeError, match="attention: W_Q is float32 but X is float64"):
        sc.attention(X, WQ.astype(np.float32), WK, WV)


def test_wrong_rank_and_shape(rng):
    X, WQ, WK, WV = instance(rng, N=5, D=4, dk=3, dv=2)
    with pytest.raises(ValueError, match=r"kappa: M must be a 2-D array \(got 1-D, shape \(4,\)\)"):
        sc.kappa(np.ones(4))
    with pytest.raises(ValueError, match=r"W_K must be D x d_k = 4 x 3 \(got 4 x 2\)"):
        sc.attention(X, WQ, WK[:, :2].copy(), WV)
    with pytest.raises(ValueError, match=r"kappa_jacobian: W_V must be D x d_v = 4 x 2 \(got 3 x 2\)"):
        sc.kappa_jacobian(X, WQ, WK, WV[:3].copy())
    with pytest.raises(ValueError, match="attention_vjp: G must be N x d_v"):
        sc.attention_vjp(X, WQ, WK, WV, np.ones((5, 3)))
    with pytest.raises(ValueError, match="additive_mask must be N x N"):
        sc.attention(X, WQ, WK, WV, mask=np.zeros((4, 4)))


def test_non_contiguous(rng):
    M = rng.standard_normal((6, 6))[::2, ::2]
    with pytest.raises(ValueError, match=r"kappa: M must be C- or Fortran-contiguous .*ascontiguousarray"):
        sc.kappa(M)
    X, WQ, WK, WV = instance(rng, N=5, D=4)
    t = torch.tensor(rng.standard_normal((4, 6)))[:, ::2]
    with pytest.raises(ValueError, match="attention: W_Q must be C- or Fortran-contiguous"):
        sc.attention(X, t, WK, WV)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf(rng, bad):
    X, WQ, WK, WV = instance(rng)
    WK = WK.copy()
    WK[1, 1] = bad
    for f in (sc.attention, sc.attention_jacobian, sc.attention_gram, sc.kappa_jacobian,
              sc.theorem34):
        with pytest.raises(ValueError, match=f"{f.__name__}: W_K contains NaN or Inf"):
            f(X, WQ, WK, WV)
    with pytest.raises(ValueError, match="kappa: M contains NaN or Inf"):
        sc.kappa(WK)
    with pytest.raises(ValueError, match="exact_correction: W contains NaN or Inf"):
        sc.exact_correction(WK)


def test_bad_options(rng):
    X, WQ, WK, WV = instance(rng)
    with pytest.raises(ValueError, match="method: unknown 'fast'"):
        sc.kappa_jacobian(X, WQ, WK, WV, method="fast")
    with pytest.raises(ValueError, match="tol must be > 0"):
        sc.kappa_jacobian(X, WQ, WK, WV, tol=0)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        sc.attention(X, WQ, WK, WV, scale=-1.0)
    with pytest.raises(ValueError, match="mask must be 'none', 'causal'"):
        sc.attention(X, WQ, WK, WV, mask="upper")
    with pytest.raises(ValueError, match="block must be"):
        sc.attention_jacobian(X, WQ, WK, WV, block="z")
    with pytest.raises(ValueError, match="target"):
        sc.exact_correction(WQ, target=0.5)
    with pytest.raises(TypeError):
        sc.kappa("not an array")


def test_torch_low_precision_is_refused_naming_it():
    t = torch.ones((3, 3), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"kappa: M must be float32 or float64 \(got torch.bfloat16\)"):
        sc.kappa(t)

"""analyze_model on real architectures built from configs (transformers, timm, torch), each head
checked against the test's own float64 rewrite of that architecture's attention (reference.py:
jacrev and SVD), after checking that the rewrite reproduces the module's own output. Decoders
with their causal masks, padding, sliding windows, RoPE (rope_parameters, linear scaling,
partial rotary, interleaved), grouped-query heads, biases, fused layouts (GPT-2's Conv1D,
GPT-NeoX), relative position biases (T5); and the modules that are declined, with the reason."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import spectral_cond.torch as sct
from reference import Head, check_head, rope_tables

import transformers  # noqa: E402  (scripts/setup-python installs it: a missing one fails)

torch.set_default_dtype(torch.float32)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4)
IDS = torch.tensor([[5, 17, 3, 42, 8, 29, 11, 60, 2]])  # distinct tokens: no repeated rows of X


def causal(N):
    return np.triu(np.full((N, N), -np.inf), 1)


def padding(keep):
    """Additive mask of a key-padding vector (1 keep, 0 pad), every row."""
    keep = np.asarray(keep, dtype=bool)
    return np.broadcast_to(np.where(keep, 0.0, -np.inf), (keep.size, keep.size)).copy()


def linear_W(lin, rows):
    """The library's W (D x len(rows)) and bias of output features `rows` of an nn.Linear."""
    W = lin.weight.detach().double().numpy()[rows].T
    b = None if lin.bias is None else lin.bias.detach().double().numpy()[rows]
    return W, b


def io_of(model, module, out_proj, inputs, layer_input="hidden_states", sample=0):
    """The module's input X (first call, sample `sample` of the batch) and per-head output (the
    input of `out_proj`, or the module's first output when out_proj is None), float64 numpy."""
    got = {}

    def pre(mod, args, kwargs):
        x = kwargs.get(layer_input, args[0] if args else None)
        got.setdefault("x", x.detach())

    def ctx(mod, args):
        got.setdefault("ctx", args[0].detach())

    def post(mod, args, out):
        got.setdefault("out", (out[0] if isinstance(out, tuple) else out).detach())

    hs = [module.register_forward_pre_hook(pre, with_kwargs=True),
          module.register_forward_hook(post)]
    if out_proj is not None:
        hs.append(out_proj.register_forward_pre_hook(ctx))
    try:
        with torch.no_grad():
            model.eval()
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        for h in hs:
            h.remove()
    c = got["ctx"] if out_proj is not None else got["out"]
    return got["x"][sample].double().numpy(), c[sample].double().numpy()


def check_model(model, inputs, module, out_proj, layer, heads, H, d, build_head, sample=0,
                layer_input="hidden_states", expect=None):
    """The rewrite (build_head(X, h) -> (Head, wq, wk, wv)) reproduces a float64 copy of the
    module; then analyze_model's κ(J) of `heads` is the rewrite's within the stated accuracy."""
    m64 = copy.deepcopy(model).double()
    path = {m: n for n, m in model.named_modules()}[module]
    mod64 = m64.get_submodule(path)
    op64 = None if out_proj is None else mod64.get_submodule(
        {m: n for n, m in module.named_modules()}[out_proj])
    inputs64 = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()} \
        if isinstance(inputs, dict) else inputs.double()
    X64, ctx64 = io_of(m64, mod64, op64, inputs64, layer_input, sample)
    for h in range(H):
        head, wq, wk, wv = build_head(X64, h, m64, mod64)
        out = head.output(wq, wk, wv)
        ref = ctx64[:, h * d:(h + 1) * d]
        # Hugging Face computes RoPE angles in float32 even in a float64 model: 1e-7 covers that.
        assert np.linalg.norm(out - ref) <= 1e-7 * np.linalg.norm(ref), f"rewrite of head {h}"
    X32, _ = io_of(model, module, out_proj, inputs, layer_input, sample)
    res = sct.analyze_model(model, inputs, layers=[layer], sample=sample, diagnostics=False)
    assert len(res) == H
    kappas = []
    for h in heads:
        r = res[h]
        assert (r.layer, r.head) == (layer, h)
        assert r.verify_error <= 1e-5, r.note
        head, wq, wk, wv = build_head(X32, h, model, module)
        k, s = head.kappa(wq, wk, wv)
        check_head(r, k, s)
        kappas.append(k)
    if expect is not None:
        assert expect(kappas, res)
    return res


def llama_like(name, cfg_kw, rope_theta, inputs=None, sample=0, mask_of=None, rope_kw=None,
               layer=1, out="o_proj"):
    cfg = getattr(transformers, name + "Config")(**cfg_kw)
    torch.manual_seed(1)
    model = getattr(transformers, name + "Model")(cfg)
    att = model.layers[layer].self_attn
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    inputs = inputs or {"input_ids": IDS}
    N = inputs["input_ids"].shape[1]
    rot = int(d * cfg.rope_parameters.get("partial_rotary_factor", 1.0))

    def build(X, h, m, a):
        g = h // (H // KV)
        wq, bq = linear_W(a.q_proj, slice(h * d, (h + 1) * d))
        wk, bk = linear_W(a.k_proj, slice(g * d, (g + 1) * d))
        wv, bv = linear_W(a.v_proj, slice(g * d, (g + 1) * d))
        mask = causal(N) if mask_of is None else mask_of(N)
        rope = rope_tables(N, rot, rope_theta, **(rope_kw or {}))
        return Head(X, d ** -0.5, bq, bk, bv, mask, rope), wq, wk, wv

    return model, inputs, att, getattr(att, out), layer, H, d, build


def test_llama_grouped_query_rope_parameters_causal():
    cfg = dict(SMALL, num_key_value_heads=2, rope_parameters={"rope_type": "default",
                                                               "rope_theta": 5e5})
    model, inputs, att, op, layer, H, d, build = llama_like("Llama", cfg, 5e5)
    res = check_model(model, inputs, att, op, layer, [0, 1, 3], H, d, build)
    assert all(r.rope and r.mask == "causal" and r.kv_head == r.head // 2 for r in res)
    assert "float64" in res[0].note  # RoPE angles recomputed exactly


def test_llama_eager_attention_and_right_padding():
    cfg = dict(SMALL, num_key_value_heads=2, attn_implementation="eager")
    keep = [1, 1, 1, 1, 1, 1, 1, 0, 0]
    inputs = {"input_ids": IDS.repeat(2, 1), "attention_mask": torch.tensor([[1] * 9, keep])}
    model, _, att, op, layer, H, d, build = llama_like(
        "Llama", cfg, 1e4, inputs=inputs, sample=1, mask_of=lambda N: causal(N) + padding(keep))
    res = check_model(model, inputs, att, op, layer, [0, 2], H, d, build, sample=1)
    assert all(r.mask == "additive" for r in res)


def test_llama_left_padding_rows_without_keys_are_singular_exactly():
    cfg = dict(SMALL, num_key_value_heads=2)  # sdpa: rows that attend to no key output 0
    keep = [0, 0, 1, 1, 1, 1, 1, 1, 1]
    inputs = {"input_ids": IDS, "attention_mask": torch.tensor([keep])}
    model, _, att, op, layer, H, d, _ = llama_like("Llama", cfg, 1e4, inputs=inputs)
    res = sct.analyze_model(model, inputs, layers=[layer], diagnostics=False)
    for r in res:
        assert r.info == "singular" and math.isinf(r.kappa_J) and r.method == "structure", r.note
        assert "attend to no key" in r.note


def test_llama_rope_linear_scaling():
    cfg = dict(SMALL, num_key_value_heads=4,
               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    model, inputs, att, op, layer, H, d, build = llama_like(
        "Llama", cfg, 1e4, rope_kw={"factor": 2.0})
    check_model(model, inputs, att, op, layer, [0, 3], H, d, build)


def test_llama_yarn_uses_the_modules_own_angles():
    cfg = dict(SMALL, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 64})
    torch.manual_seed(1)
    model = transformers.LlamaModel(transformers.LlamaConfig(**cfg))
    res = sct.analyze_model(model, {"input_ids": IDS}, layers=[0], diagnostics=False)
    for r in res:
        assert r.info in ("success", "singular") and r.rope, r.note
        assert "module's own angle tables" in r.note and r.verify_error <= 1e-5


def test_mistral_sliding_window():
    cfg = dict(SMALL, num_key_value_heads=2, sliding_window=3)
    N = IDS.shape[1]
    window = np.where(np.subtract.outer(np.arange(N), np.arange(N)) >= 3, -np.inf, 0.0)
    model, inputs, att, op, layer, H, d, build = llama_like(
        "Mistral", cfg, 1e4, mask_of=lambda N: causal(N) + window)
    res = check_model(model, inputs, att, op, layer, [1, 2], H, d, build)
    assert res[0].mask == "additive"


def test_qwen2_biases():
    cfg = dict(SMALL, num_key_value_heads=2)
    model, inputs, att, op, layer, H, d, build = llama_like("Qwen2", cfg, 1e4)
    with torch.no_grad():  # trained-like biases (initialised to zero)
        for lin in (att.q_proj, att.k_proj, att.v_proj):
            lin.bias.copy_(torch.randn_like(lin.bias))
    res = check_model(model, inputs, att, op, layer, [0, 3], H, d, build)
    assert all(r.has_bias for r in res)


def test_phi_partial_rotary():
    cfg = dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.5})
    cfg["num_key_value_heads"] = 4
    model, inputs, att, _, layer, H, d, build = llama_like("Phi", cfg, 1e4, out="dense")
    check_model(model, inputs, att, att.dense, layer, [0, 2], H, d, build)


def test_gpt_neox_fused_per_head_layout_partial_rotary():
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4)
    torch.manual_seed(2)
    model = transformers.GPTNeoXModel(cfg)
    att = model.layers[0].attention
    H, d, N = 4, 8, IDS.shape[1]
    rot = int(d * cfg.rope_parameters["partial_rotary_factor"])
    with torch.no_grad():
        att.query_key_value.bias.copy_(torch.randn_like(att.query_key_value.bias))

    def build(X, h, m, a):
        base = 3 * d * h
        w = [linear_W(a.query_key_value, slice(base + j * d, base + (j + 1) * d)) for j in range(3)]
        rope = rope_tables(N, rot, cfg.rope_parameters["rope_theta"])
        return (Head(X, d ** -0.5, w[0][1], w[1][1], w[2][1], causal(N), rope),
                w[0][0], w[1][0], w[2][0])

    check_model(model, {"input_ids": IDS}, att, att.dense, 0, [0, 3], H, d, build)


@pytest.mark.parametrize("inverse_layer_idx", [False, True])
def test_gpt2_conv1d(inverse_layer_idx):
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                  scale_attn_by_inverse_layer_idx=inverse_layer_idx)
    torch.manual_seed(3)
    model = transformers.GPT2Model(cfg)
    att = model.h[1].attn
    H, d, D, N = 4, 8, 32, IDS.shape[1]
    with torch.no_grad():
        att.c_attn.bias.copy_(torch.randn_like(att.c_attn.bias))
    c = d ** -0.5 / (2 if inverse_layer_idx else 1)

    def build(X, h, m, a):
        W = a.c_attn.weight.detach().double().numpy()  # D x 3D, not transposed
        b = a.c_attn.bias.detach().double().numpy()
        cols = [slice(j * D + h * d, j * D + (h + 1) * d) for j in range(3)]
        return (Head(X, c, *(b[s] for s in cols), causal(N)), *(W[:, s] for s in cols))

    res = check_model(model, {"input_ids": IDS}, att, att.c_proj, 1, [0, 3], H, d, build)
    assert res[0].kind == "huggingface-fused" and res[0].scale == pytest.approx(c)


@pytest.mark.parametrize("name", ["Bert", "Roberta"])
def test_bert_roberta_padding(name):
    cfg = getattr(transformers, name + "Config")(vocab_size=64, hidden_size=32,
                                                 intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=4)
    torch.manual_seed(4)
    model = getattr(transformers, name + "Model")(cfg, add_pooling_layer=False)
    att = model.encoder.layer[0].attention.self
    H, d, N = 4, 8, IDS.shape[1]
    keep = [1, 1, 1, 1, 1, 1, 0, 0, 0]
    inputs = {"input_ids": IDS.repeat(2, 1) % 60 + 3,
              "attention_mask": torch.tensor([[1] * 9, keep])}
    with torch.no_grad():
        for lin in (att.query, att.key, att.value):
            lin.bias.copy_(0.5 * torch.randn_like(lin.bias))

    def build(X, h, m, a):
        s = slice(h * d, (h + 1) * d)
        (wq, bq), (wk, bk), (wv, bv) = (linear_W(x, s) for x in (a.query, a.key, a.value))
        return Head(X, d ** -0.5, bq, bk, bv, padding(keep)), wq, wk, wv

    check_model(model, inputs, att, None, 0, [0, 3], H, d, build, sample=1)


def test_hf_vit():
    cfg = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, image_size=16, patch_size=4)
    torch.manual_seed(5)
    model = transformers.ViTModel(cfg, add_pooling_layer=False)
    att = model.layers[0].attention  # transformers 5: q_proj, k_proj, v_proj, o_proj
    H, d = 4, 8
    with torch.no_grad():
        for lin in (att.q_proj, att.k_proj, att.v_proj):
            lin.bias.copy_(0.5 * torch.randn_like(lin.bias))

    def build(X, h, m, a):
        s = slice(h * d, (h + 1) * d)
        (wq, bq), (wk, bk), (wv, bv) = (linear_W(x, s) for x in (a.q_proj, a.k_proj, a.v_proj))
        return Head(X, d ** -0.5, bq, bk, bv), wq, wk, wv

    res = check_model(model, {"pixel_values": torch.randn(1, 3, 16, 16)}, att, att.o_proj, 0,
                      [0, 3], H, d, build)
    assert res[0].N == 17  # 16 patches and the class token


def test_t5_relative_position_bias():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_heads=4)
    torch.manual_seed(6)
    model = transformers.T5EncoderModel(cfg)
    att = model.encoder.block[0].layer[0].SelfAttention
    H, d, N = 4, 8, IDS.shape[1]

    def build(X, h, m, a):
        bias = a.compute_bias(N, N)[0, h].detach().double().numpy()  # depends on no W
        s = slice(h * d, (h + 1) * d)
        (wq, _), (wk, _), (wv, _) = (linear_W(x, s) for x in (a.q, a.k, a.v))
        return Head(X, 1.0, mask=bias), wq, wk, wv

    check_model(model, {"input_ids": IDS}, att, att.o, 0, [0, 3], H, d, build)


def timm_vit(name):
    import timm
    torch.manual_seed(7)
    model = timm.create_model(name, pretrained=False, img_size=32, depth=2)
    att = model.blocks[1].attn
    H, d = att.num_heads, att.head_dim
    D = H * d

    def build(X, h, m, a):
        w = [linear_W(a.qkv, slice(j * D + h * d, j * D + (h + 1) * d)) for j in range(3)]
        return Head(X, d ** -0.5, w[0][1], w[1][1], w[2][1]), w[0][0], w[1][0], w[2][0]

    return model, torch.randn(1, 3, 32, 32), att, att.proj, 1, H, d, build


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "deit_tiny_patch16_224"])
def test_timm_vit_deit(name):
    model, x, att, op, layer, H, d, build = timm_vit(name)
    res = check_model(model, x, att, op, layer, [0, H - 1], H, d, build, layer_input="x")
    assert res[0].kind == "timm" and res[0].N == 5  # 4 patches and the class token


def test_torch_multihead_attention_masks():
    torch.manual_seed(8)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.copy_(torch.randn(48))
    N = 6
    keep = torch.tensor([[True] * N, [True, True, True, True, False, False]])
    pad = torch.where(keep, 0.0, float("-inf"))  # a float padding mask, like attn_mask
    attn_mask = torch.randn(N, N, dtype=torch.float32)  # a float mask is added to the logits

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, key_padding_mask=pad, attn_mask=attn_mask,
                             need_weights=False)[0]

    model = M()
    x = torch.randn(2, N, 16)
    res = sct.analyze_model(model, x, sample=1, diagnostics=False)
    W = mha.in_proj_weight.detach().double().numpy()
    B = mha.in_proj_bias.detach().double().numpy()
    mask = attn_mask.double().numpy() + padding(keep[1].numpy())
    for r in res:
        h, d = r.head, 4
        cols = [slice(j * 16 + h * d, j * 16 + (h + 1) * d) for j in range(3)]
        head = Head(x[1].double().numpy(), d ** -0.5, *(B[c] for c in cols), mask)
        k, s = head.kappa(*(W[c].T for c in cols))
        check_head(r, k, s)
        assert r.mask == "additive" and r.verify_error <= 1e-5


def test_torch_encoder_causal_and_decoder_cross_attention_declined():
    torch.manual_seed(9)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                           batch_first=True), 1,
                                enable_nested_tensor=False)
    N = 5
    x = torch.randn(1, N, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(N)
    res = sct.analyze_model(enc, (x, mask, None, True), diagnostics=False)
    att = enc.layers[0].self_attn
    W = att.in_proj_weight.detach().double().numpy()
    B = att.in_proj_bias.detach().double().numpy()
    for r in res:
        d, h = 8, r.head
        cols = [slice(j * 16 + h * d, j * 16 + (h + 1) * d) for j in range(3)]
        head = Head(x[0].double().numpy(), d ** -0.5, *(B[c] for c in cols), causal(N))
        k, s = head.kappa(*(W[c].T for c in cols))
        check_head(r, k, s)
        assert r.mask == "causal"

    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0,
                                                           batch_first=True), 1)
    memory = torch.randn(1, 7, 16)
    res = sct.analyze_model(dec, (x, memory, mask), diagnostics=False)
    self_att = [r for r in res if r.name.endswith("self_attn")]
    cross = [r for r in res if r.name.endswith("multihead_attn")]
    assert self_att and all(r.info == "success" and r.mask == "causal" for r in self_att)
    assert cross and all(r.info == "declined" and "cross-attention" in r.note for r in cross)


@pytest.mark.parametrize("name,kw,reason", [
    ("Qwen3", dict(num_key_value_heads=2, head_dim=8), "normalises its queries/keys"),
    ("Gemma2", dict(num_key_value_heads=2, head_dim=8), "soft-capping"),
])
def test_unmodelled_features_are_declined_with_the_reason(name, kw, reason):
    cfg = getattr(transformers, name + "Config")(**SMALL, **kw)
    torch.manual_seed(10)
    model = getattr(transformers, name + "Model")(cfg)
    res = sct.analyze_model(model, {"input_ids": IDS}, diagnostics=False)
    assert len(res) == 2 * 4
    for r in res:
        assert r.info == "declined" and reason in r.note and math.isnan(r.kappa_J)
        assert math.isfinite(r.kappa_WQ)  # the weights are still analysed


class HiddenTanhAttention(nn.Module):
    """Looks like Hugging Face attention but soft-caps its logits without saying so: only the
    check against the module's own forward can tell."""

    def __init__(self, D=16, H=2):
        super().__init__()
        self.num_heads, self.head_dim = H, D // H
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.o_proj = nn.Linear(D, D)

    def forward(self, hidden_states):
        B, N, D = hidden_states.shape
        sp = lambda t: t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        q, k, v = sp(self.q_proj(hidden_states)), sp(self.k_proj(hidden_states)), \
            sp(self.v_proj(hidden_states))
        z = 3.0 * torch.tanh(q @ k.transpose(-1, -2) / 3.0)
        return self.o_proj((z.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))


def test_a_module_that_differs_from_the_model_is_declined():
    torch.manual_seed(11)
    res = sct.analyze_model(HiddenTanhAttention(), torch.randn(1, 6, 16), diagnostics=False)
    for r in res:
        assert r.info == "declined" and "differs from the module's own forward" in r.note
        assert r.verify_error > 1e-3


def test_albert_shared_layer_is_analysed_at_every_call():
    cfg = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32,
                                    intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4)
    torch.manual_seed(12)
    model = transformers.AlbertModel(cfg, add_pooling_layer=False)
    res = sct.analyze_model(model, {"input_ids": IDS}, diagnostics=False)
    assert [(r.call, r.head) for r in res] == [(c, h) for c in range(3) for h in range(4)]
    assert all("called 3 times" in r.note and r.info == "success" for r in res)
    # Each call sees its own X: the three calls differ.
    assert len({round(r.kappa_J, 6) for r in res if r.head == 0}) == 3
    first = sct.analyze_model(model, {"input_ids": IDS}, diagnostics=False, calls="first")
    assert [r.call for r in first] == [0] * 4
    assert [r.kappa_J for r in first] == [r.kappa_J for r in res[:4]]

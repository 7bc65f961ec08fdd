"""KappaMonitor: conditioning measured during training, every k steps, at the current batch
(MATH.md §4, §11, §12), with the same attention model as analyze_model (docs/python.md)."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
from torch import nn

from ._torch_analysis import check_arguments, head_kappa, head_models, weight_kappa
from ._torch_capture import capture
from ._torch_sites import AttentionSite, find_attention


class _Budget(Exception):
    """Raised from a progress callback to stop a kappa(J) call that ran past its budget."""


class KappaMonitor:
    """A training callback that measures conditioning every `every` steps (MATH.md §4, §11, §12).

    monitor = KappaMonitor(model, every=50, log="kappa.jsonl")
    for step, (x, y) in enumerate(batches):
        ...; optimizer.step()
        monitor(step, x)        # measures at steps 0, 50, 100, ... on this batch

    At each measured step it writes one JSON line per layer (kind "layer": kappa of the layer's
    effective W_Q, W_K, W_V, i.e. with any spectral_conditioning correction) and one per
    sampled head (kind "head": kappa of the head's blocks, kappa(J) at the batch's real
    activations with method, stated accuracy and info, and the attention diagnostics with the
    bound without hypothesis). `heads` heads are sampled per layer (None: all) with a generator
    seeded by (seed, step), so every run with the same seed measures the same heads. kappa(J)
    calls share a time budget of `budget_s` seconds per measured step: a call running past it is
    cancelled and logged with info "budget", and the heads after it are logged as "skipped".
    The probe forward pass runs in eval mode without gradients and restores the global random
    state, so monitoring changes neither the model's mode nor the random numbers training draws.
    `log` may be a path ending in .jsonl/.json (JSON lines) or .csv, or None (records are
    kept in `records` either way). `overhead_s` is the time spent measuring.
    """

    def __init__(self, model: nn.Module, every: int = 100, log: Optional[str] = None,
                 heads: Optional[int] = 1, method: str = "auto", tol: float = 1e-6,
                 budget_s: float = 10.0, mask: str = "auto", sample: int = 0, seed: int = 0,
                 diagnostics: bool = True, layers: Optional[Iterable[int]] = None,
                 check: bool = True):
        check_arguments("KappaMonitor", method, tol, mask, sample)
        if every < 1:
            raise ValueError("KappaMonitor: every must be >= 1")
        if heads is not None and heads < 1:
            raise ValueError("KappaMonitor: heads must be >= 1 or None (all heads)")
        if not budget_s > 0:
            raise ValueError("KappaMonitor: budget_s must be > 0")
        self.model = model
        self.every = every
        self.heads = heads
        self.method = method
        self.tol = tol
        self.budget_s = budget_s
        self.mask = mask
        self.sample = sample
        self.seed = seed
        self.diagnostics = diagnostics
        self.check = check
        self._copies: Dict[int, nn.Module] = {}
        self.layers = None if layers is None else set(layers)
        self.sites = find_attention(model)
        if not self.sites:
            raise ValueError("KappaMonitor: the model has no attention module spectral_cond knows")
        self.records: List[dict] = []
        self.overhead_s = 0.0
        self._log = log
        self._file = None
        self._csv = None
        if log is not None:
            if not (log.endswith(".jsonl") or log.endswith(".json") or log.endswith(".csv")):
                raise ValueError(f"KappaMonitor: log {log!r}: expected a .jsonl, .json or .csv path")
            self._file = open(log, "w", newline="")

    def __enter__(self) -> "KappaMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __call__(self, step: int, inputs: Any, **extra: Any) -> Optional[List[dict]]:
        """Measures when step % every == 0 (returns the new records), else does nothing and
        returns None. `extra` (e.g. loss=..., epoch=...) is copied into every record."""
        if step % self.every != 0:
            return None
        return self.measure(inputs, step=step, **extra)

    def measure(self, inputs: Any, step: int = 0, **extra: Any) -> List[dict]:
        """Measures now, whatever the step."""
        import time

        t0 = time.perf_counter()
        captured = capture(self.model, self.sites, self.layers, inputs, probe=True)
        rng = np.random.default_rng([self.seed, step])
        deadline = t0 + self.budget_s
        new: List[dict] = []
        for i, s in enumerate(self.sites):
            if self.layers is not None and i not in self.layers:
                continue
            calls = captured.get(i, [])
            WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
            notes = list(s.notes)
            if not calls:
                notes.append("the module did not run on these inputs: no X, kappa(J) not computed")
            elif len(calls) > 1:
                notes.append(f"the module is called {len(calls)} times (shared weights): measured "
                             "at its first call")
            models, cnotes = head_models(s, calls[0] if calls else None, self.sample, self.mask,
                                         self.check, self._copies, WQ, WK, WV)
            X = models[0].X if models else None
            base = dict(extra, step=step, layer=i, name=s.name)
            new.append(dict(base, kind="layer", kappa_WQ=weight_kappa(WQ),
                            kappa_WK=weight_kappa(WK), kappa_WV=weight_kappa(WV),
                            N=0 if X is None else int(X.shape[0]), D=s.D, heads=s.heads))
            chosen = range(s.heads) if self.heads is None or self.heads >= s.heads else sorted(
                int(h) for h in rng.choice(s.heads, size=self.heads, replace=False))
            for h in chosen:
                new.append(self._head(base, models[h], notes + cnotes, deadline))
        self.overhead_s += time.perf_counter() - t0
        self._write(new)
        self.records.extend(new)
        return new

    def _head(self, base: dict, hm, notes: List[str], deadline: float) -> dict:
        import time

        nan = float("nan")
        r = dict(base, kind="head", head=hm.head, kv_head=hm.kv_head,
                 kappa_WQ=weight_kappa(hm.wq), kappa_WK=weight_kappa(hm.wk),
                 kappa_WV=weight_kappa(hm.wv), kappa_J=nan, kappa_plus_J=nan, sigma_min_J=nan,
                 sigma_max_J=nan, method="", accuracy=nan, info="not_computed",
                 row_max_mean=nan, row_max_min=nan, entropy_mean=nan, saturated_fraction=nan,
                 ratio_QK_V=nan, collapsed=None, free_bound=nan, seconds=0.0,
                 note="; ".join(notes))
        if hm.X is None and hm.refusal is None:
            return r
        if hm.refusal is None and time.perf_counter() >= deadline:
            r["info"] = "skipped"
            r["note"] = "; ".join(notes + ["the step's time budget was spent before this head"])
            return r

        def check(_fraction):
            if time.perf_counter() > deadline:
                raise _Budget()

        t = time.perf_counter()
        try:
            J, d, info, hnotes = head_kappa(hm, self.method, self.tol, self.diagnostics, check)
        except _Budget:
            r["info"] = "budget"
            r["seconds"] = time.perf_counter() - t
            r["note"] = "; ".join(notes + [f"kappa(J) cancelled after the step's budget of "
                                           f"{self.budget_s} s"])
            return r
        r["info"] = info
        if J is not None:
            r.update(kappa_J=J.kappa, kappa_plus_J=J.kappa_plus, sigma_min_J=J.sigma_min,
                     sigma_max_J=J.sigma_max, method=J.method, accuracy=J.accuracy)
        if d is not None:
            r.update(row_max_mean=d.row_max_mean, row_max_min=d.row_max_min,
                     entropy_mean=d.entropy_mean, saturated_fraction=d.saturated_fraction,
                     ratio_QK_V=d.ratio_QK_V, collapsed=d.collapsed,
                     free_bound=d.free_bound.bound if d.free_bound else nan)
        r["seconds"] = time.perf_counter() - t
        r["note"] = "; ".join(notes + hnotes)
        return r

    # Columns of the CSV log: every key of a head record; layer records leave the head columns
    # empty. Extra keys (loss=..., ...) go first, in the order of the first call.
    _COLUMNS = ("step", "kind", "layer", "name", "head", "kv_head", "N", "D", "heads",
                "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_J", "kappa_plus_J", "sigma_min_J",
                "sigma_max_J", "method", "accuracy", "info", "row_max_mean", "row_max_min",
                "entropy_mean", "saturated_fraction", "ratio_QK_V", "collapsed", "free_bound",
                "seconds", "note")

    def _write(self, new: List[dict]) -> None:
        if self._file is None or not new:
            return
        import json

        if self._log.endswith(".csv"):
            import csv

            if self._csv is None:
                extra = [k for k in new[0] if k not in self._COLUMNS]
                self._csv = csv.DictWriter(self._file, fieldnames=extra + list(self._COLUMNS),
                                           extrasaction="ignore")
                self._csv.writeheader()
            for r in new:
                self._csv.writerow({k: _csv_value(v) for k, v in r.items()})
        else:
            for r in new:
                self._file.write(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n")
        self._file.flush()


def _json_value(v: Any) -> Any:
    """JSON has no inf or NaN: +inf is written as the string "inf", NaN as null."""
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
    return v


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def read_monitor_log(path: str) -> List[dict]:
    """The records of a KappaMonitor JSON-lines log, with "inf" read back as float('inf') and
    null as NaN (the inverse of the log's encoding)."""
    import json

    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for k, v in r.items():
                if v is None and k not in ("collapsed",):
                    r[k] = float("nan")
                elif v in ("inf", "-inf"):
                    r[k] = float(v)
            out.append(r)
    return out

#!/usr/bin/env python3
"""The hostile corpus (make_corpus.py) against `spectral-cond`.

Every case must exit with its expected code (2 for all but the few valid-but-odd inputs, 3
for finite inputs whose computation overflows, docs/cli.md, and 0 or 3 for the numerical edges:
an answer or a declined one, never 1) within
the time limit, never crash, hang or run out of memory; a refused case prints exactly one line on
stderr, "spectral-cond: error: ...", containing the case's `expect` substring (the file, tensor or
argument at fault), in under MAX_SECONDS wall-clock and MAX_RSS_MB peak resident memory.

Run by ctest:   python test_hostile.py --exe spectral-cond [--report FILE] [-k PATTERN]
With pytest:    SPECTRAL_COND_EXE=... pytest tests/hostile/test_hostile.py
"""
import argparse
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hostile_run  # noqa: E402
import make_corpus  # noqa: E402

EXE = os.environ.get("SPECTRAL_COND_EXE")
MAX_SECONDS = 1.0  # CPU time (user + system) of the tool: what a case costs, whatever the load
MAX_WALL_SECONDS = float(os.environ.get("SPECTRAL_COND_HOSTILE_WALL", "4"))  # shared machines
MAX_RSS_MB = 100.0
HARD_TIMEOUT = 5.0  # a case still running then is killed and counted as a hang
if hostile_run.SANITIZED:
    # An unoptimised ASan/UBSan build: the same cases and the same exit codes and messages, with
    # every memory error, leak and undefined behaviour fatal. Its cost is the sanitizers' (the
    # 60,000-tensor header takes 12 s of CPU and 325 MB there, 0.1 s and 20 MB in Release), so
    # the time and memory limits are the Release suite's to check; here a case is only killed,
    # as a hang, after HARD_TIMEOUT.
    MAX_SECONDS = MAX_WALL_SECONDS = MAX_RSS_MB = float("inf")
    HARD_TIMEOUT = 120.0
if hostile_run.MEMCHECK:
    # Under valgrind (scripts/memcheck): every run is some 20-50 times slower, and what counts is
    # its report; exit codes and messages are checked as always.
    MAX_SECONDS = MAX_WALL_SECONDS = MAX_RSS_MB = float("inf")
    HARD_TIMEOUT = 300.0
REPORT = None
PATTERN = None


class HostileCorpus(unittest.TestCase):
    results = {}

    @classmethod
    def setUpClass(cls):
        if not EXE:
            raise unittest.SkipTest("set SPECTRAL_COND_EXE or pass --exe")
        cls.tmp = tempfile.TemporaryDirectory(prefix="sc-hostile-")
        cls.cases = make_corpus.build(cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        if REPORT:
            with open(REPORT, "w") as f:
                json.dump(cls.results, f, indent=1)
        cls.tmp.cleanup()

    def test_corpus_size(self):
        fmts = {}
        for c in self.cases:
            fmts[c["format"]] = fmts.get(c["format"], 0) + 1
        self.assertGreaterEqual(len(self.cases), 200)
        for f in ("npy", "npz", "safetensors", "sharded", "bin", "gguf", "cli", "edge"):
            self.assertIn(f, fmts)

    def test_cases(self):
        worst_t, worst_m, worst_c = 0.0, 0.0, 0.0
        cases = [c for c in self.cases if not PATTERN or PATTERN in c["id"]]
        runs = {}
        if hostile_run.MEMCHECK:
            # valgrind's runs are slow and independent: one per core at a time (their limits
            # are off), checked below in order as always.
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                futures = {c["id"]: pool.submit(hostile_run.run, EXE, c["argv"],
                                                timeout=HARD_TIMEOUT) for c in cases}
                runs = {k: f.result() for k, f in futures.items()}
        for case in cases:
            with self.subTest(case=case["id"]):
                r = runs.get(case["id"]) or hostile_run.run(EXE, case["argv"], timeout=HARD_TIMEOUT)
                self.results[case["id"]] = {"rc": r.returncode, "seconds": r.seconds,
                                            "cpu_seconds": r.cpu_seconds,
                                            "max_rss_mb": r.max_rss_mb,
                                            "stderr": r.stderr[-300:]}
                worst_t, worst_m = max(worst_t, r.seconds), max(worst_m, r.max_rss_mb)
                worst_c = max(worst_c, r.cpu_seconds)
                self.check(case, r)
        print(f"\nhostile corpus: max wall time {worst_t:.3f} s, max CPU time {worst_c:.3f} s, "
              f"max RSS {worst_m:.1f} MB", file=sys.stderr)

    def check(self, case, r):
        what = f"{case['id']} ({case['note']}): {r}"
        self.assertFalse(r.timed_out, "hang: " + what)
        self.assertEqual(r.memcheck, "", "valgrind memcheck report: " + what)
        allowed = case["exit"] if isinstance(case["exit"], list) else [case["exit"]]
        self.assertIn(r.returncode, allowed, what)
        lines = r.stderr.splitlines()
        if r.returncode != 0:
            self.assertEqual(len(lines), 1, "not one line on stderr: " + what)
            self.assertTrue(lines[0].startswith("spectral-cond: error: "), what)
            self.assertIn(case["expect"], lines[0], "message does not name it: " + what)
        f = case.get("cpu_factor", 1.0)
        self.assertLess(r.cpu_seconds, f * MAX_SECONDS, "too slow: " + what)
        self.assertLess(r.seconds, f * MAX_WALL_SECONDS, "too slow (wall clock): " + what)
        self.assertLess(r.max_rss_mb, MAX_RSS_MB, "too much memory: " + what)
        if r.returncode == 0 and "json" in case["argv"]:
            kappas = list(json_values(json.loads(r.stdout), "kappa"))
            self.assertTrue(kappas, what)
            self.assertNotIn("nan", kappas, "a NaN kappa reported as a success: " + what)


class ScaleAndZero(unittest.TestCase):
    """kappa(J) is the same for (X t, W / t) at every t (Q, K, V, P do not change and J scales
    by t, MATH.md §3), for every method; X = 0 gives J = 0 (kappa = inf), never an error."""

    METHODS = ("dense", "gram", "iterative", "qr", "lobpcg", "matfree", "auto")
    SCALES = (2.0**-1000, 2.0**-600, 1e-150, 1.0, 1e150, 2.0**600, 2.0**1000)

    @classmethod
    def setUpClass(cls):
        if not EXE:
            raise unittest.SkipTest("set SPECTRAL_COND_EXE or pass --exe")
        import numpy as np
        cls.np = np
        cls.tmp = tempfile.TemporaryDirectory(prefix="sc-scale-")
        rng = np.random.default_rng(2)
        cls.wide = {k: rng.standard_normal(s) for k, s in
                    (("X", (4, 3)), ("WQ", (3, 2)), ("WK", (3, 2)), ("WV", (3, 2)))}
        cls.tall = {k: rng.standard_normal(s) for k, s in  # J 32 x 24: singular (gauge)
                    (("X", (16, 4)), ("WQ", (4, 2)), ("WK", (4, 2)), ("WV", (4, 2)))}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def kappa(self, arrays, t, method, tag):
        paths = []
        for k in ("X", "WQ", "WK", "WV"):
            a = arrays[k] * t if k == "X" else arrays[k] / t
            p = os.path.join(self.tmp.name, f"{tag}_{k}.npy")
            with open(p, "wb") as f:
                f.write(make_corpus.npy_bytes(self.np.ascontiguousarray(a)))
            paths.append(p)
        r = hostile_run.run(EXE, ["kappa", "--x", paths[0], "--wq", paths[1], "--wk", paths[2],
                                  "--wv", paths[3], "--method", method, "--format", "json"],
                            timeout=max(20.0, HARD_TIMEOUT))
        self.assertEqual(r.memcheck, "", f"valgrind memcheck report: {method} t={t}: {r}")
        self.assertEqual(r.returncode, 0, f"{method} t={t}: {r}")
        k = json.loads(r.stdout)["kappa"]
        return float(k)

    def kappas(self, jobs):
        """kappa of every (arrays, t, method) in `jobs`, the runs spread over the cores (under
        valgrind each takes seconds), in order."""
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return list(pool.map(lambda ij: self.kappa(*ij[1], f"j{ij[0]}"), enumerate(jobs)))

    def test_scale_invariance_wide(self):
        scales = (1.0, *self.SCALES)  # each method's first run, t = 1, is its reference
        got = self.kappas([(self.wide, t, m) for m in self.METHODS for t in scales])
        for i, m in enumerate(self.METHODS):
            ks = got[i * len(scales):(i + 1) * len(scales)]
            for t, k in zip(scales[1:], ks[1:]):
                with self.subTest(method=m, t=t):
                    self.assertTrue(abs(k - ks[0]) <= 1e-9 * ks[0],
                                    f"{m}: kappa {k} at t={t}, {ks[0]} at 1")

    def test_scale_invariance_singular(self):
        jobs = [(self.tall, t, m) for m in ("dense", "qr", "auto") for t in self.SCALES]
        for (_, t, m), k in zip(jobs, self.kappas(jobs)):
            with self.subTest(method=m, t=t):
                self.assertEqual(k, float("inf"), f"{m}: a singular J reported finite at t={t}")

    def test_zero_x(self):
        zero = dict(self.wide, X=self.np.zeros((4, 3)))
        jobs = [(zero, 1.0, m) for m in self.METHODS]
        for (_, _, m), k in zip(jobs, self.kappas(jobs)):
            with self.subTest(method=m):
                self.assertEqual(k, float("inf"))


def json_values(doc, key):
    """Every value of `key` anywhere in a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == key and not isinstance(v, (dict, list)):
                yield v
            yield from json_values(v, key)
    elif isinstance(doc, list):
        for v in doc:
            yield from json_values(v, key)

def main():
    global EXE, REPORT, PATTERN
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--report", help="write every case's exit code, time and RSS to FILE")
    ap.add_argument("-k", dest="pattern", help="only the cases whose id contains PATTERN")
    args, rest = ap.parse_known_args()
    EXE, REPORT, PATTERN = os.path.abspath(args.exe), args.report, args.pattern
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()

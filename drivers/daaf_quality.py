"""What ``hpczeco bench daaf-quality`` measures: the key-region plans of DAAF and of the same-budget baselines,
the attention they run through, and the quality metrics of a trained model under each.

Protocol (one document of ``T`` tokens): the first ``C`` tokens are the *context*, planned and prefilled; the
rest is the *continuation* (``continuation`` tokens of held-out text, or the questions of a retrieval document),
whose tokens are ordinary (local) queries: they see their ``local_window`` and the context's key-region keys,
as tokens decoded after a DAAF prefill would. Every plan is over the context only, so no method can make
the scored tokens themselves global.

Methods (every one a :class:`hpczeco.daaf.Plan` over ``T`` tokens, built with ``plan_from_mask``, run by the
library's DAAF attention):

``exact``        exact causal attention (torch SDPA; not a plan);
``exact-lib``    every token global, through the library's DAAF attention (= exact; the kernels' noise floor);
``window``       the local window alone (``local_window``, no key region);
``window-wide``  a wider sliding window alone, as many query-key pairs as DAAF's plan;
``sinks``        window + the first ``G`` context tokens global (StreamingLLM's attention sinks);
``random``       window + ``window``-sized blocks of the context (a grid from 0) in random order, ``G`` tokens;
``oracle``       window + the blocks that receive the most exact attention, ``G`` tokens;
``oracle-tok``   window + the ``G`` single tokens that receive the most exact attention;
``daaf``         the planner's key regions (:func:`hpczeco.daaf.plan`: entropy windows, threshold, the budget
                 fallback, local window) -- the seed's settings;
``daaf-gl``      ``daaf`` with the first ``global_layers`` layers exact (the seed's "global layers").

``G`` is the number of global tokens of DAAF's plan of the same context (the *same attention budget*); the
last block of ``random``/``oracle`` is cut to fit ``G`` exactly. "Received exact attention" (the oracle's
score of a context key ``j``): the exact softmax weight, summed over layers, heads and the scored query rows
of the continuation, on keys outside each query's local window (``t - j > local_window``).

Attention backends: ``gpu`` (``hpczeco.gpu.daaf.attention_torch``, the GPU DAAF kernels, bf16), ``cpu``
(``hpczeco.daaf.attention``, the library's blockwise CPU path, float32 numpy), ``dense`` (a dense masked torch
attention built from the same plan: the GPU fallback and the tests' cross-check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hpczeco.daaf.attention import attention as lib_attention
from hpczeco.daaf.planner import Plan, attention_pairs, dense_pairs, plan, plan_from_mask

from .daaf_lm import KV, KVFormat, RetrievalDoc, retrieval_doc, sdpa_causal

__all__ = [
    "CURVE_METHODS",
    "METHODS",
    "DaafSettings",
    "Doc",
    "MethodPlan",
    "Runner",
    "aggregate",
    "block_grid",
    "daaf_context_plan",
    "dense_masked_attention",
    "evaluate",
    "fill_blocks",
    "make_docs",
    "method_plans",
    "oracle_mass",
    "wide_window",
]

METHODS = ("exact", "exact-lib", "window", "window-wide", "sinks", "random", "oracle", "oracle-tok", "daaf",
           "daaf-gl")
#: the methods of the budget curve (each at the budget of DAAF's percentile plan)
CURVE_METHODS = ("window-wide", "sinks", "random", "oracle", "oracle-tok", "daaf")
BASELINES = ("window-wide", "sinks", "random", "oracle", "oracle-tok")


@dataclass(frozen=True)
class DaafSettings:
    """The seed's DAAF: entropy windows of ``window`` tokens, ``threshold``, the budget fallback
    (``fallback_budget``: the top windows by entropy when no window reaches the threshold), ``local_window``;
    ``vocab_size`` the entropy's normaliser; ``global_layers`` for ``daaf-gl``; ``continuation`` the scored
    tail of a text document."""

    window: int = 512
    threshold: float = 0.8
    local_window: int = 128
    fallback_budget: float = 0.25
    vocab_size: int | None = 256
    global_layers: int = 2
    continuation: int = 1024


@dataclass
class MethodPlan:
    """One method on one document: ``plan`` over all ``T`` tokens (None for ``exact``), the first
    ``exact_layers`` layers exact, ``source`` the planner's own plan of the context (DAAF only)."""

    name: str
    plan: Plan | None
    exact_layers: int = 0
    source: Plan | None = None
    info: dict = field(default_factory=dict)

    @property
    def global_mask(self) -> np.ndarray:
        return np.ones(0, bool) if self.plan is None else self.plan.global_mask


# --------------------------------------------------------------------------------------------- plans


def daaf_context_plan(ctx: np.ndarray, s: DaafSettings, budget: float | None = None) -> Plan:
    """The planner's plan of the context ``ctx`` ``[C]``: the seed's rule (threshold, budget fallback), or with
    ``budget`` the percentile rule at that token budget."""
    if budget is None:
        return plan(ctx, s.window, s.threshold, s.local_window, policy="budget", fallback_budget=s.fallback_budget,
                    vocab_size=s.vocab_size)
    return plan(ctx, s.window, s.threshold, s.local_window, budget=budget, vocab_size=s.vocab_size)


def block_grid(C: int, window: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` blocks of ``window`` tokens from 0 over ``[0, C)`` (the last one may be shorter)."""
    return [(a, min(a + window, C)) for a in range(0, C, window)]


def fill_blocks(blocks: list[tuple[int, int]], n: int, C: int) -> np.ndarray:
    """Bool ``[C]``: the blocks in the given order until ``n`` tokens are marked (the last one cut to fit)."""
    g = np.zeros(C, dtype=bool)
    left = int(n)
    for a, b in blocks:
        if left <= 0:
            break
        take = min(b - a, left)
        g[a : a + take] = True
        left -= take
    return g


def wide_window(target_pairs: int, T: int) -> int:
    """The sliding window ``W`` (no key region) whose pair count over ``T`` tokens is closest to ``target_pairs``."""
    zero = np.zeros(T, dtype=bool)
    lo, hi = 0, T
    while lo < hi:  # the smallest W with pairs(W) >= target
        mid = (lo + hi) // 2
        if attention_pairs(zero, mid) >= target_pairs:
            hi = mid
        else:
            lo = mid + 1
    if lo > 0 and abs(attention_pairs(zero, lo - 1) - target_pairs) <= abs(attention_pairs(zero, lo) - target_pairs):
        return lo - 1
    return lo


def _extend(g_ctx: np.ndarray, T: int) -> np.ndarray:
    g = np.zeros(T, dtype=bool)
    g[: g_ctx.size] = g_ctx
    return g


def method_plans(ctx: np.ndarray, T: int, s: DaafSettings, oracle_scores: np.ndarray | None,
                 rng: np.random.Generator, methods: tuple[str, ...] = METHODS, budget: float | None = None,
                 ) -> dict[str, MethodPlan]:
    """The :class:`MethodPlan` of each of ``methods`` for a document whose context is ``ctx`` ``[C]`` and whose
    length is ``T``; ``oracle_scores`` ``[C]`` the exact attention each context key receives (needed by the
    oracles); ``budget``: DAAF at that token budget (percentile rule) instead of the seed's rule."""
    C = int(ctx.size)
    W = s.local_window
    src = daaf_context_plan(ctx, s, budget)
    g_daaf = _extend(src.global_mask, T)
    G = int(src.global_mask.sum())
    daaf_plan = plan_from_mask(g_daaf, W, f"daaf: {src.policy}")
    out: dict[str, MethodPlan] = {}
    blocks = block_grid(C, s.window)
    for name in methods:
        if name == "exact":
            out[name] = MethodPlan(name, None)
        elif name == "exact-lib":
            out[name] = MethodPlan(name, plan_from_mask(np.ones(T, bool), W, "every token global"))
        elif name == "window":
            out[name] = MethodPlan(name, plan_from_mask(np.zeros(T, bool), W, "local window"))
        elif name == "window-wide":
            Ww = wide_window(daaf_plan.pairs, T)
            out[name] = MethodPlan(name, plan_from_mask(np.zeros(T, bool), Ww, f"window {Ww}"), info={"window": Ww})
        elif name == "sinks":
            g = np.zeros(C, bool)
            g[:G] = True
            out[name] = MethodPlan(name, plan_from_mask(_extend(g, T), W, f"first {G} tokens"))
        elif name == "random":
            order = [blocks[i] for i in rng.permutation(len(blocks))]
            out[name] = MethodPlan(name, plan_from_mask(_extend(fill_blocks(order, G, C), T), W, "random blocks"))
        elif name in ("oracle", "oracle-tok"):
            if oracle_scores is None:
                raise ValueError(f"method {name!r} needs the exact model's attention (oracle_scores)")
            sc = np.asarray(oracle_scores, dtype=np.float64)
            if name == "oracle":
                sums = np.array([sc[a:b].sum() for a, b in blocks])
                order = [blocks[i] for i in np.argsort(-sums, kind="stable")]
                g = fill_blocks(order, G, C)
            else:
                g = np.zeros(C, bool)
                g[np.argsort(-sc, kind="stable")[:G]] = True
            out[name] = MethodPlan(name, plan_from_mask(_extend(g, T), W, name))
        elif name == "daaf":
            out[name] = MethodPlan(name, daaf_plan, 0, src)
        elif name == "daaf-gl":
            out[name] = MethodPlan(name, daaf_plan, s.global_layers, src)
        else:
            raise ValueError(f"unknown method {name!r}; choose from {METHODS}")
    return out


# --------------------------------------------------------------------------------------------- attention


def dense_masked_attention(q, k, v, global_mask, local_window: int, scale: float | None = None, block: int = 1024):
    """DAAF attention by a dense mask: ``q, k: [B, T, H, D]``, ``v: [B, T, H, Dv]`` torch -> ``[B, T, H, Dv]``.

    ``global_mask`` bool ``[T]`` (numpy or torch); query ``t`` attends to ``j <= t`` iff ``t - j <=
    local_window`` or ``j`` or ``t`` is global (:func:`hpczeco.daaf.allowed_mask`), per query block of
    ``block`` rows. float64 inputs stay float64; other dtypes compute in float32."""
    with torch.autocast(q.device.type, enabled=False):
        return _dense_masked(q, k, v, global_mask, local_window, scale, block)


def _dense_masked(q, k, v, global_mask, local_window: int, scale: float | None, block: int):
    B, T, H, D = q.shape
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D**-0.5 if scale is None else float(scale)
    g = torch.as_tensor(np.asarray(global_mask, dtype=bool) if not torch.is_tensor(global_mask) else global_mask,
                        device=q.device)
    kh = k.to(dt).permute(0, 2, 3, 1)  # [B, H, D, T]
    vh = v.to(dt).transpose(1, 2)  # [B, H, T, Dv]
    out = torch.empty(B, T, H, v.shape[-1], dtype=dt, device=q.device)
    j = torch.arange(T, device=q.device)
    for a in range(0, T, block):
        b = min(T, a + block)
        t = j[a:b, None]
        allowed = (j[None, :] <= t) & ((t - j[None, :] <= local_window) | g[a:b, None] | g[None, :])
        s = (q[:, a:b].to(dt).transpose(1, 2) @ kh) * scale  # [B, H, n, T]
        s = s.masked_fill(~allowed, float("-inf"))
        out[:, a:b] = (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)
    return out.to(q.dtype)


def oracle_mass(q, k, rows: np.ndarray, C: int, local_window: int, scale: float | None = None,
                chunk: int = 256) -> np.ndarray:
    """Exact attention weight each context key ``j < C`` receives from the query ``rows`` (sorted positions):
    ``sum_{t, h} softmax_j(scale q_t . k_j) [j <= t, t - j > local_window]`` ``[C]`` float64 (one layer;
    ``q, k: [1, T, H, D]`` torch)."""
    with torch.autocast(q.device.type, enabled=False):
        return _oracle_mass(q, k, rows, C, local_window, scale, chunk)


def _oracle_mass(q, k, rows, C: int, local_window: int, scale: float | None, chunk: int) -> np.ndarray:
    T, D = q.shape[1], q.shape[-1]
    scale = D**-0.5 if scale is None else float(scale)
    dt = torch.float64 if q.device.type == "cpu" else torch.float32
    kk = k[0].to(dt).permute(1, 2, 0)  # [H, D, T]
    jj = torch.arange(T, device=q.device)
    mass = torch.zeros(T, dtype=dt, device=q.device)
    rows_t = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=q.device)
    for a in range(0, rows_t.numel(), chunk):
        r = rows_t[a : a + chunk]
        s = (q[0, r].to(dt).transpose(0, 1) @ kk) * scale  # [H, n, T]
        s = s.masked_fill(jj[None, None, :] > r[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        far = (r[:, None] - jj[None, :]) > local_window  # [n, T]
        mass += (p * far[None]).sum(dim=(0, 1))
    return mass[:C].double().cpu().numpy()


class Runner:
    """The model under each method, on one device. ``backend``: ``"gpu"``, ``"cpu"`` or ``"dense"`` (see the
    module docstring); ``impl``: the GPU kernel (``hpczeco.gpu.daaf`` ``impl=``). A GPU kernel that raises
    switches the runner to ``"dense"`` with the reason in ``fallback`` (printed by ``log``)."""

    def __init__(self, model, device: str, backend: str, impl: str = "auto", log: Callable[[str], Any] = print):
        if backend not in ("gpu", "cpu", "dense"):
            raise ValueError(f"backend must be 'gpu', 'cpu' or 'dense', got {backend!r}")
        self.model, self.device, self.backend, self.impl, self.log = model, device, backend, impl, log
        self.fallback: str | None = None
        self.calls: dict[str, int] = {}

    def planned(self, p: Plan) -> Callable:
        """``attn(q, k, v)`` on ``[B, T, H, D]`` tensors under plan ``p``, by the runner's backend."""

        def gpu(q, k, v):
            from hpczeco.gpu import daaf as gd  # noqa: PLC0415 - CuPy

            return gd.attention_torch(q, k, v, None, p.local_window, impl=self.impl, plan=p)

        def cpu(q, k, v):
            o = lib_attention(q.detach().float().cpu().numpy(), k.detach().float().cpu().numpy(),
                              v.detach().float().cpu().numpy(), p, check=False)
            return torch.from_numpy(o).to(q.device, q.dtype)

        def dense(q, k, v):
            return dense_masked_attention(q, k, v, p.global_mask, p.local_window)

        def run(q, k, v):
            if self.backend == "gpu":
                try:
                    self.calls["gpu"] = self.calls.get("gpu", 0) + 1
                    return gpu(q, k, v)
                except Exception as exc:  # noqa: BLE001 - fall back, say why
                    self.fallback = f"{type(exc).__name__}: {exc}"[:300]
                    self.backend = "dense"
                    self.log(f"GPU DAAF attention failed ({self.fallback}); using the dense masked attention")
            self.calls[self.backend] = self.calls.get(self.backend, 0) + 1
            return cpu(q, k, v) if self.backend == "cpu" else dense(q, k, v)

        return run

    @torch.no_grad()
    def logits(self, tokens: np.ndarray, mp: MethodPlan, keep_from: int = 0, oracle_rows: np.ndarray | None = None,
               C: int = 0, local_window: int = 128) -> tuple[torch.Tensor, np.ndarray | None]:
        """``(logits [T - keep_from, vocab] float32 on the CPU, oracle scores [C] or None)`` of ``tokens`` ``[T]``
        under ``mp`` (rows ``keep_from..T-1``; on CUDA: bf16 autocast, as in training); ``oracle_rows`` (exact
        only): collect :func:`oracle_mass` over every layer."""
        tok = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self.device)[None]
        mass = np.zeros(C, dtype=np.float64) if oracle_rows is not None else None
        fn = None if mp.plan is None else self.planned(mp.plan)

        def attn(layer: int, q, k, v):
            if oracle_rows is not None:
                mass[:] += oracle_mass(q, k, oracle_rows, C, local_window)
            if fn is None or layer < mp.exact_layers:
                return sdpa_causal(q, k, v)
            return fn(q, k, v)

        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tok.device.type == "cuda"):
            out = self.model(tok, attn=attn, keep_from=keep_from)
        return out[0].float().cpu(), mass


# --------------------------------------------------------------------------------------------- documents


@dataclass
class Doc:
    """An evaluation document: ``tokens`` ``[T]``, context length ``C``, ``kind`` ("text" or "retrieval"),
    ``queries`` (retrieval: see :class:`hpczeco.drivers.daaf_lm.RetrievalDoc`)."""

    tokens: np.ndarray
    C: int
    kind: str
    queries: list[dict] = field(default_factory=list)

    @property
    def T(self) -> int:
        return int(self.tokens.size)

    def scored_rows(self) -> np.ndarray:
        """Rows whose logits are scored: ``C - 1 .. T - 2`` (they predict the continuation)."""
        return np.arange(self.C - 1, self.T - 1)


def make_docs(heldout: np.ndarray, T: int, s: DaafSettings, n_text: int, n_retrieval: int, seed: int,
              n_block: int = 8, n_scatter: int = 8, fmt: KVFormat = KV) -> list[Doc]:
    """``n_text`` text documents (context ``T - continuation``) and ``n_retrieval`` retrieval documents of ``T``
    tokens at offsets spread evenly over ``heldout``; ``ValueError`` if it is shorter than ``T``."""
    N = int(heldout.size)
    if N < T + 1:
        raise ValueError(f"the held-out text has {N} bytes, fewer than T={T}")
    if not 0 < s.continuation < T:
        raise ValueError(f"continuation ({s.continuation}) must lie in (0, T={T})")
    docs = []
    for i in range(n_text):
        off = int(i * (N - T) / max(1, n_text))
        docs.append(Doc(heldout[off : off + T].astype(np.int64), T - s.continuation, "text"))
    rng = np.random.default_rng([seed, T])
    for i in range(n_retrieval):
        off = int((i + 0.5) * (N - T) / max(1, n_retrieval))
        rd: RetrievalDoc = retrieval_doc(heldout, off, T, rng, n_block, n_scatter, fmt)
        docs.append(Doc(rd.tokens, rd.context, "retrieval", rd.queries))
    return docs


# --------------------------------------------------------------------------------------------- evaluation


def _doc_metrics(logits: torch.Tensor, doc: Doc, exact_argmax: torch.Tensor | None, fmt: KVFormat) -> dict:
    """Metrics of one document from ``logits`` of rows ``C - 1 .. T - 1`` (row ``C - 1 + i`` at index ``i``)."""
    C = doc.C
    tok = torch.as_tensor(doc.tokens)
    am = logits.argmax(-1)
    m: dict[str, Any] = {"argmax": am}
    if doc.kind == "text":
        n = doc.T - C  # rows C-1 .. T-2 predict tokens C .. T-1
        lp = torch.log_softmax(logits[:n], dim=-1)
        m["nll_sum"] = float(-lp.gather(1, tok[C:][:, None]).sum())
        m["n"] = n
        if exact_argmax is not None:
            m["top1_same"] = int((am[:n] == exact_argmax[:n]).sum())
            m["first_same"] = [bool(am[0] == exact_argmax[0])]
    else:
        correct, first = [], []
        for qd in doc.queries:
            a = qd["ask_value"]  # rows a-1 .. a+val_len-2 predict the value
            i = torch.arange(a - C, a - C + fmt.val_len)
            correct.append(bool((am[i] == tok[i + C]).all()))
            if exact_argmax is not None:
                first.append(bool(am[a - C] == exact_argmax[a - C]))
        m["correct"] = correct
        if exact_argmax is not None:
            m["first_same"] = first
    return m


def evaluate(runner: Runner, docs: list[Doc], s: DaafSettings, methods: tuple[str, ...] = METHODS,
             budgets: tuple[float | None, ...] = (None,), seed: int = 0, fmt: KVFormat = KV,
             log: Callable[[str], Any] | None = None) -> list[dict]:
    """One record per (document, budget, method): the plan's facts (global tokens, query-key pairs per layer
    averaged over the layers, mass recall) and the metrics (text: ``nll_sum``, ``n``, ``top1_same``; retrieval:
    per question ``correct``, ``in_daaf``; both: ``first_same``). ``exact`` is computed once per document (budget
    None), with the oracle's scores."""
    recs = []
    for di, doc in enumerate(docs):
        exact_logits, scores = runner.logits(doc.tokens, MethodPlan("exact", None), doc.C - 1, doc.scored_rows(),
                                             doc.C, s.local_window)
        ex = _doc_metrics(exact_logits, doc, None, fmt)
        ex_am = ex.pop("argmax")
        total = float(scores.sum())
        base = {"doc": di, "T": doc.T, "C": doc.C, "kind": doc.kind}
        recs.append({**base, "budget": None, "method": "exact", "n_global": doc.C, "pairs": dense_pairs(doc.T),
                     "dense_pairs": dense_pairs(doc.T), "mass_recall": 1.0, **_exact_fill(ex, doc, s, fmt)})
        for budget in budgets:
            rng = np.random.default_rng([seed, doc.T, di, 0 if budget is None else int(budget * 1e6) + 1])
            plans = method_plans(doc.tokens[: doc.C], doc.T, s, scores, rng,
                                 tuple(m for m in methods if m != "exact"), budget)
            in_daaf = _in_daaf(doc, daaf_context_plan(doc.tokens[: doc.C], s, budget).global_mask, fmt)
            for name, mp in plans.items():
                lg, _ = runner.logits(doc.tokens, mp, doc.C - 1)
                met = _doc_metrics(lg, doc, ex_am, fmt)
                met.pop("argmax")
                g = mp.plan.global_mask[: doc.C]
                L = runner.model.cfg.n_layers
                e = min(mp.exact_layers, L)  # pairs per layer, averaged over the layers (exact ones: dense)
                pairs = (e * mp.plan.dense + (L - e) * mp.plan.pairs) / L
                rec = {**base, "budget": budget, "method": name, "n_global": int(g.sum()), "pairs": pairs,
                       "dense_pairs": mp.plan.dense, "exact_layers": mp.exact_layers,
                       "mass_recall": (float(scores[g].sum()) / total if total > 0 else float("nan"))
                       if name not in ("window-wide", "exact-lib") else float("nan"), **met}
                if doc.kind == "retrieval":
                    rec["in_daaf"] = in_daaf
                if mp.source is not None:
                    rec["policy"] = mp.source.policy
                if "window" in mp.info:
                    rec["wide_window"] = mp.info["window"]
                recs.append(rec)
        if log is not None:
            log(f"  T={doc.T} {doc.kind} doc {di}: {len(budgets)} budget(s) x {len(methods)} methods done")
    return recs


def _in_daaf(doc: Doc, g_ctx: np.ndarray, fmt: KVFormat) -> list[bool]:
    """Per question: whether its definition's value lies wholly inside the key regions ``g_ctx`` ``[C]``."""
    return [bool(g_ctx[q["def_value"] : q["def_value"] + fmt.val_len].all()) for q in doc.queries]


def _exact_fill(ex: dict, doc: Doc, s: DaafSettings, fmt: KVFormat) -> dict:
    out = dict(ex)
    if doc.kind == "text":
        out["top1_same"] = out["n"]
        out["first_same"] = [True]
    else:  # bucketed by the key regions of the seed's DAAF plan of the same context
        out["first_same"] = [True] * len(doc.queries)
        out["in_daaf"] = _in_daaf(doc, daaf_context_plan(doc.tokens[: doc.C], s).global_mask, fmt)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def aggregate(recs: list[dict]) -> list[dict]:
    """Rows per (T, budget, method): perplexity of the continuations (``exp`` of the mean NLL per byte) and
    its increase over exact (%), top-1 agreement with exact over the continuation, first-token agreement
    (the token after a text context, the first answer byte of each question), retrieval accuracy (all
    questions; those whose definition lies inside / outside DAAF's key regions), the global share of the
    context, the work (pairs / dense pairs of the document) and the mass recall."""
    by: dict[tuple, list[dict]] = {}
    for r in recs:
        by.setdefault((r["T"], r["budget"], r["method"]), []).append(r)
    exact_by_T = {T: v for (T, b, m), v in by.items() if m == "exact"}
    rows = []
    for (T, budget, method), rs in sorted(by.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1],
                                                                         _order(kv[0][2]))):
        text = [r for r in rs if r["kind"] == "text"]
        ret = [r for r in rs if r["kind"] == "retrieval"]
        row: dict[str, Any] = {"T": T, "budget": budget, "method": method, "text_docs": len(text),
                               "retrieval_docs": len(ret)}
        nll = sum(r["nll_sum"] for r in text)
        n = sum(r["n"] for r in text)
        row["ppl"] = math.exp(nll / n) if n else float("nan")
        row["bits_per_byte"] = nll / n / math.log(2) if n else float("nan")
        ex_text = [r for r in exact_by_T.get(T, []) if r["kind"] == "text"]
        ex_n = sum(r["n"] for r in ex_text)
        ex_ppl = math.exp(sum(r["nll_sum"] for r in ex_text) / ex_n) if ex_n else float("nan")
        row["ppl_increase_pct"] = 100 * (row["ppl"] / ex_ppl - 1) if ex_n and n else float("nan")
        row["top1_agree"] = _ratio(sum(r["top1_same"] for r in text), n)
        firsts = [f for r in rs for f in r["first_same"]]
        row["first_token_agree"] = _ratio(sum(firsts), len(firsts))
        corr = [c for r in ret for c in r["correct"]]
        row["retrieval_acc"] = _ratio(sum(corr), len(corr))
        inside, outside = [], []
        for r in ret:
            for c, w in zip(r["correct"], r["in_daaf"]):
                (inside if w else outside).append(c)
        row["retrieval_acc_in"] = _ratio(sum(inside), len(inside))
        row["retrieval_acc_out"] = _ratio(sum(outside), len(outside))
        row["n_in"], row["n_out"] = len(inside), len(outside)
        row["global_frac"] = float(np.mean([r["n_global"] / r["C"] for r in rs]))
        row["work_frac"] = float(np.mean([r["pairs"] / r["dense_pairs"] for r in rs]))
        mr = [r["mass_recall"] for r in rs if not math.isnan(r["mass_recall"])]
        row["mass_recall"] = float(np.mean(mr)) if mr else float("nan")
        pol = sorted({r["policy"] for r in rs if "policy" in r})
        if pol:
            row["policy"] = "/".join(pol)
        ww = [r["wide_window"] for r in rs if "wide_window" in r]
        if ww:
            row["wide_window"] = int(np.median(ww))
        rows.append(row)
    exact_rows = {(r["T"]): r for r in rows if r["method"] == "exact"}
    for r in rows:
        e = exact_rows.get(r["T"])
        if e is not None:
            for key in ("retrieval_acc", "retrieval_acc_in", "retrieval_acc_out"):
                r[key + "_vs_exact"] = _ratio(r[key], e[key]) if not math.isnan(r[key]) else float("nan")
    return rows


def _order(method: str) -> int:
    return METHODS.index(method) if method in METHODS else len(METHODS)

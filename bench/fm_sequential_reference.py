"""The next step for the served model (issue 29), measured but not in the product yet: a DeepFM
whose FM part, too, learns example by example inside a batch.

    .venv/bin/python bench/fm_sequential_reference.py 100k fm 2048      # AUC on ml-100k (1m: tuning stream)

Measured here (seed 0; seeds 0-2 agree within 0.0005), progressive AUC at batch 2048, lr 0.05:
ml-1m tuning stream: served 0.7854, ``fm`` 0.7879, ``mlp`` 0.7883; ml-100k: served 0.7633, ``fm``
0.7671, ``mlp`` 0.7678 (the sequential LR: 0.7844 / 0.7637). The kernel costs ~24% of the served
model's examples/s (0.46 s per 100k examples against 0.11 s for the first-order kernel). Not in
the product because the N-rank engine has no path for it yet: its embedding rows are sharded over
owners, and the pass needs every row of the global batch with its optimizer state in one place
(the first-order tables' answer, whole on rank 0, does not scale to embedding tables). At batch 1
mode ``mlp`` equals the plain DeepFM; mode ``fm`` does not (an embedding row takes two Adagrad
steps, FM in the kernel and MLP after it, where the plain step takes one).

Inside one numba kernel, examples of a batch are taken in order. For example e:

    logit_e = offset[e]                              (bias + MLP [+ dense], batch start, torch; no FM)
            + sum_lin_fields pool(w[rows])           (fresh first-order rows)
            + FM(x_1..x_F)                           (fresh embedding rows, pooled per field: sum / mean)
    FM = 0.5 * (|S|^2 - sum_f |x_f|^2),  S = sum_f x_f

p = sigmoid(logit) is recorded (progressive validation), g = p - y, then
  * every first-order row of the example: one step with float32(g * pooled weight)
  * every embedding row v of field f (pool weight c): one step with float32(g * c * (S - x_f))
    [mode "mlp": plus g * c * J_e[f], J_e = d MLP(x_e) / d x_e at batch start]
(each table's own optimizer through ps.optimizers.step_elem; rows copied to scratch once, written
back once, marked as ps.sequential does).

After the kernel (mode "fm"): the MLP part's gradient w.r.t. the embeddings (torch backward of
the offset logits with resid / n) is applied once per batch with apply_packed_gradients, and
the dense head steps, as trainer/sequential.py does now. Mode "mlp": the head steps the same
way but the embeddings take no per-batch step (their MLP gradient went in per example).
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np
import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ps.optimizers import OPT_ADAGRAD, OPT_SGD, step_elem  # noqa: E402
from ps.rowmarks import M_NDIRTY, M_WATERMARK, marked, reserve_dirty  # noqa: E402
from ps.sequential import _batch_rows, _resolve_rows  # noqa: E402
from trainer.model import SparseModel, bag_inputs, pool  # noqa: E402
from trainer.step_checks import NonFiniteStepError, finite_grads  # noqa: E402


@numba.njit(cache=True, nogil=True)
def fm_sequential_kernel(ids, seg_off, seg_table, n_emb_seg, bags, seg_mean, labels, offset, jac, t,
                         tab_base, tab_nshards, tab_kind, tab_hyper, tab_track, slots_list, emb_list,
                         state_list, times_list, flags_list, dirty_list, meta_list, probs, resid, shard_n):
    """Returns the summed log loss; fills probs (pre-update p) and resid (p - y).

    ids/seg_off/seg_table: a packed batch whose first ``n_emb_seg`` segments are the embedding
    fields (one dim D, field f = segment f) and the rest first-order fields (dim 1).
    bags int64 [n_seg, B+1]: per-segment per-example offsets; seg_mean bool [n_seg].
    offset float64 [B]: fixed logit part. jac float64 [B, F, D] (MLP input gradient per example,
    added to the embedding rows' per-example gradient) or [0, 0, 0] (no MLP term in the kernel).
    Tables stepped here must be SGD or Adagrad (state width = dim).
    """
    n = ids.size
    nseg = seg_table.size
    n_shards = len(emb_list)
    shard_of = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    _resolve_rows(ids, seg_off, seg_table, tab_base, tab_nshards, slots_list, shard_of, rows, shard_n)
    tab_of_shard = np.empty(n_shards, np.int64)
    for ti in range(tab_base.size):
        for sh in range(tab_base[ti], tab_base[ti] + tab_nshards[ti]):
            tab_of_shard[sh] = ti
    present = np.zeros(tab_base.size, np.bool_)
    for s in range(nseg):
        present[seg_table[s]] = True
    for ti in range(tab_base.size):
        if not present[ti]:
            continue
        for sh in range(tab_base[ti], tab_base[ti] + tab_nshards[ti]):
            meta = meta_list[sh]
            if (shard_n[sh] > 0 or tab_nshards[ti] == 1) and t > meta[M_WATERMARK]:
                meta[M_WATERMARK] = t
            reserve_dirty(dirty_list[sh], meta, shard_n[sh])
    u_of, ush, urow = _batch_rows(rows, shard_of, n_shards)
    nu = urow.size
    # embedding dim
    D = 1
    if n_emb_seg > 0:
        D = emb_list[tab_base[seg_table[0]]].shape[1]
    F = n_emb_seg
    use_jac = jac.shape[0] > 0
    W = np.zeros((nu, D), np.float32)
    ST = np.zeros((nu, D), np.float32)
    udim = np.empty(nu, np.int64)
    uwidth = np.empty(nu, np.int64)
    ukind = np.empty(nu, np.int64)
    utab = np.empty(nu, np.int64)
    for u in range(nu):
        sh = ush[u]
        r = urow[u]
        e_ = emb_list[sh]
        state = state_list[sh]
        udim[u] = e_.shape[1]
        uwidth[u] = state.shape[1]
        for j in range(udim[u]):
            W[u, j] = e_[r, j]
        for j in range(uwidth[u]):
            ST[u, j] = state[r, j]
        utab[u] = tab_of_shard[sh]
        ukind[u] = tab_kind[utab[u]]
    stepped = np.zeros(nu, np.bool_)
    order = np.empty(nu, np.int64)
    n_order = 0
    # per example: first-order rows (summed weights), embedding rows (summed gradient direction)
    lu = np.empty(n, np.int64)
    lwgt = np.empty(n, np.float64)
    vu = np.empty(n, np.int64)
    vg = np.zeros((n, D), np.float64)
    x = np.zeros((max(F, 1), D), np.float64)
    S = np.zeros(D, np.float64)
    loss = 0.0
    for e in range(labels.size):
        logit = np.float64(offset[e])
        # ---- embedding fields: pooled vectors from fresh rows
        for j in range(D):
            S[j] = 0.0
        sq = 0.0
        for f in range(F):
            for j in range(D):
                x[f, j] = 0.0
            a = seg_off[f] + bags[f, e]
            b = seg_off[f] + bags[f, e + 1]
            if b <= a:
                continue
            wgt = 1.0 / (b - a) if seg_mean[f] else 1.0
            for i in range(a, b):
                u = u_of[i]
                if u < 0:
                    continue
                for j in range(D):
                    x[f, j] += wgt * np.float64(W[u, j])
            for j in range(D):
                S[j] += x[f, j]
                sq += x[f, j] * x[f, j]
        ss = 0.0
        for j in range(D):
            ss += S[j] * S[j]
        logit += 0.5 * (ss - sq)
        # ---- first-order fields
        k = 0
        for s in range(F, nseg):
            a = seg_off[s] + bags[s, e]
            b = seg_off[s] + bags[s, e + 1]
            if b <= a:
                continue
            wgt = 1.0 / (b - a) if seg_mean[s] else 1.0
            for i in range(a, b):
                u = u_of[i]
                if u < 0:
                    continue
                logit += wgt * np.float64(W[u, 0])
                q = 0
                while q < k and lu[q] != u:
                    q += 1
                if q == k:
                    lu[k] = u
                    lwgt[k] = wgt
                    k += 1
                else:
                    lwgt[q] += wgt
        p = 1.0 / (1.0 + math.exp(-logit))
        y = np.float64(labels[e])
        probs[e] = p
        g = p - y
        resid[e] = g
        loss += max(logit, 0.0) - logit * y + math.log1p(math.exp(-abs(logit)))
        # ---- embedding rows' gradient directions (from the pre-step values)
        m = 0
        for f in range(F):
            a = seg_off[f] + bags[f, e]
            b = seg_off[f] + bags[f, e + 1]
            if b <= a:
                continue
            wgt = 1.0 / (b - a) if seg_mean[f] else 1.0
            for i in range(a, b):
                u = u_of[i]
                if u < 0:
                    continue
                q = 0
                while q < m and vu[q] != u:
                    q += 1
                if q == m:
                    vu[m] = u
                    for j in range(D):
                        vg[m, j] = 0.0
                    m += 1
                for j in range(D):
                    d_ = S[j] - x[f, j]
                    if use_jac:
                        d_ += jac[e, f, j]
                    vg[q, j] += wgt * d_
        # ---- steps: first-order rows
        for q in range(k):
            u = lu[q]
            if not stepped[u]:
                stepped[u] = True
                order[n_order] = u
                n_order += 1
            kind = ukind[u]
            hyper = tab_hyper[utab[u]]
            nw, sa, _ = step_elem(kind, hyper, np.float64(W[u, 0]), np.float64(ST[u, 0]), 0.0,
                                  np.float64(np.float32(g * lwgt[q])), 1.0, 1.0)
            W[u, 0] = nw
            if uwidth[u] > 0:
                ST[u, 0] = sa
        # ---- steps: embedding rows
        for q in range(m):
            u = vu[q]
            if not stepped[u]:
                stepped[u] = True
                order[n_order] = u
                n_order += 1
            kind = ukind[u]
            hyper = tab_hyper[utab[u]]
            for j in range(udim[u]):
                sa = np.float64(ST[u, j]) if uwidth[u] > 0 else 0.0
                nw, sa, _ = step_elem(kind, hyper, np.float64(W[u, j]), sa, 0.0,
                                      np.float64(np.float32(g * vg[q, j])), 1.0, 1.0)
                W[u, j] = nw
                if uwidth[u] > 0:
                    ST[u, j] = sa
    for q in range(n_order):
        u = order[q]
        sh = ush[u]
        r = urow[u]
        e_ = emb_list[sh]
        for j in range(udim[u]):
            e_[r, j] = W[u, j]
        state = state_list[sh]
        for j in range(uwidth[u]):
            state[r, j] = ST[u, j]
        times = times_list[sh]
        if t > times[r]:
            times[r] = t
        flags = flags_list[sh]
        fl, queue = marked(flags[r], tab_track[utab[u]])
        if queue:
            meta = meta_list[sh]
            dirty_list[sh][meta[M_NDIRTY]] = r
            meta[M_NDIRTY] += 1
        flags[r] = fl
    return loss


class FMSeqModel(SparseModel):
    """SparseModel whose train_step is the FM-sequential step. mode: "fm" (MLP grad per batch) or
    "mlp" (MLP input gradient at batch start also applied per example inside the kernel)."""

    def __init__(self, cfg, mode: str = "fm", **kw):
        super().__init__(cfg, **kw)
        assert cfg.kind == "deepfm" and self._emb_block is not None and self._lin_block is not None
        assert mode in ("fm", "mlp")
        self.mode = mode
        kinds = set(self.ps._tab_kind.tolist())
        assert kinds <= {OPT_SGD, OPT_ADAGRAD}, kinds
        for t in self.tables.values():
            for sh in t.shards:
                assert sh._state.shape[1] in (0, t.dim), (t.name, sh._state.shape)

    def train_step(self, batch):
        t0 = time.perf_counter()
        batch = self.complete(batch)
        n, t = batch.size, batch.max_event_time
        eb, lb = self._emb_block, self._lin_block
        head = self.head
        full = self.pack(batch)
        buf = self.ps.gather_packed(full, insert=True, event_time=t)
        k = len(eb.keys)
        pe = full.segments(0, k)
        nf, D = len(eb.slots), eb.dim
        ne = int(pe.offsets[-1])
        w = torch.from_numpy(buf[:ne * D].reshape(ne, D)).requires_grad_(True)
        xe = pool(w, *bag_inputs(batch, eb.slots, eb.modes), nf * n).view(nf, n, D).transpose(0, 1)  # [B,F,D]
        dense = (torch.from_numpy(batch.dense) if batch.dense is not None and self.cfg.dense_features else None)
        if self.mode == "mlp":
            xl = xe.detach().requires_grad_(True)
            inp = xl.flatten(1)
        else:
            inp = xe.flatten(1)
        if dense is not None:
            inp = torch.cat([inp, dense], 1)
        mlp_out = head.mlp(inp).squeeze(1)
        logits = head.bias.expand(n) + mlp_out
        if dense is not None and head.dense_linear is not None:
            logits = logits + head.dense_linear(dense).squeeze(1)
        if self.mode == "mlp":
            jac = torch.autograd.grad(mlp_out.sum(), xl, retain_graph=True)[0].double().numpy()
        else:
            jac = np.zeros((0, 0, 0), np.float64)
        fixed = logits.detach().double()
        if not bool(torch.isfinite(fixed).all()):
            raise NonFiniteStepError("dense logits not finite")
        slots = eb.slots + lb.slots
        modes = eb.modes + lb.modes
        bags = np.stack([batch.offsets[s] for s in slots]).astype(np.int64)
        mean = np.array([m_ == "mean" for m_ in modes], np.bool_)
        t1 = time.perf_counter()
        ps = self.ps
        probs = np.empty(n, np.float32)
        resid = np.empty(n, np.float64)
        shard_n = np.zeros(len(ps._shards), np.int64)
        present = np.zeros(len(ps.table_names), np.bool_)
        present[full.slot_table] = True
        with ps._lock_all():
            slots_list, emb_list = ps._lists()
            loss = fm_sequential_kernel(
                full.ids, full.offsets, full.slot_table, k, bags, mean,
                np.ascontiguousarray(batch.labels, np.float64), np.ascontiguousarray(fixed.numpy(), np.float64),
                np.ascontiguousarray(jac), int(t), ps._tab_base, ps._tab_nshards, ps._tab_kind, ps._tab_hyper,
                ps._tab_track, slots_list, emb_list, *ps._row_lists, probs, resid, shard_n)
            for ti, sh in ps._expiring:
                if present[ti] and (shard_n[sh] or ps._tab_nshards[ti] == 1):
                    ps._shards[sh]._expire(None, max(1024, 2 * int(shard_n[sh])))
        loss /= max(n, 1)
        t2 = time.perf_counter()
        r = torch.from_numpy(resid.astype(np.float32))
        self.optimizer.zero_grad(set_to_none=True)
        logits.backward(r / max(n, 1))
        if not finite_grads(head) or not math.isfinite(loss):
            raise NonFiniteStepError("non-finite")
        if self.mode == "fm":
            g = w.grad.numpy().reshape(-1) if w.grad is not None else np.zeros(w.numel(), np.float32)
            ps.apply_packed_gradients(pe, g, t)
        self.optimizer.step()
        self.timings["forward"] += t1 - t0
        self.timings["update"] += t2 - t1
        self.timings["backward"] += time.perf_counter() - t2
        return float(loss), probs


def main(argv: list[str]) -> None:
    """``STREAM(1m|100k) VARIANT(served|fm|mlp|plain) BATCH [EMB_LR] [SEED]``: one progressive run; last line JSON."""
    import json

    import trainer  # noqa: F401  (before torch threads: OMP_WAIT_POLICY)
    from evaluation.common import auc, data, full, served_model_config
    from trainer.config import ModelConfig

    torch.set_num_threads(1)
    stream, variant, bs = argv[0], argv[1], int(argv[2])
    elr = float(argv[3]) if len(argv) > 3 else None
    seed = int(argv[4]) if len(argv) > 4 else 0
    s = full()
    d = (data(s.model_copy(update=dict(dataset="ml-1m")), 100000, 300000) if stream == "1m"
         else data(s.model_copy(update=dict(dataset="ml-100k")), None, 0))
    dd = served_model_config(s, seed).model_dump()
    if elr is not None:
        for t in dd["tables"]:
            if t["dim"] > 1:
                t["optimizer"]["lr"] = elr
    if variant == "plain":
        dd["sequential"] = False
    cfg = ModelConfig.model_validate(dd)
    m = FMSeqModel(cfg, variant) if variant in ("fm", "mlp") else SparseModel(cfg)
    rows = np.arange(len(d))
    p = np.empty(rows.size, np.float32)
    t0 = time.perf_counter()
    for a in range(0, rows.size, bs):
        b = d.batch(rows[a:a + bs])
        p[a:a + b.size] = m.train_step(b)[1]
    print(json.dumps(dict(stream=stream, variant=variant, batch=bs, seed=seed, auc=round(auc(p, d.label), 6),
                          seconds=round(time.perf_counter() - t0, 1))))


if __name__ == "__main__":
    main(sys.argv[1:])
